"""fxshard/reduce_together.py: a mean's numerator and count reduced independently, in one call."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

import fxshard
from fxshard.backend.driver import plan_function
from fxshard.graph import LAYOUT, SRC_LAYOUT, reachable
from fxshard.ops import REDISTRIBUTE

DP = fxshard.MeshSpec(dp=4)


def masked_mean(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    keep = y != -100
    return torch.where(keep, x, 0.0).sum() / keep.sum()


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, targets)


def _data(fn, seed: int, n: int = 64, classes: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Values for ``fn`` (a masked mean's one per target, cross_entropy's logits) and targets, some ignored."""
    torch.manual_seed(seed)
    y = torch.randint(0, classes, (n,))
    y[torch.rand(n) < 0.3] = -100  # ranks hold different numbers of counted targets
    x = torch.randn(n, classes)
    return (x[:, 0] if fn is masked_mean else x), y


def _reductions(fn, x, y, mesh=DP, placements=None) -> list[torch.fx.Node]:
    """The redistributions of the forward of ``fn``'s training program (its loss returned whole)."""
    x = x.detach().requires_grad_(True)
    _, planned = plan_function(fn, (x, y), mesh=mesh, placements=placements or {0: (Shard(0),), 1: (Shard(0),)},
                               training=True)
    return [n for n in planned.training.forward.graph.nodes if n.target is REDISTRIBUTE]


def _reads(node: torch.fx.Node, other: torch.fx.Node) -> bool:
    return other in reachable(node, lambda n: n.all_input_nodes)


@pytest.mark.parametrize("fn", [masked_mean, cross_entropy], ids=["masked mean", "cross_entropy"])
def test_a_means_count_and_sum_are_reduced_independently_in_one_dtype(fn):
    x, y = _data(fn, 0)
    moves = _reductions(fn, x, y)
    sums = [n for n in moves if n.meta[SRC_LAYOUT].partial]
    # the count (an int64 sum of a mask, converted to float32 before its reduction) and the sum of the
    # kept values; cross_entropy also reduces nothing else (its rows are whole on each rank)
    assert len(sums) == 2, [n.format_node() for n in moves]
    count, total = sums
    assert {n.meta["val"].dtype for n in sums} == {torch.float32}
    assert not _reads(total, count) and not _reads(count, total)
    assert all(not n.meta[LAYOUT].partial for n in sums)


@pytest.mark.parametrize("fn", [masked_mean, cross_entropy], ids=["masked mean", "cross_entropy"])
def test_the_mean_is_exact_when_ranks_count_differently(fn):
    x, y = _data(fn, 1)
    x.requires_grad_(True)
    ref = fn(x, y)
    (ref_grad,) = torch.autograd.grad(ref, x)
    loss, grads = fxshard.simulate(fn, x, y, mesh=DP, placements={0: (Shard(0),), 1: (Shard(0),)}, grad=True)
    torch.testing.assert_close(loss, ref.detach())
    torch.testing.assert_close(grads[0], ref_grad)


def test_a_count_a_float_cannot_hold_exactly_is_reduced_as_an_integer():
    """float16 holds integers exactly up to 2048: a count of up to 4096 targets stays int64 to its
    reduction (converting first could round a partial), so its reduction still precedes the division."""
    def half_mean(x, y):
        keep = y != -100
        return (torch.where(keep, x, 0.0).sum() / keep.sum().to(torch.float16)).float()

    x, y = torch.randn(4096, dtype=torch.float16), torch.randint(-100, 3, (4096,))
    sums = [n for n in _reductions(half_mean, x, y) if n.meta[SRC_LAYOUT].partial]
    assert len(sums) == 2 and sums[0].args[0].target is torch.ops.aten.sum.default, [n.format_node() for n in sums]
    assert sums[0].meta["val"].dtype == torch.int64 and _reads(sums[1], sums[0])
    out = fxshard.simulate(half_mean, x, y, mesh=DP, placements={0: (Shard(0),), 1: (Shard(0),)})
    torch.testing.assert_close(out, half_mean(x, y))


def test_a_count_reduced_over_fewer_axes_joins_the_sums_group():
    """dp x tp, the values sharded on both axes, the mask on dp alone: the count is Partial over dp, the
    sum over (dp, tp). The count is made Partial over tp too (held by tp's first rank, zero on the
    others: exact) and reduced over (dp, tp), so the two reductions are independent, in one group and
    one dtype: one call carries both. The mean and its gradient are the single-device ones."""
    torch.manual_seed(2)
    x, y = torch.randn(8, 8), torch.randint(-100, 3, (8, 8))

    def mean2d(x, y):
        keep = y != -100
        return torch.where(keep, x, 0.0).sum() / keep.sum()

    mesh, placements = fxshard.MeshSpec(dp=2, tp=2), {0: (Shard(0), Shard(1)), 1: (Shard(0), Replicate())}
    moves = _reductions(mean2d, x, y, mesh, placements)
    assert [str(n.meta["plan"]).split(": ")[-1] for n in moves if n.meta[SRC_LAYOUT].partial] == \
        ["all_reduce(dp,tp sum)", "local_partial(tp sum)", "all_reduce(dp,tp sum)"], [n.format_node() for n in moves]
    total, spread, count = [n for n in moves if n.meta[SRC_LAYOUT].partial]
    assert count.args[0] is spread and str(spread.meta[SRC_LAYOUT]) == "[] P(sum@dp)"
    assert not _reads(total, count) and not _reads(count, total)
    assert {n.meta["val"].dtype for n in (total, count)} == {torch.float32}
    xg = x.clone().requires_grad_(True)
    ref = mean2d(xg, y)
    (ref_grad,) = torch.autograd.grad(ref, xg)
    loss, grads = fxshard.simulate(mean2d, x.clone().requires_grad_(True), y, mesh=mesh, placements=placements,
                                   grad=True)
    torch.testing.assert_close(loss, ref.detach())
    torch.testing.assert_close(grads[0], ref_grad)
