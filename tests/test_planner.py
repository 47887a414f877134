"""The redistribution planner: plans, their bytes against the lower bound, and their numerics.

Every plan here is also run: ``fxshard.simulate_plan`` lowers it for every rank, runs all
ranks under LocalTensorMode, and reads the bytes each collective receives off the lowered
graph, so ``Plan.bytes_per_rank`` is checked against what really moves.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard, _StridedShard

import fxshard
from fxshard import CostModel, Layout, LayoutError, MeshSpec, Piece, lower_bound_bytes, plan_redistribute
from fxshard.planner import redistribute_cost
from fxshard.atoms import Atoms
from fxshard.exchange import received_elements
from fxshard.exchange import received_even
from fxshard.placements import layout_from_placements, placements_to_str

R = Replicate()


def S(d: int) -> Shard:
    return Shard(d)


def P(op: str = "sum") -> Partial:
    return Partial(op)


def layouts(sizes: tuple, shape: tuple, src: tuple, dst: tuple, src_order=None, dst_order=None):
    mesh = MeshSpec(list(zip("abcd", sizes)))
    return (layout_from_placements(mesh, shape, src, src_order), layout_from_placements(mesh, shape, dst, dst_order))


def case(sizes, shape, src, dst, expected, src_order=None, dst_order=None):
    order = f" order {src_order}->{dst_order}" if src_order or dst_order else ""
    return pytest.param(sizes, shape, src, dst, src_order, dst_order, expected,
                        id=f"{'x'.join(map(str, sizes))} {list(shape)} {placements_to_str(src)} -> "
                           f"{placements_to_str(dst)}{order}")


# ---- 1. what the planner does, case by case --------------------------------------------------
# Each: the steps (str of the plan's steps). All are at the lower bound (checked below).

PLANS = [
    case((4,), (8, 12), (S(0),), (R,), "all_gather(a dim 0)"),
    case((4,), (8, 12), (S(0),), (S(1),), "all_to_all(a dim 0->1)"),
    case((4,), (8, 12), (P(),), (S(1),), "reduce_scatter(a dim 1 sum)"),
    case((4,), (8, 12), (R,), (P(),), "local_partial(a sum)"),
    # a shard is a term of its partial sum: its block, zeros elsewhere (DTensor 2.15's zero-fill)
    case((4,), (8, 12), (S(0),), (P(),), "local_partial(a dim 0 sum)"),
    case((4,), (10, 8), (S(0),), (P(),), "local_partial(a dim 0 sum)"),
    case((2, 2), (8, 12), (S(0), S(1)), (P("product"), S(1)), "local_partial(a dim 0 product)"),
    # a shard moving inside its dim: [4@a 2] -> [2 4@a 1] keeps a quarter of each block in place
    case((4,), (8, 12), (S(0),), (_StridedShard(0, split_factor=2),), "exchange(a)"),
    case((2,), (8, 12), (S(0),), (_StridedShard(0, split_factor=2),), "all_to_all(a dim 0->0)"),
    # several mesh axes moving together: one collective over the flattened group
    case((2, 2), (8, 12), (S(0), S(0)), (S(1), S(1)), "all_to_all(a,b dim 0->1)"),
    case((2, 2, 2), (8, 16), (S(0), S(0), S(0)), (S(1), S(1), S(1)), "all_to_all(a,b,c dim 0->1)"),
    case((2, 2, 2), (8, 16), (S(0), S(0), S(0)), (S(1), S(1), S(1)), "all_to_all(a,b,c dim 0->1)",
         dst_order={1: (2, 1, 0)}),
    case((2, 2), (8, 12), (P(), P()), (S(0), S(1)), "reduce_scatter(a,b sum)"),
    case((2, 2), (8, 12), (S(0), S(0)), (R, R), "all_gather(a,b dim 0)"),
    # ranks swap whole blocks: no all_to_all moves as little as one exchange
    case((2, 2), (8, 12), (S(0), S(1)), (S(1), S(0)), "exchange(a,b)"),
    case((2, 4), (64, 32), (S(0), S(1)), (S(1), S(0)), "exchange(a,b)"),
    # shard before reducing: the all_reduce runs on a quarter of the data
    case((2, 4), (64, 32), (P(), R), (P(), S(0)), "local_shard(b dim 0)"),
    case((2, 4), (64, 32), (P(), R), (R, S(0)), "local_shard(b dim 0), all_reduce(a sum)"),
    # uneven (torch.chunk): padded gather as DTensor, or one exchange that moves no padding
    case((4,), (10, 8), (S(0),), (R,), "all_gather(a dim 0)"),
    case((4,), (10, 8), (S(0),), (S(1),), "exchange(a)"),
    case((2, 2), (10, 6), (S(0), S(0)), (R, R), "exchange(a,b)"),
    # a fused q|k|v of multi-query attention regrouped by head: where the two layouts' cuts do not
    # nest (no digit is whole on both sides), no all_to_all moves it; one exchange moves what each lacks
    case((2,), (10,), (S(0),), (_StridedShard(0, split_factor=5),), "exchange(a)"),  # Falcon-7B at tp=2: cuts 2, 5
    case((4,), (80,), (S(0),), (_StridedShard(0, split_factor=10),), "exchange(a)"),  # GPTBigCode at tp=4: 2, 8, 20
    case((2,), (80,), (S(0),), (_StridedShard(0, split_factor=10),), "all_to_all(a dim 0->0)"),  # at tp=2: they nest
]


@pytest.mark.parametrize("sizes, shape, src, dst, src_order, dst_order, expected", PLANS)
def test_plan(sizes, shape, src, dst, src_order, dst_order, expected):
    a, b = layouts(sizes, shape, src, dst, src_order, dst_order)
    plan = plan_redistribute(a, b)
    assert ", ".join(str(s) for s in plan.steps) == expected
    assert plan.bytes_per_rank == lower_bound_bytes(a, b)
    x = torch.randn(shape)
    run = fxshard.simulate_plan(plan, x)
    torch.testing.assert_close(run.result, x)
    assert run.received == [s.bytes_per_rank for s in plan.steps]


# a bandwidth-only model (latency 0) still takes one collective where several move the same bytes
BANDWIDTH_ONLY = [
    case((2, 4), (64, 64), (S(0), S(0)), (R, R), "all_gather(a,b dim 0)"),
    case((2, 4), (64, 64), (P(), P()), (R, R), "all_reduce(a,b sum)"),
    case((2, 4), (64, 64), (P(), P()), (S(0), S(0)), "reduce_scatter(a,b dim 0 sum)"),
]


@pytest.mark.parametrize("sizes, shape, src, dst, src_order, dst_order, expected", BANDWIDTH_ONLY)
def test_bandwidth_only_plans_take_the_fewest_collectives(sizes, shape, src, dst, src_order, dst_order, expected):
    a, b = layouts(sizes, shape, src, dst, src_order, dst_order)
    assert ", ".join(str(s) for s in plan_redistribute(a, b, cost_model=CostModel(default_latency=0.0)).steps) == expected


def test_strategies_are_priced_without_filling_shards():
    """A move asked for fills a shard into its Partial term (no collective); the price propagation compares
    strategies by does not: the filled tensor is n times the data later ops compute on (DTensor 2.15 alike)."""
    a, b = layouts((4,), (8, 12), (S(0),), (P(),))
    priced = plan_redistribute(a, b, fill_shards=False)
    assert (plan_redistribute(a, b).collectives, [s.kind for s in priced.collectives]) == ((), ["all_gather"])
    assert redistribute_cost(a, b) == priced.cost


def test_plan_cache_and_errors():
    a, b = layouts((2, 2), (8, 12), (S(0), S(1)), (S(1), S(0)))
    assert plan_redistribute(a, b) is plan_redistribute(a, b)
    assert plan_redistribute(a, a).steps == ()
    with pytest.raises(ValueError, match="does not match"):
        plan_redistribute(a, b, shape=(4, 4))
    c, _ = layouts((2, 2), (8, 8), (S(0), S(1)), (R, R))
    with pytest.raises(LayoutError, match="different shapes"):
        plan_redistribute(a, c)


def test_symbolic_mesh_plans_with_symbolic_bytes():
    import sympy

    n = sympy.Symbol("n", positive=True, integer=True)
    mesh = MeshSpec(dp=2, tp=n)
    a = layout_from_placements(mesh, (8 * n, 16 * n), (S(0), S(0)))
    b = layout_from_placements(mesh, (8 * n, 16 * n), (S(1), S(1)))
    plan = plan_redistribute(a, b)
    assert [str(s) for s in plan.steps] == ["all_to_all(dp,tp dim 0->1)"]
    assert sympy.simplify(plan.bytes_per_rank - (256 * n - 128)) == 0  # (2n-1)/2n of 128n floats


def test_sub_axes_that_do_not_nest_fall_back_to_one_exchange():
    """tp=12 seen as 2 x 6 by one layout and 3 x 4 by the other: no common atoms, one exchange."""
    mesh = MeshSpec(tp=12)
    a = Layout(mesh, (24,), [[Piece(2, mesh.sub_axis("tp", 2, 6)), Piece(12)]])
    b = Layout(mesh, (24,), [[Piece(3, mesh.sub_axis("tp", 3, 4)), Piece(8)]])
    plan = plan_redistribute(a, b)
    assert [str(s) for s in plan.steps] == ["exchange(tp)"]
    assert plan.bytes_per_rank == lower_bound_bytes(a, b)
    x = torch.randn(24)
    torch.testing.assert_close(fxshard.simulate_plan(plan, x).result, x)


# ---- 2. topology: a slow axis carries as little as possible ------------------------------------

def test_slow_axis_carries_the_smaller_tensor():
    """Gathering a 2x2 shard: one flattened all_gather by default; with axis a 8x slower, a first.

    Gathering a first moves a quarter-block over a; gathering b first would move a half-block.
    """
    a, b = layouts((2, 2), (1024, 1024), (S(0), S(1)), (R, R))
    fast = plan_redistribute(a, b)
    assert [str(s) for s in fast.steps] == ["all_gather(a,b)"]
    slow_a = CostModel(bandwidth=(("a", 100e9 / 8),), latency=(("a", 80e-6),))
    slow = plan_redistribute(a, b, cost_model=slow_a)
    assert [str(s) for s in slow.steps] == ["all_gather(a dim 0)", "all_gather(b dim 1)"]
    on_a = sum(s.bytes_per_rank for s in slow.steps if s.axes[0].name == "a")
    assert on_a == 1024 * 1024 * 4 // 4  # one quarter-block crosses the slow axis
    assert slow.cost < plan_redistribute(a, b).cost * 8


def test_slow_axis_is_avoided_when_replicas_allow():
    """dst needs data that src replicates over a: it is fetched over b, never over slow a."""
    a, b = layouts((2, 2), (64, 64), (R, S(0)), (R, S(1)))
    slow_a = CostModel(bandwidth=(("a", 100e9 / 8),), latency=(("a", 80e-6),))
    plan = plan_redistribute(a, b, cost_model=slow_a)
    assert all(ax.name != "a" for s in plan.collectives for ax in s.axes)


# ---- 3. the lower bound and the exchange's closed form ---------------------------------------

def test_lower_bound_partial_cases():
    a, b = layouts((4,), (8, 12), (P(),), (R,))
    assert lower_bound_bytes(a, b) == 2 * 3 / 4 * 8 * 12 * 4  # the all-reduce bound
    a, b = layouts((4,), (8, 12), (P(),), (S(0),))
    assert lower_bound_bytes(a, b) == 3 / 4 * 8 * 12 * 4  # the reduce-scatter bound
    a, b = layouts((4,), (8, 12), (R,), (P(),))
    assert lower_bound_bytes(a, b) == 0


PLACEMENT_OPTIONS = [R, S(0), S(1), S(2)]


@settings(max_examples=60, deadline=None, derandomize=True)
@given(sizes=st.sampled_from([(4,), (8,), (2, 2), (2, 4), (2, 2, 2)]), data=st.data())
def test_closed_form_received_matches_enumeration(sizes, data):
    """The planner's closed form for the exchange's bytes against counting index sets."""
    shape = tuple(data.draw(st.sampled_from([1, 2, 4, 8, 16])) for _ in range(3))
    src = tuple(data.draw(st.sampled_from(PLACEMENT_OPTIONS)) for _ in sizes)
    dst = tuple(data.draw(st.sampled_from(PLACEMENT_OPTIONS)) for _ in sizes)
    try:
        a, b = layouts(sizes, shape, src, dst)
    except LayoutError:
        return
    atoms = Atoms.of([a, b])
    closed = received_even(atoms.state(a), atoms.state(b))
    assert closed == (received_elements(a, b) if a.is_even() and b.is_even() else None)


# ---- 4. property: random layouts, every plan runs and reconstructs the tensor ------------------

MESHES = [(2,), (3,), (4,), (2, 2), (2, 3), (3, 2), (2, 2, 2)]


@st.composite
def placements(draw, ndim: int, mesh_ndim: int, reduce_op: str | None):
    out = []
    for _ in range(mesh_ndim):
        kind = draw(st.sampled_from(["R", "S", "S", "SS", "P"] if reduce_op else ["R", "S", "S", "SS"]))
        if kind == "R":
            out.append(R)
        elif kind == "P":
            out.append(Partial(reduce_op))
        elif kind == "SS":
            out.append(_StridedShard(draw(st.integers(0, ndim - 1)), split_factor=draw(st.sampled_from([2, 3]))))
        else:
            out.append(Shard(draw(st.integers(0, ndim - 1))))
    return tuple(out)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(sizes=st.sampled_from(MESHES), data=st.data())
def test_random_plans_reconstruct_the_tensor(sizes, data):
    ndim = data.draw(st.integers(1, 3))
    shape = tuple(data.draw(st.sampled_from([1, 2, 3, 4, 5, 6, 8, 9, 12])) for _ in range(ndim))
    op = data.draw(st.sampled_from([None, None, "sum", "max", "avg"]))
    src = data.draw(placements(ndim, len(sizes), op))
    dst = data.draw(placements(ndim, len(sizes), data.draw(st.sampled_from([None, op]))))
    try:
        a, b = layouts(sizes, shape, src, dst)
    except LayoutError:
        return  # more shards than elements, or a strided split that does not divide
    plan = plan_redistribute(a, b)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1))))
    run = fxshard.simulate_plan(plan, x)
    torch.testing.assert_close(run.result, x, atol=1e-5, rtol=1e-5)
    assert run.received == [s.bytes_per_rank for s in plan.steps], str(plan)
    bound = lower_bound_bytes(a, b)
    assert plan.bytes_per_rank >= bound - 1e-9, str(plan)
    if not a.partial and not b.partial and a.is_even() and b.is_even():
        assert plan.bytes_per_rank == bound, str(plan)


@st.composite
def sub_axis_layout(draw, mesh: MeshSpec, shape: tuple):
    """Each mesh axis whole or cut in two sub-axes; each (sub-)axis replicated or sharding a random dim."""
    dims: list[list[Piece]] = [[] for _ in shape]
    for name in mesh.names:
        size = mesh.size_of(name)
        axes = list(mesh.axis(name).split(2)) if size == 4 and draw(st.booleans()) else [mesh.axis(name)]
        for axis in draw(st.permutations(axes)):
            target = draw(st.integers(-1, len(shape) - 1))
            if target >= 0:
                dims[target].append(Piece(axis.size, axis))
    for d, pieces in enumerate(dims):
        n = 1
        for p in pieces:
            n *= int(p.size)
        if shape[d] % n:
            raise LayoutError("indivisible")
        pieces.append(Piece(shape[d] // n))
    return Layout(mesh, shape, dims)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(sizes=st.sampled_from([(4,), (2, 4), (4, 2)]), data=st.data())
def test_random_sub_axis_plans_reconstruct_the_tensor(sizes, data):
    """Layouts on mesh sub-axes (as views make them), in any order within a dim."""
    mesh = MeshSpec(list(zip("ab", sizes)))
    shape = tuple(data.draw(st.sampled_from([4, 8, 16])) for _ in range(data.draw(st.integers(1, 3))))
    try:
        a, b = data.draw(sub_axis_layout(mesh, shape)), data.draw(sub_axis_layout(mesh, shape))
    except LayoutError:
        return
    plan = plan_redistribute(a, b)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1))))
    run = fxshard.simulate_plan(plan, x)
    torch.testing.assert_close(run.result, x)
    assert run.received == [s.bytes_per_rank for s in plan.steps], str(plan)
    assert plan.bytes_per_rank == lower_bound_bytes(a, b), str(plan)


# ---- 5. cuts that do not nest: DTensor says what the target layout holds ------------------------

def dtensor_blocks(sizes: tuple, x: torch.Tensor, dst: tuple) -> dict:
    """Each rank's block of ``x`` in placements ``dst``, by DTensor: distributed as Shard(0), then
    redistributed (under LocalTensorMode, distribute_tensor cuts a _StridedShard as for rank 0 on
    every rank; redistribute from Shard(0) does not)."""
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.distributed.tensor import distribute_tensor

    from fxshard.backend.simulate import fake_world

    mesh = MeshSpec(list(zip("abcd", sizes)))
    with fake_world(mesh) as device_mesh, LocalTensorMode(int(mesh.world_size)):
        local = distribute_tensor(x, device_mesh, [S(0)] * len(sizes)).redistribute(device_mesh, dst).to_local()
    return {c: local._local_tensors[r] for r, c in enumerate(mesh.coordinates())}


REGROUPINGS = [p for p in PLANS if isinstance(p.values[3][0], _StridedShard) and len(p.values[1]) == 1]


@pytest.mark.parametrize("sizes, shape, src, dst, src_order, dst_order, expected", REGROUPINGS)
def test_regrouping_holds_what_dtensor_holds(sizes, shape, src, dst, src_order, dst_order, expected):
    a, b = layouts(sizes, shape, src, dst)
    x = torch.randn(shape)
    run = fxshard.simulate_plan(plan_redistribute(a, b), x)
    want = dtensor_blocks(sizes, x, dst)
    assert all(torch.equal(run.outputs[c], want[c]) for c in want)


def strided(sf: int):
    return R if sf == 0 else S(0) if sf == 1 else _StridedShard(0, split_factor=sf)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(n=st.sampled_from([2, 3, 4]), data=st.data())
def test_random_strided_regroupings_are_built_at_the_lower_bound(n, data):
    """Dim 0 cut by one axis at two strides (split factors, 1: Shard(0), 0: replicated): the plan
    lowers, holds DTensor's blocks, and moves exactly what the lower bound says, nesting or not."""
    sf_src, sf_dst = data.draw(st.sampled_from([0, 1, 2, 3, 5, 10])), data.draw(st.sampled_from([1, 2, 3, 5, 10]))
    shape = (n * max(sf_src, 1) * sf_dst * data.draw(st.sampled_from([1, 2])),) + data.draw(st.sampled_from([(), (3,)]))
    a, b = layouts((n,), shape, (strided(sf_src),), (strided(sf_dst),))
    plan = plan_redistribute(a, b)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1))))
    run = fxshard.simulate_plan(plan, x)
    want = dtensor_blocks((n,), x, (strided(sf_dst),))
    assert all(torch.equal(run.outputs[c], want[c]) for c in want), str(plan)
    assert run.received == [s.bytes_per_rank for s in plan.steps], str(plan)
    assert plan.bytes_per_rank == lower_bound_bytes(a, b), str(plan)


def test_lowering_refuses_an_all_to_all_whose_cuts_do_not_nest():
    """What the planner used to emit for Falcon-7B: lowering says why, instead of a reshape error."""
    from fxshard.lowering.digits import DigitError
    from fxshard.plans import Plan, Step

    a, b = layouts((2,), (10,), (S(0),), (_StridedShard(0, split_factor=5),))
    step = Step("all_to_all", (a.mesh.axis("a"),), a, b, 0, 0, bytes_per_rank=20)
    with pytest.raises(DigitError, match="do not nest"):
        fxshard.simulate_plan(Plan(a, b, (step,), 0.0), torch.randn(10))
