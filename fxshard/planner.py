"""Redistribution plans: a list of one-axis steps from one layout to another, with a cost.

This is the first planner: a fixed order of phases (reduce partials, gather or all-to-all
what the target does not keep, slice what it adds, re-partial). Each step records the
layouts before and after it, so lowering needs nothing else. Byte counts are per rank,
received over the network, for the busiest rank.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import sympy
import torch

from .layout import Layout, LayoutError, Piece
from .mesh import MeshAxis, Size, as_size

STEP_KINDS = ("all_gather", "all_reduce", "reduce_scatter", "all_to_all", "local_shard", "local_partial")


@dataclass(frozen=True)
class CostModel:
    """Alpha-beta cost per collective: ``latency + bytes / bandwidth`` of its mesh axis.

    ``bandwidth`` and ``latency`` map axis names to bytes/s and seconds; other axes use the
    defaults (one node). ``copy_bandwidth`` prices local copies (slicing, permutes).
    """

    default_bandwidth: float = 100e9
    default_latency: float = 10e-6
    copy_bandwidth: float = 1000e9
    bandwidth: tuple[tuple[str, float], ...] = ()
    latency: tuple[tuple[str, float], ...] = ()

    def axis_bandwidth(self, axis: MeshAxis) -> float:
        return dict(self.bandwidth).get(axis.name, self.default_bandwidth)

    def axis_latency(self, axis: MeshAxis) -> float:
        return dict(self.latency).get(axis.name, self.default_latency)


DEFAULT_COST_MODEL = CostModel()


@dataclass(frozen=True)
class Step:
    kind: str
    axis: MeshAxis
    before: Layout
    after: Layout
    dim: int | None = None  # the tensor dim sharded/gathered (all_to_all: the gathered dim)
    to_dim: int | None = None  # all_to_all: the dim that becomes sharded
    reduce_op: str | None = None
    bytes_per_rank: Size = 0

    def __post_init__(self) -> None:
        if self.kind not in STEP_KINDS:
            raise ValueError(f"unknown step kind {self.kind!r}; expected one of {STEP_KINDS}")

    def __str__(self) -> str:
        where = f" dim {self.dim}" if self.dim is not None else ""
        if self.to_dim is not None:
            where = f" dim {self.dim}->{self.to_dim}"
        op = f" {self.reduce_op}" if self.reduce_op else ""
        return f"{self.kind}({self.axis}{where}{op})"


@dataclass(frozen=True)
class Plan:
    src: Layout
    dst: Layout
    steps: tuple[Step, ...]
    cost: float
    dtype: torch.dtype = torch.float32

    @property
    def bytes_per_rank(self) -> Size:
        return as_size(sum((s.bytes_per_rank for s in self.steps), 0))

    @property
    def collectives(self) -> tuple[Step, ...]:
        return tuple(s for s in self.steps if not s.kind.startswith("local"))

    def __str__(self) -> str:
        return f"{self.src} -> {self.dst}: " + (", ".join(str(s) for s in self.steps) or "no-op")


def numel(shape: Sequence[Size]) -> Size:
    n: Size = 1
    for s in shape:
        n = n * s
    return as_size(n)


def _dtype_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _numeric(x: Size) -> float:
    """A float for ranking costs; symbolic sizes are evaluated with every symbol set to 8."""
    if isinstance(x, (int, float)):
        return float(x)
    expr = sympy.sympify(x)
    return float(expr.subs({s: 8 for s in expr.free_symbols}))


def _without_axis(pieces: Sequence[Piece], axis: MeshAxis) -> tuple[Piece, ...]:
    """The pieces with ``axis`` gathered: its piece becomes local (a trailing chunked piece just goes)."""
    return tuple(Piece(p.size) if p.axis == axis else p for p in pieces if not (p.axis == axis and p.chunked))


def _axes_of(pieces: Sequence[Piece]) -> list[MeshAxis]:
    return [p.axis for p in pieces if p.axis is not None]


def _dim_of(layout: Layout, axis: MeshAxis) -> int | None:
    for d, pieces in enumerate(layout.dims):
        if axis in _axes_of(pieces):
            return d
    return None


def _is_chunked(pieces: Sequence[Piece], axis: MeshAxis) -> bool:
    return any(p.axis == axis and p.chunked for p in pieces)


def _step_bytes(kind: str, axis: MeshAxis, before: Layout, dtype: torch.dtype) -> Size:
    n = axis.size
    local = numel(before.max_local_shape()) * _dtype_size(dtype)
    if kind == "all_gather":
        return as_size((n - 1) * local)
    if kind == "all_reduce":
        return as_size(sympy.sympify(2 * (n - 1) * local) / n) if not isinstance(n, int) else 2 * (n - 1) * local // n
    if kind in ("reduce_scatter", "all_to_all"):
        return as_size(sympy.sympify((n - 1) * local) / n) if not isinstance(n, int) else (n - 1) * local // n
    return 0


def _step_cost(step: Step, dtype: torch.dtype, model: CostModel) -> float:
    if step.kind.startswith("local"):
        return _numeric(numel(step.after.max_local_shape())) * _dtype_size(dtype) / model.copy_bandwidth
    return model.axis_latency(step.axis) + _numeric(step.bytes_per_rank) / model.axis_bandwidth(step.axis)


def plan_redistribute(src: Layout, dst: Layout, shape: Sequence[int] | None = None,
                      dtype: torch.dtype = torch.float32, cost_model: CostModel | None = None) -> Plan:
    """The steps that turn a tensor of layout ``src`` into layout ``dst`` on every rank."""
    if shape is not None and tuple(shape) != tuple(src.shape):
        raise ValueError(f"shape {list(shape)} does not match the layouts' shape {list(src.shape)}")
    if src.shape != dst.shape or src.mesh != dst.mesh:
        raise LayoutError(f"cannot redistribute between different shapes or meshes: {src} ({list(src.shape)}, "
                          f"{src.mesh}) -> {dst} ({list(dst.shape)}, {dst.mesh})")
    return _plan_cached(src, dst, dtype, cost_model or DEFAULT_COST_MODEL)


@functools.lru_cache(maxsize=65536)
def _plan_cached(src: Layout, dst: Layout, dtype: torch.dtype, model: CostModel) -> Plan:
    steps: list[Step] = []
    cur = src

    def add(kind: str, axis: MeshAxis, after: Layout, **kw) -> None:
        nonlocal cur
        step = Step(kind, axis, cur, after, bytes_per_rank=_step_bytes(kind, axis, cur, dtype), **kw)
        steps.append(step)
        cur = after

    # 1. partial axes the target does not keep: reduce-scatter into a target shard, else all-reduce
    dst_partial = set(dst.partial)
    for axis, op in cur.partial:
        if (axis, op) in dst_partial:
            continue
        rest = tuple(p for p in cur.partial if p[0] != axis)
        d = _dim_of(dst, axis)
        if d is not None and not _is_chunked(dst.dims[d], axis) and \
                _canon(_without_axis(dst.dims[d], axis)) == _canon(cur.dims[d]):
            after = Layout(cur.mesh, cur.shape, [dst.dims[d] if k == d else cur.dims[k] for k in range(cur.ndim)], rest)
            add("reduce_scatter", axis, after, dim=d, reduce_op=op)
        else:
            add("all_reduce", axis, cur.with_partial(rest), reduce_op=op)

    # 2. per dim: keep it, or remove the shards the target does not have (all-to-all when the
    #    target wants the same axis on another dim whose other pieces already match)
    for d in range(cur.ndim):
        for axis in reversed(_axes_of(cur.dims[d])):
            if _keeps(cur.dims[d], dst.dims[d]):
                break
            gathered = cur.with_dim(d, _without_axis(cur.dims[d], axis))
            e = _dim_of(dst, axis)
            if e is not None and e != d and not _is_chunked(cur.dims[d], axis) and \
                    not _is_chunked(dst.dims[e], axis) and _canon(_without_axis(dst.dims[e], axis)) == _canon(cur.dims[e]):
                add("all_to_all", axis, gathered.with_dim(e, dst.dims[e]), dim=d, to_dim=e)
            else:
                add("all_gather", axis, gathered, dim=d)

    # 3. shards the target adds: slice locally, outermost first
    for d in range(cur.ndim):
        todo = [a for a in _axes_of(dst.dims[d]) if a not in _axes_of(cur.dims[d])]
        for i, axis in enumerate(todo):
            later = todo[i + 1:]
            pieces = dst.dims[d]
            for a in later:
                pieces = _without_axis(pieces, a)
            add("local_shard", axis, cur.with_dim(d, pieces), dim=d)

    # 4. partial axes the target adds: R -> P, a local step
    for axis, op in dst.partial:
        if (axis, op) not in set(cur.partial):
            add("local_partial", axis, cur.with_partial(cur.partial + ((axis, op),)), reduce_op=op)

    if cur != dst:
        raise AssertionError(f"planner ended at {cur}, not at {dst} (from {src})")
    cost = sum(_step_cost(s, dtype, model) for s in steps)
    return Plan(src, dst, tuple(steps), cost, dtype)


def _keeps(cur: Sequence[Piece], dst: Sequence[Piece]) -> bool:
    """Whether ``dst`` is ``cur`` plus extra shards (reached by local slicing alone)."""
    extra = [a for a in _axes_of(dst) if a not in _axes_of(cur)]
    pieces = tuple(dst)
    for a in extra:
        pieces = _without_axis(pieces, a)
    return _canon(pieces) == _canon(cur)


def _canon(pieces: Sequence[Piece]) -> tuple[Piece, ...]:
    from .layout import _merge_adjacent

    # a chunked piece of size 1 (a size-1 dim sharded: one rank holds it) is still a shard
    return tuple(_merge_adjacent([p for p in pieces if p.size != 1 or p.axis is not None]))


def redistribute_cost(src: Layout, dst: Layout, dtype: torch.dtype = torch.float32,
                      cost_model: CostModel | None = None) -> float:
    if src == dst:
        return 0.0
    return plan_redistribute(src, dst, dtype=dtype, cost_model=cost_model).cost
