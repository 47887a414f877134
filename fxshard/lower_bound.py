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

Where ``dst`` is partial over axes Z with an identity (sum, product) that ``src`` is not, the ranks
that differ only on Z ("a term group") share one block whose terms any of them may hold: one
holding an element (R -> P) or its shard (S -> P, the rest the identity) is enough. Above, a rank's
``need`` becomes its group's, split over the group's ranks at best.
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


def _key(coord: dict[str, int], zeroed: Sequence) -> tuple:
    """The rank's term group: its coordinate with the sub-axes ``zeroed`` (partial in dst) left out."""
    out = dict(coord)
    for a in zeroed:
        out[a.name] -= a.coordinate(coord[a.name]) * int(a.inner)
    return tuple(out.values())


def _missing(src: Layout, dst: Layout, coords: list[dict[str, int]]) -> int:
    """|need - held by any of ``coords``|: the elements of their (one) target block none of them holds
    (one rank's blocks are products of per-dim index sets, so its overlap is a product too)."""
    if len(coords) == 1:
        need, common = 1, 1
        for d in range(src.ndim):
            wanted, mine = dst.local_indices(d, coords[0]), src.local_indices(d, coords[0])
            need *= len(wanted)
            common *= int(torch.isin(wanted, mine).sum())
        return need - common
    need = _flat(dst, coords[0])
    held = torch.cat([_flat(src, cd) for cd in coords])
    return int((~torch.isin(need, held)).sum())


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
    groups: dict[tuple, list[dict[str, int]]] = {}
    for c in mesh.coordinates():
        cd = mesh.coordinate_dict(c)
        groups.setdefault(_key(cd, zeroed), []).append(cd)
    if not reduced:
        return float(max(Fraction(_missing(src, dst, g), len(g)) for g in groups.values()) * itemsize)
    total_numel = 1
    for s in src.shape:
        total_numel *= int(s)
    need = {key: _flat(dst, g[0]) for key, g in groups.items()}
    p = 1
    for a in reduced:
        p *= int(a.size)
    mask = torch.zeros(total_numel, dtype=torch.bool)
    for n in need.values():
        mask[n] = True
    total = (p - 2) * int(mask.sum()) + sum(len(n) for n in need.values())
    ranks = sum(len(g) for g in groups.values())
    worst = max(max(Fraction(len(need[k]), len(g)) for k, g in groups.items()), Fraction(total, ranks))
    return float(worst * itemsize)
