"""Conversions between Layout and DTensor placements (Shard, Replicate, Partial, _StridedShard).

DTensor processes placements left to right over mesh dims (or in ``shard_order``); each
Shard splits the rank's current local block of its tensor dim with torch.chunk, and
``_StridedShard(d, split_factor=f)`` first views that block as [f, rest] and splits ``rest``.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard, _StridedShard

from .layout import Layout, LayoutError, Piece, exact_div
from .mesh import MeshAxis, MeshSpec, Size, as_size, divides, is_static

_REDUCE_NAMES = {"sum": "sum", "avg": "avg", "max": "max", "min": "min", "product": "product"}


def as_mesh_spec(mesh: Any) -> MeshSpec:
    if isinstance(mesh, MeshSpec):
        return mesh
    if hasattr(mesh, "mesh_dim_names") and hasattr(mesh, "shape"):
        return MeshSpec.from_device_mesh(mesh)
    if isinstance(mesh, Mapping):
        return MeshSpec(mesh)
    raise TypeError(f"expected a MeshSpec, a DeviceMesh or a mapping of axis sizes, got {type(mesh).__name__}")


def user_layout(name: str, spec: Any, mesh: Any, shape: Sequence[Any]) -> Layout:
    """The layout a user gave for the tensor ``name``: a ``Layout``, placements (one per mesh
    axis, or their text ``"S(0),R"``), or a bare placement on a one-axis mesh.

    Every error names the tensor, its shape and the mesh, and says what to write instead.
    """
    mesh_spec = as_mesh_spec(mesh)
    where = f"{name} (shape {[int(s) if is_static(s) else s for s in shape]}) on {mesh_spec}"
    if isinstance(spec, Layout):
        if tuple(spec.shape) != tuple(as_size(s) for s in shape):
            raise LayoutError(f"{where}: the layout given is for shape {list(spec.shape)}")
        return spec
    if isinstance(spec, str):
        spec = placements_from_str(spec)
    if isinstance(spec, Placement):
        if mesh_spec.ndim != 1:
            example = ", ".join([repr(spec)] + ["Replicate()"] * (mesh_spec.ndim - 1))
            raise LayoutError(f"{where}: a bare placement {spec!r} for a mesh of {mesh_spec.ndim} axes "
                              f"{mesh_spec.names}; give one placement per axis, e.g. ({example})")
        spec = (spec,)
    if not isinstance(spec, Sequence) or not all(isinstance(p, Placement) for p in spec):
        raise LayoutError(f"{where}: expected DTensor placements (a tuple such as (Shard(0),)) or a Layout, "
                          f"got {spec!r}")
    try:
        return layout_from_placements(mesh_spec, shape, tuple(spec))
    except LayoutError as e:
        raise LayoutError(f"{where}: placements {tuple(spec)}: {e}") from None


def _shard_order(placements: Sequence[Placement], shard_order: Any, ndim: int) -> list[tuple[int, int]]:
    """(mesh dim, tensor dim) pairs in the order the shards are applied."""
    shard_dims = {i: _norm_dim(p.dim, ndim) for i, p in enumerate(placements) if isinstance(p, (Shard, _StridedShard))}
    if shard_order is None:
        return sorted(shard_dims.items())
    order: list[tuple[int, int]] = []
    if isinstance(shard_order, Mapping):
        entries = [(int(t), tuple(m)) for t, m in shard_order.items()]
    else:
        entries = [(int(e.tensor_dim), tuple(e.mesh_dims)) for e in shard_order]
    for tensor_dim, mesh_dims in entries:
        for m in mesh_dims:
            if shard_dims.get(m) != _norm_dim(tensor_dim, ndim):
                raise LayoutError(f"shard_order names mesh dim {m} for tensor dim {tensor_dim}, "
                                  f"but placements[{m}] is {placements[m]}")
            order.append((m, shard_dims[m]))
    if sorted(order) != sorted(shard_dims.items()):
        raise LayoutError(f"shard_order {shard_order} does not cover the shards of {tuple(placements)}")
    # shards of one tensor dim must follow the given order; dims are independent
    return order


def _norm_dim(d: int, ndim: int) -> int:
    if not -ndim <= d < max(ndim, 1):
        raise LayoutError(f"Shard({d}) is out of range for a tensor with {ndim} dims")
    return d % ndim if ndim else 0


def layout_from_placements(mesh: Any, shape: Sequence[Any], placements: Sequence[Placement],
                           shard_order: Any = None) -> Layout:
    spec = as_mesh_spec(mesh)
    placements = tuple(placements)
    if len(placements) != spec.ndim:
        raise LayoutError(f"{len(placements)} placements {placements} for mesh {spec} with {spec.ndim} axes; "
                          "give one placement per mesh axis")
    shape_t = tuple(as_size(s) for s in shape)
    dims: list[list[Piece]] = [[] if is_static(s) and int(s) == 0 else [Piece(s)] for s in shape_t]
    partial: list[tuple[MeshAxis, str]] = []
    for i, p in enumerate(placements):
        if isinstance(p, Partial):
            op = _REDUCE_NAMES.get(p.reduce_op)
            if op is None:
                raise LayoutError(f"Partial({p.reduce_op!r}) is not supported; use sum, avg, max, min or product")
            partial.append((spec.axis(i), op))
        elif not isinstance(p, (Shard, _StridedShard, Replicate)):
            raise LayoutError(f"unsupported placement {p!r} on mesh axis {spec.names[i]}")
    order = _shard_order(placements, shard_order, len(shape_t))
    try:
        for mesh_dim, tensor_dim in order:
            if _shards_nothing(spec.sizes[mesh_dim], shape_t[tensor_dim]):
                continue
            p = placements[mesh_dim]
            dims[tensor_dim] = shard_local_block(dims[tensor_dim], spec.axis(mesh_dim), _skip(p), shape_t[tensor_dim])
        layout = Layout(spec, shape_t, dims, partial)
        if any(p.chunked for pieces in dims for p in pieces):  # canonical form may have evened the pieces out
            _check_uneven_blocks(layout, placements, order)
        return layout
    except LayoutError as e:
        if not _literal_applies(spec, shape_t, placements):
            raise
        error = e
    layout = Layout(spec, shape_t, _literal_dims(spec, shape_t, placements, order), partial)
    _check_uneven_blocks(layout, placements, order, error)
    return layout


def _skip(p: Placement) -> int:
    return p.split_factor if isinstance(p, _StridedShard) else 1


def _literal_applies(spec: MeshSpec, shape: tuple[Size, ...], placements: tuple[Placement, ...]) -> bool:
    """Static sizes and a _StridedShard: DTensor's chunks of chunks may then need unequal blocks."""
    return spec.is_static and all(is_static(s) for s in shape) and any(isinstance(p, _StridedShard) for p in placements)


def _literal_dims(spec: MeshSpec, shape: tuple[Size, ...], placements: tuple[Placement, ...],
                  order: list[tuple[int, int]]) -> list[list[Piece]]:
    """Each dim's pieces as DTensor applies its placements, one by one: the rank's whole block cut
    into ``split_factor`` torch.chunk blocks (``~f``; ``~1`` keeps it one block), each chunked over
    the axis (``~n@axis``, n nominal: the largest block's size)."""
    dims: list[list[Piece]] = [[] for _ in shape]
    block = [int(s) for s in shape]
    for mesh_dim, d in order:
        if _shards_nothing(spec.sizes[mesh_dim], shape[d]):
            continue
        skip, n = _skip(placements[mesh_dim]), int(spec.sizes[mesh_dim])
        per_block = -(-block[d] // skip)
        dims[d] += [Piece(skip, None, chunked=True), Piece(per_block, spec.axis(mesh_dim), chunked=True)]
        block[d] = min(block[d], skip * -(-per_block // n))
    return [pieces or [Piece(s)] for pieces, s in zip(dims, shape)]


def _shards_nothing(axis_size: Size, dim_size: Size) -> bool:
    """A mesh axis of size 1 leaves every block whole; every block of an empty dim is empty."""
    return (is_static(axis_size) and int(axis_size) == 1) or (is_static(dim_size) and int(dim_size) == 0)


def _check_uneven_blocks(layout: Layout, placements: tuple[Placement, ...], order: list[tuple[int, int]],
                         cause: LayoutError | None = None) -> None:
    """Refuse an uneven layout whose pieces would give some rank another block than DTensor does.

    DTensor's blocks, by its documented semantics (each Shard a torch.chunk of the rank's block,
    a _StridedShard of each of its split_factor chunks), are recomputed on index lists: pieces
    cannot hold every uneven strided split, and a wrong block is worse than a refusal.
    """
    if not layout.mesh.is_static or not all(is_static(s) for s in layout.shape):
        return
    for coord in layout.mesh.coordinates():
        for d in range(layout.ndim):
            expected = _dtensor_indices(int(layout.shape[d]), placements, order, d, coord, layout.mesh)
            if layout.local_index_list(d, coord) != expected:
                steps = ", ".join(f"{placements[m]} on {layout.mesh.names[m]}" for m, t in order if t == d)
                raise LayoutError(
                    f"dim {d} of size {layout.shape[d]} split unevenly by {steps}: the rank at {coord} holds "
                    f"elements {expected[:8]}{'...' if len(expected) > 8 else ''}, which no fxshard layout holds; "
                    "pad the dim to a multiple of the split factor times the mesh axis sizes"
                    + (f" ({cause})" if cause else ""))


def _dtensor_indices(size: int, placements: tuple[Placement, ...], order: list[tuple[int, int]], d: int,
                     coord: tuple[int, ...], mesh: MeshSpec) -> list[int]:
    """The global indices of dim ``d`` that DTensor's placements give the rank at ``coord``."""
    idx = list(range(size))
    for m, t in order:
        if t != d:
            continue
        p, n = placements[m], int(mesh.sizes[m])
        parts = _chunks(idx, int(p.split_factor)) if isinstance(p, _StridedShard) else [idx]
        idx = [i for part in parts for i in _chunks(part, n)[coord[m]]]
    return idx


def _chunks(idx: list[int], n: int) -> list[list[int]]:
    """torch.chunk into ``n`` (chunks of ceil(len / n), empty ones at the end)."""
    size = -(-len(idx) // n)
    return [idx[k * size:(k + 1) * size] for k in range(n)] if size else [[] for _ in range(n)]


def shard_local_block(pieces: list[Piece], axis: MeshAxis, skip: Size, dim_size: Size) -> list[Piece]:
    """Shard the local block of a dim over ``axis`` after viewing it as [skip, rest] (torch.chunk)."""
    if pieces and pieces[-1].chunked and skip == 1 and all(p.axis is not None for p in pieces):
        # nested uneven shard of a block that is one chunk: chunk whatever the last chunk left
        last = pieces[-1]
        return pieces + [Piece(-(-int(last.size) // int(last.axis.size)), axis, chunked=True)]
    if any(p.uneven_blocks for p in pieces):  # every later shard splits the rank's whole block (Layout's pieces)
        last = pieces[-1]
        block = -(-int(last.size) // int(last.axis.size))
        if skip == 1:
            return list(pieces) + [Piece(block, axis, chunked=True)]
        return list(pieces) + [Piece(skip, None, chunked=True), Piece(-(-block // int(skip)), axis, chunked=True)]
    if skip != 1 and all(p.axis is not None for p in pieces[:-1]) and _unequal_blocks(pieces, skip):
        # the rank's block (one run of the dim) viewed as [skip, rest] with torch.chunk: unequal blocks
        last = pieces[-1] if pieces else Piece(dim_size)
        block = int(last.size) if last.axis is None else -(-int(last.size) // int(last.axis.size))
        head = list(pieces) if last.axis is not None else list(pieces[:-1])
        return head + [Piece(skip, None, chunked=True), Piece(-(-block // int(skip)), axis, chunked=True)]
    out: list[Piece] = []
    todo = list(pieces)
    # 1. split off `skip` elements of local extent, major first
    while skip != 1:
        p = _next_local(todo, out)
        if p is None:
            raise LayoutError(f"split factor larger than the dim ({dim_size})")
        if divides(p.size, skip):
            out.append(p)
            skip = exact_div(skip, p.size)
        elif divides(skip, p.size):
            out.append(Piece(skip))
            todo.insert(0, Piece(exact_div(p.size, skip)))
            skip = 1
        else:
            raise LayoutError(f"_StridedShard split factor does not align with the local block of a dim of size {dim_size}")
    # 2. consume the axis from the outermost local pieces, major sub-axes first
    rest: MeshAxis | None = axis
    while rest is not None:
        local_left = [p for p in todo if p.axis is None]
        p = _next_local(todo, out)
        if p is None and rest == axis and not any(q.chunked for q in out):
            # one element left per block: torch.chunk gives it to coordinate 0
            out.append(Piece(1, axis, chunked=True))
            break
        if p is None:
            raise LayoutError(f"nothing left to shard over {axis} in a dim of size {dim_size}")
        n = rest.size
        if divides(n, p.size):
            out.append(Piece(n, rest))
            if p.size != n:
                todo.insert(0, Piece(exact_div(p.size, n)))
            rest = None
        elif divides(p.size, n) and len(local_left) > 1:
            outer, rest = rest.split(p.size)
            out.append(Piece(p.size, outer))
        elif rest == axis:  # uneven: torch.chunk the rest of the dim
            if len(local_left) > 1:
                block = " ".join(str(q) for q in [p] + todo)
                total = 1
                for q in [p] + local_left[1:]:
                    total *= int(q.size)
                if divides(n, total):
                    raise LayoutError(
                        f"sharding the strided block [{block}] of a dim of size {dim_size} over {axis}: each rank's "
                        f"{total} elements split evenly in {n}, but not on the block's pieces, so fxshard has no "
                        "layout for it; shard that dim before the strided split, or pick a split factor that "
                        f"makes the local pieces divisible by {n}")
                raise LayoutError(f"uneven shard over {axis} of a strided block [{block}] (dim of size {dim_size}) "
                                  "is not representable: make the dim divisible by the mesh axis")
            out.append(Piece(p.size, axis, chunked=True))
            rest = None
        else:
            raise LayoutError(f"mesh axis {axis} does not split evenly over a dim of size {dim_size}")
    return out + todo


def _unequal_blocks(pieces: list[Piece], skip: Size) -> bool:
    """Whether a _StridedShard's split factor ``skip`` cuts the rank's block of a dim (its last
    piece; sharded pieces before it) into torch.chunk blocks of unequal sizes on some rank."""
    if not pieces or not is_static(skip) or not all(is_static(p.size) for p in pieces):
        return False
    last = pieces[-1]
    return last.chunked or last.axis is not None or int(last.size) % int(skip) != 0


def _next_local(todo: list[Piece], out: list[Piece]) -> Piece | None:
    """The next local piece of ``todo`` (taken off it); sharded pieces before it pass to ``out``."""
    while todo:
        p = todo.pop(0)
        if p.axis is None:
            return p
        out.append(p)
    return None


def _partial_placements(layout: Layout) -> list[Placement] | None:
    """Replicate on every axis but the partial ones, which get their Partial; None where a partial
    axis is a sub-axis (no placement expresses it)."""
    result: list[Placement] = [Replicate() for _ in layout.mesh.names]
    for a, op in layout.partial:
        if not a.is_whole:
            return None
        result[layout.mesh.index(a.name)] = Partial(op)
    return result


def placements_from_layout(layout: Layout) -> tuple[Placement, ...] | None:
    """Left-to-right DTensor placements for ``layout``, or None when DTensor cannot express it."""
    spec = layout.mesh
    result = _partial_placements(layout)
    if result is None:
        return None
    for d, pieces in enumerate(layout.dims):
        if any(p.uneven_blocks for p in pieces):
            if not _write_unequal_blocks(result, d, pieces, spec):
                return None
            continue
        # a later mesh axis chunks what earlier ones left, so it may come out as sub-axes around
        # their pieces ([2@b/2 2@a 2@b%2] is _StridedShard(0, 2), Shard(0)): group by mesh axis
        by_axis: dict[int, list[int]] = {}
        for i, p in enumerate(pieces):
            if p.axis is not None:
                by_axis.setdefault(spec.index(p.axis.name), []).append(i)
        done: set[int] = set()
        for mesh_dim, idx in sorted(by_axis.items()):
            whole: MeshAxis | None = pieces[idx[0]].axis
            for i in idx[1:]:
                whole = whole.merge(pieces[i].axis) if whole is not None else None
            if whole is None or not whole.is_whole:
                return None
            factor: Size = 1
            for j in range(idx[0]):
                if j not in done:
                    factor = factor * pieces[j].size
            result[mesh_dim] = Shard(d) if factor == 1 else _StridedShard(d, split_factor=int(factor))
            done.update(idx)
    placements = tuple(result)
    try:
        if layout_from_placements(spec, layout.shape, placements) != layout:
            return None
    except LayoutError:
        return None
    return placements


def dtensor_spec_of(layout: Layout) -> tuple[tuple[Placement, ...], tuple | None] | None:
    """(placements, shard order) of ``layout`` for DTensor: the order is None where left-to-right
    placements (``placements_from_layout``) express it, else DTensor's explicit shard order (a tuple
    of ``ShardOrderEntry``, as ``DTensorSpec.shard_order``): uneven chunks applied against mesh order,
    which no _StridedShard expresses. None when DTensor cannot express the layout either way."""
    placements = placements_from_layout(layout)
    if placements is not None:
        return placements, None
    return _ordered_placements(layout)


def _ordered_placements(layout: Layout) -> tuple[tuple[Placement, ...], tuple] | None:
    """Shard(d) on every whole axis sharding dim d, applied in the order of its pieces (major first)."""
    try:
        from torch.distributed.tensor._dtensor_spec import ShardOrderEntry
    except ImportError:  # a torch without shard orders
        return None
    spec = layout.mesh
    result = _partial_placements(layout)
    if result is None:
        return None
    order: list[tuple[int, tuple[int, ...]]] = []
    for d, pieces in enumerate(layout.dims):
        axes = [p.axis for p in pieces if p.axis is not None]
        if not all(a.is_whole for a in axes) or len({a.name for a in axes}) != len(axes):
            return None
        for a in axes:
            result[spec.index(a.name)] = Shard(d)
        if axes:
            order.append((d, tuple(spec.index(a.name) for a in axes)))
    placements = tuple(result)
    try:
        if layout_from_placements(spec, layout.shape, placements, dict(order)) != layout:
            return None
    except LayoutError:
        return None
    return placements, tuple(ShardOrderEntry(tensor_dim=d, mesh_dims=m) for d, m in order)


def _write_unequal_blocks(result: list[Placement], d: int, pieces: tuple[Piece, ...], spec: MeshSpec) -> bool:
    """A dim of unequal blocks as DTensor placements, one per sharded piece in mesh order: Shard, or
    _StridedShard by the local pieces before it. False where the pieces are not in mesh order."""
    factor, last = 1, -1
    for p in pieces:
        if p.axis is None:
            factor *= int(p.size)
            continue
        m = spec.index(p.axis.name)
        if not p.axis.is_whole or m <= last:
            return False
        result[m] = Shard(d) if factor == 1 else _StridedShard(d, split_factor=factor)
        factor, last = 1, m
    return True


def placements_to_str(placements: Sequence[Placement]) -> str:
    """A compact, parseable text for placements: 'S(1),R,P(sum),SS(0;2)'."""
    parts = []
    for p in placements:
        if isinstance(p, _StridedShard):
            parts.append(f"SS({p.dim};{p.split_factor})")
        elif isinstance(p, Shard):
            parts.append(f"S({p.dim})")
        elif isinstance(p, Partial):
            parts.append(f"P({p.reduce_op})")
        elif isinstance(p, Replicate):
            parts.append("R")
        else:
            raise LayoutError(f"unsupported placement {p!r}")
    return ",".join(parts)


def placements_from_str(text: str) -> tuple[Placement, ...]:
    out: list[Placement] = []
    for part in text.replace(" ", "").split(",") if text else []:
        if part == "R":
            out.append(Replicate())
        elif part.startswith("SS("):
            d, f = part[3:-1].split(";")
            out.append(_StridedShard(int(d), split_factor=int(f)))
        elif part.startswith("S("):
            out.append(Shard(int(part[2:-1])))
        elif part.startswith("P("):
            out.append(Partial(part[2:-1]))
        else:
            raise LayoutError(f"cannot parse placement {part!r}")
    return tuple(out)


def contiguous_strides(shape: Sequence[Any]) -> tuple[int, ...]:
    """Row-major strides of ``shape``."""
    stride, acc = [], 1
    for s in reversed([int(x) for x in shape]):
        stride.append(acc)
        acc *= s
    return tuple(reversed(stride))


def as_dtensor(local: Any, device_mesh: Any, placements: Sequence[Placement], shape: Sequence[Any],
               shard_order: Any = None) -> Any:
    """The DTensor of global ``shape`` whose block on this rank is ``local``, with no communication.

    The global shape and (contiguous) strides are given, never inferred: DTensor would infer them
    from the local block assuming even shards, which uneven layouts are not. A ``shard_order``
    (``dtensor_spec_of``) goes into the DTensor's spec: ``from_local`` takes none (torch 2.13), so the
    spec is replaced after it, as torch's own shard-order test helpers do.
    """
    import torch
    from torch.distributed.tensor import DTensor

    out = DTensor.from_local(local, device_mesh, placements, run_check=False, shape=torch.Size([int(s) for s in shape]),
                             stride=contiguous_strides(shape))
    if shard_order is not None:
        from torch.distributed.tensor._dtensor_spec import DTensorSpec

        out._spec = DTensorSpec(out._spec.mesh, out._spec.placements, tensor_meta=out._spec.tensor_meta,
                                shard_order=tuple(shard_order))
    return out


def layout_as_dtensor(local: Any, device_mesh: Any, layout: Layout) -> Any:
    """``as_dtensor`` with ``layout``'s placements and shard order (``dtensor_spec_of``)."""
    placements, order = written_placements(layout)
    return as_dtensor(local, device_mesh, placements, layout.shape, order)


def written_placements(layout: Layout) -> tuple[tuple[Placement, ...], tuple | None]:
    """``dtensor_spec_of(layout)``, an error where DTensor cannot express the layout."""
    written = dtensor_spec_of(layout)
    if written is None:
        raise LayoutError(f"layout {layout} has no DTensor placements (sub-axes, or chunks DTensor cannot order)")
    return written
