"""The exchange: one all_to_all with per-peer sizes in which every rank receives exactly what it lacks.

Over the flattened group of the atoms whose place differs between two layouts, rank r
receives, for each element of its target block it does not hold, that element from one
peer that holds it (the peer of lowest group index). What it receives is therefore the
lower bound for layouts without partial reductions, uneven and strided ones included. The
price is local packing with index gathers, which the cost model charges, so a structured
collective wins whenever it moves as few bytes.

Peers of a rank are the ranks that differ from it only on the group's atoms; an atom in
the same place in both layouts selects the same elements everywhere, so no holder lies
outside the group (replicated axes hold the same data at every coordinate).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from .atoms import LOCAL, State
from .layout import Layout
from .mesh import Coordinate, MeshAxis, Size


def received_elements(src: Layout, dst: Layout) -> int:
    """Max over ranks of the elements of the ``dst`` block a rank does not hold in ``src``.

    Counted per dim (blocks are products of per-dim index sets), deduplicated over the mesh
    coordinates each dim depends on. ``received_even`` is its closed form for even layouts,
    tested against this.
    """
    mesh = src.mesh
    cache: dict[tuple, tuple[int, int]] = {}
    names = [sorted({a.name for p in (src.dims[d] + dst.dims[d]) if (a := p.axis) is not None}) for d in range(src.ndim)]
    worst = 0
    for coord in mesh.coordinates():
        cd = mesh.coordinate_dict(coord)
        need, common = 1, 1
        for d in range(src.ndim):
            key = (d,) + tuple(cd[n] for n in names[d])
            if key not in cache:
                mine, wanted = src.local_indices(d, cd), dst.local_indices(d, cd)
                cache[key] = (len(wanted), int(torch.isin(wanted, mine).sum()))
            n, c = cache[key]
            need, common = need * n, common * c
        worst = max(worst, need - common)
    return worst


# ---- the same count in closed form, on the planner's atom states ----------------------------------
def received_even(state: State, target: State) -> int | None:
    """Elements of its target block the busiest rank lacks: ``received_elements`` in closed form, on
    atom states (None where a dim is uneven or its sub-axes do not nest).

    Atoms are the finest sub-axes of the search, so a digit fixed by two different atoms (or
    two parts of one) in the two states is fixed differently on some rank.
    """
    if any(_numel(pieces) == 0 for pieces in state.dims):
        return 0  # an empty tensor (a dim of size 0): no rank lacks an element
    need, both_free = 1, 1
    for here, there in zip(state.dims, target.dims):
        if any(p.chunked for p in here + there):
            return None
        edges = digit_edges(here, there)
        if edges is None:
            return None
        s_spans, t_spans = spans(here), spans(there)
        for lo, hi in zip(edges, edges[1:]):
            a, b = _digit(s_spans, lo, hi), _digit(t_spans, lo, hi)
            if a is not None and b is not None and a != b:
                return _dst_numel(target)
            if b is None:
                need *= hi // lo
                if a is None:
                    both_free *= hi // lo
    return need - both_free


def digit_edges(here: tuple, there: tuple) -> list[int] | None:
    """Where two states' sharded pieces cut one even dim (strides, ascending, 1 and the dim's size
    included); None where they do not nest or are symbolic.

    Each edge must divide the next for the dim to be a product of digits each whole on both
    sides: ``[2@tp 5] -> [5 2@tp]`` cuts 10 at 2 and 5, and no digit is fixed by tp on both.
    """
    bounds = {1, _numel(here)} | {b for _, lo, n in spans(here) + spans(there) for b in (lo, lo * n)}
    if not all(isinstance(b, int) for b in bounds):
        return None
    edges = sorted(bounds)
    return None if any(hi % lo for lo, hi in zip(edges, edges[1:])) else edges


def cuts_nest(here: tuple, there: tuple) -> bool:
    """Whether one even dim's cuts in two states nest (symbolic sizes: where one state's cuts are
    among the other's, as one layout's always nest)."""
    mine, theirs = _cuts(here), _cuts(there)
    return mine <= theirs or theirs <= mine or digit_edges(here, there) is not None


def _cuts(pieces: tuple) -> set:
    return {b for _, lo, n in spans(pieces) for b in (lo, lo * n)}


def _numel(pieces: tuple) -> Size:
    total: Size = 1
    for p in pieces:
        total = total * p.size
    return total


def _digit(spans: list, lo: int, hi: int) -> tuple | None:
    for atom, s_lo, n in spans:
        if s_lo <= lo and hi <= s_lo * n:
            return (atom, lo // s_lo, hi // lo)
    return None


def _dst_numel(state: State) -> int:
    n = 1
    for pieces in state.dims:
        for p in pieces:
            if p.atom is LOCAL:
                n *= p.size
    return n


def spans(pieces: tuple) -> list[tuple[int, Size, Size]]:
    """(atom, stride, size) of each sharded piece of an even dim."""
    out, inner = [], 1
    for p in reversed(pieces):
        if p.atom is not LOCAL:
            out.append((p.atom, inner, p.size))
        inner = inner * p.size
    return out


# ---- lowering tables: the exchange's index tables ----------------------------------------------------
@dataclass(frozen=True)
class ExchangeTables:
    """What one rank does in an exchange (flat local positions, group order of peers)."""

    send_index: torch.Tensor  # positions in my src block, concatenated in peer order
    send_splits: list[int]
    recv_splits: list[int]
    unpack_index: torch.Tensor  # dst position -> index into cat(my src block, received)


def group_coordinates(axes: tuple[MeshAxis, ...], coord: dict[str, int]) -> list[dict[str, int]]:
    """Coordinates of the ranks in ``coord``'s group over ``axes``, in group order (row-major, axes major first)."""
    out = []
    for digits in itertools.product(*(range(int(a.size)) for a in axes)):
        c = dict(coord)
        for a, v in zip(axes, digits):
            c[a.name] += (v - a.coordinate(coord[a.name])) * int(a.inner)
        out.append(c)
    return out


def _flat_indices(layout: Layout, coord: dict[str, int]) -> torch.Tensor:
    """Global flat index of every element of the rank's block, in local (row-major) order."""
    strides = torch.ones(layout.ndim, dtype=torch.long)
    for d in range(layout.ndim - 2, -1, -1):
        strides[d] = strides[d + 1] * int(layout.shape[d + 1])
    flat = torch.zeros((), dtype=torch.long)
    for d in range(layout.ndim):
        idx = layout.local_indices(d, coord) * strides[d]
        flat = flat.unsqueeze(-1) + idx
    return flat.reshape(-1)


def exchange_tables(src: Layout, dst: Layout, axes: tuple[MeshAxis, ...], coordinate: Coordinate) -> ExchangeTables:
    coord = src.mesh.coordinate_dict(coordinate)
    peers = group_coordinates(axes, coord)
    me = peers.index(coord)
    total = 1
    for s in src.shape:
        total *= int(s)
    held = [_flat_indices(src, p) for p in peers]
    # the holder of each element: lowest group index (each rank first asks itself)
    owner = torch.full((total,), -1, dtype=torch.long)
    owner_pos = torch.zeros(total, dtype=torch.long)
    for i in reversed(range(len(peers))):
        owner[held[i]] = i
        owner_pos[held[i]] = torch.arange(len(held[i]))

    def sources(receiver: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For ``receiver``'s dst block: holder peer and its position, per element (self first)."""
        need = _flat_indices(dst, peers[receiver])
        who, pos = owner[need].clone(), owner_pos[need].clone()
        mine = torch.full((total,), -1, dtype=torch.long)
        mine[held[receiver]] = torch.arange(len(held[receiver]))
        self_pos = mine[need]
        local = self_pos >= 0
        who[local], pos[local] = receiver, self_pos[local]
        if bool((who < 0).any()):
            raise AssertionError(f"exchange {src} -> {dst} over {axes}: an element has no holder in the group")
        return need, who, pos

    send_parts, send_splits = [], []
    for q in range(len(peers)):
        if q == me:
            send_splits.append(0)
            send_parts.append(torch.zeros(0, dtype=torch.long))
            continue
        _, who, pos = sources(q)
        part = pos[who == me]
        send_parts.append(part)
        send_splits.append(len(part))
    _, who, pos = sources(me)
    recv_splits = [0 if p == me else int((who == p).sum()) for p in range(len(peers))]
    # received elements arrive grouped by sender, each group in my dst order
    own = len(held[me])
    unpack = pos.clone()
    offsets = [own + sum(recv_splits[:p]) for p in range(len(peers))]
    for p in range(len(peers)):
        if p == me:
            continue
        sel = who == p
        unpack[sel] = offsets[p] + torch.arange(int(sel.sum()))
    return ExchangeTables(torch.cat(send_parts), send_splits, recv_splits, unpack)
