"""Planner states: layouts written over the finest mesh sub-axes ("atoms") two layouts share.

The planner visits many layouts; ``Layout`` validates and canonicalizes on creation (~20 us),
so the search works on plain tuples and converts only the chosen path back. Every mesh axis
that either layout uses is cut at each sub-axis boundary either one uses; an atom is one cut
(a whole axis when nothing cuts it). A sharded even piece holds exactly one atom, so moving
"tp/2" alone and moving "tp" as two atoms are the same kind of step. A chunked (uneven) piece
holds the whole axis it was made with, which must then be one atom.

A state is ``(dims, partial)``: ``dims[d]`` a tuple of ``(size, atom, chunked)`` pieces major
to minor (``atom == -1`` for a local piece), ``partial`` a sorted tuple of ``(atom, op)``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from .layout import Layout, LayoutError, Piece
from .mesh import MeshAxis, MeshSpec, Size, as_size, is_static

PieceT = tuple  # (size, atom, chunked)
Dim = tuple  # tuple[PieceT, ...]
State = tuple  # (dims, partial)
LOCAL = -1


def _order_key(mesh: MeshSpec, axis: MeshAxis) -> tuple:
    """Mesh order, major first: the rank order of a flattened group of these axes."""
    inner = axis.inner if is_static(axis.inner) else 0
    return (mesh.index(axis.name), -int(inner) if is_static(inner) else 0)


class AtomError(LayoutError):
    """Two layouts cut one mesh axis in ways the planner's states cannot hold together."""


@dataclass(frozen=True)
class Atoms:
    """The atoms of a set of layouts, in mesh order (so a sorted tuple of ids is a group's rank order)."""

    mesh: MeshSpec
    axes: tuple[MeshAxis, ...]

    @classmethod
    def of(cls, layouts: Sequence[Layout]) -> "Atoms":
        mesh = layouts[0].mesh
        cuts: dict[str, set] = {}
        for layout in layouts:
            for a in layout.used_axes():
                cuts.setdefault(a.name, {1, a.axis_size}).update({a.inner, a.inner * a.size})
        atoms: list[MeshAxis] = []
        for name, bounds in cuts.items():
            if not all(is_static(b) for b in bounds):
                if len(bounds) > 2:
                    raise AtomError(f"mesh axis {name} of symbolic size is cut into sub-axes; plan it with static sizes")
                atoms.append(mesh.axis(name))
                continue
            edges = sorted(int(b) for b in bounds)
            for lo, hi in zip(edges, edges[1:]):
                if hi % lo:
                    raise AtomError(f"sub-axes of mesh axis {name} do not nest (boundaries {edges})")
                atoms.append(mesh.sub_axis(name, hi // lo, lo))
        atoms.sort(key=lambda a: _order_key(mesh, a))
        return cls(mesh, tuple(atoms))

    def split(self, axis: MeshAxis) -> list[int]:
        """Atom ids that make up ``axis``, major first."""
        out = []
        for i, a in enumerate(self.axes):
            if a.name != axis.name:
                continue
            if not all(is_static(v) for v in (a.inner, a.size, axis.inner, axis.size)):
                out.append(i)  # a symbolic axis is never cut: its one atom
            elif int(axis.inner) <= int(a.inner) and int(a.inner) * int(a.size) <= int(axis.inner) * int(axis.size):
                out.append(i)
        return out

    def state(self, layout: Layout) -> State:
        dims = []
        for pieces in layout.dims:
            out: list[PieceT] = []
            for p in pieces:
                if p.axis is None:
                    out.append((p.size, LOCAL, False))
                    continue
                ids = self.split(p.axis)
                if p.chunked:
                    if len(ids) != 1:
                        raise AtomError(f"uneven shard on {p.axis} while the other layout cuts that axis into sub-axes")
                    out.append((p.size, ids[0], True))
                else:
                    out.extend((self.axes[i].size, i, False) for i in ids)
            dims.append(canonical_dim(out))
        partial = []
        for axis, op in layout.partial:
            partial.extend((i, op) for i in self.split(axis))
        return tuple(dims), tuple(sorted(partial))

    def layout(self, state: State, shape: Sequence[Size]) -> Layout:
        dims, partial = state
        return Layout(self.mesh, shape,
                      [[Piece(s, None if a == LOCAL else self.axes[a], c) for s, a, c in pieces] for pieces in dims],
                      [(self.axes[a], op) for a, op in partial])

    def group(self, ids: Iterable[int]) -> tuple[MeshAxis, ...]:
        """A flattened group as mesh axes, adjacent atoms of one axis merged (fewest process groups)."""
        out: list[MeshAxis] = []
        for i in sorted(ids):
            a = self.axes[i]
            merged = out[-1].merge(a) if out else None
            if merged is not None:
                out[-1] = merged
            else:
                out.append(a)
        return tuple(out)

    def group_size(self, ids: Iterable[int]) -> Size:
        n: Size = 1
        for i in ids:
            n = n * self.axes[i].size
        return as_size(n)


def canonical_dim(pieces: Iterable[PieceT]) -> Dim:
    """Adjacent local pieces merged, local size-1 pieces dropped: one spelling per dim."""
    out: list[PieceT] = []
    for p in pieces:
        if p[1] == LOCAL:
            if p[0] == 1:
                continue
            if out and out[-1][1] == LOCAL:
                size = out[-1][0] * p[0]
                out[-1] = (size if type(size) is int else as_size(size), LOCAL, False)
                continue
        out.append(p)
    return tuple(out)


def localized(pieces: Dim, ids: frozenset) -> Dim:
    """``pieces`` with the atoms ``ids`` gathered: their pieces become local."""
    return canonical_dim((s, LOCAL, False) if a in ids else (s, a, c) for s, a, c in pieces)


def atoms_in(pieces: Dim) -> frozenset:
    return frozenset(a for _, a, _ in pieces if a != LOCAL)


def local_numel(state: State, shape: Sequence[Size], sizes: Sequence[Size]) -> Size:
    """Elements on the rank holding the most (coordinate 0 of every chunked piece)."""
    n: Size = 1
    for pieces in state[0]:
        for s, a, chunked in pieces:
            if a == LOCAL:
                n = n * s
            elif chunked:
                n = n * (-(-int(s) // int(sizes[a])))
    return n if type(n) is int else as_size(n)


def stride_of(pieces: Dim) -> dict[int, Size]:
    """Atom -> product of the sizes of the pieces after it (where it sits in the dim)."""
    out: dict[int, Size] = {}
    inner: Size = 1
    for s, a, chunked in reversed(pieces):
        if a != LOCAL:
            out[a] = -1 if chunked else inner
        inner = as_size(inner * s)
    return out


def moving_atoms(state: State, target: State) -> list[int]:
    """Atoms whose place (dim and stride, uneven dim, or partial op) differs between two states."""
    def places(st: State) -> dict:
        out: dict = {a: ("p", op) for a, op in st[1]}
        for d, pieces in enumerate(st[0]):
            for a, stride in stride_of(pieces).items():
                out[a] = ("d", d, stride if stride != -1 else pieces)
        return out

    here, there = places(state), places(target)
    return sorted(a for a in set(here) | set(there) if here.get(a) != there.get(a))
