"""The op registry is the one place an op is taught to fxshard: each toy op below is defined with
torch.library, given one registry entry and nothing else, and then propagates (its layouts and
collectives), localizes (its arguments on each rank) and computes the single-device result on
every simulated rank."""
from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Shard

import fxshard
from fxshard import registry, rules
from fxshard.backend.simulate import fake_world, lowered_graphs
from fxshard.localization import LocalShape, MaskedLookup
from fxshard.op_kinds import VIEW


@torch.library.custom_op("fxshard_toys::scale_rows", mutates_args=())
def scale_rows(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return x * s[:, None]


@scale_rows.register_fake
def _(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("fxshard_toys::regroup", mutates_args=())
def regroup(x: torch.Tensor, shape: list[int]) -> torch.Tensor:
    return x.reshape(shape).clone()


@regroup.register_fake
def _(x: torch.Tensor, shape: list[int]) -> torch.Tensor:
    return x.new_empty(shape)


@torch.library.custom_op("fxshard_toys::rows_of", mutates_args=())
def rows_of(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return table[index]


@rows_of.register_fake
def _(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return table.new_empty(tuple(index.shape) + tuple(table.shape[1:]))


toys = torch.ops.fxshard_toys
MESH = fxshard.MeshSpec(tp=4)


def collectives(fn, *args, placements) -> list[str]:
    return [f"{c.kind}({','.join(map(str, c.axes))})" for c in
            fxshard.explain(fn, *args, mesh=MESH, placements=placements, strict=True).collectives]


def test_an_einsum_like_op_is_one_line(monkeypatch):
    monkeypatch.setitem(registry.OPS, toys.scale_rows.default, registry.einsum_op("m n, m -> m n"))

    def f(x, s):
        return toys.scale_rows(x, s) * 2

    x, s = torch.randn(8, 6), torch.randn(8)
    placements = {0: (Shard(0),), 1: (Shard(0),)}
    e = fxshard.explain(f, x, s, mesh=MESH, placements=placements, strict=True)
    assert str(e.output_layouts[0]) == "[4@tp 2] [6]" and not e.collectives  # rows stay where they are
    torch.testing.assert_close(fxshard.simulate(f, x, s, mesh=MESH, placements=placements), f(x, s))
    # the row scale replicated, x sharded by columns: still nothing moves
    assert collectives(f, x, s, placements={0: (Shard(1),)}) == []


def test_a_view_like_op_with_a_shape_argument_is_one_entry(monkeypatch):
    monkeypatch.setitem(registry.OPS, toys.regroup.default, registry.Op(VIEW, LocalShape(1)))

    def f(x):
        return toys.regroup(x, [4, 2, 6]) + 1

    x = torch.randn(8, 6)
    placements = {0: (Shard(0),)}
    e = fxshard.explain(f, x, mesh=MESH, placements=placements, strict=True)
    assert str(e.output_layouts[0]) == "[4@tp] [2] [6]" and not e.collectives  # the view algebra: no comm
    with fake_world(MESH) as mesh:
        local = lowered_graphs(f, x, device_mesh=mesh, placements=placements)[(1,)]
    call = next(n for n in local.graph.nodes if n.target is toys.regroup.default)
    assert list(call.args[1]) == [1, 2, 6]  # localized: this rank's shape
    torch.testing.assert_close(fxshard.simulate(f, x, mesh=MESH, placements=placements), f(x))


def test_an_indexed_op_is_one_entry(monkeypatch):
    monkeypatch.setitem(registry.OPS, toys.rows_of.default,
                        registry.signature_op(rules.embedding, MaskedLookup(table=0, index=1, dim=0, mask_unsqueeze=-1)))

    def f(table, index):
        return toys.rows_of(table, index).sum(-1).exp()  # exp needs the sum: one all_reduce of [3, 5]

    table, index = torch.randn(16, 4), torch.randint(0, 16, (3, 5))
    placements = {0: (Shard(0),)}  # rows of the table split over the ranks: looked up where they lie
    assert collectives(f, table, index, placements=placements) == ["all_reduce(tp)"]  # of [3, 5], not the table
    torch.testing.assert_close(fxshard.simulate(f, table, index, mesh=MESH, placements=placements), f(table, index))


def test_an_op_without_an_entry_is_named_with_the_fix():
    def f(x, s):
        return toys.scale_rows(x, s)

    with pytest.raises(fxshard.propagate.UnsupportedOpError, match=r"fxshard_toys\.scale_rows.*fxshard\.registry\.OPS"):
        fxshard.explain(f, torch.randn(8, 6), torch.randn(8), mesh=MESH, placements={0: (Shard(0),)}, strict=True)
