"""Regional compilation (backend/layers/regions.py): each rank's lowered programs cut at their layers, each
distinct region compiled once and reused by every layer with its key.

Numerics: every rank's programs run region by region in lockstep (``simulate_ranks(regional=True)``:
a layer runs the graph of the first region with its key, as its compiled code would), checked against
one device on fresh random data. Reuse: the production path (``TrainingProgram``) asks
``compile_local`` for no more region graphs at 5 layers than at 3. Collectives: the regional FSDP
step issues the whole program's buckets, its gathers a layer early and its reductions waited a layer
late (backend/layers/prefetch.py); tests/test_e2e_gloo.py runs that on real ranks.
"""
from __future__ import annotations

import dataclasses
import os
import sys
from collections import Counter

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import fxshard
from fxshard.backend import options
from fxshard.backend.layers.regional_program import RegionRole
from fxshard.backend.programs import training
from fxshard.backend.simulate import simulate_ranks

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from models.llama import Llama, LlamaConfig, fsdp_placements, fsdp_tp_placements, megatron_placements  # noqa: E402

CFG = LlamaConfig(vocab_size=64, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=64)
BANDWIDTH_BOUND = fxshard.CostModel(default_latency=0.0)  # bytes decide FSDP plans at toy sizes


def reference(model: Llama, x: torch.Tensor, y: torch.Tensor, grad: bool) -> tuple[torch.Tensor, dict]:
    model.zero_grad()
    loss = model.loss(x, y)
    if not grad:
        return loss.detach(), {}
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    return loss.detach(), grads


@pytest.mark.parametrize("mesh, placements, grad", [
    (fxshard.MeshSpec(dp=4), fsdp_placements, True),       # FSDP: parameters gathered in their layer's region
    # Megatron: all-reduces inside the regions. ~6 s: by default fsdp runs the regional backward and
    # megatron-inference the all-reduces inside regions
    pytest.param(fxshard.MeshSpec(tp=4), megatron_placements, True, marks=pytest.mark.slow),
    (fxshard.MeshSpec(tp=4), megatron_placements, False),  # inference: the forward alone
    # FSDP x TP: the last layer returns what the others do, for the next layer, and no one reads it
    (fxshard.MeshSpec(dp=2, tp=2), fsdp_tp_placements, True),
], ids=["fsdp", "megatron", "megatron-inference", "fsdp-tp"])
def test_regional_program_matches_one_device(mesh, placements, grad):
    torch.manual_seed(len(mesh.names) + grad)
    model = Llama(CFG)
    x, y = torch.randint(0, CFG.vocab_size, (4, 16)), torch.randint(0, CFG.vocab_size, (4, 16))
    ref_loss, ref_grads = reference(model, x, y, grad)
    sharded = (Shard(0),) + (Replicate(),) * (len(mesh.names) - 1)  # on dp, the mesh's first dim
    batch = {0: sharded, 1: sharded} if "dp" in mesh.names else {}
    run = simulate_ranks(model.loss, x, y, mesh=mesh, placements=placements(model) | batch, grad=grad,
                         cost_model=BANDWIDTH_BOUND, regional=True)
    layers = CFG.n_layers * (2 if grad else 1)  # forward and backward
    assert 0 < run.region_graphs < layers  # the programs ran region by region, a layer on another's graph
    got = (run.full()[0], run.full_grads() if grad else {})
    torch.testing.assert_close(got, (ref_loss, ref_grads), rtol=1e-4, atol=1e-6)


def _fsdp_program(mesh, layers: int = CFG.n_layers, batch: tuple[int, int] = (4, 16), regional: bool = True,
                  own_targets: bool = False) -> training.TrainingProgram:
    """The program of one FSDP training step of the Llama with ``layers`` layers on a ``batch`` of tokens
    (the targets: the tokens, or ``own_targets`` drawn after them), as ``training.compile_local`` (which
    the caller patches) left it."""
    from train_llama import distribute_parameters

    torch.manual_seed(0)
    model = Llama(dataclasses.replace(CFG, n_layers=layers))
    distribute_parameters(model, mesh, fsdp_placements(model))
    step = fxshard.compile(model.loss, cost_model=BANDWIDTH_BOUND, regional=regional)
    x = distribute_tensor(torch.randint(0, CFG.vocab_size, batch), mesh, (Shard(0),))
    y = distribute_tensor(torch.randint(0, CFG.vocab_size, batch), mesh, (Shard(0),)) if own_targets else x
    step(x, y).backward()
    return step.last


def _record_compiles(monkeypatch) -> list[torch.fx.GraphModule]:
    """The region graphs the training program gives ``compile_local`` from now on (each runs as it is: no
    Inductor here)."""
    compiled: list[torch.fx.GraphModule] = []

    def record(gm: torch.fx.GraphModule, inputs, policy, **_):
        compiled.append(gm)
        return gm

    monkeypatch.setattr(training, "compile_local", record)
    return compiled


def _compiled_regions(layers: int, mesh, monkeypatch) -> tuple[int, int]:
    """(region graphs given to compile_local, regions run that are compiled: every region but those between
    two layers) for one FSDP training step of ``layers`` layers."""
    compiled = _record_compiles(monkeypatch)
    runner = _fsdp_program(mesh, layers)
    return len(compiled), sum(r.role is not RegionRole.BETWEEN for r in runner._forward.regions + runner._backward.regions)


def test_a_deeper_model_compiles_no_more_region_graphs(fake_mesh_4, monkeypatch):
    """A layer each way (and the first or last layer where the plan lays it out differently), the prologue
    and the epilogue each way: as many region graphs at 5 layers as at 3, fewer than the regions run."""
    (three, ran_three), (five, _) = (_compiled_regions(n, fake_mesh_4, monkeypatch) for n in (3, 5))
    assert five == three < ran_three, (three, five, ran_three)


@pytest.mark.parametrize("worth_seconds, compiled_ends", [
    (options.DEFAULTS.worth_seconds, ["epilogue", "epilogue", "prologue"]),  # backward: its epilogue first
    (0.0, ["prologue", "epilogue", "epilogue", "prologue"]),
], ids=["default", "every-end"])
def test_a_training_steps_ends_are_compiled_where_that_pays(fake_mesh_4, monkeypatch, worth_seconds, compiled_ends):
    """bench/train.py's FSDP Llama, three layers: the forward prologue (the root's gathers, the embedding
    lookup, rotary tables) costs less run as its graph than its compile pays back (end_regions.py) and runs
    so, its collectives bucketed as compiled; the epilogues (norm, output projection, loss) and the backward
    prologue (the embedding's gradient packed for its reduce_scatter) are compiled, as every end is where
    the threshold is 0."""
    from train_llama import distribute_parameters

    monkeypatch.setattr(options, "DEFAULTS", dataclasses.replace(options.DEFAULTS, worth_seconds=worth_seconds))
    compiled = _record_compiles(monkeypatch)
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=2048, dim=256, n_layers=3, n_heads=8, n_kv_heads=4, ffn_dim=768))
    distribute_parameters(model, fake_mesh_4, fsdp_placements(model))
    step = fxshard.compile(model.loss, cost_model=fxshard.CostModel())
    tokens = distribute_tensor(torch.randint(0, 2048, (8, 128)), fake_mesh_4, (Shard(0),))
    step(tokens, tokens).backward()
    regions = step.last._forward.regions + step.last._backward.regions
    given = {id(gm) for gm in compiled}
    ends = [r.role.value for r in regions
            if r.role in (RegionRole.PROLOGUE, RegionRole.EPILOGUE) and id(r.graph) in given]
    assert ends == compiled_ends
    assert len(compiled) == 2 + len(compiled_ends)  # and a layer each way


def _traces_and_merges(layers: int, mesh, monkeypatch) -> tuple[int, int]:
    """(traces Inductor's bucket merges made, buckets merged) for one FSDP training step of ``layers`` layers."""
    from torch._inductor.fx_passes import bucketing

    from fxshard.backend.inductor import buckets

    counts = Counter()
    original = bucketing._trace

    def trace(fn, inputs):
        counts["traces"] += 1
        return original(fn, inputs)

    def counted(merge):
        def run(graph, bucket, insert_before=None):
            counts["merges"] += 1
            return merge(graph, bucket, insert_before=insert_before)
        return run

    monkeypatch.setattr(bucketing, "_trace", trace)
    for name in ("merge_all_gathers", "merge_reduce_scatters"):
        monkeypatch.setattr(buckets, name, counted(getattr(buckets, name)))
    _record_compiles(monkeypatch)
    _fsdp_program(mesh, layers, batch=(8, 64))  # parameters gathered, gradients reduce_scattered
    return counts["traces"], counts["merges"]


def test_every_layers_buckets_are_traced_once(fake_mesh_4, monkeypatch):
    """The layers' buckets are alike: each kind's merge is traced once (backend/inductor/bucket_traces.py), so one
    more layer merges more buckets and traces none more (three layers: the fewest a program is cut at)."""
    (traces_three, merges_three), (traces_four, merges_four) = (_traces_and_merges(n, fake_mesh_4, monkeypatch)
                                                                for n in (3, 4))
    assert traces_four == traces_three < merges_three < merges_four, \
        (traces_three, merges_three, traces_four, merges_four)


def _compile_work(layers: int, mesh, monkeypatch) -> Counter:
    """What compiling one FSDP training step of ``layers`` layers walks (Dynamo's capture, every stage, the cut
    into regions; Inductor left out): the nodes read going through a graph's node list (``visited``), the
    nodes the block buckets' dependency search reaches (``reached``), and the program inputs handed to
    Inductor's sort of a merged bucket's region (``inputs sorted``)."""
    import torch.fx as fx
    from torch._inductor.fx_passes import bucketing

    from fxshard.backend.inductor import buckets

    counts: Counter = Counter()
    walk, reach = fx.graph._node_list.__iter__, buckets.reachable
    sort = getattr(bucketing, "_sort_bucket_region", None)

    def walked(node_list):
        for node in walk(node_list):
            counts["visited"] += 1
            yield node

    def reached(node, step):
        found = reach(node, step)
        counts["reached"] += len(found)
        return found

    def sorted_region(graph, new_nodes, inputs):
        counts["inputs sorted"] += sum(n.op == "placeholder" for n in inputs)
        return sort(graph, new_nodes, inputs)

    with monkeypatch.context() as patch:  # undone before the next depth is counted
        patch.setattr(buckets, "reachable", reached)
        if sort is not None:
            patch.setattr(bucketing, "_sort_bucket_region", sorted_region)
        _record_compiles(patch)
        patch.setattr(fx.graph._node_list, "__iter__", walked)
        _fsdp_program(mesh, layers, batch=(8, 64))  # parameters gathered, gradients reduce_scattered
    return counts


# folded by default (its regions are cut from whole programs unfolded: the cut's work is both's); whole with --slow
@pytest.mark.parametrize("fold, depths", [pytest.param(False, (2, 4, 6), marks=pytest.mark.slow), (True, (5, 7, 9))],
                         ids=["whole", "folded"])
def test_compiling_a_program_takes_time_linear_in_its_layers(fake_mesh_4, monkeypatch, fold, depths):
    """Every stage reads each layer's part of the program a fixed number of times: two more layers add about
    as many nodes visited from 4 layers to 6 as from 2 to 4 (2 / 4 / 6 / 8 layers: 64k / 107k / 152k / 197k,
    each layer planned: ``FXSHARD_FOLD=0``), and folded (backend/programs/fold.py: five layers and more planned as
    four, the others copied) from 7 to 9 as from 5 to 7.
    The cut into regions was quadratic (64 layers' cut took 3.2 s, 32 layers' 1.1 s): each bucket merge
    compared the program's nodes before and after it, searched from each member to the program's end for
    dependencies and had Inductor look back to the placeholders for its inputs; the whole compile visited
    73k / 138k / 217k nodes. Counts, not times."""
    monkeypatch.setenv("FXSHARD_FOLD", "1" if fold else "0")
    two, four, six = (_compile_work(n, fake_mesh_4, monkeypatch) for n in depths)
    for kind in ("visited", "reached"):
        assert six[kind] - four[kind] <= 1.1 * (four[kind] - two[kind]), (kind, two, four, six)
    assert two["inputs sorted"] == four["inputs sorted"] == six["inputs sorted"] == 0, (two, four, six)


def test_the_backward_frees_each_layers_saved_values_after_its_region(fake_mesh_4, monkeypatch):
    """The forward's saved activations are freed layer by layer as the backward's regions read them last,
    as AOTAutograd's backward frees them, not all at once when the step ends (which held every layer's
    activations beside all gradients: the step's peak 1.09x DTensor's at bench/gpu.py's TP+SP size)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    saved: list[StorageWeakRef] = []
    alive_per_region: list[int] = []
    run_forward = training.TrainingProgram.run_forward

    def recording_forward(self, inputs):
        own = {x.untyped_storage().data_ptr() for x in inputs}  # parameters the forward returns stay alive
        results = run_forward(self, inputs)
        saved[:] = [StorageWeakRef(t.untyped_storage()) for t in results[self.num_outputs:]
                    if t.untyped_storage().data_ptr() not in own]
        return results

    def recording_region(gm, inputs, policy, **_):
        def run(*args):
            if saved:  # the backward's regions (the forward's run before ``saved`` is set)
                alive_per_region.append(sum(not ref.expired() for ref in saved))
            return gm(*args)
        return run

    monkeypatch.setattr(training.TrainingProgram, "run_forward", recording_forward)
    monkeypatch.setattr(training, "compile_local", recording_region)
    # every end compiled, its region recorded: toy sizes
    monkeypatch.setattr(options, "DEFAULTS", dataclasses.replace(options.DEFAULTS, worth_seconds=0.0))
    _fsdp_program(fake_mesh_4)
    assert len(saved) > 10 and len(alive_per_region) >= CFG.n_layers, (len(saved), alive_per_region)
    # the epilogue's region (the output projection's backward) finds every saved value alive and frees its own;
    # each layer's region after it (the last layer's first) finds fewer alive than the one before it
    epilogue, *layers, _prologue = alive_per_region
    assert epilogue == len(saved) and len(layers) == CFG.n_layers, (len(saved), alive_per_region)
    assert all(a > b for a, b in zip(alive_per_region, alive_per_region[1:])), alive_per_region
    assert layers[-1] < len(saved) / 2, (len(saved), alive_per_region)


def test_a_retained_graph_runs_its_backward_again(fake_mesh_4, monkeypatch):
    """``backward(retain_graph=True)`` keeps the saved values for a second backward (which accumulates the
    same gradients again); without it a second backward says the graph is freed, as eager PyTorch does."""
    from train_llama import distribute_parameters

    monkeypatch.setattr(training, "compile_local", lambda gm, inputs, policy, **_: gm)
    torch.manual_seed(0)
    model = Llama(CFG)
    distribute_parameters(model, fake_mesh_4, fsdp_placements(model))
    step = fxshard.compile(model.loss, cost_model=BANDWIDTH_BOUND)
    x = distribute_tensor(torch.randint(0, CFG.vocab_size, (4, 16)), fake_mesh_4, (Shard(0),))
    loss = step(x, x)
    loss.backward(retain_graph=True)
    once = {n: p.grad.to_local().clone() for n, p in model.named_parameters()}
    loss.backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad.to_local(), 2 * once[n], msg=lambda m: f"{n}: {m}")
    with pytest.raises(RuntimeError, match="second time"):
        loss.backward()


def _fsdp_step(regional: bool, mesh, monkeypatch) -> training.TrainingProgram:
    """One FSDP training step's program, its regions (or whole programs) bucketed by the pass
    ``compile_local`` gives Inductor, applied here without Inductor (``bucketed_uncompiled``)."""
    from fxshard.backend.inductor.compile_local import bucketed_uncompiled

    monkeypatch.setattr(training, "compile_local", lambda gm, inputs, policy, **_: bucketed_uncompiled(gm, policy))
    return _fsdp_program(mesh, batch=(8, 64), regional=regional)


def _kind(node: torch.fx.Node) -> str:
    return node.target._opname.removesuffix("_into_tensor_out").removesuffix("_into_tensor").removesuffix("_tensor")


def _started(gm: torch.fx.GraphModule) -> list[str]:
    """The collectives a graph starts, by kind, in order."""
    return [_kind(n) for n in gm.graph.nodes if getattr(n.target, "namespace", None) == "_c10d_functional"
            and n.target is not torch.ops._c10d_functional.wait_tensor.default]


def _bucketed_collectives(regional: bool, mesh, monkeypatch) -> list[dict[str, int]]:
    """Per program run (forward, backward: region by region, or whole), the collectives it starts."""
    runner = _fsdp_step(regional, mesh, monkeypatch)
    found = []
    for program in (runner._forward, runner._backward):
        graphs = [program.compiled[k] for k in range(len(program.regions))] if regional else [program]
        found.append(dict(Counter(kind for gm in graphs for kind in _started(gm))))
    return found


# ~8 s, with --slow: by default test_regional_fsdp_gathers_a_layer_early_... lists this regional step's collectives
# region by region (the same 4 gathers and the loss's all_reduce forward, 3 gathers and 4 reduce_scatters backward),
# and tests/test_overlap.py's test_each_block_is_one_bucket the whole program's buckets
@pytest.mark.slow
def test_regional_fsdp_issues_the_whole_programs_buckets(fake_mesh_4, monkeypatch):
    """Cut into regions, FSDP still makes one all_gather and one reduce_scatter per block, as the whole
    program does and FSDP2 does: the root's parameters (embedding, final norm, output projection) are
    gathered in the prologue, before the first layer, and their gradients reduced after the whole
    backward (regions.py); the buckets merged on the whole programs before the cut (buckets.merge_blocks)."""
    regional = _bucketed_collectives(True, fake_mesh_4, monkeypatch)
    whole = _bucketed_collectives(False, fake_mesh_4, monkeypatch)
    # forward: the root and 3 layers, and the loss's count and sum in one call (reduce_together.py);
    # backward: each layer regathered (its norms' weights kept from the forward), one reduce_scatter per
    # block, the root's last
    assert regional == whole == [{"all_gather": 4, "all_reduce": 1}, {"all_gather": 3, "reduce_scatter": 4}], \
        (regional, whole)


def _waits_elsewhere(gm: torch.fx.GraphModule) -> int:
    """How many of a graph's waits wait a collective another region started (an input of the region)."""
    return sum(n.target is torch.ops._c10d_functional.wait_tensor.default and n.args[0].op == "placeholder"
               for n in gm.graph.nodes)


def test_regional_fsdp_gathers_a_layer_early_and_waits_reductions_a_layer_late(fake_mesh_4, monkeypatch):
    """prefetch.py: no layer region starts its own gathers (a region between the two layers before it
    does, so the layer between computes while they move) and none waits its own reductions (a region
    after the next layer does). Per region, in the order they run: (role, layer, collectives started,
    waits of ones started elsewhere)."""
    runner = _fsdp_step(True, fake_mesh_4, monkeypatch)
    found = [[(r.role.value, r.index, _started(program.compiled[k]), _waits_elsewhere(program.compiled[k]))
              for k, r in enumerate(program.regions)] for program in (runner._forward, runner._backward)]
    gather, reduce = ["all_gather"], ["reduce_scatter"]
    assert found == [
        # forward: layer 0's gathers start before the prologue (which gathers the root's and waits them),
        # layer 1's before layer 0, layer 2's before layer 1; each layer waits its own; the loss's sums (one call)
        [("between", None, gather, 0), ("prologue", None, gather, 0), ("between", None, gather, 0),
         ("layer", 0, [], 1), ("between", None, gather, 0), ("layer", 1, [], 1), ("layer", 2, [], 1),
         ("epilogue", None, ["all_reduce"], 0)],
        # backward, last layer first: each layer's regather starts before the region ahead of it runs, its
        # reduce_scatter is waited after the next layer; the root's gradients reduced (and waited) at the end
        [("between", None, gather, 0), ("epilogue", None, [], 0), ("between", None, gather, 0),
         ("layer", 2, reduce, 1), ("between", None, gather, 0), ("layer", 1, reduce, 1), ("between", None, [], 1),
         ("layer", 0, reduce, 1), ("between", None, [], 1), ("prologue", None, reduce, 0), ("between", None, [], 1)],
    ], found


def _gathers_targets(runner: training.TrainingProgram) -> bool:
    """Whether the forward gathers the batch's targets (its last placeholder): an all_gather of a value
    computed from them alone, as a plan that keeps the logits sharded on the vocabulary does."""
    targets = runner.forward_graph.graph.find_nodes(op="placeholder")[-1]
    return any(n.target is torch.ops._c10d_functional.all_gather_into_tensor.default
               and {a for a in fxshard.graph.reachable(n, lambda n: n.all_input_nodes) if a.op == "placeholder"}
               == {targets} for n in runner.forward_graph.graph.nodes)


# output-projection-gathered with --slow: test_regional_fsdp_gathers_a_layer_early_... reads the layer regions of
# that batch's backward, and targets-gathered (the case that once left no backward layer region) runs by default
@pytest.mark.parametrize("batch, gathers_targets", [
    pytest.param((8, 64), False, marks=pytest.mark.slow),  # ~4 s
    ((4, 16), True),
], ids=["output-projection-gathered", "targets-gathered"])
def test_every_layer_runs_its_backward_in_its_own_region(fake_mesh_4, monkeypatch, batch, gathers_targets):
    """Each layer's backward is a layer region (compiled), at least as large as its forward's, whatever
    the plan gathers for the loss: a gathered value the loss reads (the targets, where the plan gathers
    them in the prologue with the root's parameters) once placed every gradient after it in the
    prologue, which runs uncompiled."""
    monkeypatch.setattr(training, "compile_local", lambda gm, inputs, policy, **_: gm)
    runner = _fsdp_program(fake_mesh_4, batch=batch, own_targets=True)
    assert _gathers_targets(runner) == gathers_targets
    sizes = [{r.index: len(r.graph.graph.nodes) for r in program.regions if r.role is RegionRole.LAYER}
             for program in (runner._forward, runner._backward)]
    assert sorted(sizes[0]) == sorted(sizes[1]) == list(range(CFG.n_layers)), sizes
    assert all(sizes[1][k] >= sizes[0][k] for k in sizes[0]), sizes


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_a_tensor_parallel_models_layers_are_one_program_each_way(fake_mesh_4, monkeypatch, sequence_parallel):
    """torchtitan's TP plan (and TP + SP) through ``torch.compile(backend="fxshard")``: every layer's forward
    is one program, the first layer's too, and every layer's backward another: two layer graphs for
    three layers (and the prologue's and the epilogue's each way). (With sequence parallelism the
    embedding's reduce_scatter leaves a flat buffer viewed back to the residual stream's shape; that view
    belongs to the prologue, or the first layer would be a program of its own, compiled again.)"""
    import torch.nn.functional as F
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    from models.llama import tensor_parallel_plan

    compiled = _record_compiles(monkeypatch)
    # every end compiled, whatever it costs uncompiled
    monkeypatch.setattr(options, "DEFAULTS", dataclasses.replace(options.DEFAULTS, worth_seconds=0.0))
    torch.manual_seed(0)
    model = Llama(dataclasses.replace(CFG, dim=64, n_heads=8, n_kv_heads=4))  # a kv head or more per rank
    parallelize_module(model, fake_mesh_4, tensor_parallel_plan(model, sequence_parallel=sequence_parallel))
    step = torch.compile(model, backend="fxshard", options={"cost_model": fxshard.CostModel()})
    tokens = torch.randint(0, CFG.vocab_size, (4, 16))
    logits = step(tokens)
    with loss_parallel():
        F.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    torch._dynamo.reset()
    # a layer's program each way, and the prologue's and the epilogue's each way
    assert len(compiled) == 6, [len(gm.graph.nodes) for gm in compiled]


def test_fsdp_x_tp_layers_are_one_program_each_way(fake_mesh_4, monkeypatch):
    """FSDP x TP on a 2 x 2 mesh (bench/train.py's fsdp_tp case, three layers): the plan gathers the
    embedding table whole, so the prologue hands the first layer the residual stream reduced (for its
    norm) and as partial sums (for its residual add, a copy on one rank); every layer ends by reducing its
    partial sums for the next norm, which the next layer reads beside the partial sums themselves, and
    the epilogue does not. Each layer keeps the conversions of its values (stage 5's, ``LOWERED_MOVE``)
    and the last returns what the others do (``regions._same_outputs``): one forward program for three
    layers, and one backward (besides the prologue's and the epilogue's)."""
    from torch.distributed.device_mesh import init_device_mesh
    from train_llama import distribute_parameters

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    compiled = _record_compiles(monkeypatch)
    # every end compiled, whatever it costs uncompiled
    monkeypatch.setattr(options, "DEFAULTS", dataclasses.replace(options.DEFAULTS, worth_seconds=0.0))
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=2048, dim=256, n_layers=3, n_heads=8, n_kv_heads=4, ffn_dim=768))
    distribute_parameters(model, mesh, fsdp_tp_placements(model))
    step = fxshard.compile(model.loss, cost_model=fxshard.CostModel())
    tokens = distribute_tensor(torch.randint(0, 2048, (8, 128)), mesh, (Shard(0), Replicate()))
    step(tokens, tokens).backward()
    layers = [r.index for program in (step.last._forward, step.last._backward) for r in program.regions
              if r.role is RegionRole.LAYER]
    # a layer's program each way, and the prologue's and the epilogue's each way
    assert sorted(layers) == [0, 0, 1, 1, 2, 2] and len(compiled) == 6, (layers, [len(g.graph.nodes) for g in compiled])



def _tp_mlp() -> torch.nn.Sequential:
    """The tensor-parallel tutorial's MLP: two Linears of different shapes, one column-, one row-parallel
    (on 4 ranks every local weight is 4 x 4 and every local bias 4 long, the two layers' alike)."""
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


MLP_PLACEMENTS = {"0.weight": (Shard(0),), "0.bias": (Shard(0),), "2.weight": (Shard(1),)}


@pytest.mark.parametrize("layers", [2, 3])
def test_a_program_is_cut_where_one_layer_program_serves_three_layers(layers):
    """The cut adds the prologue's and the epilogue's compiles to the layer's: it pays from three alike layers
    (``Options.shared_layers``). Two layers are compiled whole, one program each way; three run region by
    region, a layer on another's graph; both compute what one device does."""
    assert options.DEFAULTS.shared_layers == 3
    torch.manual_seed(layers)
    model = Llama(dataclasses.replace(CFG, n_layers=layers))
    x, y = torch.randint(0, CFG.vocab_size, (4, 16)), torch.randint(0, CFG.vocab_size, (4, 16))
    ref_loss, ref_grads = reference(model, x, y, True)
    run = simulate_ranks(model.loss, x, y, mesh=fxshard.MeshSpec(tp=4), placements=megatron_placements(model),
                         grad=True, cost_model=BANDWIDTH_BOUND, regional=True)
    if layers < options.DEFAULTS.shared_layers:
        assert run.region_graphs == 0
    else:
        assert 0 < run.region_graphs < 2 * layers
    torch.testing.assert_close((run.full()[0], run.full_grads()), (ref_loss, ref_grads), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
def test_a_model_whose_layers_differ_is_compiled_whole(grad):
    """Cutting pays where a layer's compiled program serves others. The MLP's two layers differ: no regions,
    one program each way (one call per step instead of one per layer), the same numbers as one device."""
    torch.manual_seed(3)
    model = _tp_mlp()
    x = torch.randn(4, 4, requires_grad=grad)
    ref = model(x)
    ref_grads = torch.autograd.grad(ref.sum(), [x, *model.parameters()]) if grad else ()
    run = simulate_ranks(model, x, mesh=fxshard.MeshSpec(tp=4), placements=MLP_PLACEMENTS, grad=grad, regional=True)
    assert run.region_graphs == 0
    torch.testing.assert_close(run.full()[0], ref.detach(), rtol=1e-5, atol=1e-6)
    if grad:
        got = run.full_grads()
        torch.testing.assert_close([got[k] for k in (0, "0.weight", "0.bias", "2.weight", "2.bias")],
                                   list(ref_grads), rtol=1e-5, atol=1e-6)


def test_layers_are_alike_by_global_layouts_on_every_rank(fake_mesh_4):
    """``layers_alike`` reads parameter names and global layouts, the same on every rank (the cut decides
    the buckets, which every rank must issue alike): the MLP's two layers have parameters of the same local
    shapes on every rank but not the same layouts; the Llama's layers are alike."""
    from fxshard.backend.layers.regions import layers_alike
    from fxshard.backend.simulate import lowered_graphs

    mlp = lowered_graphs(_tp_mlp(), torch.randn(4, 4), device_mesh=fake_mesh_4, placements=MLP_PLACEMENTS)
    shapes = {n.name: tuple(n.meta["val"].shape) for n in mlp[(1,)].graph.find_nodes(op="placeholder")}
    assert shapes["_0_weight"] == shapes["_2_weight"] and shapes["_0_bias"] == shapes["_2_bias"], shapes
    model = Llama(CFG)
    tokens = torch.randint(0, CFG.vocab_size, (4, 16))
    llama = lowered_graphs(model.loss, tokens, tokens, device_mesh=fake_mesh_4, placements=megatron_placements(model))
    assert [layers_alike(g) for g in mlp.values()] == [False] * 4
    assert [layers_alike(g) for g in llama.values()] == [True] * 4


def test_fxshard_compile_of_a_sequential_trains_as_one_program_each_way(fake_mesh_4, monkeypatch):
    """``fxshard.compile`` of an ``nn.Sequential`` (its parameters named "0.weight": the traced program's
    arguments are made identifiers, "_0_weight") trains, and, its layers differing, compiles its forward and
    its backward whole: two programs, no regions."""
    from fxshard.backend.layers.regional_program import RegionalProgram

    compiled = _record_compiles(monkeypatch)
    torch.manual_seed(0)
    model = _tp_mlp()
    for name, p in list(model.named_parameters()):
        index, attr = name.split(".")
        placements = MLP_PLACEMENTS.get(name, (Replicate(),))
        setattr(model[int(index)], attr, torch.nn.Parameter(distribute_tensor(p.detach(), fake_mesh_4, placements)))
    step = fxshard.compile(model)
    step(torch.randn(4, 4)).sum().backward()
    assert len(compiled) == 2
    assert not isinstance(step.last._forward, RegionalProgram) and not isinstance(step.last._backward, RegionalProgram)
    assert {n: p.grad.placements for n, p in model.named_parameters()} == {
        n: p.placements for n, p in model.named_parameters()}
