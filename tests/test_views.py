"""View chains of sharded tensors: the layout that comes out, and that no collective goes in.

Each row is a chain a model really writes (attention head split and merge, sequence
parallelism around a linear, fused QKV, batch x heads merges) with its input layout and the
output layout fxshard must find with zero communication. ``simulate`` checks the numbers.
"""
from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate as R, Shard as S
from torch.distributed.tensor.placement_types import _StridedShard as SS

from fxshard import Layout, MeshSpec, Piece
from fxshard.backend.explain import explain
from fxshard.backend.simulate import simulate

TP4, TP8, TP2 = MeshSpec(tp=4), MeshSpec(tp=8), MeshSpec(tp=2)
DP2_TP2 = MeshSpec(dp=2, tp=2)
ABC = MeshSpec(a=2, b=2, c=2)


def strided(mesh: MeshSpec, shape: tuple, d: int, outer: int, axis: str = "tp") -> Layout:
    """Dim ``d`` as [outer  n@axis  rest]: ``outer`` local blocks, each split over ``axis``."""
    n = mesh.size_of(axis)
    dims = [()] * len(shape)
    dims[d] = (Piece(outer), Piece(n, mesh.axis(axis)))
    return Layout(mesh, shape, dims)


def case(name, fn, shape, mesh, placements, expected):
    return pytest.param(fn, shape, mesh, placements, expected, id=name)


CHAINS = [
    # attention: [b,s,h] with h sharded -> [b,s,a,h/a] and back
    case("head split a=8 > tp=4", lambda x: x.view(2, 8, 8, 8), (2, 8, 64), TP4, (S(2),), "[2] [8] [4@tp 2] [8]"),
    case("head split a=16 > tp=4", lambda x: x.view(2, 8, 16, 4), (2, 8, 64), TP4, (S(2),), "[2] [8] [4@tp 4] [4]"),
    case("head split a=4 = tp=4", lambda x: x.view(2, 8, 4, 16), (2, 8, 64), TP4, (S(2),), "[2] [8] [4@tp] [16]"),
    case("head split a=2 < tp=8: sub-axes", lambda x: x.view(2, 8, 2, 32), (2, 8, 64), TP8, (S(2),), "[2] [8] [2@tp/4] [4@tp%4 8]"),
    case("head split a=4 < tp=8: sub-axes", lambda x: x.view(2, 8, 4, 16), (2, 8, 64), TP8, (S(2),), "[2] [8] [4@tp/2] [2@tp%2 8]"),
    case("head split and merge, tp=8", lambda x: x.view(2, 8, 2, 32).reshape(2, 8, 64), (2, 8, 64), TP8, (S(2),), "[2] [8] [8@tp 8]"),
    case("head split and merge, tp=4", lambda x: x.view(2, 8, 8, 8).flatten(2), (2, 8, 64), TP4, (S(2),), "[2] [8] [4@tp 16]"),
    case("head split via unflatten", lambda x: x.unflatten(-1, (4, 16)), (2, 8, 64), TP4, (S(2),), "[2] [8] [4@tp] [16]"),
    # sequence parallel: [b,s,h] with s sharded -> [b*s,h] -> mm -> [b,s,h]
    case("sequence parallel around a linear", lambda x: (x.view(16, 16) @ torch.ones(16, 16)).view(2, 8, 16),
         (2, 8, 16), TP4, (S(1),), "[2] [4@tp 2] [16]"),
    case("[b*s,h] rows sharded -> [b,s,h], b < tp", lambda x: x.view(2, 8, 16), (16, 16), TP4, (S(0),), "[2@tp/2] [2@tp%2 4] [16]"),
    case("[b*s,h] rows sharded -> [b,s,h], b = tp", lambda x: x.view(4, 8, 16), (32, 16), TP4, (S(0),), "[4@tp] [8] [16]"),
    case("[b,s,h] batch sharded -> [b*s,h]", lambda x: x.reshape(-1, 16), (4, 8, 16), TP4, (S(0),), "[4@tp 8] [16]"),
    # two-axis fusion and decomposition
    case("fuse, sharded dim first", lambda x: x.view(24), (4, 6), TP2, (S(0),), "[2@tp 12]"),
    case("fuse, sharded dim second (strided)", lambda x: x.view(24), (4, 6), TP2, (S(1),), "[4 2@tp 3]"),
    case("fuse, both dims sharded", lambda x: x.view(24), (4, 6), DP2_TP2, (S(0), S(1)), "[2@dp 2 2@tp 3]"),
    case("split, sharded dim first", lambda x: x.view(4, 6), (24,), TP2, (S(0),), "[2@tp 2] [6]"),
    case("split a strided dim", lambda x: x.view(4, 6), (24,), TP2, strided(TP2, (24,), 0, 4), "[4] [2@tp 3]"),
    case("split a dim sharded twice", lambda x: x.view(4, 6), (24,), DP2_TP2, (S(0), S(0)), "[2@dp 2@tp] [6]"),
    case("fuse then split back", lambda x: x.flatten().view(4, 6), (4, 6), TP2, (S(1),), "[4] [2@tp 3]"),
    # 2-D and 3-D meshes, two mesh axes on one dim, both shard orders
    case("3-D mesh, two axes on one dim -> split", lambda x: x.view(2, 4, 4), (8, 4), ABC, (S(0), S(0), R()), "[2@a] [2@b 2] [4]"),
    case("3-D mesh, three axes -> fuse", lambda x: x.view(32), (8, 4), ABC, (S(0), S(0), S(1)), "[2@a 2@b 2 2@c 2]"),
    case("2-D mesh, tp then dp order -> fuse", lambda x: x.view(32), (8, 4), DP2_TP2, (SS(0, split_factor=2), S(0)), "[2@tp 2@dp 8]"),
    case("2-D mesh, tp then dp order -> split", lambda x: x.view(2, 2, 2, 4), (8, 4), DP2_TP2,
         (SS(0, split_factor=2), S(0)), "[2@tp] [2@dp] [2] [4]"),
    # fused QKV: [b,s,3h] as [3  tp  h/tp] -> q, k, v
    case("fused qkv -> view -> unbind", lambda x: x.view(2, 4, 3, 4, 4).unbind(2)[1], (2, 4, 48), TP4,
         strided(TP4, (2, 4, 48), 2, 3), "[2] [4] [4@tp] [4]"),
    case("fused qkv -> split", lambda x: x.split(16, dim=-1)[2], (2, 4, 48), TP4, strided(TP4, (2, 4, 48), 2, 3), "[2] [4] [4@tp 4]"),
    case("fused qkv -> chunk", lambda x: x.chunk(3, dim=-1)[0], (2, 4, 48), TP4, strided(TP4, (2, 4, 48), 2, 3), "[2] [4] [4@tp 4]"),
    case("fused qkv -> narrow k", lambda x: x.narrow(-1, 16, 16), (2, 4, 48), TP4, strided(TP4, (2, 4, 48), 2, 3), "[2] [4] [4@tp 4]"),
    case("fused qkv -> q+k+v", lambda x: sum(x.split(16, -1)), (2, 4, 48), TP4, strided(TP4, (2, 4, 48), 2, 3), "[2] [4] [4@tp 4]"),
    case("q, k, v -> cat (fused)", lambda x: torch.cat([x, 2 * x, 3 * x], dim=-1), (2, 4, 16), TP4, (S(2),), "[2] [4] [3 4@tp 4]"),
    case("q, k, v -> stack", lambda x: torch.stack([x, 2 * x, 3 * x], dim=2), (2, 4, 16), TP4, (S(2),), "[2] [4] [3] [4@tp 4]"),
    case("fused qkv -> split -> cat back", lambda x: torch.cat(x.split(16, -1), dim=-1), (2, 4, 48), TP4,
         strided(TP4, (2, 4, 48), 2, 3), "[2] [4] [3 4@tp 4]"),
    # attention batch x heads merges
    case("[b,a,s,hd] -> [b*a,s,hd]", lambda x: x.reshape(16, 4, 16), (2, 8, 4, 16), TP4, (S(1),), "[2 4@tp 2] [4] [16]"),
    case("[b,a,s,hd] -> [b*a,s,hd] -> back", lambda x: x.reshape(16, 4, 16).view(2, 8, 4, 16), (2, 8, 4, 16), TP4,
         (S(1),), "[2] [4@tp 2] [4] [16]"),
    case("[b,a,s,hd] dp x tp -> [b*a,s,hd]", lambda x: x.reshape(32, 4, 16), (4, 8, 4, 16), DP2_TP2, (S(0), S(1)), "[2@dp 2 2@tp 4] [4] [16]"),
    case("[b,s,a,hd] -> transpose -> [b*a,s,hd]", lambda x: x.transpose(1, 2).reshape(16, 4, 16), (2, 4, 8, 16), TP4,
         (S(2),), "[2 4@tp 2] [4] [16]"),
    # transpose / permute then reshape
    case("transpose then reshape", lambda x: x.transpose(1, 2).reshape(32, 8), (2, 8, 16), TP4, (S(2),), "[2 4@tp 4] [8]"),
    case("permute then flatten", lambda x: x.permute(2, 0, 1).flatten(1), (2, 8, 6), TP4, (S(1),), "[6] [2 4@tp 2]"),
    case("t on a 2-D mesh", lambda x: x.t(), (8, 8), DP2_TP2, (S(0), S(1)), "[2@tp 4] [2@dp 4]"),
    case("head split, transpose, merge b*a (tp=8)", lambda x: x.view(2, 4, 2, 32).transpose(1, 2).reshape(4, 4, 32),
         (2, 4, 64), TP8, (S(2),), "[2 2@tp/4] [4] [4@tp%4 8]"),
    # squeeze / unsqueeze / expand
    case("squeeze a size-1 dim", lambda x: x.squeeze(1), (2, 1, 8), TP4, (S(2),), "[2] [4@tp 2]"),
    case("unsqueeze", lambda x: x.unsqueeze(0).unsqueeze(-1), (2, 8), TP4, (S(1),), "[1] [2] [4@tp 2] [1]"),
    case("view with size-1 dims", lambda x: x.view(2, 1, 8), (2, 8), TP4, (S(1),), "[2] [1] [4@tp 2]"),
    case("expand a broadcast dim", lambda x: x.expand(4, 8), (1, 8), TP4, (S(1),), "[4] [4@tp 2]"),
    # select / slice / split along local dims or local factors
    case("select a local dim", lambda x: x.select(0, 1), (4, 16), TP4, (S(1),), "[4@tp 4]"),
    case("slice a local dim", lambda x: x[2:6], (8, 16), TP4, (S(1),), "[4] [4@tp 4]"),
    case("chunk a local dim", lambda x: x.chunk(2, dim=0)[1], (8, 16), TP4, (S(1),), "[4] [4@tp 4]"),
    case("unbind a local dim", lambda x: x.unbind(0)[1], (3, 4, 8), TP4, (S(2),), "[4] [4@tp 2]"),
    case("slice a local outer factor", lambda x: x[:, 8:16], (4, 24), TP4, strided(TP4, (4, 24), 1, 3), "[4] [4@tp 2]"),
    case("cat of equal shards along the sharded dim", lambda x: torch.cat([x, x], dim=1), (4, 8), TP4, (S(1),), "[4] [2 4@tp 2]"),
]


def chain_result(e) -> tuple[Layout, list]:
    """The chain's own output layout and collectives (before any conversion to a DTensor form)."""
    value = next(n for n in e.graph.graph.nodes if n.op == "output").args[0][0]
    if "plan" in value.meta:  # the output was converted to a DTensor-expressible layout
        return value.meta["src_layout"], [c for c in e.collectives if c.node is not value]
    return value.meta["layout"], list(e.collectives)


@pytest.mark.parametrize("fn, shape, mesh, placements, expected", CHAINS)
def test_view_chain_keeps_the_data_in_place(fn, shape, mesh, placements, expected):
    x = torch.randn(shape)
    e = explain(fn, x, mesh=mesh, placements={0: placements})
    layout, collectives = chain_result(e)
    assert (str(layout), collectives) == (expected, [])
    torch.testing.assert_close(simulate(fn, x, mesh=mesh, placements={0: placements}), fn(x))


def test_at_least_forty_chains():
    assert len(CHAINS) >= 40


def test_as_strided_that_is_a_plain_view_is_a_view():
    x = torch.randn(2, 8, 64)

    def f(t):
        return torch.as_strided(t, (2, 8, 4, 16), (512, 64, 16, 1))

    e = explain(f, x, mesh=TP4, placements={0: (S(2),)})
    assert (str(chain_result(e)[0]), e.collectives) == ("[2] [8] [4@tp] [16]", [])
    torch.testing.assert_close(simulate(f, x, mesh=TP4, placements={0: (S(2),)}), f(x))


def test_as_strided_that_is_not_a_view_is_refused():
    from fxshard.propagate import UnsupportedOpError

    with pytest.raises(UnsupportedOpError, match="not a row-major view"):
        explain(lambda t: torch.as_strided(t, (4, 4), (1, 4)), torch.randn(16), mesh=TP4, placements={0: (S(0),)})


# ---- slices that cut through a shard: less communication than a gather --------------------------
# (chain, input shape, mesh, placements, the chain's collectives with bytes per rank, its output layout)
CUTS = [
    # rows [0, 4) of [4@tp 2]: the shards move inside two outer blocks ([2 4@tp]); one exchange
    case("chunk(2)[0] through the shards", lambda x: x.chunk(2, dim=1)[0] * 2, (2, 8, 16), TP4, (S(1),),
         ("exchange(tp) 256 B/rank", "[2] [4@tp] [16]")),
    case("split(4) of a dim sharded twice", lambda x: x.split(4, dim=0)[1] + 1, (8, 6), DP2_TP2, (S(0), S(0)),
         ("exchange(dp,tp) 48 B/rank", "[2@dp 2@tp] [6]")),
    # edges on shard boundaries: each rank keeps its rows of the range (zeros elsewhere); nothing moves
    case("narrow(0, 2, 4) of [4@tp 2]: edges on shard boundaries, nothing moves", lambda x: x.narrow(0, 2, 4) * 2,
         (8, 6), TP4, (S(0),), ("", "[4] [6] P(sum@tp)")),
    # most of the dim, edges inside shards: gathering is cheapest
    case("narrow(0, 1, 6) of [4@tp 2]: gathered", lambda x: x.narrow(0, 1, 6) * 2, (8, 6), TP4, (S(0),),
         ("all_gather(tp) 144 B/rank", "[6] [6]")),
    # one row, or a short range: taken where it lies, zeros elsewhere (Partial(sum)), reduced when needed
    case("select through the shards", lambda x: x.select(0, 5) * 2, (8, 6), TP4, (S(0),),
         ("", "[6] P(sum@tp)")),
    case("select through the shards, then exp", lambda x: x.select(0, 5).exp(), (8, 6), TP4, (S(0),),
         ("all_reduce(tp) 36 B/rank", "[6]")),
    case("select on 2x2: the other dim stays sharded", lambda x: x.select(0, 5).exp(), (8, 6), DP2_TP2,
         (S(0), S(1)), ("all_reduce(dp) 12 B/rank", "[2@tp 3]")),
    case("narrow 2 of 64 rows", lambda x: x.narrow(0, 1, 2).exp(), (64, 6), TP4, (S(0),),
         ("all_reduce(tp) 72 B/rank", "[2] [6]")),
]


@pytest.mark.parametrize("fn, shape, mesh, placements, expected", CUTS)
def test_slice_through_a_shard_moves_least(fn, shape, mesh, placements, expected):
    x = torch.randn(shape)
    e = explain(fn, x, mesh=mesh, placements={0: placements})
    layout, collectives = chain_result(e)
    assert (", ".join(f"{c.kind}({','.join(map(str, c.axes))}) {c.bytes_per_rank} B/rank" for c in collectives),
            str(layout)) == expected
    torch.testing.assert_close(simulate(fn, x, mesh=mesh, placements={0: placements}), fn(x))
