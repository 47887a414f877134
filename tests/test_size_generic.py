"""One program for every length of a dim that grows and that no layout shards (backend/programs/size_generic.py).

A graph Dynamo made dynamic gets a program per set of sizes (backend/programs/sizes.py); two programs whose local
code is the same and whose layouts differ only in the sizes of unsharded dims give one program compiled for
symbolic sizes, which serves every later size on the line through the two. Checked here: the line, the
layouts, which Dynamo graphs qualify, and, on a fake process group of 4, that the program for symbolic sizes
(Inductor's) returns what a program per size returns, for sizes it never saw, and is not used where the
growing dim is sharded. tests/test_e2e_gloo.py checks ``generate()`` on a dynamic cache against one device.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import fxshard
from fxshard.backend.programs import size_generic
from fxshard.backend.programs.size_generic import Affine, affine_sizes_only, flat_key, resized, same_but_sizes
from fxshard.layout import Layout, Piece

MESH = fxshard.MeshSpec(tp=2)
TP = MESH.axis("tp")


def test_the_line_through_two_sizes_predicts_the_next_ones():
    """A decode step's sizes: the cache length n (an int and a dim), a mask of n + 1, strides of 64 n."""
    def key(n: int) -> tuple:
        return (((2, 1), (1, 1)), n, ((2, 4, n, 16), (64 * n, 16 * n, 16, 1)), ((2, 1, 1, n + 1), (n + 1,) * 3 + (1,)))

    line = Affine.between(flat_key(key(16)), flat_key(key(17)))
    assert line is not None
    assert all(line.predicts(flat_key(key(n))) for n in (2, 18, 40, 4096))
    assert not line.predicts(flat_key(key(1)))  # a length of 1 is special to the traces
    batch = list(flat_key(key(18)))
    batch[0] = 3  # a size the two calls agree on changes
    assert not line.predicts(tuple(batch))
    off = list(flat_key(key(18)))
    off[-1] += 1  # the mask's last stride moves: the sizes leave the line
    assert not line.predicts(tuple(off))
    assert Affine.between(flat_key(key(16)), flat_key(key(16))) is None  # nothing varies
    # a number that moves by a fraction of the first one's move: no integer slope
    assert Affine.between((16, 8), (18, 9)) is None
    assert Affine.between((16, 2.0), (17, 3.0)) is None  # only ints move


def test_layouts_alike_but_for_unsharded_sizes():
    cache16 = Layout(MESH, (2, 4, 16, 16), [(), (Piece(2, TP),), (), ()])
    cache17 = Layout(MESH, (2, 4, 17, 16), [(), (Piece(2, TP),), (), ()])
    assert same_but_sizes(cache16, cache17, [2])
    assert resized(cache16, (2, 4, 17, 16)) is cache17
    seq16 = Layout(MESH, (2, 16, 8), [(), (Piece(2, TP),), ()])  # the growing dim sharded: one program per size
    seq18 = Layout(MESH, (2, 18, 8), [(), (Piece(2, TP),), ()])
    assert not same_but_sizes(seq16, seq18, [1])
    other = Layout(MESH, (2, 4, 17, 16), [(Piece(2, TP),), (), (), ()])  # other placements
    assert not same_but_sizes(cache16, other, [2])


def _dynamo_graph(fn, *args) -> torch.fx.GraphModule:
    graphs = []

    def grab(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(fn, backend=grab, dynamic=True)
    compiled(*args)
    return graphs[-1]


def test_only_graphs_computing_sizes_by_sums_and_products_qualify():
    """``min``, ``//`` or a comparison of sizes can agree at two lengths and not at a third."""
    x = torch.randn(2, 6, 4)
    assert affine_sizes_only(_dynamo_graph(lambda x: torch.cat([x, x[:, -1:]], 1).view(2, x.shape[1] + 1, 4) * 2, x))
    assert not affine_sizes_only(_dynamo_graph(lambda x: x[:, : x.shape[1] // 2] * 2, x))
    assert not affine_sizes_only(_dynamo_graph(lambda x: x[:, max(0, x.shape[1] - 4):] * 2, x))


def attend(x: torch.Tensor, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step's attention over a cache that grows by the new token: (output, the grown cache)."""
    cache = torch.cat([cache, x], dim=1)
    weights = torch.softmax(x @ cache.transpose(1, 2), dim=-1)
    return weights @ cache, cache


def _decode(mesh, cache_placement, lengths, generic: bool, monkeypatch) -> tuple[list, int]:
    """``attend`` compiled by the backend, called at each cache length (fresh random data, seeded)."""
    if not generic:
        monkeypatch.setattr(size_generic, "generalize", lambda *args, **kwargs: None)
    torch._dynamo.reset()
    lowered: list[str] = []
    step = torch.compile(attend, backend="fxshard",
                         options={"on_graph": lambda stage, gm: lowered.append(stage) if stage == "lower" else None})
    outs = []
    for n in lengths:
        torch.manual_seed(n)
        x, cache = torch.randn(2, 1, 8), torch.randn(2, n, 8)
        with torch.no_grad():
            out = step(distribute_tensor(x, mesh, [Replicate()]), distribute_tensor(cache, mesh, [cache_placement]))
        outs.append(out)
    monkeypatch.undo()
    return outs, len(lowered)


def test_a_cache_sharded_on_features_compiles_one_program_for_every_length(fake_mesh_4, monkeypatch):
    """The cache sharded on its features (dim 2), growing on dim 1: programs for the first lengths (Dynamo's
    static graph, then three of its dynamic graph: the matmuls' expands and views name the length, so the line
    through two programs' arguments must hold at a third), then Inductor's program for symbolic lengths
    serves every later one, lengths it never saw included, with what a program per length returns (on the fake process
    group the all_reduce keeps each rank's partial sum, alike in both), the outputs' global shapes and
    placements those of the length called."""
    lengths = [4, 5, 6, 7, 9, 12, 31]
    got, programs = _decode(fake_mesh_4, Shard(2), lengths, True, monkeypatch)
    want, per_length = _decode(fake_mesh_4, Shard(2), lengths, False, monkeypatch)
    assert per_length == len(lengths)
    assert programs == 4, programs
    for n, (g, w) in zip(lengths, zip(got, want)):
        for a, b in zip(g, w):
            assert isinstance(a, DTensor) and a.placements == b.placements and a.shape == b.shape, (n, a, b)
            torch.testing.assert_close(a.to_local(), b.to_local(), rtol=1e-5, atol=1e-6)
        assert g[1].shape == (2, n + 1, 8) and g[1].placements == (Shard(2),)


def test_a_cache_sharded_on_the_growing_dim_compiles_a_program_per_length(fake_mesh_4, monkeypatch):
    """Sharded on the dim that grows, each rank's block depends on the length (and 5 rows split unevenly):
    no program serves two lengths."""
    lengths = [4, 5, 6, 7, 8]
    _, programs = _decode(fake_mesh_4, Shard(1), lengths, True, monkeypatch)
    assert programs == len(lengths)
