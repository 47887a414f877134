"""A softmax over a sharded dim gathers each rank's (max, sum of exp) in one call (fxshard/softmax_statistics.py).

Numerics against one device on fresh random data (forward and gradients, 4 simulated ranks); the
collectives of each plan counted exactly on rank 0's lowered programs.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

import fxshard
from fxshard.backend.simulate import fake_world, lowered_graphs, simulate_ranks
from fxshard.backend.reports.traffic import collective_calls

BANDWIDTH_BOUND = fxshard.CostModel(default_latency=0.0)  # bytes alone: two all_reduces move fewer than the gather


def kinds(gm: torch.fx.GraphModule) -> dict[str, int]:
    found: dict[str, int] = {}
    for call in collective_calls(gm):
        found[call.kind] = found.get(call.kind, 0) + 1
    return found


def vocab_parallel_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, targets)


def masked_softmax(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)


def test_vocab_parallel_cross_entropy_gathers_max_and_sum_in_one_call():
    """Logits [tokens, vocab] vocab-sharded on tp=4: the forward's max and sum (two all_reduces, the
    second waiting on the first) are one all_gather of each rank's pair; the loss's mean stays one
    all_reduce. Loss and the logits' gradient match one device."""
    torch.manual_seed(0)
    logits, targets = torch.randn(32, 64, requires_grad=True), torch.randint(0, 64, (32,))
    placements = {0: (Shard(1),), 1: (Replicate(),)}
    mesh = fxshard.MeshSpec(tp=4)
    with fake_world(mesh) as device_mesh:
        forward, backward = lowered_graphs(vocab_parallel_loss, logits, targets, device_mesh=device_mesh,
                                           placements=placements, grad=True)[(0,)]
        plain, _ = lowered_graphs(vocab_parallel_loss, logits, targets, device_mesh=device_mesh,
                                  placements=placements, grad=True, cost_model=BANDWIDTH_BOUND)[(0,)]
        assert kinds(forward) == {"all_gather": 1, "all_reduce": 1}, kinds(forward)
        assert kinds(plain) == {"all_reduce": 3}, kinds(plain)  # max, sum, the loss: where bytes alone decide
        gathered = next(c for c in collective_calls(forward) if c.kind == "all_gather")
    assert gathered.input_bytes == 32 * 2 * 4  # a (max, sum) pair of fp32 per row
    run = simulate_ranks(vocab_parallel_loss, logits, targets, mesh=mesh, placements=placements, grad=True)
    expected = vocab_parallel_loss(logits, targets)
    expected.backward()
    torch.testing.assert_close(run.full()[0], expected.detach())
    torch.testing.assert_close(run.full_grads()[0], logits.grad)


@pytest.mark.parametrize("masked_block", [False, True], ids=["random-mask", "a-rank-all-masked"])
def test_softmax_over_sharded_keys_with_masked_blocks(masked_block):
    """Attention-like scores [batch, queries, keys], keys sharded on tp=4 and rows on dp=2: masked keys
    (-inf), whole rank blocks of them too (their max -inf, their sum 0), give one device's softmax, never
    NaN."""
    torch.manual_seed(1)
    scores = torch.randn(4, 8, 32)
    mask = torch.rand(4, 8, 32) < 0.3
    if masked_block:
        mask[:, :4, :8] = True  # rank tp=0's keys, for half the queries
    mask[..., -1] = False  # no row wholly masked (eager's softmax is NaN there, as is fxshard's)
    placements = {0: (Shard(0), Shard(2)), 1: (Shard(0), Shard(2))}
    mesh = fxshard.MeshSpec(dp=2, tp=4)
    with fake_world(mesh) as device_mesh:
        forward = lowered_graphs(masked_softmax, scores, mask, device_mesh=device_mesh, placements=placements)[(0, 0)]
        assert kinds(forward) == {"all_gather": 1}, kinds(forward)
    run = simulate_ranks(masked_softmax, scores, mask, mesh=mesh, placements=placements)
    result = run.full()[0]
    assert not result.isnan().any()
    torch.testing.assert_close(result, masked_softmax(scores, mask))


def test_a_symbolic_number_of_ranks_keeps_the_two_reductions():
    """``explain`` on a symbolic tp: the number of blocks is not a number, so the max and the sum stay
    two all_reduces, priced as expressions of tp."""
    import sympy

    tp = sympy.Symbol("tp", positive=True, integer=True)
    logits, targets = torch.randn(32, 64), torch.randint(0, 64, (32,))
    explained = fxshard.explain(vocab_parallel_loss, logits, targets, mesh=fxshard.MeshSpec({"tp": tp}),
                                placements={0: (Shard(1),), 1: (Replicate(),)})
    assert [c.kind for c in explained.collectives] == ["all_reduce", "all_reduce"]
    assert explained.bytes_per_rank.free_symbols == {tp}
