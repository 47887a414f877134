"""The fewest bytes any plan can make the busiest rank receive, from index sets alone.

Independent of the planner: each rank's blocks are enumerated as sets of global elements.

* Without a partial reduction, rank r must receive every element of its target block it
  does not already hold: ``|need(r) - held(r)|``.
* Where ``src`` is partial over axes A that ``dst`` is not (group size p), each element one
  A-group needs takes p - 1 transfers to reduce, plus one more for every other rank of the
  group that needs it: the group receives at least ``(p - 2) * U + sum |need(r)|`` (U its
  distinct needed elements), so its busiest rank at least a p-th of that (the reduce-scatter
  bound (p-1)/p * U and the all-reduce bound 2(p-1)/p * U are the two ends). Every rank also
  receives at least one value per needed element. The bound is the larger of the two.

A rank that ends as a zero of ``Partial(sum)`` (R -> P) needs nothing.
"""
from __future__ import annotations

from fractions import Fraction
from typing import Sequence

import torch

from .layout import Layout, LayoutError


def _elements(layout: Layout, coord: dict[str, int]) -> frozenset[int]:
    strides = [1] * layout.ndim
    for d in range(layout.ndim - 2, -1, -1):
        strides[d] = strides[d + 1] * int(layout.shape[d + 1])
    flat = torch.zeros((), dtype=torch.long)
    for d in range(layout.ndim):
        flat = flat.unsqueeze(-1) + layout.local_indices(d, coord) * strides[d]
    return frozenset(flat.reshape(-1).tolist())


def lower_bound_bytes(src: Layout, dst: Layout, shape: Sequence[int] | None = None,
                      dtype: torch.dtype = torch.float32) -> float:
    """Bytes the busiest rank must receive to turn ``src`` into ``dst`` (static meshes and shapes)."""
    if shape is not None and tuple(shape) != tuple(src.shape):
        raise ValueError(f"shape {list(shape)} does not match the layouts' shape {list(src.shape)}")
    if src.shape != dst.shape or src.mesh != dst.mesh:
        raise LayoutError(f"lower_bound_bytes needs one shape and mesh, got {src} and {dst}")
    mesh = src.mesh
    if not mesh.is_static or not all(isinstance(s, int) for s in src.shape):
        raise LayoutError("lower_bound_bytes enumerates elements: it needs a static mesh and shape")
    itemsize = torch.empty((), dtype=dtype).element_size()
    reduced = [a for a, op in src.partial if (a, op) not in dst.partial]
    zeroed = [a for a, op in dst.partial if (a, op) not in src.partial and op == "sum"]
    need, held = {}, {}
    for coord in mesh.coordinates():
        cd = mesh.coordinate_dict(coord)
        zero = any(a.coordinate(cd[a.name]) != 0 for a in zeroed)
        need[coord] = frozenset() if zero else _elements(dst, cd)
        held[coord] = _elements(src, cd)
    if not reduced:
        return float(max(len(need[c] - held[c]) for c in need) * itemsize)
    groups: dict[tuple, list] = {}
    for coord in need:
        cd = mesh.coordinate_dict(coord)
        key = tuple(sorted((n, v - sum(a.coordinate(v) * int(a.inner) for a in reduced if a.name == n))
                           for n, v in cd.items()))
        groups.setdefault(key, []).append(coord)
    p = 1
    for a in reduced:
        p *= int(a.size)
    worst = Fraction(max(len(n) for n in need.values()))
    for members in groups.values():
        union = frozenset().union(*(need[c] for c in members))
        total = (p - 2) * len(union) + sum(len(need[c]) for c in members)
        worst = max(worst, Fraction(total, p))
    return float(worst * itemsize)
