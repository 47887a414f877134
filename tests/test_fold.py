"""A training step's repeated layers planned once (backend/programs/fold.py): stages 1-5 run on layers 0, 1, L-2 and
L-1, and layer 1's plan (and its lowered programs) stamped out for the others.

The folded program must be the program planning the whole model gives: the same local code per region
(what Inductor compiles), the same schedule (which value each region reads and writes), the same saved
values and collectives, and the single-device numerics; and where the layers are not alike, the whole model
is planned.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from collections import Counter

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import fxshard
from fxshard.backend.layers.block_regions import blocks_as_regions, repeated_blocks
from fxshard.backend.programs.fold import STAMP
from fxshard.backend.programs.fold_lowered import REGION
from fxshard.backend.layers.regional_program import RegionalProgram, RegionRole, program_structure, region_schedule
from fxshard.backend.simulate import simulate_ranks

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
sys.path.insert(0, os.path.dirname(__file__))  # zoo.py
from models.llama import Llama, LlamaConfig, fsdp_placements, fsdp_tp_placements, megatron_placements  # noqa: E402
from train_llama import distribute_parameters  # noqa: E402

VOCAB = 64


def _config(layers: int) -> LlamaConfig:
    return LlamaConfig(vocab_size=VOCAB, dim=32, n_layers=layers, n_heads=4, n_kv_heads=2, ffn_dim=64)


def _llama(layers: int = 6) -> Llama:
    """Our Llama with no two layers' weights alike (its norm weights start as ones: a copy reading another
    layer's would go unseen)."""
    torch.manual_seed(0)
    model = Llama(_config(layers))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p), alpha=0.1)
    return model


def _model(mesh, placements, layers: int = 6) -> Llama:
    model = _llama(layers)
    given = placements(model) if callable(placements) else placements
    distribute_parameters(model, mesh, {n: given.get(n, (Replicate(),) * mesh.ndim)
                                        for n, _ in model.named_parameters()})
    return model


def _step(model: Llama, mesh, inputs, fold: bool, monkeypatch):
    """A fresh ``fxshard.compile(model.loss)`` (folding on or off) and one step: the program."""
    monkeypatch.setenv("FXSHARD_FOLD", "1" if fold else "0")
    torch._dynamo.reset()
    compiled = fxshard.compile(model.loss, inductor=False)
    tokens, targets = _data()
    with warnings.catch_warnings():  # stages 4-5 ran on four layers too, unfolded (fold.lower_folded)
        warnings.filterwarnings("error", message="fxshard: the lowered layers of a folded plan")
        warnings.filterwarnings("error", message="erase_node")  # shorten erases each dropped call once
        compiled(distribute_tensor(tokens, mesh, inputs), distribute_tensor(targets, mesh, inputs)).backward()
    model.zero_grad()
    return compiled.last


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (4, 16), generator=g), torch.randint(0, VOCAB, (4, 16), generator=g)


def _ops(gm) -> Counter:
    return Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")


# FSDP x TP by default (both axes' collectives in one plan); FSDP alone and Megatron TP alone with --slow
@pytest.mark.parametrize("style", [pytest.param("fsdp", marks=pytest.mark.slow),
                                   pytest.param("tp", marks=pytest.mark.slow), "fsdp_tp"])
def test_a_folded_program_is_the_whole_models_program(fake_mesh_4, monkeypatch, style):
    """Six layers, FSDP, Megatron TP and FSDP x TP: folded, stages 1-3 trace four layers, and the lowered
    step is the one the whole model's plan gives: per region the same code, the same schedule, the same
    collectives and saved values."""
    if style == "fsdp_tp":
        mesh, inputs, placements = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")), \
            (Shard(0), Replicate()), fsdp_tp_placements
    else:
        mesh, inputs = fake_mesh_4, ((Shard(0),) if style == "fsdp" else (Replicate(),))
        placements = fsdp_placements if style == "fsdp" else megatron_placements
    folded = _step(_model(mesh, placements), mesh, inputs, True, monkeypatch)
    whole = _step(_model(mesh, placements), mesh, inputs, False, monkeypatch)
    assert folded.plan.joint is None and whole.plan.joint is not None  # folded: no joint graph of six layers
    assert "unfold" in folded.reporter.times and "unfold" not in whole.reporter.times
    for a, b in ((folded.forward_graph, whole.forward_graph), (folded.backward_graph, whole.backward_graph)):
        assert _ops(a) == _ops(b)
        assert len(a.graph.find_nodes(op="placeholder")) == len(b.graph.find_nodes(op="placeholder"))
    mine, theirs = _regions(folded), _regions(whole)
    assert [(index, layer, ops) for index, layer, ops, _ in mine] == \
        [(index, layer, ops) for index, layer, ops, _ in theirs]
    assert [code for *_, code in mine if code] == [code for *_, code in theirs if code]
    # the folded step's regions were cut from its four layers' bucketed programs, unfolded (fold_lowered.py)
    for which in ("forward", "backward"):
        assert all(REGION in n.meta for n in folded._region_graphs[which].graph.nodes if n.op == "call_function")
        assert any(STAMP in n.meta for n in folded._region_graphs[which].graph.nodes)
    table: dict = {}
    assert _computes(folded, table) == _computes(whole, table)
    assert _region_computes(folded, table) == _region_computes(whole, table)


def _regions(program) -> list:
    """Per region of the step (forward, then backward): its role and layer (Inductor compiles a layer), its
    operations (collectives bucketed), and a compiled region's code (``program_structure``, with each process
    group named by its ranks: a compile makes its sub-groups anew)."""
    return [(r.role, r.index, _ops(r.graph),
             _named_groups(program_structure(r.graph.graph)) if r.role is RegionRole.LAYER else None)
            for regions in program._regions() for r in regions]


def _named_groups(x):
    if isinstance(x, tuple):
        if len(x) == 2 and x[0] == "str" and _group_ranks(x[1].strip("'")) is not None:
            return ("group", _group_ranks(x[1].strip("'")))
        return tuple(_named_groups(y) for y in x)
    return x


def _group_ranks(name: str):
    import torch.distributed as dist

    try:
        return tuple(dist.get_process_group_ranks(torch._C._distributed_c10d._resolve_process_group(name)))
    except Exception:
        return None


def _computes(program, table: dict) -> tuple[list[int], list[int]]:
    """What the step's lowered forward returns (its outputs, not its saved values) and what its backward
    returns, each value as an expression over the step's inputs and tangents (ids interned in ``table``, so two
    programs' values are equal exactly when they compute alike, in whatever order their nodes run: a
    backward's saved value is the forward's expression for it)."""
    def arg(a, memo):
        if isinstance(a, torch.fx.Node):
            return memo[a]
        if isinstance(a, (list, tuple)):
            return tuple(arg(x, memo) for x in a)
        if isinstance(a, str) and _group_ranks(a) is not None:
            return ("group", _group_ranks(a))
        return repr(a)

    def expressions(gm, memo):
        for node in gm.graph.nodes:
            if node.op == "call_function":
                key = (str(node.target), arg(node.args, memo), arg(tuple(sorted(node.kwargs.items())), memo))
                memo[node] = table.setdefault(key, len(table))
        return [memo[o] for o in node.args[0]]  # the output node's

    forward, backward = program.forward_graph, program.backward_graph
    memo = {p: table.setdefault(("input", p.name), len(table)) for p in forward.graph.find_nodes(op="placeholder")}
    results = expressions(forward, memo)
    placeholders = backward.graph.find_nodes(op="placeholder")
    saved = results[program.num_outputs:]
    bmemo = dict(zip(placeholders, saved))
    bmemo.update({p: table.setdefault(("tangent", k), len(table)) for k, p in enumerate(placeholders[len(saved):])})
    return results[:program.num_outputs], expressions(backward, bmemo)


def _region_computes(program, table: dict) -> tuple[list[int], list[int]]:
    """As ``_computes``, through the step's regions and their schedules (what runs, its collectives bucketed):
    each region's graph evaluated on the expressions its schedule hands it."""
    forward_regions, backward_regions = program._regions()

    def run(which, regions, args):
        schedule = region_schedule(program._region_graphs[which], regions)
        walker = RegionalProgram(None, regions, None, schedule=schedule)
        attrs = [table.setdefault(_constant(value), len(table)) for _, value in schedule.attrs]
        return list(walker.walk(args, attrs, lambda k, inputs: _evaluate(regions[k].graph, inputs, table)))

    forward = program.lowered_graphs()[0]
    inputs = [table.setdefault(("input", p.name), len(table)) for p in forward.graph.find_nodes(op="placeholder")]
    results = run("forward", forward_regions, inputs)
    n = program.num_outputs
    tangents = [table.setdefault(("tangent", k), len(table)) for k in range(n)]
    return results[:n], run("backward", backward_regions, results[n:] + tangents)


def _constant(value) -> tuple:
    """A constant the program reads (a rotary table lent to each layer: block_joint.py) by its value: two
    programs' constants compare by content, wherever each keeps them."""
    if isinstance(value, torch.Tensor):
        return ("constant", str(value.dtype), tuple(value.shape), tuple(value.detach().flatten().tolist()))
    return ("constant", repr(value))


def _evaluate(gm, inputs, table) -> list:
    """The expressions ``gm`` returns given its inputs' (ids interned in ``table``)."""
    memo = dict(zip(gm.graph.find_nodes(op="placeholder"), inputs))

    def arg(a):
        if isinstance(a, torch.fx.Node):
            return memo[a]
        if isinstance(a, (list, tuple)):
            return tuple(arg(x) for x in a)
        if isinstance(a, str) and _group_ranks(a) is not None:
            return ("group", _group_ranks(a))
        return repr(a)

    for node in gm.graph.nodes:
        if node.op == "call_function":
            key = (str(node.target), arg(node.args), arg(tuple(sorted(node.kwargs.items()))))
            memo[node] = table.setdefault(key, len(table))
    return [memo[o] for o in node.args[0]]


def test_a_folded_step_computes_what_the_model_does(fake_mesh_4, monkeypatch):
    """Six layers with replicated weights (the fake group's result is exact): the folded step's loss and every
    parameter's gradient are the single-device model's, the stamped layers' (2 and 3) included."""
    model = _model(fake_mesh_4, {})
    reference = Llama(_config(6))
    reference.load_state_dict({k: v.full_tensor() for k, v in model.state_dict().items()})
    tokens, targets = _data()
    monkeypatch.setenv("FXSHARD_FOLD", "1")
    torch._dynamo.reset()
    compiled = fxshard.compile(model.loss, inductor=False)
    loss = compiled(distribute_tensor(tokens, fake_mesh_4, [Replicate()]),
                    distribute_tensor(targets, fake_mesh_4, [Replicate()]))
    loss.backward()
    assert compiled.last.plan.joint is None
    expected = reference.loss(tokens, targets)
    expected.backward()
    torch.testing.assert_close(loss.full_tensor(), expected)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, msg=name)


@pytest.mark.parametrize("axes, placements, regional", [  # Megatron TP alone with --slow (FSDP x TP has its plan)
    pytest.param({"tp": 4}, megatron_placements, False, marks=pytest.mark.slow),
    ({"dp": 4}, fsdp_placements, True),
    ({"dp": 2, "tp": 2}, fsdp_tp_placements, False),
], ids=["tp", "fsdp-regional", "fsdp_tp"])
def test_a_folded_plan_trains_as_one_device_on_simulated_ranks(fake_mesh_4, axes, placements, regional):
    """Six layers with sharded weights (Megatron TP, FSDP, FSDP x TP on four ranks: the module's fake group),
    every rank's program lowered from the unfolded plan and run under ``simulate`` (regionally too): the loss
    and every gradient are one device's."""
    model = _llama()
    tokens, targets = _data()
    loss = model.loss(tokens, targets)
    loss.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    given = dict(placements(model))
    batch = (Shard(0),) + (Replicate(),) * (len(axes) - 1) if "dp" in axes else (Replicate(),)
    with blocks_as_regions(repeated_blocks(model)):
        run = simulate_ranks(model.loss, tokens, targets, mesh=fxshard.MeshSpec(**axes), grad=True, fold=True,
                             placements={0: batch, 1: batch, **given}, regional=regional)
    assert run.graph is None  # folded: no joint graph of six layers
    got = run.full_grads()
    torch.testing.assert_close(run.full()[0], loss.detach(), rtol=1e-5, atol=1e-6)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)


# Llama with --slow: Mixtral's layers are Llama's with experts (the same rotary tables and norms to fold), and
# a folded Hugging Face Llama step runs the whole model's regions below
@pytest.mark.parametrize("name", [pytest.param("llama", marks=pytest.mark.slow), "mixtral"])
def test_a_hugging_face_model_folds_and_trains_as_one_device(fake_mesh_4, name):
    """Hugging Face Llama and Mixtral with six layers under Megatron TP on four simulated ranks: folded (their
    layers read per-layer copies of the rotary tables and constants, made alike, and each layer's backward makes
    the next layer's input norm's gradient: ``same_values.same_value``, ``fold._Layers.next_params``), and the loss and
    every gradient are one device's."""
    pytest.importorskip("transformers")
    import types

    import transformers
    from zoo import ZOO

    arch = ZOO[name]
    cells = dict(zip(arch.build.__code__.co_freevars, (c.cell_contents for c in arch.build.__closure__)))
    config = getattr(transformers, cells["config_name"])(attn_implementation=cells["attention"],
                                                         **{**cells["cfg"], "num_hidden_layers": 6})
    torch.manual_seed(0)
    model = getattr(transformers, cells["model_name"])(config).eval()
    with torch.no_grad():  # no two layers' weights alike (norm weights start as ones: a copy reading another
        for p in model.parameters():  # layer's would go unseen)
            p.add_(torch.randn_like(p), alpha=0.1)
    args = arch.example(2, 8)
    fn = arch.call(model)
    loss_of = types.MethodType(lambda self, *a: fn(*a).float().pow(2).mean(), model)
    loss = loss_of(*args)
    loss.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    with blocks_as_regions(repeated_blocks(model)):
        run = simulate_ranks(loss_of, *args, mesh=fxshard.MeshSpec(tp=4), placements=arch.plan(model), grad=True,
                             fold=True)
    assert run.graph is None  # folded
    got = run.full_grads()
    torch.testing.assert_close((run.full()[0], {n: got[n] for n in want}), (loss.detach(), want), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["llama", pytest.param("mixtral", marks=pytest.mark.slow)])
def test_a_folded_hugging_face_step_runs_the_whole_models_regions(fake_mesh_4, monkeypatch, name):
    """Hugging Face Llama (and Mixtral, slow tier) with six layers under Megatron TP: the folded step's regions,
    bucketed on four layers and unfolded (fold_lowered.py: rotary tables lent per layer, the next layer's norm
    gradient made in a layer's backward), are the whole model's: each region's operations and code, and what
    every value they hand each other computes."""
    pytest.importorskip("transformers")
    folded, whole = (_hugging_face_step(fake_mesh_4, monkeypatch, name, fold) for fold in (True, False))
    assert folded.plan.joint is None and whole.plan.joint is not None
    mine, theirs = _regions(folded), _regions(whole)
    assert [(index, layer, ops) for index, layer, ops, _ in mine] == \
        [(index, layer, ops) for index, layer, ops, _ in theirs]
    assert [code for *_, code in mine if code] == [code for *_, code in theirs if code]
    assert all(REGION in n.meta for n in folded._region_graphs["forward"].graph.nodes if n.op == "call_function")
    table: dict = {}
    assert _region_computes(folded, table) == _region_computes(whole, table)


def _hugging_face_step(mesh, monkeypatch, name: str, fold: bool):
    """A six-layer Hugging Face model of ``tests/zoo.py`` under its TP plan: one step of a fresh
    ``fxshard.compile`` of its loss (folding on or off), the program."""
    import types

    import transformers
    from zoo import ZOO

    arch = ZOO[name]
    cells = dict(zip(arch.build.__code__.co_freevars, (c.cell_contents for c in arch.build.__closure__)))
    config = getattr(transformers, cells["config_name"])(attn_implementation=cells["attention"],
                                                         **{**cells["cfg"], "num_hidden_layers": 6})
    torch.manual_seed(0)
    model = getattr(transformers, cells["model_name"])(config).eval()
    plan = arch.plan(model)
    for n, p in list(model.named_parameters()):
        owner, _, attr = n.rpartition(".")
        setattr(model.get_submodule(owner), attr,
                torch.nn.Parameter(distribute_tensor(p.detach(), mesh, plan.get(n, (Replicate(),)))))
    fn = arch.call(model)
    loss_of = types.MethodType(lambda self, *a: fn(*a).float().pow(2).mean(), model)
    monkeypatch.setenv("FXSHARD_FOLD", "1" if fold else "0")
    torch._dynamo.reset()
    compiled = fxshard.compile(loss_of, inductor=False)
    compiled(*[distribute_tensor(a, mesh, (Replicate(),)) for a in arch.example(2, 8)]).backward()
    return compiled.last


def test_a_model_whose_first_layer_dynamo_traces_inline_folds(fake_mesh_4, monkeypatch):
    """Residual MLP blocks (``rank_programs.Blocks``) under FSDP: Dynamo traces the first block inline and calls
    the region for the other five, so the calls are layers 1-5, not 0-4; the fold names layers by their
    parameters (template 2, successor 4), and the folded step is the whole model's, region by region, value by
    value, and computes what one device does."""
    from rank_programs import Blocks, shard_parameters

    def step(fold: bool, placements):
        torch.manual_seed(0)
        model = Blocks(32, 64, 6)
        reference = Blocks(32, 64, 6)
        reference.load_state_dict(model.state_dict())
        shard_parameters(model, fake_mesh_4, placements)
        data = torch.randn(64, 32)
        monkeypatch.setenv("FXSHARD_FOLD", "1" if fold else "0")
        torch._dynamo.reset()
        compiled = fxshard.compile(model, inductor=False)
        out = compiled(distribute_tensor(data, fake_mesh_4, [Shard(0) if placements == (Shard(0),) else Replicate()]))
        out.sum().backward()
        return compiled.last, model, reference, data, out

    folded, *_ = step(True, (Shard(0),))
    whole, *_ = step(False, (Shard(0),))
    assert folded.folded is not None and (folded.folded.short.template, folded.folded.short.successor) == (2, 4)
    assert [(i, layer, ops) for i, layer, ops, _ in _regions(folded)] == \
        [(i, layer, ops) for i, layer, ops, _ in _regions(whole)]
    table: dict = {}
    assert _computes(folded, table) == _computes(whole, table)
    assert _region_computes(folded, table) == _region_computes(whole, table)
    # replicated weights (the fake group's result is exact): one device's output and gradients
    program, model, reference, data, out = step(True, (Replicate(),))
    assert program.folded is not None
    expected = reference(data)
    expected.sum().backward()
    torch.testing.assert_close(out.full_tensor(), expected)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, msg=name)


def _sharded_layer(model: Llama, layer: int) -> dict:
    """Layer ``layer``'s parameters Shard(0), every other replicated."""
    return {n: (Shard(0),) if n.startswith(f"layers.{layer}.") else (Replicate(),) for n, _ in model.named_parameters()}


@pytest.mark.parametrize("why, layers, placements", [
    ("four layers: nothing to fold", 4, fsdp_placements),
    ("a dropped layer's weight in another layout", 6, lambda model: _sharded_layer(model, 3)),
    ("the template layer's weight in another layout", 6, lambda model: _sharded_layer(model, 1)),
])
def test_layers_not_alike_are_planned_whole(fake_mesh_4, monkeypatch, why, layers, placements):
    """Where the layers are not alike (or too few to gain), the whole model is planned, and the log says why."""
    model = _model(fake_mesh_4, placements, layers)
    with _fxshard_log() as lines:
        program = _step(model, fake_mesh_4, (Replicate(),), True, monkeypatch)
    assert program.plan.joint is not None, why
    assert any("planned whole, not folded" in line for line in lines), (why, lines)


@contextlib.contextmanager
def _fxshard_log():
    """The INFO lines of the ``fxshard`` logger within the block (whatever handlers torch's logging set)."""
    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("fxshard")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
