"""Dropless expert parallelism: a MoE layer's routed rows dispatched to their experts' ranks by all-to-all.

The layer (tests/moe_programs.py) is written as torchtitan writes it; with its expert stacks ``Shard(0)``
on ``ep`` and the tokens ``Shard(0)`` on it, stage 1 makes its routed region one op
(backend/capture/routed_experts.py) that each rank runs on its own pairs (fxshard/routing.py). Each case
is checked against one device on fresh data, on simulated ranks; what the ranks received is measured
(``SimulatedRun.bytes_received``) against what that routing makes them receive.
"""
from __future__ import annotations

import warnings

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import fxshard
from fxshard.backend.explain import collectives_of, explain
from fxshard.backend.simulate import simulate_ranks
from fxshard.routing import ROUTED_OPS

from moe_programs import DroplessMoE, received_by_routing, routed_rows

TOKENS, DIM = 64, 32
EXPERTS_SHARDED = {"w1": [Shard(0)], "w2": [Shard(0)], "w3": [Shard(0)]}


def _model_and_data(seed: int, skew: float = 2.0, **kw):
    torch.manual_seed(seed)
    model = DroplessMoE(skew=skew, **kw)
    g = torch.Generator().manual_seed(seed + 1)
    return model, torch.randn(TOKENS, DIM, generator=g), torch.randn(TOKENS, DIM, generator=g)


def _simulate(model, x, target, ep: int, grad: bool):
    def loss(x, target):
        return ((model(x) - target) ** 2).mean()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = simulate_ranks(loss if grad else model, *((x, target) if grad else (x,)), mesh=fxshard.MeshSpec(ep=ep),
                             placements={0: [Shard(0)], **({1: [Shard(0)]} if grad else {}), **EXPERTS_SHARDED},
                             grad=grad)
    warned = sorted({str(w.message) for w in caught if str(w.message).startswith("fxshard")})
    return run, warned


def _assert_gradients_close(grads, model) -> None:
    """Each gradient against one device's, to bf16's rounding relative to its largest entry: the experts' vjp
    (torch.func's, which torch.compile traces) rounds its bf16 steps apart from eager autograd's by an ulp
    here and there; a gradient lost or misrouted is off by its whole size."""
    for name, p in model.named_parameters():
        assert (grads[name] - p.grad).abs().max() <= 1e-2 * p.grad.abs().max(), name


def _chosen(model, x) -> torch.Tensor:
    scores = torch.softmax(x @ model.router + model.bias, dim=-1)
    return torch.topk(scores, model.top_k, dim=1)[1]


@pytest.mark.parametrize("ep", [2, 4, 8])
def test_forward_and_gradients_are_one_devices(ep):
    model, x, target = _model_and_data(ep)
    want = ((model(x) - target) ** 2).mean()
    want.backward()
    run, warned = _simulate(model, x, target, ep, grad=True)
    torch.testing.assert_close(run.full()[0], want.detach())
    _assert_gradients_close(run.full_grads(), model)
    assert warned == []
    assert any(n.target in ROUTED_OPS for n in run.graph.graph.nodes)


@pytest.mark.parametrize("ep", [2, 8])
def test_no_expert_weight_moves_and_the_ranks_receive_what_the_routing_sends(ep):
    """Inference at ep: the planned collectives are none (the experts stay where they are); what each
    rank received is its share of the dispatch and the combine (rows of 32 fp32 values, the score with
    the dispatched row), within 1.1x of that routing's rows + the counts (one int64 per expert)."""
    model, x, _ = _model_and_data(10 + ep)
    with torch.no_grad():
        want = model(x)
        run, warned = _simulate(model, x, None, ep, grad=False)
        torch.testing.assert_close(run.full()[0], want)
    assert warned == []
    assert collectives_of(run.graph) == []
    rows = received_by_routing(_chosen(model, x), ep, model.experts, row_bytes=DIM * 4)
    scores = received_by_routing(_chosen(model, x), ep, model.experts, row_bytes=4)
    for r, got in enumerate(run.bytes_received):
        floor = rows[r]  # the rows each way, at least
        assert floor <= got <= 1.1 * (rows[r] + scores[r]) + 8 * model.experts, (r, got, rows[r])
    assert len(set(run.bytes_received)) > 1  # skewed routing: the ranks receive unequal amounts


def test_explain_gives_the_dispatch_as_all_to_alls_whose_bytes_the_ranks_then_receive():
    """explain names the routed op's three all_to_alls (the counts, the rows out, the results back), each
    with its bytes as a function of the routing's row counts; evaluated at this routing's counts, they are
    what each simulated rank measured."""
    ep = 4
    model, x, _ = _model_and_data(21)
    e = explain(model, x, mesh=fxshard.MeshSpec(ep=ep), placements={0: [Shard(0)], **EXPERTS_SHARDED})
    assert e.collectives == [] and [c.kind for c in e.dispatches] == ["all_to_all"] * 3
    assert "routed experts: 3 x all_to_all" in e.summary() and "rows_in" in e.report()
    total = sum(c.bytes_per_rank for c in e.dispatches)
    symbols = sorted(total.free_symbols, key=str)  # rows_in[...], rows_out[...]
    with torch.no_grad():
        run, _ = _simulate(model, x, None, ep, grad=False)
    for r, (incoming, returned) in enumerate(routed_rows(_chosen(model, x), ep, model.experts)):
        assert int(total.subs({symbols[0]: incoming, symbols[1]: returned})) == run.bytes_received[r]


def test_a_bf16_model_is_one_devices():
    """Parameters and activations in bf16 (the grouped matmul's own dtype): forward and gradients as one device."""
    model, x, target = _model_and_data(50, dtype=torch.bfloat16)
    x, target = x.bfloat16(), target.bfloat16()
    want = ((model(x).float() - target.float()) ** 2).mean()
    want.backward()

    def loss(x, target):
        return ((model(x).float() - target.float()) ** 2).mean()

    run = simulate_ranks(loss, x, target, mesh=fxshard.MeshSpec(ep=4), grad=True,
                         placements={0: [Shard(0)], 1: [Shard(0)], **EXPERTS_SHARDED})
    torch.testing.assert_close(run.full()[0], want.detach())
    _assert_gradients_close(run.full_grads(), model)
    assert any(n.target in ROUTED_OPS for n in run.graph.graph.nodes)


def test_experts_replicated_route_each_ranks_tokens_locally():
    """Experts replicated, tokens sharded (data or context parallelism): the routed op with no dispatch, each rank
    its own tokens through every expert; nothing moves in the forward (the region as written sorts every rank's
    pairs: it gathered the tokens), and a training step all-reduces the replicated weights' gradients only."""
    model, x, target = _model_and_data(3)
    with torch.no_grad():
        run = simulate_ranks(model, x, mesh=fxshard.MeshSpec(dp=2), placements={0: [Shard(0)]})
        torch.testing.assert_close(run.full()[0], model(x))
    assert any(n.target in ROUTED_OPS for n in run.graph.graph.nodes)
    assert collectives_of(run.graph) == []

    def loss(x, target):
        return ((model(x) - target) ** 2).mean()

    want = loss(x, target)
    want.backward()
    run = simulate_ranks(loss, x, target, mesh=fxshard.MeshSpec(dp=2), placements={0: [Shard(0)], 1: [Shard(0)]},
                         grad=True)
    torch.testing.assert_close(run.full()[0], want.detach())
    _assert_gradients_close(run.full_grads(), model)
    assert {c.kind for c in collectives_of(run.graph)} == {"all_reduce"}


def test_a_shared_expert_and_a_residual_add_into_the_routed_sum():
    """``shared(x).index_add(0, tokens, out)``: the routed op's sum lands on the shared expert's output."""
    model, x, target = _model_and_data(5, shared=True)
    want = ((model(x) - target) ** 2).mean()
    want.backward()
    run, warned = _simulate(model, x, target, 4, grad=True)
    torch.testing.assert_close(run.full()[0], want.detach())
    _assert_gradients_close(run.full_grads(), model)
    assert warned == []
    assert any(n.target in ROUTED_OPS for n in run.graph.graph.nodes)


def test_a_load_balancing_loss_reads_the_counts_beside_the_routed_op():
    """The counts feed both the routed op (its offsets) and the auxiliary loss: the loss's counts are each
    rank's histc of its own pairs, summed (Partial), and its gradient reaches the router through the scores."""
    model, x, target = _model_and_data(40, balance=True)

    def loss(x, target):
        y, balance = model(x)
        return ((y - target) ** 2).mean() + 0.1 * balance

    want = loss(x, target)
    want.backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = simulate_ranks(loss, x, target, mesh=fxshard.MeshSpec(ep=4), grad=True,
                             placements={0: [Shard(0)], 1: [Shard(0)], **EXPERTS_SHARDED})
    assert not [w for w in caught if str(w.message).startswith("fxshard")]
    torch.testing.assert_close(run.full()[0], want.detach())
    _assert_gradients_close(run.full_grads(), model)
    assert any(n.target in ROUTED_OPS for n in run.graph.graph.nodes)
    assert not [c for c in collectives_of(run.graph) if c.kind == "all_gather"]


def test_bytes_received_is_the_planned_traffic_where_sizes_are_static():
    """A program without data-dependent sizes: each rank received what the plan says (the planner's formula)."""
    x, w = torch.randn(8, 16), torch.randn(16, 12)
    run = simulate_ranks(lambda x, w: torch.relu(x @ w).sum(0), x, w, mesh=fxshard.MeshSpec(tp=4),
                         placements={0: [Shard(0)], 1: [Shard(1)]})
    planned = sum(int(c.bytes_per_rank) for c in collectives_of(run.graph))
    assert planned > 0 and run.bytes_received == [planned] * 4


def test_a_routed_program_is_not_kept_on_disk(monkeypatch, tmp_path):
    """Its lowered program names the body by a key of this process's registry: a second process would load
    a program it cannot run, so the lowered cache keeps none (it is planned every time)."""
    from fxshard.backend.programs import lowered_cache
    from fxshard.backend.programs.inference import LoweredInference

    model, x, _ = _model_and_data(7)
    run, _ = _simulate(model, x, None, 2, grad=False)
    graph = next(iter(run.lowered.values()))
    assert any(n.target in ROUTED_OPS for n in graph.graph.nodes)
    written = []
    monkeypatch.setattr(lowered_cache, "write_whole", lambda path, payload: written.append(path))
    lowered_cache.store_lowered("key", LoweredInference(graph, [0], [], ()), [], [])
    assert written == []


MESH_CASES = {  # besides the router's gradient and the mean loss: an all_reduce each, over every axis
    # data parallel beside EP: the tokens on both axes, the experts on ep (replicated on dp): their gradients
    # sum over dp (one all_reduce each, as DDP), nothing else moves
    "dp x ep": ({"dp": 2, "ep": 2}, [Shard(0), Shard(0)], [Replicate(), Shard(0)], {"all_reduce": 3 + 2}),
    # the experts FSDP'd on dp besides: gathered over dp for the step, their gradients reduce-scattered
    "fsdp(dp) x ep": ({"dp": 2, "ep": 2}, [Shard(0), Shard(0)], [Shard(1), Shard(0)],
                      {"all_gather": 3, "reduce_scatter": 3, "all_reduce": 2}),
    # EP borrowing the dp x tp ranks (torchtitan's layout): the experts cut over the flattened 4-rank group
    "ep over dp x tp": ({"dp": 2, "tp": 2}, [Shard(0), Shard(0)], [Shard(0), Shard(0)], {"all_reduce": 2}),
}


@pytest.mark.parametrize("case", list(MESH_CASES))
def test_ep_composes_with_other_axes(case):
    """The pairs stay where the tokens lie; only what the experts' other axes ask for moves."""
    sizes, tokens, experts, moved = MESH_CASES[case]
    model, x, target = _model_and_data(30)
    want = ((model(x) - target) ** 2).mean()
    want.backward()

    def loss(x, target):
        return ((model(x) - target) ** 2).mean()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = simulate_ranks(loss, x, target, mesh=fxshard.MeshSpec(**sizes), grad=True,
                             placements={0: tokens, 1: tokens, **{w: experts for w in ("w1", "w2", "w3")}})
    assert not [w for w in caught if str(w.message).startswith("fxshard")]
    torch.testing.assert_close(run.full()[0], want.detach())
    _assert_gradients_close(run.full_grads(), model)  # an expert's summed over dp in bf16 besides
    kinds = {}
    for c in collectives_of(run.graph):
        kinds[c.kind] = kinds.get(c.kind, 0) + 1
    assert kinds == moved
    assert any(n.target in ROUTED_OPS for n in run.graph.graph.nodes)


def _routed_layer(x, router, w1, w2, *, leak: bool = False, k: int = 2):
    """A smaller dropless layer as a function; ``leak`` also returns its rows in expert order, which the
    layer's result does not show but this output does: the region must stay as written."""
    scores = torch.softmax(x @ router, dim=-1)
    top, chosen = torch.topk(scores, k, dim=1)
    flat = chosen.view(-1)
    counts = torch.histc(flat.float(), bins=w1.shape[0], min=0, max=w1.shape[0])
    order = torch.argsort(flat, stable=True)
    tokens = order // k
    rows = (x[tokens] * top.view(-1)[order][:, None]).bfloat16()
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    out = torch._grouped_mm(torch.relu(torch._grouped_mm(rows, w1, offs=offsets)), w2, offs=offsets).float()
    y = torch.zeros_like(x).scatter_add(0, tokens.view(-1, 1).expand(-1, x.shape[1]), out)
    return (y, out) if leak else y


@pytest.mark.parametrize("leak", [False, True])
def test_a_region_whose_rows_escape_is_left_as_written(leak):
    """With its sorted rows returned, the order between sort and add is visible: no routed op (routing
    replicated, experts gathered), still exact; without, the region is one op and the experts stay."""
    torch.manual_seed(60)
    x, router = torch.randn(32, 16), torch.randn(16, 4)
    w1, w2 = torch.randn(4, 16, 32).bfloat16(), torch.randn(4, 32, 16).bfloat16()
    with torch.no_grad():
        want = _routed_layer(x, router, w1, w2, leak=leak)
        run = simulate_ranks(lambda *a: _routed_layer(*a, leak=leak), x, router, w1, w2, mesh=fxshard.MeshSpec(ep=2),
                             placements={0: [Shard(0)], 2: [Shard(0)], 3: [Shard(0)]})
    for got, expected in zip(run.full(), want if leak else (want,)):
        torch.testing.assert_close(got, expected)
    routed = any(n.target in ROUTED_OPS for n in run.graph.graph.nodes)
    gathered = [c for c in collectives_of(run.graph) if c.kind == "all_gather"]
    assert routed is not leak and bool(gathered) is leak


def test_ranks_whose_experts_no_row_reaches():
    """Every pair routed to the first two experts (a router biased hard): at ep 4 two ranks' experts get no
    row, run on none and send nothing back; forward and gradients still one device's."""
    model, x, target = _model_and_data(70, skew=50.0)
    assert int(_chosen(model, x).max()) < 2
    want = ((model(x) - target) ** 2).mean()
    want.backward()
    run, warned = _simulate(model, x, target, 4, grad=True)
    torch.testing.assert_close(run.full()[0], want.detach())
    _assert_gradients_close(run.full_grads(), model)
    assert warned == [] and any(n.target in ROUTED_OPS for n in run.graph.graph.nodes)
