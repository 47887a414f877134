"""The collectives of a sharded cross-entropy loss: exactly these, and the single-device value.

A language-model head ``h @ w.T`` whose weight is vocab-sharded on ``tp`` (Megatron's output
projection) and whose tokens are batch-sharded on ``dp`` (FSDP's batch), then
``F.cross_entropy(..., reduction="mean")``. Each case lists every collective a reader of the loss
pays, in order, as (kind, axes): the vocab-parallel log-softmax's max and sum on tp (each rank's pair
gathered in one call: fxshard/softmax_statistics.py), the count of
targets that are not ignored on dp, then the loss's own all_reduce (``explain`` leaves the loss
Partial, as DTensor would: it is reduced where it is read; a training program reduces it at its
output). The target's log-probability (Partial over tp: zeros on the ranks that do not hold its
class) stays Partial through the ignore mask (``where``) and the sum, so its reduction is the
loss's, over (dp, tp) at once, not a call of its own.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

import fxshard

TOKENS, DIM, VOCAB = 32, 16, 64


def head_loss(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(h @ w.t(), y)


CASES = {
    # name: (mesh, placements of (h, w, y), the collectives in order)
    "vocab-parallel, batch on dp": (
        {"dp": 2, "tp": 2}, ((Shard(0), Replicate()), (Replicate(), Shard(0)), (Shard(0), Replicate())),
        [("all_gather", "tp"), ("all_reduce", "dp"), ("all_reduce", "dp,tp")]),
    "vocab-parallel, batch replicated": (
        {"tp": 4}, ((Replicate(),), (Shard(0),), (Replicate(),)),
        [("all_gather", "tp"), ("all_reduce", "tp")]),
    "batch on dp, vocab whole": (
        {"dp": 4}, ((Shard(0),), (Replicate(),), (Shard(0),)),
        [("all_reduce", "dp"), ("all_reduce", "dp")]),
}


def _inputs(ignored: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(ignored)
    y = torch.randint(0, VOCAB, (TOKENS,), generator=g)
    y[torch.randperm(TOKENS, generator=g)[:ignored]] = -100  # ranks hold different numbers of targets
    return torch.randn(TOKENS, DIM, generator=g), torch.randn(VOCAB, DIM, generator=g), y


@pytest.mark.parametrize("name", CASES)
def test_collectives_of_a_sharded_cross_entropy(name):
    sizes, placements, expected = CASES[name]
    plan = dict(enumerate(placements))
    e = fxshard.explain(head_loss, *_inputs(0), mesh=fxshard.MeshSpec(**sizes), placements=plan)
    pending = [a for a, _ in e.output_layouts[0].partial]
    calls = [(c.kind, ",".join(str(a) for a in c.axes)) for c in e.collectives]
    calls += [("all_reduce", ",".join(str(a) for a in pending))] if pending else []
    assert calls == expected, str(e)


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("ignored", [0, 7])
def test_sharded_cross_entropy_is_the_single_device_mean(name, ignored):
    sizes, placements, _ = CASES[name]
    args = _inputs(ignored)
    got = fxshard.simulate(head_loss, *args, mesh=fxshard.MeshSpec(**sizes), placements=dict(enumerate(placements)))
    torch.testing.assert_close(got, head_loss(*args), rtol=1e-5, atol=1e-6)
