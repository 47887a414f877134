"""Ops that move elements along some dims, on a tensor sharded along another: nothing moves.

DTensor computes these where the blocks lie (repeat and tile too, where fxshard keeps the repeat
factor as an unsharded outer piece of the sharded dim: ``[2 4@tp 2]``, DTensor's
``_StridedShard(0, split_factor=2)``). Each case runs at tp=2 and 4 on even and uneven sizes and
checks, at once: no collective, the exact single-device result, and that each rank's block of the
output is the block DTensor's own split code gives for the output's placements.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import _StridedShard

import fxshard
from fxshard.backend.simulate import fake_world, lowered_graphs
from fxshard.backend.reports.traffic import collective_calls
from fxshard.placements import placements_from_layout

INDEX = torch.tensor([4, 0, 2, 0])

# name: (function, sharded dim of a [rows, 6] input)
CASES = {
    "repeat a local dim": (lambda x: x.repeat(1, 3), 0),
    "repeat the sharded dim": (lambda x: x.repeat(2, 1), 0),
    "repeat with a new leading dim": (lambda x: x.repeat(2, 1, 1), 0),
    "tile the sharded dim": (lambda x: x.tile((3, 1)), 0),
    "expand a new dim": (lambda x: x.unsqueeze(1).expand(-1, 3, -1), 0),
    "flip a local dim": (lambda x: x.flip(1), 0),
    "flip two local dims": (lambda x: x.view(-1, 2, 3).flip((1, 2)), 0),
    "fliplr": (torch.fliplr, 0),
    "rot90": (lambda x: x.rot90(1, (0, 1)), 0),
    "roll a local dim": (lambda x: x.roll(2, 1), 0),
    "roll two local dims": (lambda x: x.view(-1, 2, 3).roll((1, 2), (1, 2)), 0),
    "index_select a local dim": (lambda x: x.index_select(1, INDEX), 0),
    "index_select with the sharded dim last": (lambda x: x.index_select(0, INDEX), 1),
    "pad a local dim": (lambda x: F.pad(x, (1, 2), value=0.5), 0),
    "cummax": (lambda x: x.cummax(1).values, 0),
    "logcumsumexp": (lambda x: x.logcumsumexp(1), 0),
    "argmax": (lambda x: x.argmax(1), 0),
    "max along a local dim": (lambda x: x.max(1).values, 0),
}


def dtensor_block(full: torch.Tensor, placements, coordinate: int, world: int) -> torch.Tensor:
    """DTensor's own split of ``full`` for ``placements`` (one mesh axis): this rank's block."""
    (p,) = placements
    if isinstance(p, (Shard, _StridedShard)):
        return p._split_tensor(full, world, with_padding=False)[0][coordinate]
    return full


def every_case(x: torch.Tensor, xt: torch.Tensor) -> tuple:
    """All cases in one program (one capture per size): ``x`` is sharded on dim 0, ``xt`` on dim 1."""
    return tuple(fn(x if dim == 0 else xt) for fn, dim in CASES.values())


@pytest.mark.parametrize("world, rows", [(2, 8), (2, 7), (4, 8), (4, 7), (4, 3)])
def test_moves_nothing_and_gives_dtensors_blocks(world, rows):
    x = torch.randn(rows, 6)
    mesh, placements = fxshard.MeshSpec(tp=world), {0: Shard(0), 1: Shard(1)}
    e = fxshard.explain(every_case, x, x.t().contiguous(), mesh=mesh, placements=placements)
    outs = fxshard.simulate(every_case, x, x.t().contiguous(), mesh=mesh, placements=placements)
    wrong = {}
    for case, out, expected, layout in zip(CASES, outs, every_case(x, x.t()), e.output_layouts):
        as_dtensor = placements_from_layout(layout)
        blocks_agree = all(torch.equal(layout.shard(expected, (r,)), dtensor_block(expected, as_dtensor, r, world))
                           for r in range(world))
        if not (torch.equal(out, expected) and blocks_agree):
            wrong[case] = (str(layout), as_dtensor, torch.equal(out, expected))
    assert (e.collectives, wrong) == ([], {})


@pytest.mark.parametrize("fn", [lambda x: x.flip(0), lambda x: x.roll(1, 0), lambda x: x.roll(1),
                                lambda x: x.index_select(0, INDEX)], ids=["flip", "roll", "roll flat", "index_select"])
def test_moving_along_the_sharded_dim_gathers_it(fn):
    """Elements cross ranks there (DTensor gathers too): one all_gather, then the op on whole rows."""
    x = torch.randn(7, 6)
    e = fxshard.explain(fn, x, mesh=fxshard.MeshSpec(tp=4), placements={0: Shard(0)})
    out = fxshard.simulate(fn, x, mesh=fxshard.MeshSpec(tp=4), placements={0: Shard(0)})
    assert ([c.kind for c in e.collectives], torch.equal(out, fn(x))) == (["all_gather"], True)


BACKWARD = [lambda x: x.flip(1), lambda x: x.index_select(1, INDEX), lambda x: F.pad(x, (1, 2)),
            lambda x: x.cummax(1).values, lambda x: x.repeat(2, 3), lambda x: x.roll(2, 1)]


def test_their_backward_moves_nothing_either():
    """index_select's backward is index_add, cummax's scatter_add: rows of the gradient stay where they are."""
    x = torch.randn(8, 6, requires_grad=True)
    weights = [torch.randn_like(fn(x)) for fn in BACKWARD]

    def loss(t: torch.Tensor) -> torch.Tensor:
        return sum((fn(t) * w).sum() for fn, w in zip(BACKWARD, weights))

    mesh = fxshard.MeshSpec(tp=4)
    _, grads = fxshard.simulate(loss, x, mesh=mesh, placements={0: Shard(0)}, grad=True)
    with fake_world(mesh) as device_mesh:
        forward, backward = lowered_graphs(loss, x, device_mesh=device_mesh, placements={0: Shard(0)}, grad=True)[(0,)]
        moved = [c for c in collective_calls(forward) + collective_calls(backward) if c.input_bytes > 4]
    loss(x).backward()
    torch.testing.assert_close((moved, grads[0]), ([], x.grad))  # moved: all but the scalar loss's all_reduce


@pytest.mark.parametrize("fn, collectives", [
    (lambda y: y.flip(1), []),
    (lambda y: y.roll(1, 1), []),
    (lambda y: y.index_select(1, INDEX), []),
    (lambda y: F.pad(y, (1, 1)), []),
    (lambda y: F.pad(y, (1, 1), value=1.0), ["all_reduce"]),  # the fill would be summed over ranks
], ids=["flip", "roll", "index_select", "pad with zeros", "pad with ones"])
def test_partial_sums_move_unreduced(fn, collectives):
    """x @ w over a sharded contraction is Partial(sum): moving its elements keeps the shares apart."""
    x, w = torch.randn(4, 8), torch.randn(8, 6)
    pl = {0: Shard(1), 1: Shard(0)}

    def f(x, w):
        return fn(x @ w)

    e = fxshard.explain(f, x, w, mesh=fxshard.MeshSpec(tp=4), placements=pl)
    out = fxshard.simulate(f, x, w, mesh=fxshard.MeshSpec(tp=4), placements=pl)
    assert [c.kind for c in e.collectives] == collectives
    torch.testing.assert_close(out, f(x, w))
