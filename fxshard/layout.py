"""Factorized layouts: which piece of a global tensor each rank holds.

Every tensor dim is a sequence of pieces, major to minor. A local piece is held whole by
every rank; a sharded piece on a mesh axis (or sub-axis) of size n has size n and each rank
holds the one index equal to its coordinate on that axis. Partial axes (each with its reduce
op: one op, or sum and avg mixed, which commute) and replicated axes (all the others) complete
the picture.

Text notation (``str(layout)``), one bracket per dim, pieces major to minor::

    [2] [4@tp 2] [64]          dim 1 = 4 pieces on tp, each of 2 rows
    [2 4@dp] [8]               strided: 2 local blocks, each split on dp (DTensor _StridedShard)
    [2@tp/4] [4@tp%4 8]        tp=8 seen as sub-axes tp/4 (size 2) and tp%4 (size 4)
    [~10@tp]                   uneven: 10 rows split over tp with torch.chunk semantics
    [~3 ~4@tp]                 uneven strided: 10 rows as 3 torch.chunk blocks (4, 3, 3), each split
                               over tp (DTensor's _StridedShard(0, split_factor=3) of 10 rows)
    [8] [16] P(sum@tp)         partial sums over tp
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import sympy
import torch

from .mesh import Coordinate, MeshAxis, MeshSpec, Size, as_size, divides, is_static

REDUCE_OPS = ("sum", "avg", "max", "min", "product")
LINEAR_REDUCE_OPS = frozenset({"sum", "avg"})  # commute with each other: may be mixed over different axes
IDENTITY = {"sum": 0.0, "product": 1.0}  # what a rank holds that does not hold the value (R -> Partial)


class LayoutError(ValueError):
    """A layout that cannot exist (overlapping axes, indivisible pieces, unknown reduce op)."""


def exact_div(n: Size, d: Size) -> Size:
    if is_static(n) and is_static(d):
        return int(n) // int(d)
    return as_size(sympy.simplify(sympy.sympify(n) / sympy.sympify(d)))


@dataclass(frozen=True)
class Piece:
    """A factor of a tensor dim: local (``axis is None``) or sharded on ``axis``.

    A ``chunked`` piece splits the rest of the dim (nominally ``size`` elements) over its axis
    with torch.chunk semantics, for sizes the axis does not divide; nothing follows it but
    further chunked pieces. A chunked local piece (``axis is None``) cuts the rest of the dim into
    ``size`` torch.chunk blocks of unequal sizes (a _StridedShard's split factor that does not
    divide the dim); the chunked sharded pieces after it split each block.
    """

    size: Size
    axis: MeshAxis | None = None
    chunked: bool = False

    def __str__(self) -> str:
        if self.axis is None:
            return f"~{self.size}" if self.chunked else str(self.size)
        if self.chunked:
            return f"~{self.size}@{self.axis}"
        return f"{self.size}@{self.axis}"

    @property
    def uneven_blocks(self) -> bool:
        """A chunked local piece: unequal blocks, each split by the pieces after it."""
        return self.chunked and self.axis is None


class _Interned(type):
    """Layouts are interned: equal layouts are one object, so comparing two is mostly ``is``.

    Propagation, refinement and pricing compare and hash layouts by the hundred thousand (a
    memo key holds a node's input layouts, a planner cache key a pair) and build the same ones
    again and again (every layer asks for the same gathers). A construction first looks its
    arguments up (``_BY_ARGUMENTS``: no canonicalization for a layout built before), then its
    canonical fields (``_CANONICAL``). Both tables are caches that hold nothing alive: weak values,
    dropped with the last layout that uses them. A layout unpickled elsewhere is a copy; equality
    still compares fields where two layouts are not the same object."""

    def __call__(cls, mesh: MeshSpec, shape: Sequence[Any], dims: Sequence[Sequence[Piece]] | None = None,
                 partial: Iterable[tuple[MeshAxis, str]] | Mapping[MeshAxis, str] = ()) -> "Layout":
        try:
            key = (mesh, tuple(shape), None if dims is None else tuple(tuple(p) for p in dims),
                   tuple(partial.items()) if isinstance(partial, Mapping) else tuple(partial))
            known = _BY_ARGUMENTS.get(key)
        except TypeError:  # an unhashable argument (a size given as a list): built, not looked up
            key, known = None, None
        if known is not None:
            return known
        layout = super().__call__(mesh, shape, dims, partial)._interned()
        if key is not None:
            _BY_ARGUMENTS[key] = layout
        return layout


# explicit caches of _Interned (weak values: a layout no one holds leaves them)
_BY_ARGUMENTS: "weakref.WeakValueDictionary[tuple, Layout]" = weakref.WeakValueDictionary()
_CANONICAL: "weakref.WeakValueDictionary[tuple, Layout]" = weakref.WeakValueDictionary()


@dataclass(frozen=True)
class Layout(metaclass=_Interned):
    """The factorized layout of one tensor over a mesh; immutable, hashable, canonical, interned."""

    mesh: MeshSpec
    shape: tuple[Size, ...]
    dims: tuple[tuple[Piece, ...], ...]
    partial: tuple[tuple[MeshAxis, str], ...] = ()

    def __init__(
        self,
        mesh: MeshSpec,
        shape: Sequence[Any],
        dims: Sequence[Sequence[Piece]] | None = None,
        partial: Iterable[tuple[MeshAxis, str]] | Mapping[MeshAxis, str] = (),
    ):
        shape_t = tuple(as_size(s) for s in shape)
        if dims is None:
            dims = [()] * len(shape_t)
        if len(dims) != len(shape_t):
            raise LayoutError(f"layout has {len(dims)} dims but the shape {list(shape_t)} has {len(shape_t)}")
        canon = tuple(_canonical_dim(size, tuple(p), d) for d, (size, p) in enumerate(zip(shape_t, dims)))
        self._set(mesh, shape_t, canon, _canonical_partial(partial))

    def _set(self, mesh: MeshSpec, shape: tuple[Size, ...], dims: tuple[tuple[Piece, ...], ...],
             partial: tuple[tuple[MeshAxis, str], ...]) -> None:
        object.__setattr__(self, "mesh", mesh)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "dims", dims)
        object.__setattr__(self, "partial", partial)
        self._validate()

    def _derived(self, dims: tuple[tuple[Piece, ...], ...], partial: tuple[tuple[MeshAxis, str], ...]) -> "Layout":
        """A layout of this one's mesh and shape from dims already canonical: propagation derives
        layouts by the thousand, and canonicalizing dims that are canonical is most of a Layout's cost."""
        new = object.__new__(Layout)
        new._set(self.mesh, self.shape, dims, partial)
        return new._interned()

    def _interned(self) -> "Layout":
        """The one layout equal to this one (this one, if it is the first)."""
        return _CANONICAL.setdefault((self.mesh, self.shape, self.dims, self.partial), self)

    # equality reads the fields, as the dataclass would; the hash is computed once (layouts key the
    # planner's cache and propagation's memo) and is never pickled (str hashes differ between processes)
    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if other.__class__ is not self.__class__:
            return NotImplemented
        return hash(self) == hash(other) and (self.mesh, self.shape, self.dims, self.partial) == (
            other.mesh, other.shape, other.dims, other.partial)

    def __hash__(self) -> int:
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.mesh, self.shape, self.dims, self.partial))
            object.__setattr__(self, "_hash", h)
        return h

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("_hash", "_max_local_shape")}

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def replicated(cls, mesh: MeshSpec, shape: Sequence[Any]) -> "Layout":
        return cls(mesh, shape)

    def with_dim(self, d: int, pieces: Sequence[Piece]) -> "Layout":
        dims = list(self.dims)
        dims[d] = _canonical_dim(self.shape[d], tuple(pieces), d)
        return self._derived(tuple(dims), self.partial)

    def with_partial(self, partial: Iterable[tuple[MeshAxis, str]]) -> "Layout":
        return self._derived(self.dims, _canonical_partial(partial))

    # ---- queries --------------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def is_replicated(self) -> bool:
        return not self.partial and not self.sharded_axes()

    @property
    def reduce_ops(self) -> frozenset[str]:
        """The partial reduce ops: one op, or sum and avg on different axes (they commute)."""
        return frozenset(op for _, op in self.partial)

    def sharded_axes(self) -> tuple[MeshAxis, ...]:
        return tuple(p.axis for pieces in self.dims for p in pieces if p.axis is not None)

    def used_axes(self) -> tuple[MeshAxis, ...]:
        return self.sharded_axes() + tuple(a for a, _ in self.partial)

    def is_even(self) -> bool:
        return not any(p.chunked for pieces in self.dims for p in pieces)

    def dim_is_sharded(self, d: int) -> bool:
        return any(p.axis is not None for p in self.dims[d])

    def local_shape(self, coordinate: Coordinate) -> tuple[Size, ...]:
        coord = self.mesh.coordinate_dict(coordinate)
        return tuple(_local_size(size, pieces, coord) for size, pieces in zip(self.shape, self.dims))

    def max_local_shape(self) -> tuple[Size, ...]:
        """Local shape of the rank with the most elements (coordinate 0 under torch.chunk); computed
        once per layout (strategies rank candidates by it)."""
        shape = self.__dict__.get("_max_local_shape")
        if shape is None:
            shape = self.local_shape({n: 0 for n in self.mesh.names})
            object.__setattr__(self, "_max_local_shape", shape)
        return shape

    def local_indices(self, d: int, coordinate: Coordinate) -> torch.Tensor:
        """Global indices along dim ``d`` held by the rank at ``coordinate``, in local order."""
        return torch.tensor(self.local_index_list(d, coordinate), dtype=torch.long)

    def local_index_list(self, d: int, coordinate: Coordinate) -> list[int]:
        """``local_indices`` as a list, computed without tensors: safe to call while a fake or tracing
        mode is active (a layout read inside a trace)."""
        size = self.shape[d]
        if not is_static(size):
            raise LayoutError("local_indices needs static sizes")
        return _dim_indices(int(size), self.dims[d], self.mesh.coordinate_dict(coordinate))

    def holds_value(self, coordinate: Coordinate) -> bool:
        """Whether this rank holds the value when converting R -> P: coordinate 0 of every sum and
        product axis (the others hold the op's identity, IDENTITY); every rank for avg, max, min."""
        coord = self.mesh.coordinate_dict(coordinate)
        return all(a.coordinate(coord[a.name]) == 0 for a, op in self.partial if op in IDENTITY)

    def is_representative(self, coordinate: Coordinate) -> bool:
        """True for one rank of each group of replicas (coordinate 0 on every replicated part)."""
        coord = self.mesh.coordinate_dict(coordinate)
        used: dict[str, int] = {}
        for a in self.used_axes():
            used[a.name] = used.get(a.name, 0) + a.coordinate(coord[a.name]) * int(a.inner)
        return all(coord[n] == used.get(n, 0) for n in self.mesh.names)

    # ---- moving data: global <-> local -----------------------------------------------------
    def shard(self, tensor: torch.Tensor, coordinate: Coordinate) -> torch.Tensor:
        """This rank's local block of the global ``tensor`` (R -> this layout, per rank)."""
        if tuple(tensor.shape) != tuple(int(s) for s in self.shape):
            raise LayoutError(f"tensor of shape {list(tensor.shape)} does not match layout {self}")
        out = tensor
        for d in range(self.ndim):
            if self.dim_is_sharded(d):
                out = out.index_select(d, self.local_indices(d, coordinate).to(out.device))
        if self.partial and not self.holds_value(coordinate):
            out = torch.full_like(out, IDENTITY[next(op for _, op in self.partial if op in IDENTITY)])
        return out.contiguous()

    def unshard(self, local: Mapping[tuple[int, ...], torch.Tensor]) -> torch.Tensor:
        """The global tensor from every rank's local block (reducing partial axes)."""
        groups: dict[tuple, list[tuple[tuple[int, ...], torch.Tensor]]] = {}
        for coord in self.mesh.coordinates():
            if not self.is_representative(coord):
                continue
            cd = self.mesh.coordinate_dict(coord)
            key = tuple(a.coordinate(cd[a.name]) for a in self.sharded_axes())
            groups.setdefault(key, []).append((coord, local[coord]))
        first = next(iter(local.values()))
        out = first.new_zeros([int(s) for s in self.shape])
        for members in groups.values():
            value = self._reduce([t for _, t in members])
            coord = members[0][0]
            index = [self.local_indices(d, coord) for d in range(self.ndim)]
            out[_open_mesh(index)] = value
        return out

    def _reduce(self, values: list[torch.Tensor]) -> torch.Tensor:
        """The value of one block from its shares on every coordinate of the partial axes: sum and
        avg axes sum then divide by the avg axes' size; a single max, min or product op reduces."""
        if not self.partial:
            return values[0]
        stacked = torch.stack(values)
        if self.reduce_ops <= LINEAR_REDUCE_OPS:
            n_avg = 1
            for a, op in self.partial:
                n_avg *= int(a.size) if op == "avg" else 1
            return stacked.sum(0) / n_avg if n_avg != 1 else stacked.sum(0)
        op = next(iter(self.reduce_ops))
        return {"max": lambda: stacked.amax(0), "min": lambda: stacked.amin(0), "product": lambda: stacked.prod(0)}[op]()

    # ---- text ---------------------------------------------------------------------------------
    def __str__(self) -> str:
        text = " ".join("[" + (" ".join(str(p) for p in pieces) or str(size)) + "]"
                        for size, pieces in zip(self.shape, self.dims)) or "[]"
        if self.partial:
            by_op: dict[str, list[str]] = {}
            for a, op in self.partial:
                by_op.setdefault(op, []).append(str(a))
            text += " " + " ".join(f"P({op}@{','.join(axes)})" for op, axes in by_op.items())
        return text

    def __repr__(self) -> str:
        return f"Layout({self})"

    def visualize(self) -> str:
        """A text grid of which rank holds each element (fxshard/visualize.py)."""
        from .visualize import visualize

        return visualize(self)

    def _validate(self) -> None:
        axes = self.used_axes()
        for a in axes:
            if a.name not in self.mesh.names:
                raise LayoutError(f"layout uses axis {a} that mesh {self.mesh} does not have")
            if a.axis_size != self.mesh.size_of(a.name):
                raise LayoutError(f"axis {a} was made for a mesh axis of size {a.axis_size}; {self.mesh} has {self.mesh.size_of(a.name)}")
        for i, a in enumerate(axes):
            for b in axes[i + 1:]:
                if a.overlaps(b):
                    raise LayoutError(f"mesh axis {a.name} is used twice in one layout ({a} and {b})")
        for a, op in self.partial:
            if op not in REDUCE_OPS:
                raise LayoutError(f"unknown partial reduce op {op!r}; expected one of {REDUCE_OPS}")
        if len(self.reduce_ops) > 1 and not self.reduce_ops <= LINEAR_REDUCE_OPS:
            where = ", ".join(f"Partial({op}) on {a}" for a, op in self.partial)
            raise LayoutError(f"a tensor cannot be partial with two reduce ops at once ({where}): only sum and avg "
                              "commute (DTensor refuses other mixes too); reduce one of them first (Replicate on "
                              "its axes) or make them one op")


def _canonical_partial(partial: Iterable[tuple[MeshAxis, str]] | Mapping[MeshAxis, str]
                       ) -> tuple[tuple[MeshAxis, str], ...]:
    """Partial axes without size-1 ones, adjacent sub-axes merged, sorted by axis."""
    part = partial.items() if isinstance(partial, Mapping) else partial
    return tuple(sorted(_merge_partial([(a, op) for a, op in part if a.size != 1]),
                        key=lambda ao: (ao[0].name, str(ao[0]))))


def _merge_partial(partial: list[tuple[MeshAxis, str]]) -> list[tuple[MeshAxis, str]]:
    """Adjacent sub-axes partial with the same op are one partial axis: P(sum@tp/2, tp%2) is P(sum@tp)."""
    merged = True
    while merged:
        merged = False
        for i, (a, op) in enumerate(partial):
            for j, (b, op_b) in enumerate(partial):
                if i != j and op == op_b and a.merge(b) is not None:
                    rest = [x for k, x in enumerate(partial) if k not in (i, j)]
                    partial, merged = rest + [(a.merge(b), op)], True
                    break
            if merged:
                break
    return partial


def _open_mesh(index: list[torch.Tensor]) -> tuple:
    """Per-dim index tensors -> an advanced-indexing tuple that selects their product."""
    n = len(index)
    return tuple(i.reshape([-1 if k == j else 1 for j in range(n)]) for k, i in enumerate(index))



def _dim_indices(size: int, pieces: tuple[Piece, ...], coord: Mapping[str, int]) -> list[int]:
    """The global indices of a dim of ``size`` that ``pieces`` give the rank at ``coord``: each piece
    splits every block so far (evenly, or with torch.chunk where chunked), a sharded one keeps the
    rank's part of each. In a dim of unequal blocks every piece but a sharded one right after a local
    one splits the rank's whole block instead, as each DTensor placement does (``~1`` marks it)."""
    rows = [list(range(size))] if size else []
    whole = any(p.uneven_blocks for p in pieces)
    for k, p in enumerate(pieces):
        if whole and not (p.axis is not None and k and pieces[k - 1].axis is None):
            rows = [[i for row in rows for i in row]]
        split = _chunks if p.chunked else _equal_parts
        if p.axis is None:
            rows = [part for row in rows for part in split(row, int(p.size))]
        else:
            c = p.axis.coordinate(coord[p.axis.name])
            rows = [split(row, int(p.axis.size))[c] for row in rows]
    return [i for row in rows for i in row]


def _equal_parts(row: list[int], n: int) -> list[list[int]]:
    k = len(row) // n
    return [row[i * k:(i + 1) * k] for i in range(n)]


def _chunks(row: list[int], n: int) -> list[list[int]]:
    """torch.chunk into ``n`` (chunks of ceil(len / n), empty ones at the end)."""
    k = -(-len(row) // n)
    return [row[i * k:(i + 1) * k] for i in range(n)]


def _local_size(size: Size, pieces: tuple[Piece, ...], coord: Mapping[str, int]) -> Size:
    if is_static(size) and int(size) == 0:  # an empty dim (q[..., rotary_dim:] with full rotary) is empty everywhere
        return 0
    if any(p.uneven_blocks for p in pieces):  # blocks of unequal sizes: counted (static sizes only)
        return len(_dim_indices(int(size), pieces, coord))
    rows, cols = 1, size
    for p in pieces:
        if p.axis is None:
            rows, cols = rows * p.size, exact_div(cols, p.size)
        elif p.chunked:
            n, c = int(p.axis.size), p.axis.coordinate(coord[p.axis.name])
            chunk = -(-int(cols) // n)
            cols = max(0, min(chunk, int(cols) - c * chunk))
        else:
            cols = exact_div(cols, p.axis.size)
    return as_size(rows * cols)


def _canonical_dim(size: Size, pieces: tuple[Piece, ...], d: int) -> tuple[Piece, ...]:
    """Merge what can merge, drop size-1 pieces, make the trailing local piece explicit."""
    out: list[Piece] = []
    remaining: Size | None = size
    blocks_of: Size = size
    for p in pieces:
        if p.uneven_blocks and (out or remaining is None or not divides(p.size, remaining)):
            if not is_static(p.size) or (out and out[-1].axis is None):
                raise LayoutError(f"dim {d}: unequal blocks ({p}) need a static size and a sharded piece before them")
            out.append(Piece(as_size(p.size), None, chunked=True))
            blocks_of, remaining = remaining, None
            continue
        if p.axis is None:
            if p.size == 1 or remaining == 0:  # an empty dim keeps one trailing Piece(0), added below
                continue
            if remaining is None:
                raise LayoutError(f"dim {d}: a local piece cannot follow an uneven (chunked) shard")
            if not divides(p.size, remaining):
                raise LayoutError(f"dim {d} of size {size}: piece {p.size} does not divide the remaining {remaining}")
            remaining = exact_div(remaining, p.size)
            out.append(Piece(as_size(p.size)))
            continue
        n = p.axis.size
        if n == 1:
            continue
        if remaining is not None and divides(n, remaining):
            if not p.chunked and p.size != n:
                raise LayoutError(f"dim {d}: a sharded piece has the size of its axis ({n}), got {p.size}")
            remaining = exact_div(remaining, n)
            out.append(Piece(n, p.axis))
        elif p.chunked or remaining is None:
            out.append(Piece(remaining if remaining is not None else p.size, p.axis, chunked=True))
            remaining = None
        else:
            raise LayoutError(f"dim {d} of size {size}: mesh axis {p.axis} of size {n} does not divide the "
                              f"remaining {remaining}; uneven shards must be chunked pieces")
    if remaining is not None and remaining != 1:
        out.append(Piece(remaining))
    if out and out[-1].uneven_blocks:  # unequal blocks that nothing splits: the rank's block is whole
        out = out[:-1] + ([Piece(blocks_of)] if blocks_of not in (None, 1) else [])
    return tuple(_merge_adjacent(out))


def _merge_adjacent(pieces: list[Piece]) -> list[Piece]:
    out: list[Piece] = []
    for p in pieces:
        if out and not p.chunked and not out[-1].chunked:
            q = out[-1]
            if q.axis is None and p.axis is None:
                out[-1] = Piece(as_size(q.size * p.size))
                continue
            if q.axis is not None and p.axis is not None:
                merged = q.axis.merge(p.axis)
                if merged is not None:
                    out[-1] = Piece(merged.size, merged)
                    continue
        out.append(p)
    return out
