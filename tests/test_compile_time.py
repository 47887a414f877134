"""fxshard's own compile time: every stage timed and logged, and the shortcuts that make the stages
cheaper leave every plan as it was (bench/compile.py measures the times themselves)."""
from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections import Counter

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import fxshard
from fxshard.backend.capture.capture import capture
from fxshard.backend.capture.inputs import input_layouts, named_inputs
from fxshard.backend.programs.joint import plan_training
from fxshard.backend.capture.trace import trace_global
from fxshard.printing import format_graph
from fxshard.propagate import Decisions, propagate
from fxshard.refine import propagate_with_pins
from fxshard.timing import STAGES, timed_by

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from models.llama import Llama, LlamaConfig, fsdp_placements, fsdp_tp_placements, megatron_placements  # noqa: E402

CFG = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64)
BANDWIDTH_BOUND = fxshard.CostModel(default_latency=0.0)


@pytest.mark.parametrize("training, stages", [
    (False, [s for s in STAGES if s not in ("split", "unfold", "regions")]),
    # regions: Inductor's regional programs only (test_regions); unfold: repeated layers only (test_fold)
    (True, [s for s in STAGES if s not in ("unfold", "regions")]),
])
def test_every_stage_is_timed_and_logged(fake_mesh_4, make_mlp, capfd, training, stages):
    """TORCH_LOGS=fxshard prints each stage's time (inference and training) and a per-graph summary."""
    torch.manual_seed(0)
    model = make_mlp()
    for name, p in list(model.named_parameters()):
        owner, leaf = model.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2]
        placements = (Shard(0),) if name.startswith("up") else (Replicate(),)
        owner.register_parameter(leaf, torch.nn.Parameter(distribute_tensor(p.detach(), fake_mesh_4, placements),
                                                          requires_grad=training))
    compiled = fxshard.compile(model, inductor=False)
    torch._logging.set_logs(modules={"fxshard": logging.INFO})
    try:
        compiled(torch.randn(4, 8))
    finally:
        torch._logging.set_logs()
    err = capfd.readouterr().err
    logged = [s for s in STAGES if f"fxshard graph MLP: {s} took" in err]
    assert logged == stages and "fxshard's stages took" in err, err[-3000:]


def _count_stages() -> tuple[Counter, contextlib.AbstractContextManager]:
    seen: Counter = Counter()

    @contextlib.contextmanager
    def count(name: str):
        seen[name] += 1
        yield

    return seen, timed_by(count)


def mlp_loss(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return (torch.relu(x @ w1.t()) @ w2.t()).sum()


def _planned_joint(example_value) -> tuple[str, Counter]:
    """The planned joint graph of a Megatron MLP's loss as text, and how often each stage ran;
    Dynamo's example value of the loss is kept (``"as captured"``), removed (None) or replaced."""
    torch.manual_seed(0)
    args = (torch.randn(4, 8), torch.randn(16, 8, requires_grad=True), torch.randn(8, 16, requires_grad=True))
    mesh = fxshard.MeshSpec(tp=4)
    captured = capture(mlp_loss, args)
    names = named_inputs(mlp_loss, args, captured.objects)
    layouts = input_layouts(captured.objects, mesh, [k for _, k in names], {1: (Shard(0),), 2: (Shard(1),)})
    if not isinstance(example_value, str):
        out = next(n for n in captured.gm.graph.nodes if n.op == "output").args[0][0]
        out.meta["example_value"] = example_value
    seen, timer = _count_stages()
    with timer:
        plan = plan_training(captured.gm, captured.example_inputs, mesh=mesh, layouts=layouts,
                             names=[n for n, _ in names])
    return format_graph(plan.joint), seen


@pytest.mark.parametrize("example_value, traces", [
    ("as captured", 1),  # a scalar loss: its tangent is replicated, the joint is traced once
    (None, 2),  # no example value to shape the tangent: the forward is traced and planned first
    (torch.zeros((), dtype=torch.float64), 3),  # a wrong one: the joint trace stops, the forward is planned
])
def test_a_scalar_loss_is_planned_without_a_forward_plan(example_value, traces):
    """The joint plan of a loss is the same whether its tangent's layout comes from a forward-only plan
    or is known replicated (one trace and one plan instead of two each)."""
    reference, _ = _planned_joint(None)
    planned, seen = _planned_joint(example_value)
    assert (planned, seen["trace"]) == (reference, traces)


def mlp_out(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return torch.relu(x @ w1.t()) @ w2.t()


def _planned_joint_of_dtensors(mesh, keep_example: bool) -> tuple[str, tuple, Counter, tuple]:
    """A Megatron MLP whose weights are DTensors and which returns its (Partial) DTensor output: its
    planned joint graph as text, its output layouts, how often each stage ran, and the placements
    Dynamo's example value of the output has (eager DTensor's)."""
    from fxshard.placements import as_mesh_spec

    torch.manual_seed(0)
    x = distribute_tensor(torch.randn(4, 8), mesh, [Replicate()])
    w1 = distribute_tensor(torch.randn(16, 8), mesh, [Shard(0)]).requires_grad_()
    w2 = distribute_tensor(torch.randn(8, 16), mesh, [Shard(1)]).requires_grad_()
    captured = capture(mlp_out, (x, w1, w2))
    out = next(n for n in captured.gm.graph.nodes if n.op == "output").args[0][0]
    eager = tuple(out.meta["example_value"].placements)
    if not keep_example:
        del out.meta["example_value"]
    spec = as_mesh_spec(mesh)
    names = named_inputs(mlp_out, (x, w1, w2), captured.objects)
    layouts = input_layouts(captured.objects, spec, [k for _, k in names])
    seen, timer = _count_stages()
    with timer:
        plan = plan_training(captured.gm, captured.example_inputs, mesh=spec, layouts=layouts,
                             names=[n for n, _ in names])
    return format_graph(plan.joint), plan.output_layouts, seen, eager


def test_a_dtensor_output_is_planned_without_a_forward_plan(fake_mesh_4):
    """A program returning DTensors takes its outputs' layouts from Dynamo's example values (eager
    DTensor's placements, reduced: this output is Partial, its tangent replicated): one trace and one
    plan, and the same joint plan as when a forward-only plan is made first to learn them."""
    from fxshard.layout import Layout

    reference, reference_layouts, reference_seen, eager = _planned_joint_of_dtensors(fake_mesh_4, keep_example=False)
    planned, layouts, seen, _ = _planned_joint_of_dtensors(fake_mesh_4, keep_example=True)
    assert [type(p).__name__ for p in eager] == ["Partial"]
    assert (reference_seen["trace"], seen["trace"]) == (2, 1)
    assert layouts == reference_layouts == (Layout.replicated(fxshard.MeshSpec(tp=4), (4, 8)),)
    assert planned == reference


def _mesh_and_placements(style: str, model: Llama) -> tuple[fxshard.MeshSpec, dict]:
    if style == "fsdp":
        return fxshard.MeshSpec(dp=4), {**fsdp_placements(model), 0: (Shard(0),)}
    if style == "megatron":
        return fxshard.MeshSpec(tp=4), megatron_placements(model)
    batch = (Shard(0), Replicate())
    return fxshard.MeshSpec(dp=2, tp=2), {**fsdp_tp_placements(model), 0: batch}


@pytest.mark.parametrize("style", ["fsdp", "megatron", pytest.param("fsdp_tp", marks=pytest.mark.slow)])
def test_refinement_reusing_decisions_leaves_the_plan_unchanged(style):
    """Refinement's propagations share decisions (``Decisions``: across rounds and across a model's
    repeated layers); every layout is the one propagating each node afresh gives."""
    torch.manual_seed(0)
    model = Llama(CFG)
    x = torch.randint(0, CFG.vocab_size, (8, 16))
    mesh, placements = _mesh_and_placements(style, model)
    captured = capture(model, (x,))
    names = named_inputs(model, (x,), captured.objects)
    layouts = input_layouts(captured.objects, mesh, [k for _, k in names], placements)

    def planned(memo: Decisions | None) -> list:
        program = trace_global(captured.gm, captured.example_inputs, mesh=mesh, layouts=layouts)
        propagate_with_pins(lambda pinned, foreseen=None: propagate(program.gm, mesh, program.input_layouts,
                                                                    pinned=pinned, cost_model=BANDWIDTH_BOUND,
                                                                    memo=memo, foreseen=foreseen),
                            program.gm, BANDWIDTH_BOUND)
        return [(n.name, n.meta.get("layout"), n.meta.get("arg_layouts")) for n in program.gm.graph.nodes]

    assert planned(Decisions()) == planned(None)


@pytest.mark.parametrize("cost_model", [fxshard.CostModel(), BANDWIDTH_BOUND], ids=["default", "bandwidth-bound"])
def test_every_propagation_of_a_training_step_is_the_fresh_one(fake_mesh_4, monkeypatch, cost_model):
    """A training step's refinement (FSDP: every round runs) shares decisions, also those made with fewer
    pins (``Decisions.with_fewer_pins``); after each of its propagations every layout is the one the same
    propagation without shared decisions gives."""
    from fxshard import pipeline

    propagated, reused, mismatched = [0], [0], []
    fewer = Decisions.with_fewer_pins

    def counted(self, *args):
        found = fewer(self, *args)
        reused[0] += found is not None
        return found

    def checked(gm, mesh, *args, memo=None, **kwargs):
        def plan() -> list:
            return [(n.name, n.meta.get("layout"), n.meta.get("arg_layouts")) for n in gm.graph.nodes]
        propagate(gm, mesh, *args, memo=memo, **kwargs)
        shared = plan()
        propagate(gm, mesh, *args, memo=None, **kwargs)
        propagated[0] += 1
        if plan() != shared:
            mismatched.append(kwargs.get("pinned"))
        return gm

    monkeypatch.setattr(Decisions, "with_fewer_pins", counted)
    monkeypatch.setattr(pipeline, "propagate", checked)
    monkeypatch.setenv("FXSHARD_LOWERED_CACHE", "0")
    torch.manual_seed(0)
    model = Llama(CFG)
    for name, param in list(model.named_parameters()):
        owner = model.get_submodule(name.rpartition(".")[0])
        owner.register_parameter(name.rpartition(".")[2], torch.nn.Parameter(
            distribute_tensor(param.detach(), fake_mesh_4, fsdp_placements(model)[name])))
    compiled = fxshard.compile(model.loss, cost_model=cost_model, inductor=False)
    x, y = (distribute_tensor(torch.randint(0, CFG.vocab_size, (8, 16)), fake_mesh_4, [Shard(0)]) for _ in range(2))
    compiled(x, y).backward()
    assert propagated[0] >= 6 and reused[0] > 0, (propagated, reused)  # 8 propagations, ~160 decisions reused
    assert not mismatched, mismatched


def test_refinement_pins_an_input_of_every_layer_at_once():
    """Pinning one layer's norm weight prices as pinning another's: refinement pins each kind of input
    in every layer at once (``refine.smallest_classes``), so a 4-layer FSDP model is refined with no
    more propagations than a 2-layer one (each tried one layer's norm weights alone before: 10 each), and the plan is the one pinning the inputs one by one would
    find (the joint plans' text is golden-tested in test_golden.py)."""
    tried: dict[int, list[frozenset[str]]] = {}
    for layers in (2, 4):
        torch.manual_seed(0)
        model = Llama(LlamaConfig(vocab_size=64, dim=32, n_layers=layers, n_heads=4, n_kv_heads=2, ffn_dim=64))
        x = torch.randint(0, 64, (8, 16))
        mesh = fxshard.MeshSpec(dp=4)
        captured = capture(model, (x,))
        names = named_inputs(model, (x,), captured.objects)
        layouts = input_layouts(captured.objects, mesh, [k for _, k in names], {**fsdp_placements(model), 0: (Shard(0),)})
        program = trace_global(captured.gm, captured.example_inputs, mesh=mesh, layouts=layouts)
        runs = tried[layers] = []
        memo = Decisions()

        def run(pinned, foreseen=None):
            runs.append(pinned)
            propagate(program.gm, mesh, program.input_layouts, pinned=pinned, cost_model=BANDWIDTH_BOUND, memo=memo,
                      foreseen=foreseen)

        propagate_with_pins(run, program.gm, BANDWIDTH_BOUND)
        norms = {f"fn_layers_{i}_{kind}_norm_weight" for i in range(layers) for kind in ("attention", "ffn")}
        for pins in runs:
            # a layer's norm weight is pinned with every other layer's of its kind, or not at all
            for kind in ("attention", "ffn"):
                of_kind = {n for n in norms if kind in n}
                assert not (of_kind & pins) or of_kind <= pins, pins
    # 2 layers: the greedy plan, activations pinned, four classes (the two norms' kinds, the final norm,
    # wk), all moved inputs, the foreseen plan; 4 layers: the six smallest are the norms, two classes
    assert [len(tried[2]), len(tried[4])] == [8, 6], tried


def test_a_model_plans_each_repeated_layer_once():
    """Decisions are keyed by a node's structure: a deeper model adds no new strategy choices (the
    layers after the first reuse the first's), and the plan is the fresh one."""
    torch.manual_seed(0)
    made = []
    for layers in (2, 3):
        model = Llama(LlamaConfig(vocab_size=64, dim=32, n_layers=layers, n_heads=4, n_kv_heads=2, ffn_dim=64))
        x = torch.randint(0, 64, (8, 16))
        mesh = fxshard.MeshSpec(dp=4)
        captured = capture(model, (x,))
        names = named_inputs(model, (x,), captured.objects)
        layouts = input_layouts(captured.objects, mesh, [k for _, k in names],
                                {**fsdp_placements(model), 0: (Shard(0),)})
        program = trace_global(captured.gm, captured.example_inputs, mesh=mesh, layouts=layouts)
        memo = Decisions()
        propagate(program.gm, mesh, program.input_layouts, cost_model=BANDWIDTH_BOUND, memo=memo)
        made.append(len(memo.made))
    assert made[1] == made[0], made


def test_a_layouts_cached_hash_is_not_pickled():
    """Layouts keep their hash and largest local shape once computed; neither travels in a pickle
    (str hashes differ between processes: a rank would look a layout up under another's hash)."""
    import pickle

    from fxshard.layout import Layout, Piece
    from fxshard.mesh import MeshAxis

    mesh = fxshard.MeshSpec(dp=2, tp=4)
    layout = Layout(mesh, (8, 16), [[Piece(4, MeshAxis("tp", 4))], []], [(MeshAxis("dp", 2), "sum")])
    hash(layout), layout.max_local_shape()
    copy = pickle.loads(pickle.dumps(layout))
    fields = set(copy.__dict__)  # before == computes the copy's own hash
    assert (fields, copy == layout) == ({"mesh", "shape", "dims", "partial"}, True)


def test_the_collector_is_paused_while_fxshard_plans_and_on_again_after(fake_mesh_4, make_mlp):
    """backend/inductor/collector.py: no automatic garbage collection walks the compile's objects during the
    stages (each full pass walks every FX node and fake tensor made so far: 1.1 s of an 8-layer first
    step); the collector is as it was after, and a block that finds it off leaves it off."""
    import gc

    from fxshard.backend.inductor.collector import collector_paused

    torch.manual_seed(0)
    model = make_mlp()
    for name, p in list(model.named_parameters()):
        owner, leaf = model.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2]
        owner.register_parameter(leaf, torch.nn.Parameter(distribute_tensor(
            p.detach(), fake_mesh_4, (Shard(0),) if name.startswith("up") else (Replicate(),))))
    enabled: dict[str, bool] = {}
    options = {"inductor": False, "on_graph": lambda stage, gm: enabled.setdefault(stage, gc.isenabled())}
    assert gc.isenabled()
    x = distribute_tensor(torch.randn(4, 8), fake_mesh_4, (Replicate(),))
    torch.compile(model, backend="fxshard", options=options)(x)
    assert enabled["plan"] is False and enabled["plan_backward"] is False, enabled  # reported from within the stages
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_nodes_made_without_create_nodes_argument_scan_are_the_nodes_it_makes():
    """fxshard's copies make their nodes with ``graph.new_node`` / ``copy_node`` / ``copy_nodes``, which skip
    ``create_node``'s pytree scan of the arguments for symbolic sizes: the same graph as ``graph_copy`` /
    ``node_copy`` gives (names, arguments, keyword arguments, readers, types, meta its own dict), names
    deduplicated alike; a graph whose module watches nodes being made sees each with its arguments."""
    import torch.fx as fx
    from torch.fx.experimental.proxy_tensor import make_fx

    from fxshard.graph import copy_node, copy_nodes, new_node

    def program(x: torch.Tensor, w: torch.Tensor) -> tuple:
        y = torch.nn.functional.linear(x, w).relu()
        return y.sum(dim=[0], keepdim=True), torch.split(y, [1, 2], dim=0)[1], x.new_zeros((3,), dtype=torch.int64)

    source = make_fx(program)(torch.randn(3, 4), torch.randn(5, 4)).graph
    for node in source.nodes:
        node.meta["mark"] = node.name
    copies = []
    for copy_all in (lambda g, m: g.graph_copy(source, m), lambda g, m: copy_nodes(g, source, m)):
        graph, made = fx.Graph(), {}
        graph.output(copy_all(graph, made))
        graph.output(copy_all(graph, {}))  # a second copy in the same graph: every name taken once already
        copies.append((graph, made))
    (torch_graph, torch_made), (ours, ours_made) = copies
    ours.lint()
    assert ours.python_code("self").src == torch_graph.python_code("self").src
    assert any(n.kwargs for n in ours.nodes) and any(len(n.users) > 1 for n in ours.nodes)
    for node in source.nodes:
        if node.op == "output":
            continue
        a, b = torch_made[node], ours_made[node]
        assert (b.name, b.op, b.target, b.type, b.meta) == (a.name, a.op, a.target, a.type, a.meta)
        assert b.meta is not node.meta
        assert [u.name for u in b.users] == [u.name for u in a.users]
    seen: list[tuple] = []
    watched = fx.GraphModule(torch.nn.Module(), fx.Graph())
    watched._register_create_node_hook(lambda n: seen.append((n.args, dict(n.kwargs))))
    x = watched.graph.placeholder("x")
    made = new_node(watched.graph, "call_function", torch.ops.aten.sum.dim_IntList, (x, [0]), {"keepdim": True})
    copy_node(watched.graph, made, lambda a: a)
    assert seen == [((), {}), ((x, [0]), {"keepdim": True}), ((x, [0]), {"keepdim": True})]


def _bucket_trace_calls(name: str, group: str) -> list[tuple]:
    """(callable, arguments) as Inductor's merges hand ``_trace`` a bucket function of ``bucket_traces.RECORDED``
    (fake tensors of the program's mode): members of several shapes, and for fxshard's gather, which packs bytes,
    of several dtypes; torch 2.15's reduce_scatter merge binds its inputs' shapes and unpadded ones in a partial."""
    import functools
    import importlib
    import inspect

    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    mode = FakeTensorMode(shape_env=ShapeEnv())

    def fakes(*specs: tuple) -> list[torch.Tensor]:
        with mode:
            return [torch.empty(shape, dtype=dtype) for shape, dtype in specs]

    f32, cpu = torch.float32, torch.device("cpu")
    alike = fakes(((6,), f32), ((6, 8), f32), ((2, 8), f32), ((3, 4, 2), f32))
    mixed = fakes(((3,), torch.int64), ((5, 2), f32), ((7,), torch.uint8))
    scattered = fakes(((8, 3), f32), ((12,), f32), ((4, 2, 2), f32))
    module, _, attribute = name.rpartition(".")
    fn = getattr(importlib.import_module(module), attribute)
    if name.endswith("_gather_bucket"):  # fxshard's: Inductor's own views a strided slice of bytes, as fxshard does not
        return [(fn, (alike, group, 4, f32, [f32] * 4, 1)),
                (fn, (mixed, group, 4, torch.uint8, [x.dtype for x in mixed], 2))]
    if "all_gather" in name:
        return [(fn, (alike, group, 4, f32, [f32] * 4, 1))]
    if "reduce_scatter" in name and "unpadded_input_indices" in inspect.signature(fn).parameters:
        unpadded = [scattered[0], *fakes(((10,), f32)), scattered[2]]  # the second's padding to 12 rows removed
        return [(functools.partial(fn, rs_input_shapes=None, unpadded_input_indices=None),
                 (scattered, group, 4, "sum", f32, cpu)),
                (functools.partial(fn, rs_input_shapes=[x.shape for x in scattered], unpadded_input_indices=[1]),
                 (unpadded, group, 4, "sum", f32, cpu))]
    if "reduce_scatter" in name:
        return [(fn, (scattered, group, 4, "sum", f32, cpu))]
    return [(fn, (fakes(((), f32), ((), f32)), group, "sum", f32, cpu)), (fn, (alike, group, "avg", f32, cpu))]


def _trace_record(gm) -> list[tuple]:
    """What a bucket trace gives the program it is copied into: every node but the placeholders (which the
    copy maps by position), with its arguments by position, name, metadata and values' sizes and strides."""
    import torch.fx as fx
    import torch.utils._pytree as pytree

    position = {node: k for k, node in enumerate(gm.graph.nodes)}

    def sized(value):
        return pytree.tree_map(lambda t: (tuple(t.shape), t.stride(), t.dtype, t.device)
                               if isinstance(t, torch.Tensor) else t, value)

    return [(node.op, node.target, node.name, fx.node.map_arg((node.args, node.kwargs), position.__getitem__),
             sorted(node.meta), sized(node.meta.get("val")), sized(node.meta.get("eager_input_vals")),
             str(node.meta.get("tensor_meta")))
            for node in gm.graph.nodes if node.op != "placeholder"]


@pytest.mark.parametrize("name", __import__("fxshard.backend.inductor.bucket_traces", fromlist=["RECORDED"]).RECORDED)
def test_a_recorded_bucket_trace_is_make_fxs(fake_mesh_4, name):
    """``bucket_traces.recorded`` records the ops a bucket function dispatches instead of tracing it with
    ``make_fx``: for every function it records, the graph Inductor's ``bucketing._trace`` makes (nodes,
    names, arguments, metadata, values), on members of several shapes and dtypes; and within
    ``traces_reused`` Inductor's merges take it, make_fx only tracing a function it does not record, and a
    merge handing a copy of a callable (a new partial each merge, torch 2.15) takes the first one's trace."""
    import copy

    from torch._inductor.fx_passes import bucketing

    from fxshard.backend.inductor.bucket_traces import recorded, traces_reused

    group = fake_mesh_4.get_group().group_name
    for fn, arguments in _bucket_trace_calls(name, group):
        made = recorded(fn, arguments)
        assert made is not None
        assert _trace_record(made) == _trace_record(bucketing._trace(fn, arguments))
    traced: list = []

    def make_fx_trace(fn, inputs):
        traced.append(fn)
        return made

    def unrecorded(*args):
        return fn(*args)

    original = bucketing._trace
    bucketing._trace = make_fx_trace
    try:
        with traces_reused():
            traces = [bucketing._trace(f, arguments) for f in (fn, copy.copy(fn), unrecorded, unrecorded)]
    finally:
        bucketing._trace = original
    assert traced == [unrecorded] and traces[0] is traces[1] and traces[2] is traces[3]


@pytest.mark.parametrize("laid_out_otherwise", [False, True])
def test_a_merge_that_keeps_its_values_metadata_leaves_their_readers_values(laid_out_otherwise):
    """``bucket_traces.users_kept``: after a merge replaces values, Inductor recomputes their readers' fake
    values; where every replacement has the metadata of the value it replaces (fxshard's gathers: contiguous,
    as before) nothing is recomputed, and where one is laid out otherwise the readers are recomputed as
    without it: the graph and every value's metadata as Inductor's merge leaves them."""
    import torch.fx as fx
    from torch._inductor.fx_passes import bucketing
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from fxshard.backend.inductor.bucket_traces import users_kept

    aten = torch.ops.aten

    def merged(fn_output, kept: bool) -> tuple[list, int]:
        mode = FakeTensorMode(shape_env=ShapeEnv())
        graph = fx.Graph()
        x = graph.placeholder("x")
        y = graph.call_function(aten.clone.default, (x,))
        z = graph.call_function(aten.t.default, (y,))
        graph.output((z,))
        with mode:
            x.meta["val"] = torch.empty(4, 6)
            y.meta["val"] = torch.empty(4, 6)
            z.meta["val"] = y.meta["val"].t()
        recomputed = []
        recompute = bucketing._recompute_changed_user_metadata

        def counted(users):
            recomputed.append(len(users))
            recompute(users)

        bucketing._recompute_changed_user_metadata = counted
        try:
            with users_kept() if kept else contextlib.nullcontext():
                bucketing._insert_fn_trace_before_node(graph, lambda a: [fn_output(a)], (x.meta["val"],), z, [x], [y])
        finally:
            bucketing._recompute_changed_user_metadata = recompute
        graph.erase_node(y)
        values = [(n.name, str(n.target), tuple(n.meta["val"].shape), n.meta["val"].stride())
                  for n in graph.nodes if n.op == "call_function"]
        return values, sum(recomputed)

    fn_output = (lambda a: a.t().contiguous().t()) if laid_out_otherwise else (lambda a: a.clone())
    (ours, ours_recomputed), (inductors, inductors_recomputed) = merged(fn_output, True), merged(fn_output, False)
    assert ours == inductors and inductors_recomputed == 1
    assert ours_recomputed == (1 if laid_out_otherwise else 0)
    if laid_out_otherwise:
        assert ours[-1][-1] == (4, 1)  # the reader's value recomputed: the transpose of a column-major input
