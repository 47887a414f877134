"""Training: the joint forward+backward program, sharded (backend/programs/joint.py, training.py, parallel.py).

Loss and every gradient are checked against the single-device run on fresh random data; the
collectives of each plan are counted on the lowered forward and backward programs.
"""
from __future__ import annotations

import copy
import os
import sys

import pytest
import torch
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import parallelize_module

import fxshard
from fxshard.backend.simulate import fake_world, lowered_graphs, simulate_ranks
from fxshard.backend.reports.traffic import collective_calls

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from models.llama import (  # noqa: E402
    Llama, LlamaConfig, fsdp_placements, fsdp_tp_placements, megatron_placements, tensor_parallel_plan)

CFG = LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=16, n_kv_heads=8, ffn_dim=128)
# bytes, not latency, decide FSDP plans at these toy sizes (tests/test_models.py says why)
BANDWIDTH_BOUND = fxshard.CostModel(default_latency=0.0)


def reference(model: Llama, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    loss = model.loss(x, y)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    return loss.detach(), grads


def data(batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.randint(0, CFG.vocab_size, (batch, seq)), torch.randint(0, CFG.vocab_size, (batch, seq)))


def assert_matches(loss: torch.Tensor, grads: dict, ref_loss: torch.Tensor, ref_grads: dict) -> None:
    torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=1e-6)
    assert set(grads) == set(ref_grads)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


def collectives(gm: torch.fx.GraphModule) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in collective_calls(gm):
        out[c.kind] = out.get(c.kind, 0) + 1
    return out


def simulated_counts(model: Llama, x, y, mesh: fxshard.MeshSpec, placements: dict, cost_model=None):
    """The training step on simulated ranks, planned once: the loss and gradients (as ``fxshard.simulate(...,
    grad=True)`` gives them), and the forward collectives, backward collectives and forward calls of the lowered
    programs rank 0 ran (as ``lowered_graphs`` gives them)."""
    with fake_world(mesh):  # the programs' process groups live until their calls are read
        run = simulate_ranks(model.loss, x, y, mesh=mesh, placements=placements, grad=True, cost_model=cost_model)
        fwd, bwd = run.lowered[(0,) * mesh.ndim]
        return run.full()[0], run.full_grads(), collectives(fwd), collectives(bwd), collective_calls(fwd)


# ~7 s: by default test_fsdp_x_tensor_parallel[shape0] trains Megatron on its tp axis (exact; the same reduces
# each way, and the vocab-parallel loss's), test_tensor_and_sequence_parallel_... TP on a 1-D mesh
@pytest.mark.slow
@pytest.mark.parametrize("tp", [4, pytest.param(8, marks=pytest.mark.slow)])
def test_tensor_parallel_two_all_reduces_per_layer_each_way(tp):
    torch.manual_seed(tp)
    model = Llama(CFG)
    x, y = data(2, 16)
    ref_loss, ref_grads = reference(model, x, y)
    mesh = fxshard.MeshSpec(tp=tp)
    loss, grads, fwd, bwd, _ = simulated_counts(model, x, y, mesh, megatron_placements(model))
    assert_matches(loss, grads, ref_loss, ref_grads)
    layers = CFG.n_layers
    # forward: 2 per layer, the vocab-parallel embedding, and the vocab-parallel loss's small ones: the pick's
    # all_reduce, and each rank's max and sum gathered in one all_gather (fxshard/softmax_statistics.py: under
    # the default cost model one call's latency beats two reductions of a few bytes)
    assert fwd == {"all_reduce": 2 * layers + 1 + 1, "all_gather": 1}
    # backward: 2 per layer (each block's input gradient), 1 into the output projection's input
    assert bwd == {"all_reduce": 2 * layers + 1}


# ~8 s: by default test_fsdp_x_tensor_parallel[shape0] trains FSDP on its dp axis (exact, each gradient
# reduce-scattered), tests/test_regions.py the FSDP step on dp=4 (exact; its gathers and reductions counted)
@pytest.mark.slow
@pytest.mark.parametrize("dp", [4, pytest.param(8, marks=pytest.mark.slow)])
def test_fsdp_gathers_each_parameter_and_reduce_scatters_each_gradient(dp):
    torch.manual_seed(dp)
    model = Llama(CFG)
    x, y = data(4 * dp, 32)
    placements = {**fsdp_placements(model), 0: (Shard(0),), 1: (Shard(0),)}
    mesh = fxshard.MeshSpec(dp=dp)
    ref_loss, ref_grads = reference(model, x, y)
    loss, grads, fwd, bwd, fwd_calls = simulated_counts(model, x, y, mesh, placements, BANDWIDTH_BOUND)
    assert_matches(loss, grads, ref_loss, ref_grads)
    n_params = len(list(model.parameters()))
    assert fwd["all_gather"] == n_params
    assert all(c.input_bytes <= 8 for c in fwd_calls if c.kind == "all_reduce")  # the loss's scalars only
    assert bwd["reduce_scatter"] == n_params and "all_reduce" not in bwd
    # every layer's matrices are gathered again for the backward; kept between the passes: the norms'
    # tiny weights and the output projection (needed first, at once); the embedding's gradient needs
    # only the token ids, not its table
    assert bwd["all_gather"] == 7 * CFG.n_layers


def test_fsdp_under_the_default_cost_model_prices_a_blocks_gathers_as_one_call():
    """FSDP placements, the default cost model (10 us a collective), activations about as large as a
    layer's weights. Priced one latency per parameter, a layer's 9 gathers and 9 reduce_scatters lose
    to a tensor-parallel plan (the batch replicated, activations all-reduced at every layer: each rank
    computes and holds the whole batch's norms and residuals); stage 6 buckets each block's into one
    call (backend/inductor/buckets.py), and refinement now prices them so (``refine.planned_cost``): FSDP."""
    torch.manual_seed(5)
    config = LlamaConfig(vocab_size=1024, dim=128, n_layers=2, n_heads=8, n_kv_heads=4, ffn_dim=384)
    model = Llama(config)
    x, y = torch.randint(0, 1024, (8, 256)), torch.randint(0, 1024, (8, 256))
    placements = {**fsdp_placements(model), 0: (Shard(0),), 1: (Shard(0),)}
    mesh = fxshard.MeshSpec(dp=4)
    ref_loss, ref_grads = reference(model, x, y)
    loss, grads, fwd, bwd, fwd_calls = simulated_counts(model, x, y, mesh, placements)
    assert_matches(loss, grads, ref_loss, ref_grads)
    n_params = len(list(model.parameters()))
    assert (fwd, bwd) == ({"all_gather": n_params, "all_reduce": 2},
                          {"all_gather": 7 * config.n_layers, "reduce_scatter": n_params})
    assert all(c.input_bytes <= 8 for c in fwd_calls if c.kind == "all_reduce")  # the loss's scalars only


@pytest.mark.parametrize("dtypes, latencies", [
    ((torch.float32, torch.float32), 1),
    ((torch.float32, torch.bfloat16), 1),  # a block's gathers of two dtypes: one call (bucket_copies.gather_key)
])
def test_a_blocks_gathers_pay_one_latency_whatever_their_dtypes(dtypes, latencies):
    """``refine.planned_cost`` prices a plan as stage 6 issues it: one block's parameter gathers are one
    call, also when the block mixes dtypes (a bfloat16 matrix beside a float32 norm weight), since an
    all_gather bucket packs its members as bytes. Two weights of ``layers.0`` Shard(0) on dp=4, each
    wanted replicated: the two gathers' bytes and one latency."""
    from fxshard.graph import ARG_LAYOUTS, LAYOUT
    from fxshard.refine import planned_cost

    mesh, model = fxshard.MeshSpec(dp=4), fxshard.CostModel()
    graph, weights = torch.fx.Graph(), []
    for name, dtype in zip(("layers_0_w", "layers_0_norm_weight"), dtypes):
        w = graph.placeholder(name)
        w.meta.update({"val": torch.empty(64, 16, dtype=dtype), LAYOUT: layout_of(mesh, (64, 16), (Shard(0),))})
        weights.append(w)
    use = graph.call_function(torch.ops.aten.add.Tensor, tuple(weights))
    whole = layout_of(mesh, (64, 16), (Replicate(),))
    use.meta.update({"val": torch.empty(64, 16), LAYOUT: whole, ARG_LAYOUTS: (whole, whole)})
    out = graph.output((use,))
    out.meta[ARG_LAYOUTS] = (whole,)
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    gathered = sum(3 * 64 * 16 // 4 * dtype.itemsize for dtype in dtypes)  # 3 of 4 shards arrive
    expected = gathered / model.default_bandwidth + latencies * model.default_latency
    assert planned_cost(gm, model, output_names=("layers.0.w",)) == pytest.approx(expected)


def layout_of(mesh: fxshard.MeshSpec, shape: tuple, placements: tuple) -> fxshard.Layout:
    from fxshard.placements import layout_from_placements

    return layout_from_placements(mesh, shape, placements)


@pytest.mark.parametrize("shape", [(2, 2), pytest.param((2, 4), marks=pytest.mark.slow)])
def test_fsdp_x_tensor_parallel(shape):
    torch.manual_seed(sum(shape))
    model = Llama(CFG)
    dp, tp = shape
    x, y = data(4 * dp, 32)
    batch = (Shard(0), Replicate())
    placements = {**fsdp_tp_placements(model), 0: batch, 1: batch}
    mesh = fxshard.MeshSpec(dp=dp, tp=tp)
    ref_loss, ref_grads = reference(model, x, y)
    loss, grads, fwd, bwd, _ = simulated_counts(model, x, y, mesh, placements, BANDWIDTH_BOUND)
    assert_matches(loss, grads, ref_loss, ref_grads)
    n_params = len(list(model.parameters()))
    assert bwd["reduce_scatter"] == n_params  # every gradient lands in its parameter's dp shard
    layers = CFG.n_layers
    # Megatron's (2 per layer, the embedding's; the output projection's input gradient) and the loss's:
    # the vocab-parallel max and sum on tp, the target count on dp, the loss itself on (dp, tp) at once.
    # At tp=2 the max and sum are each rank's pair gathered in one all_gather instead (no more bytes:
    # fxshard/softmax_statistics.py); at tp=4 the gather moves twice the two reductions' bytes
    statistics = {"all_gather": 1, "all_reduce": 0} if tp == 2 else {"all_gather": 0, "all_reduce": 2}
    assert (fwd["all_reduce"], bwd["all_reduce"]) == (2 * layers + 1 + 2 + statistics["all_reduce"], 2 * layers + 1)
    assert fwd.get("all_gather", 0) == n_params + statistics["all_gather"]


@pytest.mark.parametrize("tp", [4, pytest.param(8, marks=pytest.mark.slow)])
def test_tensor_and_sequence_parallel_with_parallelize_module(tp):
    """The numerics once; the collectives with the gathered block inputs kept for the backward and gathered again."""
    torch.manual_seed(0)
    model = Llama(CFG)
    x, y = data(2, 16)
    ref_loss, ref_grads = reference(model, x, y)
    sharded = copy.deepcopy(model)
    with fake_world(fxshard.MeshSpec(tp=tp)) as mesh:
        with LocalTensorMode(tp):
            # replicated logits: DTensor's eager cross-entropy (which Dynamo runs while tracing) needs
            # loss_parallel() for vocab-sharded ones, and DTensor targets beside DTensor logits
            parallelize_module(sharded, mesh, tensor_parallel_plan(sharded, sequence_parallel=True,
                                                                   loss_parallel=False))
            targets = distribute_tensor(y, mesh, [Replicate()])
        run = simulate_ranks(sharded.loss, x, targets, grad=True)  # the default split: gathered inputs kept
        assert_matches(run.full()[0], run.full_grads(), ref_loss, ref_grads)
        fwd, bwd = run.lowered[(0,)]
        _check_sequence_parallel_counts(collectives(fwd), collectives(bwd), collective_calls(bwd), keep=True)
        with fake_world(fxshard.MeshSpec(tp=tp)) as device_mesh:
            fwd, bwd = lowered_graphs(sharded.loss, x, targets, device_mesh=device_mesh, grad=True,
                                      training_split=fxshard.TrainingSplit(keep_gathered_activations=False))[(0,)]
        _check_sequence_parallel_counts(collectives(fwd), collectives(bwd), collective_calls(bwd), keep=False)


def _check_sequence_parallel_counts(fwd_counts: dict, bwd_counts: dict, bwd_calls: list, keep: bool) -> None:
    layers = CFG.n_layers
    # forward per layer: 2 all_gather + 2 reduce_scatter, as parallelize_module's plan says; + the
    # embedding's reduce_scatter, the output projection's gather and the logits' (replicated loss)
    assert fwd_counts == {"all_gather": 2 * layers + 2, "reduce_scatter": 2 * layers + 1}
    # backward per layer: per block the output gradient gathered once (both the input and the weight
    # gradient read it) and the input gradient reduce-scattered once (the norm scales the shard); the
    # weight gradient reads the block input the forward gathered (kept, as DTensor keeps it) or, as
    # Megatron-LM, gathers it again; + the embedding's gradient gathered (and the output projection's
    # input again), its input's gradient reduce-scattered; the norm weights' gradients all-reduced
    # (their tokens are sharded)
    regathers = 0 if keep else 2 * layers + 1
    assert bwd_counts == {"all_gather": 2 * layers + 1 + regathers, "reduce_scatter": 2 * layers + 1,
                          "all_reduce": 2 * layers + 1}
    assert {c.input_bytes for c in bwd_calls if c.kind == "all_reduce"} == {CFG.dim * 4}


def test_grad_outputs_seed_the_backward():
    """A non-scalar output: its tangent has the output's layout, seeded with the caller's values."""
    torch.manual_seed(1)
    w = torch.randn(32, 64, requires_grad=True)
    x = torch.randn(8, 32)
    seed = torch.randn(8, 64)
    (x @ w).tanh().backward(seed)
    ref = w.grad.clone()
    run = fxshard.backend.simulate.simulate_ranks(lambda x, w: (x @ w).tanh(), x, w, mesh=fxshard.MeshSpec(tp=4),
                                                  placements={1: (Shard(1),)}, grad=True, grad_outputs=[seed])
    torch.testing.assert_close(run.full()[0], (x @ w).tanh().detach())
    torch.testing.assert_close(run.full_grads()[1], ref, rtol=1e-5, atol=1e-6)


def test_grad_without_trainable_inputs_says_so():
    with pytest.raises(ValueError, match="requires grad"):
        fxshard.simulate(lambda x: x.sum(), torch.randn(4), mesh=fxshard.MeshSpec(tp=2), grad=True)


def test_no_rank_keeps_a_gathered_value_between_the_passes():
    """FSDP x TP: no activation is saved gathered; of the gathered weights only the norms' (tiny) and
    the one the backward needs first are kept, the others are gathered again in the backward."""
    from fxshard.backend.programs.joint import grows
    from fxshard.refine import input_root
    from fxshard.backend.driver import plan_function
    from fxshard.registry import RELABELS as RELABEL_OPS

    torch.manual_seed(3)
    model = Llama(CFG)
    x, y = data(8, 32)
    batch = (Shard(0), Replicate())
    placements = {**fsdp_tp_placements(model), 0: batch, 1: batch}
    _, planned = plan_function(model.loss, (x, y), mesh=fxshard.MeshSpec(dp=2, tp=2), placements=placements,
                               training=True, cost_model=BANDWIDTH_BOUND)
    plan = planned.training
    out = next(n for n in plan.forward.graph.nodes if n.op == "output")
    saved = list(out.args[0][plan.num_outputs:])
    assert saved, "the backward reads nothing from the forward?"

    def gathered(n):
        while n.op == "call_function" and n.target in RELABEL_OPS:
            n = n.args[0]
        return n if grows(n) else None

    kept = [g for g in map(gathered, saved) if g is not None]
    assert all(input_root(g.args[0]) is not None for g in kept), "an activation was kept gathered"
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    big = [g for g in kept if g.meta["val"].numel() * 4 > largest // 64]
    assert len(big) == 1, big  # the output projection's weight, which the backward needs first
    assert [n for n in plan.backward.graph.nodes if grows(n)], "the backward gathers the layers' weights again"


def test_sequence_parallel_weight_gradients_read_the_gathered_output_gradient():
    """TP + SP at the bench's sizes (bench/train.py's Llama, 1024 tokens): each block's ``wo`` weight
    gradient reads the output gradient that the input gradient gathers one op later (a relabelling of
    it: ``t(view(g))``), not the attention output moved heads -> sequence by an all_to_all and a
    Partial result reduce-scattered (the plan before ``Refinement.foresee``). Backward per layer: the
    two blocks' output gradients gathered and input gradients reduce-scattered, the blocks' inputs kept
    gathered from the forward (``TrainingSplit``; Megatron-LM gathers them again: 2 all_gathers more),
    and the norms' weight gradients all-reduced."""

    config = LlamaConfig(vocab_size=2048, dim=256, n_layers=2, n_heads=8, n_kv_heads=4, ffn_dim=768)
    torch.manual_seed(0)
    model = Llama(config)
    x, y = torch.randint(0, 2048, (8, 128)), torch.randint(0, 2048, (8, 128))
    with fake_world(fxshard.MeshSpec(tp=4)) as mesh:
        with LocalTensorMode(4):
            parallelize_module(model, mesh, tensor_parallel_plan(model, sequence_parallel=True, loss_parallel=False))
            targets = distribute_tensor(y, mesh, [Replicate()])
        with fake_world(fxshard.MeshSpec(tp=4)) as device_mesh:
            fwd, bwd = lowered_graphs(model.loss, x, targets, device_mesh=device_mesh, grad=True,
                                      cost_model=fxshard.CostModel(default_latency=0.0))[(0,)]
            found = collectives(bwd)
    layers = config.n_layers
    assert found == {"all_gather": 2 * layers + 1, "reduce_scatter": 2 * layers + 1, "all_reduce": 2 * layers + 1}


def test_the_backward_rebuilds_pointwise_values_from_what_it_keeps():
    """A normalization's output and SwiGLU's product are rebuilt in the backward from values it keeps
    anyway (the norm's input and statistics, the two projections): no saved value is a pointwise op or a
    view of kept values alone, and fewer bytes cross than when every read value is saved
    (``TrainingSplit(recompute_pointwise=False)``), with the same collectives."""
    from fxshard.backend.driver import plan_function
    from fxshard.backend.programs.joint import _rebuilds_freely

    torch.manual_seed(0)
    model = Llama(CFG)
    x, y = data(2, 16)

    def split(recompute: bool) -> tuple[list[torch.fx.Node], dict]:
        _, planned = plan_function(model.loss, (x, y), mesh=fxshard.MeshSpec(tp=4), placements=megatron_placements(model),
                                   training=True, training_split=fxshard.TrainingSplit(recompute_pointwise=recompute))
        saved = list(torch.fx.node.map_arg(planned.training.forward.graph.output_node().args[0], lambda n: n))
        return saved[planned.training.num_outputs:], {**collectives(planned.training.forward),
                                                       **{f"bwd {k}": v for k, v in collectives(planned.training.backward).items()}}

    def nbytes(nodes: list[torch.fx.Node]) -> int:
        return sum(n.meta["val"].numel() * n.meta["val"].element_size() for n in nodes)

    (rebuilt, moves), (everything, moves_saving_all) = split(True), split(False)
    kept = set(rebuilt)
    for n in rebuilt:
        if _rebuilds_freely(n):
            assert not all(a.op == "placeholder" or a in kept for a in n.all_input_nodes), f"{n} is rebuildable"
    # per layer: the two norms' outputs and their scaled views, the attention output's view, silu and its product
    assert nbytes(rebuilt) < nbytes(everything) and len(everything) - len(rebuilt) >= 5 * CFG.n_layers
    assert moves == moves_saving_all
