"""Slices, selects, splits and concatenations as sub-ranges and stacks of pieces.

A contiguous range of a dim keeps its sharding when it cuts the outermost piece at index
boundaries and that piece is local (q = rows [h, 2h) of a fused [3 4@tp 8] is [4@tp 8]), or
when it lies inside one index of a local outermost piece (recurse into the inner pieces).
Any other range needs the dim redistributed: gathered, or its shards moved inside equal outer
blocks where the ranges fall on block edges (``shards_inside``), whichever the planner prices lower. Concatenating tensors of one layout and equal size
along a dim puts a new local piece outside theirs ([3 4@tp 8] from q, k, v).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch

from .layout import LINEAR_REDUCE_OPS, Layout, Piece

aten = torch.ops.aten


def slice_pieces(pieces: Sequence[Piece], start: int, end: int) -> tuple[Piece, ...] | None:
    """Pieces of the range [start, end) of a dim with ``pieces``; None if it needs communication."""
    pieces = tuple(pieces)
    total = math.prod(int(p.size) for p in pieces)
    if start == 0 and end == total:
        return pieces
    if end <= start:  # an empty range: no rank holds any of it, whatever the layout
        return ()
    if any(p.chunked for p in pieces) or not pieces:
        return None
    p, rest = pieces[0], pieces[1:]
    inner = math.prod(int(q.size) for q in rest)
    a, s = divmod(start, inner)
    b, e = divmod(end, inner)
    if p.axis is not None:
        return None
    if s == 0 and e == 0:
        return (Piece(b - a),) + rest
    if a == b:
        return slice_pieces(rest, s, e)
    if b == a + 1 and e == 0:
        return slice_pieces(rest, s, inner)
    return None


def _norm(i: int | None, size: int, default: int) -> int:
    if i is None:
        return default
    i = int(i)
    if i < 0:
        i += size
    return min(max(i, 0), size)


def _dim(d: int, ndim: int) -> int:
    return d % ndim if ndim else 0


def shards_inside(pieces: Sequence[Piece], size: int, ranges: Sequence[tuple[int, int]]) -> tuple[Piece, ...] | None:
    """The dim re-sharded so that every range is a run of whole outer indices (then slicing is local).

    The dim is seen as [size / g, g] with g the gcd of the range edges; the shards move into g.
    (chunk(2)[0] of [4@tp 2]: [2 4@tp], then rows [0, 4) are [4@tp] on every rank.)
    """
    sharded = [p for p in pieces if p.axis is not None]
    if not sharded or any(p.chunked for p in pieces):
        return None
    g = size
    for s, e in ranges:
        g = math.gcd(g, math.gcd(s, e))
    n = math.prod(int(p.size) for p in sharded)
    if g == size or g % n:
        return None
    return (Piece(size // g),) + tuple(Piece(p.size, p.axis) for p in sharded) + (Piece(g // n),)


def masked_output(layout: Layout, d: int, start: int, end: int, drop_dim: bool) -> Layout | None:
    """Each rank takes its own part of the range, zeros elsewhere: Partial(sum) over dim ``d``'s axes.

    Only where every rank's block of dim ``d`` is one contiguous run of it (shards outermost).
    """
    pieces = layout.dims[d]
    axes = [p.axis for p in pieces if p.axis is not None]
    if not axes or any(p.chunked for p in pieces) or not layout.reduce_ops <= LINEAR_REDUCE_OPS:
        return None
    first_local = next((i for i, p in enumerate(pieces) if p.axis is None), len(pieces))
    if any(p.axis is not None for p in pieces[first_local:]):
        return None  # a local piece outside a shard: the rank's rows are strided
    shape, dims = list(layout.shape), list(layout.dims)
    if drop_dim:
        del shape[d], dims[d]
    else:
        shape[d], dims[d] = end - start, ()
    return Layout(layout.mesh, shape, dims, tuple(layout.partial) + tuple((a, "sum") for a in axes))


def _sliced(layout: Layout, d: int, ranges: Sequence[tuple[int, int]], drop_dim: bool,
            cost: Callable[[Layout, Layout], float] | None = None) -> tuple[Layout, tuple[Layout, ...]]:
    """(required input, one output layout per range) for taking ``ranges`` of dim ``d``.

    A range that cuts through a shard needs the input redistributed: gathered, or (when
    cheaper) its shards moved inside equal outer blocks so that every range keeps them. One
    range may instead be taken where it lies, zeros elsewhere (``masked_output``), priced at
    the all-reduce that its Partial(sum) will take.
    """
    cuts = [slice_pieces(layout.dims[d], s, e) for s, e in ranges]
    required = layout
    if not all(c is not None for c in cuts):
        required = layout.with_dim(d, ())
        best = cost(layout, required) if cost is not None else 0.0
        inside = shards_inside(layout.dims[d], int(layout.shape[d]), ranges)
        if inside is not None and cost is not None:
            moved = layout.with_dim(d, inside)
            if cost(layout, moved) < best:
                required, best = moved, cost(layout, moved)
        masked = masked_output(layout, d, *ranges[0], drop_dim) if len(ranges) == 1 and cost is not None else None
        if masked is not None and cost(masked, masked.with_partial(layout.partial)) <= best:
            return layout, (masked,)  # on a tie: nothing moves now, and a consumer may never need the sum
        cuts = [slice_pieces(required.dims[d], s, e) for s, e in ranges]
    outs = []
    for (s, e), cut in zip(ranges, cuts):
        pieces = cut if cut is not None else ()
        shape, dims = list(required.shape), list(required.dims)
        if drop_dim:
            del shape[d], dims[d]
        else:
            shape[d], dims[d] = e - s, pieces
        outs.append(Layout(layout.mesh, shape, dims, required.partial))
    return required, tuple(outs)


def _arg(node: Any, i: int, name: str, default: Any) -> Any:
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


def slice_rule(node: Any, ins: Sequence[Layout], cost=None) -> tuple[tuple[Layout, ...], Any]:
    x = ins[0]
    d = _dim(_arg(node, 1, "dim", 0), x.ndim)
    size = int(x.shape[d])
    start, end = _norm(_arg(node, 2, "start", None), size, 0), _norm(_arg(node, 3, "end", None), size, size)
    step = _arg(node, 4, "step", 1)
    if step != 1:
        required = x.with_dim(d, ())
        shape = list(x.shape)
        shape[d] = len(range(start, end, step))
        return (required,), Layout(x.mesh, shape, [p if k != d else () for k, p in enumerate(required.dims)],
                                   x.partial)
    required, (out,) = _sliced(x, d, [(start, max(start, end))], drop_dim=False, cost=cost)
    return (required,), out


def select_rule(node: Any, ins: Sequence[Layout], cost=None) -> tuple[tuple[Layout, ...], Any]:
    x = ins[0]
    d = _dim(node.args[1], x.ndim)
    i = int(node.args[2]) % int(x.shape[d])
    required, (out,) = _sliced(x, d, [(i, i + 1)], drop_dim=True, cost=cost)
    return (required,), out


def split_rule(node: Any, ins: Sequence[Layout], cost=None) -> tuple[tuple[Layout, ...], Any]:
    x = ins[0]
    d = _dim(_arg(node, 2, "dim", 0), x.ndim)
    sizes = [int(v.shape[d]) for v in node.meta["val"]]
    offsets = [sum(sizes[:k]) for k in range(len(sizes))]
    required, outs = _sliced(x, d, [(o, o + s) for o, s in zip(offsets, sizes)], drop_dim=False, cost=cost)
    return (required,), outs


def unbind_rule(node: Any, ins: Sequence[Layout], cost=None) -> tuple[tuple[Layout, ...], Any]:
    x = ins[0]
    d = _dim(_arg(node, 1, "dim", 0), x.ndim)
    required, outs = _sliced(x, d, [(i, i + 1) for i in range(int(x.shape[d]))], drop_dim=True, cost=cost)
    return (required,), outs


def _stack_candidates(ins: Sequence[Layout], d: int | None) -> list[Layout]:
    """Templates for the common layout: each input's, and each with dim ``d`` (the cat dim) local."""
    out: list[Layout] = []
    for t in ins:
        for cand in ([t] if d is None else [t, t.with_dim(d, ())]):
            if cand not in out:
                out.append(cand)
    return out


def concat_rule(node: Any, ins: Sequence[Layout], cost) -> tuple[tuple[Layout, ...], Any]:
    """cat: inputs share a layout; equal sizes with equal pieces on the cat dim stack as an outer piece.

    torch.cat skips 1-D empty inputs whatever the others' rank (a KV cache that starts as
    ``torch.tensor([])``): they stay as they are and take no part in the decision. An input of
    size 0 along the cat dim (a cache started as ``[b, h, 0, d]``) adds no rows: it is asked for
    in the others' layout (its cat dim whole), which costs it nothing, and leaves the others' cat
    dim as it would be without it (else a sharded cat dim would be gathered for nothing).
    """
    out_shape = list(node.meta["val"].shape)
    ndim = len(out_shape)
    skipped = [x.ndim == 1 and x.shape[0] == 0 and ndim != 1 for x in ins]
    d = _dim(_arg(node, 1, "dim", 0), ndim)
    rowless = [not skip and x.shape[d] == 0 for x, skip in zip(ins, skipped)]  # (a symbolic size is not 0)
    if all(skip or none for skip, none in zip(skipped, rowless)):
        rowless = [False] * len(ins)  # nothing but empty inputs: decided among them as ever
    kept = [x for x, skip, none in zip(ins, skipped, rowless) if not (skip or none)]
    if not kept:
        return tuple(ins), Layout.replicated(ins[0].mesh, out_shape)
    best = None
    for t in _stack_candidates(kept, d):
        # unequal blocks (an uneven _StridedShard) split the rank's whole block: no outer piece above them
        equal = all(x.shape[d] == t.shape[d] for x in kept) and not any(p.uneven_blocks for p in t.dims[d])
        cat_pieces = t.dims[d] if equal else ()
        required = tuple(Layout(x.mesh, x.shape, [cat_pieces if k == d else t.dims[k] for k in range(ndim)],
                                t.partial) for x in kept)
        cat_out = (Piece(len(kept)),) + tuple(cat_pieces) if equal else ()
        out_dims = [cat_out if k == d else t.dims[k] for k in range(ndim)]
        out = Layout(t.mesh, out_shape, out_dims, t.partial)
        c = sum(cost(x, r) for x, r in zip(kept, required))
        if best is None or c < best[0]:
            best = (c, required, out)
    chosen, out = iter(best[1]), best[2]

    def asked(x: Layout, skip: bool, none: bool) -> Layout:
        if skip:
            return x
        if none:
            return Layout(x.mesh, x.shape, [() if k == d else out.dims[k] for k in range(ndim)], out.partial)
        return next(chosen)
    return tuple(asked(x, skip, none) for x, skip, none in zip(ins, skipped, rowless)), out


def stack_rule(node: Any, ins: Sequence[Layout], cost) -> tuple[tuple[Layout, ...], Any]:
    d = _dim(_arg(node, 1, "dim", 0), ins[0].ndim + 1)
    out_shape = list(node.meta["val"].shape)
    best = None
    for t in _stack_candidates(ins, None):
        required = tuple(Layout(x.mesh, x.shape, t.dims, t.partial) for x in ins)
        dims = list(t.dims)
        dims.insert(d, ())
        out = Layout(t.mesh, out_shape, dims, t.partial)
        c = sum(cost(x, r) for x, r in zip(ins, required))
        if best is None or c < best[0]:
            best = (c, required, out)
    return best[1], best[2]
