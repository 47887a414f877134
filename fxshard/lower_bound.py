"""The fewest bytes any plan can make the busiest rank receive, from index sets alone.

Independent of the planner: each rank's blocks are enumerated as index sets (per dim, or
as global flat indices where blocks of several ranks must be united).

* Without a partial reduction, rank r must receive every element of its target block it
  does not already hold: ``|need(r) - held(r)|``.
* Where ``src`` is partial over axes A that ``dst`` is not (p contributions per element),
  each needed element takes at least p - 1 transfers to reduce once, plus one more for every
  other rank that needs it: all ranks together receive at least
  ``(p - 2) * U + sum |need(r)|`` (U the distinct needed elements), so the busiest rank at
  least a W-th of that (W ranks; on a 1-D mesh this is the reduce-scatter bound (p-1)/p * U
  and the all-reduce bound 2(p-1)/p * U). Every rank also receives at least one value per
  needed element. The bound is the larger of the two.

A rank that ends as a zero of ``Partial(sum)`` (R -> P) needs nothing.
"""
from __future__ import annotations

from fractions import Fraction
from typing import Sequence

import torch

from .layout import IDENTITY, Layout, LayoutError


def _flat(layout: Layout, coord: dict[str, int]) -> torch.Tensor:
    """Global flat indices of the rank's block."""
    flat = torch.zeros((), dtype=torch.long)
    for d in range(layout.ndim):
        stride = 1
        for s in layout.shape[d + 1:]:
            stride *= int(s)
        flat = flat.unsqueeze(-1) + layout.local_indices(d, coord) * stride
    return flat.reshape(-1)


def _missing(src: Layout, dst: Layout, coord: dict[str, int]) -> int:
    """|need - held|: blocks are products of per-dim index sets, so the overlap is a product too."""
    need, common = 1, 1
    for d in range(src.ndim):
        wanted, mine = dst.local_indices(d, coord), src.local_indices(d, coord)
        need *= len(wanted)
        common *= int(torch.isin(wanted, mine).sum())
    return need - common


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
    zeroed = [a for a, op in dst.partial if (a, op) not in src.partial and op in IDENTITY]
    coords = [mesh.coordinate_dict(c) for c in mesh.coordinates()]
    zero = [any(a.coordinate(cd[a.name]) != 0 for a in zeroed) for cd in coords]
    if not reduced:
        return float(max(0 if z else _missing(src, dst, cd) for cd, z in zip(coords, zero)) * itemsize)
    total_numel = 1
    for s in src.shape:
        total_numel *= int(s)
    need = {}
    for cd, z in zip(coords, zero):
        key = tuple(cd.values())
        need[key] = torch.zeros(0, dtype=torch.long) if z else _flat(dst, cd)
    p = 1
    for a in reduced:
        p *= int(a.size)
    mask = torch.zeros(total_numel, dtype=torch.bool)
    for n in need.values():
        mask[n] = True
    total = (p - 2) * int(mask.sum()) + sum(len(n) for n in need.values())
    worst = max(Fraction(max(len(n) for n in need.values())), Fraction(total, len(need)))
    return float(worst * itemsize)
