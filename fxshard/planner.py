"""Redistribution plans: the cheapest sequence of steps from one layout to another.

The entry points: ``plan_redistribute`` (cached; the search is fxshard/search.py) and
``redistribute_cost``. Layouts the search's atom states cannot hold together (sub-axes that do not
nest, unequal blocks of an uneven _StridedShard) are planned as partial reductions, one exchange,
then local partials. A plan made under other size hints (symbolic
meshes) is another plan: the cache is keyed by them.
"""
from __future__ import annotations

import functools
from typing import Sequence

import torch

from .atoms import AtomError
from .costs import DEFAULT_COST_MODEL, CostModel, collective_bytes, dtype_size, numel
from .exchange import received_elements
from .hints import current as current_hints
from .layout import Layout, LayoutError
from .plans import Plan, Step
from .search import Search, shortest_path, to_plan


def plan_redistribute(src: Layout, dst: Layout, shape: Sequence[int] | None = None,
                      dtype: torch.dtype = torch.float32, cost_model: CostModel | None = None) -> Plan:
    """The cheapest steps that turn a tensor of layout ``src`` into layout ``dst`` on every rank."""
    if shape is not None and tuple(shape) != tuple(src.shape):
        raise ValueError(f"shape {list(shape)} does not match the layouts' shape {list(src.shape)}")
    if src.shape != dst.shape or src.mesh != dst.mesh:
        raise LayoutError(f"cannot redistribute between different shapes or meshes: {src} ({list(src.shape)}, "
                          f"{src.mesh}) -> {dst} ({list(dst.shape)}, {dst.mesh})")
    hints = () if src.mesh.is_static else current_hints()  # dst has the same mesh
    return _plan_cached(src, dst, dtype, cost_model or DEFAULT_COST_MODEL, hints)


def redistribute_cost(src: Layout, dst: Layout, dtype: torch.dtype = torch.float32,
                      cost_model: CostModel | None = None) -> float:
    if src == dst:
        return 0.0
    return plan_redistribute(src, dst, dtype=dtype, cost_model=cost_model).cost


def clear_plan_cache() -> None:
    _plan_cached.cache_clear()


@functools.lru_cache(maxsize=65536)
def _plan_cached(src: Layout, dst: Layout, dtype: torch.dtype, model: CostModel, hints: tuple) -> Plan:
    if src == dst:
        return Plan(src, dst, (), 0.0, dtype)
    try:
        search = Search(src, dst, dtype, model)
    except AtomError:
        return _exchange_only(src, dst, dtype, model)
    found = shortest_path(search)
    if found is None:
        raise LayoutError(f"no redistribution plan from {src} to {dst} on {src.mesh} (shape {list(src.shape)})")
    return to_plan(search, *found, dtype)


def _exchange_only(src: Layout, dst: Layout, dtype: torch.dtype, model: CostModel) -> Plan:
    """Layouts the atom states cannot hold together (sub-axes that do not nest, unequal blocks): reduce
    partials, one exchange, then make the target's other partials locally."""
    steps: list[Step] = []
    cur = src
    removed = [(a, op) for a, op in src.partial if (a, op) not in dst.partial]
    for op in sorted({op for _, op in removed}):  # one all_reduce per op (sum and avg may be mixed)
        axes = tuple(a for a, o in removed if o == op)
        after = cur.with_partial(tuple(p for p in cur.partial if p[0] not in axes))
        n = numel([a.size for a in axes])
        nbytes = collective_bytes("all_reduce", n, numel(cur.max_local_shape()) * dtype_size(dtype))
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
