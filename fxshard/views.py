"""Views as regroupings of pieces.

A view keeps row-major element order, so it maps groups of input dims onto groups of output
dims with equal products (the Mesh-TensorFlow invariant). Within a group the input pieces,
read major to minor, are the pieces of the flattened group; cutting that sequence at the
output dims' sizes gives each output dim its pieces. A cut inside a local piece splits it; a
cut inside a sharded piece splits its mesh axis into sub-axes. Only a cut that divides
neither way needs communication, and then just that group is gathered.
"""
from __future__ import annotations

import math
from typing import Sequence

import sympy

from .hints import assume, at_hints
from .layout import Layout, Piece, _merge_adjacent
from .mesh import Size, as_size, is_static


def _divides(a: Size, b: Size) -> bool:
    """Whether ``a`` divides ``b``; for symbolic sizes, as proved by sympy, else as the hint says
    (then recorded: the result holds for mesh sizes that make this division exact)."""
    if is_static(a) and is_static(b):
        return int(b) % int(a) == 0
    q = sympy.simplify(sympy.sympify(b) / sympy.sympify(a))
    if q.is_integer:
        return True
    at_hint = at_hints(q)
    if at_hint.is_integer and at_hint > 0:
        assume(f"{a} divides {b}")
        return True
    return False


def view_groups(in_shape: Sequence[int], out_shape: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Pairs (input dims, output dims) whose sizes multiply to the same number, in order.

    A tensor with no elements has no order to keep: once a product reaches 0 no product of the
    other side's dims may ever catch up with it, and the dims left on one side need not multiply
    to 1. There the remaining dims of both sides are one last group (its two products may differ:
    [0, 2] as [0, 3] ends in ([1], [1])); ``view_layout`` holds nothing in such a group.
    """
    a, b = [int(s) for s in in_shape], [int(s) for s in out_shape]
    if math.prod(a) != math.prod(b):
        raise ValueError(f"cannot view shape {a} as {b}")
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(a) or j < len(b):
        if i < len(a) and a[i] == 1 and (j >= len(b) or b[j] != 1):
            groups.append(([i], []))
            i += 1
            continue
        if j < len(b) and b[j] == 1 and (i >= len(a) or a[i] != 1):
            groups.append(([], [j]))
            j += 1
            continue
        if i == len(a) or j == len(b):  # one side's dims ran out: only an empty tensor's can
            groups.append((list(range(i, len(a))), list(range(j, len(b)))))
            break
        gi, gj, pa, pb = [i], [j], a[i], b[j]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb and i < len(a):
                gi.append(i)
                pa *= a[i]
                i += 1
            elif pb < pa and j < len(b):
                gj.append(j)
                pb *= b[j]
                j += 1
            else:  # the smaller product is 0 (or the other side ran out): the rest is one group
                gi += range(i, len(a))
                gj += range(j, len(b))
                i, j = len(a), len(b)
                break
        groups.append((gi, gj))
    return groups


def split_pieces(pieces: Sequence[Piece], sizes: Sequence[int]) -> list[list[Piece]] | None:
    """Cut ``pieces`` (major to minor) into dims of ``sizes``; None if a cut needs communication."""
    # pieces of adjacent dims may be one piece: [2] [3] is [6] (cut as 3 x 2), [2@tp/3] [3@tp%3] is [6@tp]
    queue = _merge_adjacent(list(pieces))
    out: list[list[Piece]] = []
    for size in sizes:
        cur: list[Piece] = []
        need = size
        while need != 1:
            if not queue:
                return None
            if queue[0].chunked:  # an uneven shard moves whole, as the last piece of its dim
                if len(queue) != 1 or queue[0].size != need:
                    return None
                cur.append(queue.pop(0))
                break
            p = queue.pop(0)
            if not (is_static(p.size) and is_static(need)):
                if _divides(p.size, need):  # the whole piece fits in this dim
                    cur.append(p)
                    need = as_size(sympy.simplify(sympy.sympify(need) / p.size))
                    continue
                # cut inside a local p: its first ``need`` here, the rest to the next dims (a cut
                # inside a symbolic mesh axis would need sub-axes sympy cannot keep apart: gathered)
                if p.axis is not None or not _divides(need, p.size):
                    return None
                cur.append(Piece(need))
                queue.insert(0, Piece(as_size(sympy.simplify(sympy.sympify(p.size) / need))))
                break
            g = math.gcd(int(p.size), int(need))
            if g == 1:
                return None
            if g == p.size:
                cur.append(p)
            elif p.axis is None:
                cur.append(Piece(g))
                queue.insert(0, Piece(int(p.size) // g))
            else:
                outer, inner = p.axis.split(g)
                cur.append(Piece(g, outer))
                queue.insert(0, Piece(inner.size, inner))
            need //= g
        out.append(cur)
    if any(p.size != 1 or p.axis is not None for p in queue):  # a sharded size-1 dim (~1@tp) cannot vanish
        return None
    return out


def view_layout(src: Layout, out_shape: Sequence[int]) -> tuple[Layout, Layout]:
    """(required input layout, output layout) for viewing a tensor of layout ``src`` as ``out_shape``.

    The required input equals ``src`` whenever the view needs no communication; otherwise the
    dims of the groups that cannot be cut are made local.
    """
    required = list(src.dims)
    out_dims: list[tuple[Piece, ...]] = [()] * len(out_shape)
    # an empty tensor's block is empty on every rank, in any layout: where its dims cannot be cut
    # (or, in a group of size 0, need not be), its output dims are whole and nothing moves
    empty = math.prod(int(s) for s in src.shape) == 0
    for gi, gj in view_groups(src.shape, out_shape):
        size_in = math.prod(int(src.shape[d]) for d in gi)
        size_out = math.prod(int(out_shape[d]) for d in gj)
        one_to_one = len(gi) == 1 and len(gj) == 1 and size_in == size_out
        if size_in != size_out or (size_in == 0 and not one_to_one):
            continue
        pieces = [p for d in gi for p in src.dims[d]]
        cut = [list(src.dims[gi[0]])] if one_to_one else split_pieces(pieces, [out_shape[d] for d in gj])
        if cut is None and empty:
            continue
        if cut is None:
            for d in gi:
                required[d] = ()
            continue
        for d, ps in zip(gj, cut):
            out_dims[d] = tuple(ps)
    req = Layout(src.mesh, src.shape, required, src.partial)
    return req, Layout(src.mesh, out_shape, out_dims, src.partial)
