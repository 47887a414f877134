"""Planner states: layouts written over the finest mesh sub-axes ("atoms") two layouts share.

The planner visits many layouts; ``Layout`` validates and canonicalizes on creation (~20 us),
so the search works on plain tuples and converts only the chosen path back. Every mesh axis
that either layout uses is cut at each sub-axis boundary either one uses; an atom is one cut
(a whole axis when nothing cuts it). A sharded even piece holds exactly one atom, so moving
"tp/2" alone and moving "tp" as two atoms are the same kind of step. A chunked (uneven) piece
holds the whole axis it was made with, which must then be one atom.

A ``State`` is ``(dims, partial)``: ``dims[d]`` a tuple of ``AtomPiece(size, atom, chunked)``
major to minor (``atom is LOCAL`` for a local piece), ``partial`` a sorted tuple of
``PartialAtom(atom, op)``. They are named tuples: as cheap to hash and compare as tuples.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Iterable, NamedTuple, Sequence

from .layout import Layout, LayoutError, Piece
from .mesh import MeshAxis, MeshSpec, Size, as_size, is_static

LOCAL = None  # the atom of a local piece


class AtomPiece(NamedTuple):
    size: Size
    atom: int | None  # an atom id, or LOCAL
    chunked: bool = False  # an uneven (torch.chunk) shard


class PartialAtom(NamedTuple):
    atom: int
    op: str  # the pending reduction: sum, avg, max, min


Dim = tuple  # tuple[AtomPiece, ...], major to minor


class State(NamedTuple):
    dims: tuple  # tuple[Dim, ...]
    partial: tuple  # sorted tuple[PartialAtom, ...]


UNEVEN = -1  # stride_of's mark for a chunked piece: no stride, its whole dim is its place

# the search makes these by the hundred thousand: skip the named tuples' Python-level __new__
make_piece = functools.partial(tuple.__new__, AtomPiece)  # make_piece((size, atom, chunked))
make_state = functools.partial(tuple.__new__, State)  # make_state((dims, partial))


class InDim(NamedTuple):
    """Where an atom shards: dim ``dim``, ``stride`` elements per index (UNEVEN: the dim's pieces)."""

    dim: int
    stride: object


class Pending(NamedTuple):
    """An atom a partial ``op`` is pending over."""

    op: str


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
            out: list[AtomPiece] = []
            for p in pieces:
                if p.uneven_blocks:
                    raise AtomError(f"{layout} splits a dim into unequal blocks: no atom state holds it")
                if p.axis is None:
                    out.append(AtomPiece(p.size, LOCAL))
                    continue
                ids = self.split(p.axis)
                if p.chunked:
                    if len(ids) != 1:
                        raise AtomError(f"uneven shard on {p.axis} while the other layout cuts that axis into sub-axes")
                    out.append(AtomPiece(p.size, ids[0], True))
                else:
                    out.extend(AtomPiece(self.axes[i].size, i) for i in ids)
            dims.append(canonical_dim(out))
        partial = []
        for axis, op in layout.partial:
            partial.extend(PartialAtom(i, op) for i in self.split(axis))
        return State(tuple(dims), tuple(sorted(partial)))

    def layout(self, state: State, shape: Sequence[Size]) -> Layout:
        return Layout(self.mesh, shape,
                      [[Piece(p.size, None if p.atom is LOCAL else self.axes[p.atom], p.chunked) for p in pieces]
                       for pieces in state.dims],
                      [(self.axes[p.atom], p.op) for p in state.partial])

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


def canonical_dim(pieces: Iterable[AtomPiece]) -> Dim:
    """Adjacent local pieces merged, local size-1 pieces dropped: one spelling per dim."""
    out: list[AtomPiece] = []
    after_local = False
    for p in pieces:
        size, atom, _ = p
        if atom is not LOCAL:
            after_local = False
        elif size == 1:
            continue
        elif after_local:
            size = out[-1][0] * size
            out[-1] = make_piece((size if type(size) is int else as_size(size), LOCAL, False))
            continue
        else:
            after_local = True
        out.append(p)
    return tuple(out)


def localized(pieces: Dim, ids: frozenset) -> Dim:
    """``pieces`` with the atoms ``ids`` gathered: their pieces become local. A chunk of a chunk
    gathered leaves the outer chunk whole (its nominal size is only rank 0's share of it)."""
    return canonical_dim(make_piece((p[0], LOCAL, False)) if p[1] in ids else p for i, p in enumerate(pieces)
                         if not (p[1] in ids and p[2] and i and pieces[i - 1][2]))


def atoms_in(pieces: Dim) -> frozenset:
    return frozenset(atom for _, atom, _ in pieces if atom is not LOCAL)


def local_numel(state: State, shape: Sequence[Size], sizes: Sequence[Size]) -> Size:
    """Elements on the rank holding the most (coordinate 0 of every chunked piece; of a chunk of a
    chunk only the inner one counts: its nominal size is already the outer chunk of coordinate 0)."""
    n: Size = 1
    for pieces in state.dims:
        for i, p in enumerate(pieces):
            if p.atom is LOCAL:
                n = n * p.size
            elif p.chunked and not (i + 1 < len(pieces) and pieces[i + 1].chunked):
                n = n * (-(-int(p.size) // int(sizes[p.atom])))
    return n if type(n) is int else as_size(n)


def stride_of(pieces: Dim) -> dict[int, Size]:
    """Atom -> product of the sizes of the pieces after it (where it sits in the dim); UNEVEN for a
    chunked piece."""
    out: dict[int, Size] = {}
    inner: Size = 1
    for size, atom, chunked in reversed(pieces):
        if atom is not LOCAL:
            out[atom] = UNEVEN if chunked else inner
        inner = inner * size
        if type(inner) is not int:
            inner = as_size(inner)
    return out


def moving_atoms(state: State, target: State) -> list[int]:
    """Atoms whose place (dim and stride, uneven dim, or partial op) differs between two states."""
    def places(st: State) -> dict[int, InDim | Pending]:
        out: dict[int, InDim | Pending] = {p.atom: Pending(p.op) for p in st.partial}
        for d, pieces in enumerate(st.dims):
            for a, stride in stride_of(pieces).items():
                out[a] = InDim(d, stride if stride != UNEVEN else pieces)
        return out

    here, there = places(state), places(target)
    return sorted(a for a in set(here) | set(there) if here.get(a) != there.get(a))
