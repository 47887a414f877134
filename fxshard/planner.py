"""Redistribution plans: the cheapest sequence of steps from one layout to another.

The entry points: ``plan_redistribute`` (cached; the search is fxshard/search.py) and
``redistribute_cost``. A dim of unequal blocks (an uneven _StridedShard) that differs between the
layouts is planned through waypoints: an exchange into a first waypoint, the search from it to a
second (dims of unequal blocks held still), an exchange out, the cheapest of all (`_via_waypoints`).
Layouts whose sub-axes do not nest are planned as partial reductions, one exchange, then local
partials. A plan made under other size hints (symbolic meshes) is another plan: the cache is
keyed by them.
"""
from __future__ import annotations

import functools
import itertools
from typing import Iterator, Sequence

import torch

from .atoms import AtomError
from .costs import DEFAULT_COST_MODEL, CostModel, collective_bytes, dtype_size, numel
from .exchange import received_elements
from .hints import current as current_hints
from .layout import Layout, LayoutError, Piece
from .plans import MIXED_SUM_AVG, Plan, Step
from .search import Search, shortest_path, to_plan


def plan_redistribute(src: Layout, dst: Layout, shape: Sequence[int] | None = None,
                      dtype: torch.dtype = torch.float32, cost_model: CostModel | None = None,
                      fill_shards: bool = True) -> Plan:
    """The cheapest steps that turn a tensor of layout ``src`` into layout ``dst`` on every rank.

    ``fill_shards``: a shard may become its Partial term locally (S -> P(sum): its block, zeros
    elsewhere), as in a move asked for; not in a price strategies are compared by (``redistribute_cost``).
    """
    if shape is not None and tuple(shape) != tuple(src.shape):
        raise ValueError(f"shape {list(shape)} does not match the layouts' shape {list(src.shape)}")
    if src.shape != dst.shape or src.mesh != dst.mesh:
        raise LayoutError(f"cannot redistribute between different shapes or meshes: {src} ({list(src.shape)}, "
                          f"{src.mesh}) -> {dst} ({list(dst.shape)}, {dst.mesh})")
    hints = () if src.mesh.is_static else current_hints()  # dst has the same mesh
    return _plan_cached(src, dst, dtype, cost_model or DEFAULT_COST_MODEL, hints, fill_shards)


def redistribute_cost(src: Layout, dst: Layout, dtype: torch.dtype = torch.float32,
                      cost_model: CostModel | None = None) -> float:
    """What propagation prices a strategy's move at: planned without filling shards into Partial terms.
    A filled tensor is n times the data every later op computes on, which no step cost sees; DTensor
    2.15 likewise makes S -> P(sum) only in a redistribution asked for (its strategy costs price it inf)."""
    if src == dst:
        return 0.0
    return plan_redistribute(src, dst, dtype=dtype, cost_model=cost_model, fill_shards=False).cost


def clear_plan_cache() -> None:
    _plan_cached.cache_clear()


@functools.lru_cache(maxsize=65536)
def _plan_cached(src: Layout, dst: Layout, dtype: torch.dtype, model: CostModel, hints: tuple,
                 fill_shards: bool) -> Plan:
    if src == dst:
        return Plan(src, dst, (), 0.0, dtype)
    try:
        search = Search(src, dst, dtype, model, fill_shards)
    except AtomError:
        if _has_unequal_blocks(src) or _has_unequal_blocks(dst):
            return _via_waypoints(src, dst, dtype, model, fill_shards)
        return _exchange_only(src, dst, dtype, model)
    found = shortest_path(search)
    if found is None:
        raise LayoutError(f"no redistribution plan from {src} to {dst} on {src.mesh} (shape {list(src.shape)})")
    return to_plan(search, *found, dtype)


def _has_unequal_blocks(layout: Layout) -> bool:
    return any(p.uneven_blocks for pieces in layout.dims for p in pieces)


def _via_waypoints(src: Layout, dst: Layout, dtype: torch.dtype, model: CostModel, fill_shards: bool) -> Plan:
    """The cheapest of ``src`` -exchange-> ``m1`` -search-> ``m2`` -exchange-> ``dst`` over the waypoints
    ``_waypoints`` proposes, and of the exchange-only plan: a partial source reduce-scatters or
    all-reduces only the blocks that are needed (DTensor's way), instead of reducing everything first."""
    try:
        best: Plan | None = _exchange_only(src, dst, dtype, model)
    except LayoutError:
        best = None
    for m1, m2 in _waypoints(src, dst):
        plan = _through(src, m1, m2, dst, dtype, model, fill_shards)
        if plan is not None and (best is None or plan.cost < best.cost):
            best = plan
    if best is None:
        raise LayoutError(f"no redistribution plan from {src} to {dst} on {src.mesh} (shape {list(src.shape)}): "
                          "no waypoint of unequal blocks the search can move between")
    return best


def _waypoints(src: Layout, dst: Layout) -> Iterator[tuple[Layout, Layout]]:
    """Pairs of layouts (m1 with ``src``'s partials, m2 with ``dst``'s) that agree on every dim of
    unequal blocks, so the search moves between them; each dim picked from ``_dim_waypoints``."""
    options = [_dim_waypoints(s, t) for s, t in zip(src.dims, dst.dims)]
    for choice in itertools.product(*options):
        try:
            yield (Layout(src.mesh, src.shape, [c[0] for c in choice], src.partial),
                   Layout(src.mesh, src.shape, [c[1] for c in choice], dst.partial))
        except LayoutError:  # an axis used twice (a waypoint sharding a dim on a partial axis)
            continue


def _dim_waypoints(s: tuple[Piece, ...], t: tuple[Piece, ...]) -> list[tuple[tuple, tuple]]:
    """(m1's pieces, m2's pieces) for one dim going from ``s`` to ``t``: held still at ``s``, ``t`` or a
    coarser cut of either (the pieces before one of unequal blocks: every rank's block contains its
    block of the whole dim), or moved by the search from ``s`` or to ``t`` where neither is unequal."""
    if s == t:
        return [(s, t)]
    stops = list(dict.fromkeys([s, t] + _cuts(s) + _cuts(t)))
    movable = [x for x in stops if not any(p.uneven_blocks for p in x)]
    out = [(x, x) for x in stops]
    out += [(s, x) for x in movable if s in movable and x != s]
    out += [(x, t) for x in movable if t in movable and x != t]
    return list(dict.fromkeys(out))


def _cuts(pieces: tuple[Piece, ...]) -> list[tuple[Piece, ...]]:
    return [pieces[:k] for k, p in enumerate(pieces) if p.uneven_blocks]


def _through(src: Layout, m1: Layout, m2: Layout, dst: Layout, dtype: torch.dtype, model: CostModel,
             fill_shards: bool) -> Plan | None:
    """The plan exchange(src -> m1), search(m1 -> m2), exchange(m2 -> dst); None where a part has none."""
    first, last = _exchange_step(src, m1, dtype, model), _exchange_step(m2, dst, dtype, model)
    if first is None or last is None:
        return None
    middle = Plan(m1, m2, (), 0.0, dtype)
    if m1 != m2:
        try:
            search = Search(m1, m2, dtype, model, fill_shards)
        except AtomError:
            return None
        found = shortest_path(search)
        if found is None:
            return None
        middle = to_plan(search, *found, dtype)
    steps = first[0] + middle.steps + last[0]
    return Plan(src, dst, steps, first[1] + middle.cost + last[1], dtype)


def _exchange_step(a: Layout, b: Layout, dtype: torch.dtype, model: CostModel) -> tuple[tuple[Step, ...], float] | None:
    """(the steps, their cost) of one exchange from ``a`` to ``b``, which moves partial values as any
    other: a local_shard where no rank lacks an element, nothing where ``a == b``; None where no
    exchange can (the partials differ, or a partial axis's name also shards a dim) or need (no dim of
    unequal blocks changes: the search moves such dims, from another waypoint)."""
    if a == b:
        return (), 0.0
    if not any(x != y and any(p.uneven_blocks for p in x + y) for x, y in zip(a.dims, b.dims)):
        return None
    partial_names = {x.name for x, _ in a.partial}
    if a.partial != b.partial or any(x.name in partial_names for x in a.sharded_axes() + b.sharded_axes()):
        return None
    names = {x.name for x in a.sharded_axes() + b.sharded_axes()}
    group = tuple(a.mesh.axis(n) for n in a.mesh.names if n in names)
    if not group or not a.mesh.is_static:
        return None
    itemsize = dtype_size(dtype)
    held, wanted = (numel(x.max_local_shape()) * itemsize for x in (a, b))
    nbytes = received_elements(a, b) * itemsize
    if not nbytes:
        return (Step("local_shard", group, a, b),), model.copy_cost(wanted)
    cost = model.collective_cost(group, nbytes) + model.copy_cost(2 * (held + wanted))  # index gathers on both ends
    return (Step("exchange", group, a, b, bytes_per_rank=nbytes),), cost


def _exchange_only(src: Layout, dst: Layout, dtype: torch.dtype, model: CostModel) -> Plan:
    """Layouts the atom states cannot hold together (sub-axes that do not nest, unequal blocks): reduce
    partials, one exchange, then make the target's other partials locally."""
    steps: list[Step] = []
    cur = src
    removed = [(a, op) for a, op in src.partial if (a, op) not in dst.partial]
    if removed:  # one all_reduce (sum and avg mixed: one sum, divided by the avg axes' size)
        ops = {op for _, op in removed}
        axes = tuple(a for a, _ in removed)
        after = cur.with_partial(tuple(p for p in cur.partial if p[0] not in axes))
        n = numel([a.size for a in axes])
        nbytes = collective_bytes("all_reduce", n, numel(cur.max_local_shape()) * dtype_size(dtype))
        op = ops.pop() if len(ops) == 1 else MIXED_SUM_AVG
        steps.append(Step("all_reduce", axes, cur, after, reduce_op=op, bytes_per_rank=nbytes))
        cur = after
    added = [(a, op) for a, op in dst.partial if (a, op) not in cur.partial]
    mid = dst.with_partial(tuple(p for p in dst.partial if p not in added))
    if cur.partial != mid.partial or not src.mesh.is_static:
        raise LayoutError(f"no redistribution plan from {src} to {dst}: their sub-axes do not nest")
    kept = {a.name for a, _ in mid.partial}
    names = {a.name for a in cur.sharded_axes() + mid.sharded_axes()} - kept
    group = tuple(src.mesh.axis(n) for n in src.mesh.names if n in names)
    if group and cur != mid:
        nbytes = received_elements(cur, mid) * dtype_size(dtype)
        steps.append(Step("exchange", tuple(group), cur, mid, bytes_per_rank=nbytes))
    cur = mid
    for op in sorted({op for _, op in added}):  # then the partials the target has: local, one step per op
        after = cur.with_partial(cur.partial + tuple(p for p in added if p[1] == op))
        steps.append(Step("local_partial", tuple(a for a, o in added if o == op), cur, after, reduce_op=op))
        cur = after
    cost = sum(model.collective_cost(s.axes, s.bytes_per_rank) for s in steps if not s.is_local)
    return Plan(src, dst, tuple(steps), cost, dtype)
