"""Index digits of a redistribution step: what each part of every dim is before and after.

Cut every dim at the edges of each sharded piece of the layouts before and after a step,
and cut every mesh axis of the step's group where any piece cuts it: each part ("digit")
of an index is then local, or fixed by one sub-axis coordinate, on each side. A structured
collective is then one rule: digits the group fixes before and frees after are gathered
(they come from the peers, in group order), digits it frees before and fixes after are
scattered (each peer gets its slice), and every other digit stays where it is.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from fxshard.layout import Layout
from fxshard.mesh import MeshAxis, MeshSpec

Label = tuple  # (axis name, inner, size): one sub-axis


class DigitError(ValueError):
    """A step whose layouts cut a dim where no structured collective can see digits."""


@dataclass(frozen=True)
class Digit:
    size: int
    before: Label | None
    after: Label | None


def axis_spans(pieces) -> list[tuple[int, int, MeshAxis]]:
    """(lo, hi, axis) per sharded piece of an even dim: the index digits [lo, hi) it fixes."""
    out, inner = [], 1
    for p in reversed(pieces):
        if p.axis is not None:
            out.append((inner, inner * int(p.size), p.axis))
        inner *= int(p.size)
    return out


def digit_label(spans, lo: int, hi: int) -> Label | None:
    """The sub-axis (name, inner, size) fixing digit [lo, hi), or None where the digit is free."""
    for s_lo, s_hi, axis in spans:
        if s_lo <= lo and hi <= s_hi:
            return (axis.name, int(axis.inner) * (lo // s_lo), hi // lo)
    return None


def step_digits(before: Layout, after: Layout, group: Sequence[MeshAxis],
                local_shape: Sequence[int]) -> list[list[Digit]]:
    """Per dim, its digits major to minor; a dim the step leaves alone is one local digit.

    (Such a dim may be uneven: its local size, from ``local_shape``, is this rank's.)
    """
    names = {a.name for a in group}
    cuts: dict[str, set[int]] = {n: set() for n in names}
    while True:
        dims = []
        for d in range(before.ndim):
            if before.dims[d] == after.dims[d] and not any(p.axis is not None and p.axis.name in names
                                                             for p in before.dims[d]):
                dims.append([Digit(int(local_shape[d]), None, None)])
                continue
            sb, sa = axis_spans(before.dims[d]), axis_spans(after.dims[d])
            bounds = {1, int(before.shape[d])} | {b for lo, hi, _ in sb + sa for b in (lo, hi)}
            for lo, hi, axis in sb + sa:  # where a group axis is cut elsewhere, cut it here too
                for c in cuts.get(axis.name, ()):
                    if int(axis.inner) < c < int(axis.inner) * int(axis.size):
                        bounds.add(lo * c // int(axis.inner))
            edges = sorted(bounds, reverse=True)
            if any(hi % lo for hi, lo in zip(edges, edges[1:])):
                raise DigitError(f"{before} -> {after}: dim {d} is cut at {sorted(bounds)}, which do not nest: "
                                 "no digit is whole on both sides, so no structured collective moves it")
            dims.append([Digit(hi // lo, digit_label(sb, lo, hi), digit_label(sa, lo, hi)) for hi, lo in zip(edges, edges[1:])])
        new = {n: set(c) for n, c in cuts.items()}
        for digits in dims:
            for dg in digits:
                for lab in (dg.before, dg.after):
                    if lab is not None and lab[0] in new:
                        new[lab[0]].update({lab[1], lab[1] * lab[2]})
        if new == cuts:
            return dims
        cuts = new


def in_group(label: Label | None, group: Sequence[MeshAxis]) -> bool:
    if label is None:
        return False
    name, inner, size = label
    return any(a.name == name and int(a.inner) <= inner and inner * size <= int(a.inner) * int(a.size) for a in group)


def lead_labels(dims: list[list[Digit]], group: Sequence[MeshAxis], mesh: MeshSpec) -> list[Label]:
    """The group's sub-axes as the digits of a flattened group rank, major first."""
    labels = {lab for digits in dims for dg in digits for lab in (dg.before, dg.after) if in_group(lab, group)}
    return sorted(labels, key=lambda lab: (mesh.index(lab[0]), -lab[1]))


def coordinate_of(label: Label, coord: dict[str, int]) -> int:
    name, inner, size = label
    return (coord[name] // inner) % size
