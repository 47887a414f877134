"""Specification of Layout and MeshSpec: what each rank holds, conversions to and from DTensor
placements, canonical form, local shapes, errors and the printed notation.

Pure tests (no process group) except the ones marked ``distribute_tensor``, which compare with
DTensor itself on a fake process group under LocalTensorMode. Ranks are row-major over mesh
coordinates, i.e. ``MeshSpec.coordinates()`` order.
"""
from __future__ import annotations

import types

import pytest
import sympy
import torch
import torch.distributed as dist
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import distribute_tensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, ShardOrderEntry
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard, _StridedShard
from torch.testing._internal.distributed.fake_pg import FakeStore

from fxshard import Layout, LayoutError, MeshSpec, Piece
from fxshard.placements import layout_from_placements, placements_from_layout

NAMES = ("a", "b", "c")


def mesh(*sizes) -> MeshSpec:
    """A mesh with axes named a, b, c (major first)."""
    return MeshSpec(list(zip(NAMES, sizes)))


def SS(dim: int, split_factor: int) -> _StridedShard:
    return _StridedShard(dim, split_factor=split_factor)


def global_tensor(shape) -> torch.Tensor:
    """Distinct, exactly representable values (float, so that avg/sum partials are exact)."""
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)


def case(sizes, shape, placements, order=None):
    text = ",".join(str(p) for p in placements).replace(" ", "")
    if order is not None:
        text += " order=" + ";".join(f"{d}:{list(m)}" for d, m in order.items())
    return pytest.param(sizes, shape, tuple(placements), order,
                        id=f"{'x'.join(map(str, sizes))} {list(shape)} {text}")


# (mesh sizes, global shape, placements, shard_order {tensor dim: mesh dims in application order})
PLACEMENTS = [
    case((4,), (8, 6), [Shard(0)]),
    case((4,), (8, 6), [Shard(1)]),               # 6 rows over 4: 2, 2, 2, 0
    case((4,), (8, 6), [Replicate()]),
    case((4,), (10, 6), [Shard(0)]),              # 3, 3, 3, 1
    case((4,), (9,), [Shard(0)]),                 # 3, 3, 3, 0
    case((4,), (3,), [Shard(0)]),                 # 1, 1, 1, 0
    case((4,), (8, 6), [SS(0, 2)]),
    case((4,), (12, 6), [SS(0, 3)]),
    case((4,), (10,), [SS(0, 2)]),                # two blocks of 5, each 2, 2, 1, 0
    case((4,), (8, 6), [Partial("sum")]),
    case((4,), (8, 6), [Partial("avg")]),
    case((4,), (8, 6), [Partial("max")]),
    case((4,), (8, 6), [Partial("min")]),
    case((2, 2), (8, 6), [Shard(0), Shard(0)]),
    case((2, 2), (8, 6), [Shard(0), Shard(1)]),
    case((2, 2), (8, 6), [Shard(1), Shard(0)]),
    case((2, 2), (8, 6), [Replicate(), Shard(1)]),
    case((2, 2), (8, 6), [SS(0, 2), Shard(0)]),
    case((2, 2), (10, 6), [Shard(0), Shard(0)]),  # 5 per a, then 3, 2 per b
    case((2, 2), (7, 6), [Shard(0), Shard(0)]),   # 4, 3 per a, then 2, 2 / 2, 1 per b
    case((2, 2), (3, 6), [Shard(0), Shard(0)]),   # 2, 1 per a, then 1, 1 / 1, 0 per b
    case((2, 2), (8, 6), [Shard(0), Shard(0)], {0: [1, 0]}),
    case((2, 2), (8, 6), [Shard(0), Partial("sum")]),
    case((2, 2), (8, 6), [Partial("max"), Shard(1)]),
    case((2, 2), (8, 6), [Partial("avg"), Partial("avg")]),
    case((2, 2), (8, 6), [Partial("min"), Replicate()]),
    case((2, 2, 2), (8, 4, 6), [Shard(0), Shard(1), Shard(0)]),
    case((2, 2, 2), (16, 4), [Shard(0), Shard(0), Shard(0)]),
    case((2, 2, 2), (12, 4), [Shard(0), Shard(0), Shard(0)]),  # 6 per a, 3 per b, then 2, 1 per c
    case((2, 2, 2), (16, 4), [SS(0, 2), Shard(1), Shard(0)]),
    case((2, 2, 2), (8, 8), [Shard(0), Shard(0), Shard(0)], {0: [2, 0, 1]}),
    case((2, 2, 2), (8, 8), [Shard(0), Shard(1), Shard(0)], {0: [2, 0], 1: [1]}),
    case((2, 2, 2), (8, 4, 6), [Shard(0), Partial("sum"), Shard(2)]),
    case((2, 2, 2), (8, 6), [Partial("sum"), Shard(1), Partial("sum")]),
    case((2,), (2, 4, 0, 8), [Shard(1)]),        # an empty KV cache sharded on its heads
    case((2,), (3, 0), [Replicate()]),
]


def _is_plain(p) -> bool:
    return type(p) in (Shard, Replicate, Partial)


# what DTensor's distribute_tensor can produce directly (no strided shards, no shard order)
DISTRIBUTABLE = [c for c in PLACEMENTS if c.values[3] is None and all(map(_is_plain, c.values[2]))]


def dtensor_placements(sizes, placements, order):
    """DTensor's own left-to-right form of ``placements`` applied in ``order``."""
    if order is None:
        return tuple(placements)
    entries = tuple(ShardOrderEntry(tensor_dim=d, mesh_dims=tuple(m)) for d, m in order.items())
    sized_mesh = types.SimpleNamespace(size=lambda i: sizes[i])
    return DTensorSpec._convert_shard_order_to_StridedShard(entries, tuple(placements), sized_mesh)


def dtensor_local(t, sizes, placements, coord) -> torch.Tensor:
    """Ground truth: DTensor's split code applied left to right (Shard and _StridedShard)."""
    local = t
    for i, p in enumerate(placements):
        if isinstance(p, (Shard, _StridedShard)):
            local = p._split_tensor(local, sizes[i], with_padding=False)[0][coord[i]]
    return local


def holds_sum_value(placements, coord) -> bool:
    """fxshard's R -> Partial(sum): the value lives on coordinate 0 of each sum axis, zeros elsewhere."""
    return all(c == 0 for p, c in zip(placements, coord) if isinstance(p, Partial) and p.reduce_op == "sum")


# ---- placements <-> Layout ----------------------------------------------------------------------

@pytest.mark.parametrize("sizes, shape, placements, order", PLACEMENTS)
def test_to_placements_round_trips_dtensor_placements(sizes, shape, placements, order):
    """With a shard order, the expected placements are DTensor's own _StridedShard form of it."""
    layout = layout_from_placements(mesh(*sizes), shape, placements, order)
    assert placements_from_layout(layout) == dtensor_placements(sizes, placements, order)


@pytest.mark.parametrize("sizes, shape, placements, order", PLACEMENTS)
def test_shard_is_what_dtensor_puts_on_each_rank(sizes, shape, placements, order):
    spec, t = mesh(*sizes), global_tensor(shape)
    layout = layout_from_placements(spec, shape, placements, order)
    left_to_right = dtensor_placements(sizes, placements, order)

    def expected(coord):
        local = dtensor_local(t, sizes, left_to_right, coord)
        return local if holds_sum_value(placements, coord) else torch.zeros_like(local)

    wrong = [c for c in spec.coordinates() if not torch.equal(layout.shard(t, c), expected(c))]
    assert wrong == []


@pytest.mark.parametrize("sizes, shape, placements, order", PLACEMENTS)
def test_local_shape_is_the_shape_of_the_shard(sizes, shape, placements, order):
    spec, t = mesh(*sizes), global_tensor(shape)
    layout = layout_from_placements(spec, shape, placements, order)
    wrong = [c for c in spec.coordinates() if layout.local_shape(c) != tuple(layout.shard(t, c).shape)]
    assert wrong == []


@pytest.fixture(scope="module")
def fake_world():
    """A fake 8-rank process group; LocalTensorMode runs every rank of a mesh in this process."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    yield
    dist.destroy_process_group()


def distribute_per_rank(t, sizes, placements) -> dict[tuple[int, ...], torch.Tensor]:
    """distribute_tensor's local tensor on every rank, keyed by mesh coordinate."""
    spec = mesh(*sizes)
    n = int(spec.world_size)
    with LocalTensorMode(n):
        device_mesh = init_device_mesh("cpu", sizes, mesh_dim_names=spec.names)
        local = distribute_tensor(t, device_mesh, placements)._local_tensor
    # a plain tensor (not a LocalTensor) is the same on every rank
    per_rank = getattr(local, "_local_tensors", None) or {r: local for r in range(n)}
    return {c: per_rank[r] for r, c in enumerate(spec.coordinates())}


@pytest.mark.parametrize("sizes, shape, placements, order",
                         [c for c in DISTRIBUTABLE if not any(isinstance(p, Partial) for p in c.values[2])])
def test_shard_matches_distribute_tensor(fake_world, sizes, shape, placements, order):
    spec, t = mesh(*sizes), global_tensor(shape)
    layout = layout_from_placements(spec, shape, placements)
    per_rank = distribute_per_rank(t, sizes, placements)
    wrong = [c for c in spec.coordinates() if not torch.equal(layout.shard(t, c), per_rank[c])]
    assert wrong == []


@pytest.mark.parametrize("sizes, shape, placements, order", DISTRIBUTABLE)
def test_unshard_reads_distribute_tensor(fake_world, sizes, shape, placements, order):
    """DTensor's R -> Partial(sum) holds value/n on every rank; it reduces to the same global tensor."""
    t = global_tensor(shape)
    layout = layout_from_placements(mesh(*sizes), shape, placements)
    torch.testing.assert_close(layout.unshard(distribute_per_rank(t, sizes, placements)), t)


def test_mesh_spec_from_device_mesh(fake_world):
    with LocalTensorMode(4):
        device_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        assert MeshSpec.from_device_mesh(device_mesh) == MeshSpec(dp=2, tp=2)


# ---- layouts DTensor cannot express ---------------------------------------------------------------

TP8 = MeshSpec(tp=8)
DP2_TP4 = MeshSpec(dp=2, tp=4)

NO_DTENSOR_FORM = [
    pytest.param(Layout(TP8, (16,), [[Piece(2, TP8.sub_axis("tp", 2, 4)), Piece(8)]]),
                 id="[2@tp/4 8]"),
    pytest.param(Layout(TP8, (4, 32), [[Piece(2, TP8.sub_axis("tp", 2, 4)), Piece(2)],
                                       [Piece(4, TP8.sub_axis("tp", 4, 1)), Piece(8)]]),
                 id="[2@tp/4 2] [4@tp%4 8]"),
    pytest.param(Layout(TP8, (8, 4), [[Piece(2, TP8.sub_axis("tp", 2, 4)), Piece(4)], [Piece(4)]],
                        partial=[(TP8.sub_axis("tp", 4, 1), "sum")]),
                 id="[2@tp/4 4] [4] P(sum@tp%4)"),
    pytest.param(Layout(DP2_TP4, (8,), [[Piece(2, DP2_TP4.axis("dp")), Piece(2, DP2_TP4.sub_axis("tp", 2, 2)),
                                         Piece(2)]]),
                 id="[2@dp 2@tp/2 2]"),
]


@pytest.mark.parametrize("layout", NO_DTENSOR_FORM)
def test_sub_axis_layouts_have_no_placements(layout):
    assert placements_from_layout(layout) is None


# ---- unshard inverts shard -------------------------------------------------------------------------

def _placement_layout(sizes, shape, placements, order):
    return layout_from_placements(mesh(*sizes), shape, placements, order)


ALL_LAYOUTS = [pytest.param(_placement_layout(*c.values), id=c.id) for c in PLACEMENTS] + NO_DTENSOR_FORM


@pytest.mark.parametrize("layout", ALL_LAYOUTS)
def test_unshard_inverts_shard(layout):
    t = global_tensor(layout.shape)
    locals_ = {c: layout.shard(t, c) for c in layout.mesh.coordinates()}
    assert torch.equal(layout.unshard(locals_), t)


# ---- canonical form ------------------------------------------------------------------------------

M4 = mesh(4)
M22 = mesh(2, 2)
M14 = mesh(1, 4)
A, B = M22.axis("a"), M22.axis("b")

SAME_LAYOUT = [
    pytest.param(Layout(M4, (8,), [[Piece(2), Piece(4)]]), Layout(M4, (8,), [[Piece(8)]]),
                 id="local pieces merge"),
    pytest.param(Layout(M4, (8,), [[Piece(8)]]), Layout.replicated(M4, (8,)),
                 id="whole local dim == no pieces"),
    pytest.param(Layout(M4, (8,), [[Piece(1), Piece(4, M4.axis("a")), Piece(1)]]),
                 Layout(M4, (8,), [[Piece(4, M4.axis("a")), Piece(2)]]),
                 id="size-1 pieces drop, trailing local piece is implicit"),
    pytest.param(Layout(TP8, (16,), [[Piece(2, TP8.sub_axis("tp", 2, 4)), Piece(4, TP8.sub_axis("tp", 4, 1)), Piece(2)]]),
                 Layout(TP8, (16,), [[Piece(8, TP8.axis("tp")), Piece(2)]]),
                 id="tp/4 then tp%4 merge into tp"),
    pytest.param(layout_from_placements(M14, (8,), [Shard(0), Shard(0)]),
                 layout_from_placements(M14, (8,), [Replicate(), Shard(0)]),
                 id="size-1 mesh axis shards nothing"),
    pytest.param(Layout(M22, (8,), partial=[(B, "sum"), (A, "sum")]),
                 Layout(M22, (8,), partial={A: "sum", B: "sum"}),
                 id="partial axes are a set"),
    pytest.param(layout_from_placements(M22, (8,), [Shard(0), Shard(0)], {0: [1, 0]}),
                 layout_from_placements(M22, (8,), [SS(0, 2), Shard(0)]),
                 id="shard order == _StridedShard"),
]


@pytest.mark.parametrize("one, other", SAME_LAYOUT)
def test_equal_layouts_built_differently_are_one_value(one, other):
    assert (one, hash(one)) == (other, hash(other))
    assert one is other  # interned: propagation compares layouts by the hundred thousand


def test_derived_layouts_are_interned_and_pickled_layouts_equal():
    import pickle

    sharded = Layout(M22, (8, 4), [[Piece(2, A)], []])
    assert sharded.with_dim(0, [Piece(8)]) is Layout.replicated(M22, (8, 4))
    assert sharded.with_partial([(B, "sum")]) is Layout(M22, (8, 4), [[Piece(2, A)], []], partial={B: "sum"})
    copy = pickle.loads(pickle.dumps(sharded))  # a copy (another process's hash differs): equal all the same
    assert (copy, hash(copy)) == (sharded, hash(sharded))
    assert Layout(M22, [8, 4], [[Piece(2, A)], []]) is sharded  # a list of sizes is looked up as its tuple


DIFFERENT_LAYOUT = [
    pytest.param(Layout(M22, (8,), [[Piece(2, A), Piece(2, B)]]), Layout(M22, (8,), [[Piece(2, B), Piece(2, A)]]),
                 id="order of axes in a dim"),
    pytest.param(Layout(M4, (8,), [[Piece(4, M4.axis("a"))]]), Layout(M4, (8,), [[Piece(2), Piece(4, M4.axis("a"))]]),
                 id="blocked vs strided"),
    pytest.param(Layout(M22, (8,), partial=[(A, "sum")]), Layout(M22, (8,), partial=[(A, "max")]),
                 id="reduce op"),
]


@pytest.mark.parametrize("one, other", DIFFERENT_LAYOUT)
def test_different_layouts_differ(one, other):
    assert one != other


# ---- local shapes ----------------------------------------------------------------------------------

LOCAL_SIZES = [  # (mesh sizes, dim size, placements, local size of the dim on each rank in rank order)
    ((4,), 8, [Shard(0)], [2, 2, 2, 2]),
    ((4,), 10, [Shard(0)], [3, 3, 3, 1]),
    ((4,), 9, [Shard(0)], [3, 3, 3, 0]),
    ((4,), 3, [Shard(0)], [1, 1, 1, 0]),
    ((4,), 10, [SS(0, 2)], [4, 4, 2, 0]),
    ((2, 2), 7, [Shard(0), Shard(0)], [2, 2, 2, 1]),
    ((2, 2), 10, [Shard(0), Shard(0)], [3, 2, 3, 2]),
    ((2, 2), 3, [Shard(0), Shard(0)], [1, 1, 1, 0]),
]


@pytest.mark.parametrize("sizes, size, placements, expected", LOCAL_SIZES,
                         ids=[f"{c[1]} on {c[0]} {c[2]}" for c in LOCAL_SIZES])
def test_local_size_follows_torch_chunk(sizes, size, placements, expected):
    spec = mesh(*sizes)
    layout = layout_from_placements(spec, (size,), placements)
    assert [layout.local_shape(c)[0] for c in spec.coordinates()] == expected


n = sympy.Symbol("n", positive=True, integer=True)
SYMBOLIC = MeshSpec(tp=n)

SYMBOLIC_LOCAL_SHAPES = [  # (global shape, placements, local shape)
    pytest.param((4 * n, 8), [Shard(0)], (4, 8), id="4n rows on tp=n"),
    pytest.param((2, 6 * n), [Shard(1)], (2, 6), id="6n cols on tp=n"),
    pytest.param((4 * n, 8), [Replicate()], (4 * n, 8), id="replicated"),
    pytest.param((2 * n * n,), [Shard(0)], (2 * n,), id="2n^2 on tp=n"),
]


@pytest.mark.parametrize("shape, placements, expected", SYMBOLIC_LOCAL_SHAPES)
def test_symbolic_local_shape(shape, placements, expected):
    assert layout_from_placements(SYMBOLIC, shape, placements).local_shape((0,)) == expected


# ---- errors ----------------------------------------------------------------------------------------

TP = TP8.axis("tp")

ERRORS = [
    pytest.param(lambda: Layout(TP8, (16, 16), [[Piece(8, TP)], [Piece(2, TP8.sub_axis("tp", 2, 4))]]),
                 r"mesh axis tp is used twice", id="overlapping axes"),
    pytest.param(lambda: Layout(M22, (8,), [[Piece(2, A)]], partial=[(A, "sum")]),
                 r"mesh axis a is used twice", id="sharded and partial on one axis"),
    pytest.param(lambda: layout_from_placements(M22, (8,), [Shard(0)]),
                 r"1 placements .* with 2 axes; give one placement per mesh axis", id="wrong number of placements"),
    pytest.param(lambda: Layout(M4, (8,), partial=[(M4.axis("a"), "prod")]),
                 r"unknown partial reduce op 'prod'", id="unknown reduce op"),
    pytest.param(lambda: layout_from_placements(M4, (8,), [Partial("bxor")]),
                 r"Partial\('bxor'\) is not supported", id="unsupported Partial"),
    pytest.param(lambda: Layout(M22, (8,), partial=[(A, "sum"), (B, "max")]),
                 r"partial with two reduce ops", id="two reduce ops"),
    pytest.param(lambda: layout_from_placements(M22, (8,), [Partial("sum"), Partial("max")]),
                 r"two reduce ops at once \(Partial\(sum\) on a, Partial\(max\) on b\): only sum and avg commute",
                 id="two reduce ops from placements"),
    pytest.param(lambda: Layout(M22, (8,), partial=[(A, "product"), (B, "avg")]),
                 r"partial with two reduce ops", id="product and avg"),
    pytest.param(lambda: Layout(M4, (10,), [[Piece(4, M4.axis("a"))]]),
                 r"does not divide the remaining 10; uneven shards must be chunked", id="uneven without chunking"),
    pytest.param(lambda: Layout(M4, (8,), [[Piece(2, M4.axis("a"))]]),
                 r"a sharded piece has the size of its axis \(4\), got 2", id="piece size != axis size"),
    pytest.param(lambda: Layout(M4, (8,), [[Piece(3)]]),
                 r"piece 3 does not divide the remaining 8", id="local piece does not divide"),
    pytest.param(lambda: Layout(M4, (8, 8), [[Piece(8)]]),
                 r"layout has 1 dims but the shape \[8, 8\] has 2", id="dims vs shape"),
    pytest.param(lambda: Layout(M4, (8,), [[Piece(2, MeshSpec(x=2).axis("x"))]]),
                 r"uses axis x that mesh .* does not have", id="axis not in mesh"),
    pytest.param(lambda: Layout(M4, (8,), [[Piece(8, TP)]]),
                 r"uses axis tp that mesh", id="axis of another mesh"),
    pytest.param(lambda: layout_from_placements(SYMBOLIC, (sympy.Symbol("s") * 4 + 2,), [SS(0, 3)]),
                 r"split factor larger than the dim \(4\*s \+ 2\)", id="uneven _StridedShard split factor of a symbolic dim"),
    pytest.param(lambda: Layout(M4, (10,), [[Piece(2), Piece(3, None, chunked=True), Piece(2, M4.axis("a"), chunked=True)]]),
                 r"unequal blocks \(~3\) need a static size and a sharded piece before them", id="unequal blocks of blocks"),
    pytest.param(lambda: layout_from_placements(M22, (8,), [Shard(0), Replicate()], {0: [1]}),
                 r"shard_order names mesh dim 1 for tensor dim 0", id="shard_order vs placements"),
    pytest.param(lambda: layout_from_placements(M4, (8,), [Shard(1)]),
                 r"Shard\(1\) is out of range for a tensor with 1 dims", id="Shard dim out of range"),
    pytest.param(lambda: layout_from_placements(M4, (8,), [Shard(0)]).shard(torch.zeros(4), (0,)),
                 r"tensor of shape \[4\] does not match layout", id="shard a tensor of another shape"),
]


@pytest.mark.parametrize("make, message", ERRORS)
def test_invalid_layouts_raise_layout_error(make, message):
    with pytest.raises(LayoutError, match=message):
        make()


MESH_ERRORS = [
    pytest.param(lambda: MeshSpec(), r"at least one axis", id="no axes"),
    pytest.param(lambda: MeshSpec([("tp", 2), ("tp", 2)]), r"names must be unique", id="duplicate names"),
    pytest.param(lambda: MeshSpec({"t-p": 2}), r"must be an identifier", id="bad name"),
    pytest.param(lambda: MeshSpec(tp=0), r"size 0; sizes must be >= 1", id="size 0"),
    pytest.param(lambda: MeshSpec(tp=8).sub_axis("tp", 3, 1), r"no sub-axis of size 3", id="sub-axis does not divide"),
    pytest.param(lambda: MeshSpec(tp=8).index("dp"), r"mesh has no axis 'dp'", id="unknown axis"),
    pytest.param(lambda: MeshSpec(dp=2, tp=4).coordinate_dict((0,)), r"has 1 entries; mesh .* has 2 axes",
                 id="short coordinate"),
    pytest.param(lambda: SYMBOLIC.coordinates(), r"is symbolic", id="coordinates of a symbolic mesh"),
]


@pytest.mark.parametrize("make, message", MESH_ERRORS)
def test_invalid_meshes_raise_value_error(make, message):
    with pytest.raises(ValueError, match=message):
        make()


# ---- meshes and axes ---------------------------------------------------------------------------------

def test_coordinates_are_row_major():
    assert MeshSpec(dp=2, tp=3).coordinates() == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]


@pytest.mark.parametrize("spec, world_size", [
    (MeshSpec(tp=4), 4), (MeshSpec(dp=2, tp=3), 6), (MeshSpec(dp=2, tp=n), 2 * n)])
def test_world_size(spec, world_size):
    assert spec.world_size == world_size


AXIS_TEXT = [  # (axis, printed coordinate formula, coordinate of tp rank 5 on it)
    (TP8.axis("tp"), "tp", 5),
    (TP8.sub_axis("tp", 2, 4), "tp/4", 1),
    (TP8.sub_axis("tp", 4, 1), "tp%4", 1),
    (TP8.sub_axis("tp", 2, 2), "tp/2%2", 0),
    (TP8.sub_axis("tp", 8, 1), "tp", 5),
]


@pytest.mark.parametrize("axis, text, coordinate", AXIS_TEXT, ids=[t for _, t, _ in AXIS_TEXT])
def test_axis_prints_as_its_coordinate_formula(axis, text, coordinate):
    assert (str(axis), axis.coordinate(5)) == (text, coordinate)


@pytest.mark.parametrize("outer", [1, 2, 4, 8])
def test_split_axis_merges_back(outer):
    major, minor = TP.split(outer)
    assert major.merge(minor) == TP


# ---- text notation (the examples of the fxshard.layout docstring) ----------------------------------

TEXT = [
    (layout_from_placements(MeshSpec(tp=4), (2, 8, 64), [Shard(1)]), "[2] [4@tp 2] [64]"),
    (layout_from_placements(MeshSpec(dp=4), (8, 8), [SS(0, 2)]), "[2 4@dp] [8]"),
    (Layout(TP8, (2, 32), [[Piece(2, TP8.sub_axis("tp", 2, 4))], [Piece(4, TP8.sub_axis("tp", 4, 1)), Piece(8)]]),
     "[2@tp/4] [4@tp%4 8]"),
    (layout_from_placements(MeshSpec(tp=4), (10,), [Shard(0)]), "[~10@tp]"),
    (layout_from_placements(MeshSpec(tp=4), (8, 16), [Partial("sum")]), "[8] [16] P(sum@tp)"),
    (layout_from_placements(MeshSpec(dp=2, tp=2), (8,), [Partial("max"), Partial("max")]), "[8] P(max@dp,tp)"),
    (layout_from_placements(MeshSpec(dp=2, tp=2), (7,), [Shard(0), Shard(0)]), "[~7@dp ~4@tp]"),
    (Layout.replicated(MeshSpec(tp=4), ()), "[]"),
]


@pytest.mark.parametrize("layout, text", TEXT, ids=[t for _, t in TEXT])
def test_str(layout, text):
    assert str(layout) == text
