"""The planner's search: A* over atom states toward the target layout.

From each state (fxshard/atoms.py) the moves are collectives on a group of atoms (one mesh axis,
a sub-axis, or several flattened into one group) that move those atoms toward where the target
has them: all_gather, all_reduce, reduce_scatter, all_to_all, local_shard and local_partial (from a
free atom, or from a shard: its block is a term of a partial sum, as DTensor 2.15 zero-fills it).
Moves are target-directed: an atom is inserted into a dim only where the target has it, so the
graph stays small; the one exception is a partial sum, which may be reduce-scattered early into
any dim ("parked") so that later steps move 1/n of the data. One more edge, ``exchange``, goes
straight to the target's shards from the first few states with no reduction pending: an
all_to_all with per-peer sizes in which every rank receives exactly the elements it lacks
(fxshard/exchange.py). Step costs come from the cost model (fxshard/costs.py).
"""
from __future__ import annotations

import functools
import heapq
import itertools
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from .atoms import (
    LOCAL,
    UNEVEN,
    AtomPiece,
    Atoms,
    InDim,
    PartialAtom,
    Pending,
    State,
    atoms_in,
    canonical_dim,
    local_numel,
    localized,
    make_state,
    moving_atoms,
    stride_of,
)
from .costs import CostModel, collective_bytes, dtype_size
from .exchange import cuts_nest, received_elements, received_even, spans
from .layout import IDENTITY, LINEAR_REDUCE_OPS, Layout
from .mesh import MeshAxis, Size, as_size
from .plans import MIXED_SUM_AVG, Plan, Step

MAX_STATES = 4000  # a search that pops more states than this falls back to its best plan so far
EXCHANGE_TRIES = 3  # exchanges are priced from the first states popped with no reduction pending


@dataclass(frozen=True)
class Move:
    """One edge of the search: ``kind`` on the atoms ``ids``, arriving at ``state``."""

    kind: str
    ids: frozenset
    state: State
    reduce_op: str | None = None
    axes: tuple = ()  # the exchange's group (its atoms are not in ``ids``)


class Search:
    """Everything one planning problem needs: atoms, target, sizes, costs."""

    def __init__(self, src: Layout, dst: Layout, dtype: torch.dtype, model: CostModel, fill_shards: bool = True):
        self.src, self.dst, self.model = src, dst, model
        # ops a shard may become a Partial term of locally (its block, the op's identity elsewhere)
        self.fills = IDENTITY if fill_shards else {}
        self.itemsize = dtype_size(dtype)
        self.frozen = frozen_dims(src, dst)
        self.shape = _search_shape(src, self.frozen)
        plain_src, plain_dst = (_without_dims(x, self.frozen, self.shape) for x in (src, dst))
        self.atoms = Atoms.of([plain_src, plain_dst])
        self.sizes = [a.size for a in self.atoms.axes]
        self.start, self.goal = self.atoms.state(plain_src), self.atoms.state(plain_dst)
        self.goal_where = _where(self.goal)
        self.goal_strides = [stride_of(p) for p in self.goal.dims]
        self._local_bytes: dict = {}
        self._groups: dict = {}

    def layout(self, state: State) -> Layout:
        """The layout of ``state``, its frozen dims (unequal blocks the search holds still) restored."""
        plain = self.atoms.layout(state, self.shape)
        if not self.frozen:
            return plain
        return Layout(self.src.mesh, self.src.shape,
                      [self.src.dims[d] if d in self.frozen else plain.dims[d] for d in range(plain.ndim)], plain.partial)

    # -- moves --------------------------------------------------------------------------------
    def moves(self, state: State) -> Iterator[Move]:
        """Moves of atoms not yet where the goal has them, grouped by (from, to) kind."""
        where = _where(state)
        strides = [stride_of(p) for p in state.dims]
        classes: dict[tuple, list[int]] = {}
        for a in range(len(self.sizes)):
            here, there = where.get(a), self.goal_where.get(a)
            here_kind, there_kind = type(here), type(there)  # InDim, Pending, or NoneType (a free atom)
            if here == there and (here_kind is not InDim or self._in_place(state, strides[here.dim], a, here.dim)):
                continue
            key = (here_kind, there_kind, _op_class(here.op) if here_kind is Pending else None)
            classes.setdefault(key, []).append(a)
        for (src_kind, dst_kind, _), members in classes.items():
            for ids in _groups(members, self.atoms.axes):
                yield from self._moves_for(state, where, src_kind, dst_kind, ids)

    def _in_place(self, state: State, dim_strides: dict, a: int, d: int) -> bool:
        """Whether atom ``a``, in dim ``d`` at ``dim_strides[a]``, sits where the goal has it."""
        if dim_strides[a] == UNEVEN:  # uneven: only an identical dim is in place
            return state.dims[d] == self.goal.dims[d]
        return dim_strides[a] == self.goal_strides[d].get(a)

    def _moves_for(self, state: State, where: dict, src_kind: type, dst_kind: type, ids: frozenset) -> Iterator[Move]:
        dims, partial = state
        if src_kind is Pending:
            ops = {where[a].op for a in ids}
            op = ops.pop() if len(ops) == 1 else MIXED_SUM_AVG  # one sum over both, divided by the avg atoms
            rest = tuple(p for p in partial if p.atom not in ids)
            yield Move("all_reduce", ids, make_state((dims, rest)), op)
            if dst_kind is InDim:
                new = self._insert(dims, ids, padded_reduce=True)
                if new is not None:
                    yield Move("reduce_scatter", ids, make_state((new, rest)), op)
            for e in range(len(dims)):  # reduce early into any dim: later steps move 1/n of the data
                parked = self._park(dims, ids, e)
                if parked is not None:
                    yield Move("reduce_scatter", ids, make_state((parked, rest)), op)
            return
        if src_kind is InDim:
            if any(self._chunked(dims, a) for a in ids) and not self._gatherable_chunk(dims, ids):
                return
            gathered = tuple(localized(p, ids) for p in dims)
            yield Move("all_gather", ids, make_state((gathered, partial)))
            if dst_kind is Pending and self.goal_where[next(iter(ids))].op in self.fills:
                yield from self._made_partial(gathered, partial, ids)
            if dst_kind is InDim and not any(self._chunked(dims, a) for a in ids):
                new = self._insert(gathered, ids, even_only=True)
                if new is not None and _structured_all_to_all(dims, new, ids):
                    yield Move("all_to_all", ids, make_state((new, partial)))
            return
        # free atoms: shard locally toward the target, or make them partial
        if dst_kind is InDim:
            new = self._insert(dims, ids, local_chunk=True)
            if new is not None:
                yield Move("local_shard", ids, make_state((new, partial)))
        elif dst_kind is Pending:
            yield from self._made_partial(dims, partial, ids)

    def _made_partial(self, dims: tuple, partial: tuple, ids: frozenset) -> Iterator[Move]:
        """local_partial: ``ids`` made partial as the goal has them, with no communication. A free
        atom's coordinate 0 keeps the value; a sharded atom's block is its term, the rest of the dim
        the op's identity (``dims``: the atoms already gathered; only ops with an identity)."""
        op = self.goal_where[next(iter(ids))].op
        if all(p.op == op or {p.op, op} <= LINEAR_REDUCE_OPS for p in partial):
            pending = tuple(sorted(partial + tuple(PartialAtom(a, op) for a in ids)))
            yield Move("local_partial", ids, make_state((dims, pending)), op)

    def _insert(self, dims: tuple, ids: frozenset, even_only: bool = False, local_chunk: bool = False,
                padded_reduce: bool = False) -> tuple | None:
        """``dims`` with ``ids`` sharded where the target has them, if the rest of each dim allows."""
        out = list(dims)
        for e, target in enumerate(self.goal.dims):
            mine = ids & atoms_in(target)
            if not mine:
                continue
            keep = atoms_in(dims[e]) | mine
            candidate = localized(target, atoms_in(target) - keep)
            if localized(candidate, mine) != dims[e]:
                return None
            chunked = [i for i, p in enumerate(candidate) if p.chunked and p.atom in mine]
            if chunked:
                if padded_reduce and len(ids) == 1 and _chunks_local_block(candidate, chunked[0]):
                    out[e] = candidate  # a padded reduce_scatter of the local block (DTensor's way), the tail cut
                    continue
                if even_only or not local_chunk or len(ids) != 1:
                    return None
                if any(p.atom is LOCAL for p in candidate[:chunked[0]]):
                    return None  # an uneven shard of a strided block: no local lowering
                if chunked[0] != len(candidate) - 1:
                    return None  # a chunk inserted before a later chunk re-cuts the block that chunk split:
                    # ranks lack elements of it (issue 19: [~5@a ~1@c] -> [~5@a ~2@b ~1@c]); the inner one comes after
            out[e] = candidate
        return tuple(out)

    def _park(self, dims: tuple, ids: frozenset, e: int) -> tuple | None:
        """``dims`` with ``ids`` sharding the front of dim ``e``'s last local piece, where it divides (a
        frozen dim stands for unequal blocks: nothing parks there)."""
        if e in self.frozen:
            return None
        pieces = dims[e]
        last = max((i for i, p in enumerate(pieces) if p.atom is LOCAL), default=None)
        if last is None or (last + 1 < len(pieces) and pieces[last + 1].chunked):
            return None
        n = self.group(ids)[1]
        size = pieces[last].size
        if not (isinstance(size, int) and isinstance(n, int) and size % n == 0):
            return None
        new = pieces[:last] + tuple(AtomPiece(self.sizes[a], a) for a in sorted(ids)) + \
            (AtomPiece(size // n, LOCAL),) + pieces[last + 1:]
        out = list(dims)
        out[e] = canonical_dim(new)
        return tuple(out)

    @staticmethod
    def _chunked(dims: tuple, a: int) -> bool:
        return any(p.atom == a and p.chunked for pieces in dims for p in pieces)

    @staticmethod
    def _gatherable_chunk(dims: tuple, ids: frozenset) -> bool:
        """An uneven all_gather pads one chunked piece that is its dim's only piece."""
        return len(ids) == 1 and any(len(p) == 1 and p[0].atom in ids for p in dims)

    # -- costs --------------------------------------------------------------------------------
    def estimate(self, state: State) -> float:
        """A lower bound on the cost left: one latency if a sharded atom is misplaced or a sum pending.

        Local moves only add shards where the goal has them and make atoms partial where the goal
        has them so, so they never turn a state that needs a collective into one that does not (a
        shard the goal has partial over an op with an identity may be such a local move: not counted).
        """
        if state == self.goal:
            return 0.0
        goal_partial = set(self.goal.partial)
        if any(p not in goal_partial for p in state.partial):
            return self._min_latency
        for d, pieces in enumerate(state.dims):
            strides = stride_of(pieces)
            for a in strides:
                there = self.goal_where.get(a)
                if type(there) is Pending and there.op in self.fills:
                    continue
                if type(there) is not InDim or there.dim != d or not self._in_place(state, strides, a, d):
                    return self._min_latency
        return 0.0

    @functools.cached_property
    def _min_latency(self) -> float:
        return min(self.model.axis_latency(a) for a in self.atoms.axes) if self.atoms.axes else 0.0

    def local_bytes(self, state: State) -> Size:
        got = self._local_bytes.get(state)
        if got is None:
            got = self._local_bytes[state] = local_numel(state, self.shape, self.sizes) * self.itemsize
        return got

    def group(self, ids: frozenset) -> tuple[tuple[MeshAxis, ...], Size]:
        """(the flattened group of ``ids`` as mesh axes, its size), cached."""
        got = self._groups.get(ids)
        if got is None:
            got = self._groups[ids] = (self.atoms.group(ids), self.atoms.group_size(ids))
        return got

    def step_bytes(self, move: Move, before: State) -> Size:
        if move.kind.startswith("local"):
            return 0
        n = self.group(move.ids)[1]
        local = self.local_bytes(before)
        if move.kind == "reduce_scatter" and any(p.chunked for pieces in move.state.dims for p in pieces
                                                 if p.atom in move.ids):
            local = as_size(self.local_bytes(move.state) * n)  # padded to n equal chunks
        return collective_bytes(move.kind, n, local)

    def step_cost(self, move: Move, before: State, nbytes: Size) -> float:
        if move.kind.startswith("local"):
            return self.model.copy_cost(self.local_bytes(move.state))
        return self.model.collective_cost(self.group(move.ids)[0], nbytes)

    # -- the exchange edge --------------------------------------------------------------------
    def exchange_target(self, state: State) -> State | None:
        """The goal's dims with ``state``'s partial axes (then local_partial, or the pending reductions,
        end the plan: an exchange moves a partial value as any other, and reduces 1/n of the data after
        it); None where a pending reduction's atom shards a dim of the goal."""
        goal_dims = set().union(*(atoms_in(d) for d in self.goal.dims)) if self.goal.dims else set()
        if any(p.atom in goal_dims for p in state.partial if p not in set(self.goal.partial)):
            return None
        return make_state((self.goal.dims, state.partial))

    def exchange(self, state: State, target: State) -> tuple[tuple, Size, float] | None:
        """(group, bytes, cost) of one exchange from ``state`` to ``target``, when possible."""
        if not self.src.mesh.is_static or not all(isinstance(s, int) for s in self.src.shape):
            return None
        moving = moving_atoms(state, target)
        if not moving:
            return None
        group = self.atoms.group(moving)
        received = received_even(state, target)
        if received is None:  # uneven or non-nesting: count on the layouts
            before, after = self.layout(state), self.layout(target)
            received = received_elements(before, after)
        nbytes = received * self.itemsize
        pack = 2 * (self.local_bytes(state) + self.local_bytes(target))  # index gathers on both ends
        cost = self.model.collective_cost(group, nbytes) + self.model.copy_cost(pack)
        return group, nbytes, cost


def frozen_dims(src: Layout, dst: Layout) -> frozenset[int]:
    """Dims of unequal blocks (an uneven _StridedShard) that two layouts share: the search holds them
    still, as one local piece of the most elements a rank has there (no atom state holds such a dim)."""
    return frozenset(d for d, pieces in enumerate(src.dims)
                     if pieces == dst.dims[d] and any(p.uneven_blocks for p in pieces))


def _search_shape(layout: Layout, frozen: frozenset[int]) -> tuple:
    """``layout``'s shape with each frozen dim the most elements one rank holds of it."""
    coords = list(layout.mesh.coordinates()) if frozen else []
    return tuple(max(len(layout.local_index_list(d, c)) for c in coords) if d in frozen else size
                 for d, size in enumerate(layout.shape))


def _without_dims(layout: Layout, frozen: frozenset[int], shape: tuple) -> Layout:
    """``layout`` in the search's shape, its frozen dims local."""
    if not frozen:
        return layout
    return Layout(layout.mesh, shape, [() if d in frozen else p for d, p in enumerate(layout.dims)], layout.partial)


def _chunks_local_block(pieces: tuple, i: int) -> bool:
    """Whether the chunked piece ``pieces[i]`` splits a dim's whole local block: it is the last piece
    and every piece before it is sharded (the block a rank holds, cut with torch.chunk)."""
    return i == len(pieces) - 1 and all(p.atom is not LOCAL for p in pieces[:i])


def _op_class(op: str) -> str:
    """Pending ops reduced together: sum and avg (sum, then a division), or one other op alone."""
    return MIXED_SUM_AVG if op in LINEAR_REDUCE_OPS else op


def _where(state: State) -> dict[int, InDim | Pending]:
    """Atom -> the dim it shards (stride left out) or the reduction pending over it; free atoms are absent."""
    out: dict[int, InDim | Pending] = {}
    for d, pieces in enumerate(state.dims):
        for _, atom, _ in pieces:
            if atom is not LOCAL:
                out[atom] = InDim(d, None)
    for atom, op in state.partial:
        out[atom] = Pending(op)
    return out



def _structured_all_to_all(before: tuple, after: tuple, ids: frozenset) -> bool:
    """Whether an all_to_all (equal blocks, one per peer) carries ``before`` to ``after``.

    It gathers some index digits and scatters others, so every dim must be a product of digits
    whole on both sides (its cuts nest: lowering views the block as them, and each rank keeps
    exactly 1/n of its block, as ``collective_bytes`` counts), and the gathered and scattered
    digits must not overlap (where an atom leaves a digit that another atom of the group takes,
    ranks swap whole blocks: a permutation, which the exchange does). Where the cuts do not
    nest, ranks keep unequal parts of their blocks: only the exchange moves that, at its real
    count.
    """
    for b, a in zip(before, after):
        if not cuts_nest(b, a):
            return False
        left = [(s, s * n) for x, s, n in spans(b) if x in ids]
        taken = [(s, s * n) for x, s, n in spans(a) if x in ids]
        try:
            if any(lo1 < hi2 and lo2 < hi1 for lo1, hi1 in left for lo2, hi2 in taken):
                return False
        except TypeError:  # symbolic sizes it cannot order: no all_to_all
            return False
    return True


def _groups(members: list[int], axes: Sequence[MeshAxis]) -> list[frozenset]:
    """The groups a class of atoms is tried in: each atom, each mesh axis's atoms, and all of them."""
    out = [frozenset([a]) for a in members]
    by_name: dict[str, list[int]] = {}
    for a in members:
        by_name.setdefault(axes[a].name, []).append(a)
    out += [frozenset(v) for v in by_name.values() if len(v) > 1]
    if len(by_name) > 1:
        out.append(frozenset(members))
    return list(dict.fromkeys(out))


def shortest_path(search: Search) -> tuple[list, float] | None:
    """A* (Dijkstra with an admissible, consistent estimate: one latency while a collective remains)."""
    start, goal = search.start, search.goal
    best: dict[State, float] = {start: 0.0}
    parent: dict[State, tuple] = {}
    heap: list = [(search.estimate(start), 0, 0.0, start)]
    counter = itertools.count(1)
    exchanges_left = EXCHANGE_TRIES
    popped = 0

    def push(state: State, cost: float) -> None:
        heapq.heappush(heap, (cost + search.estimate(state), next(counter), cost, state))

    while heap:
        _, _, cost, state = heapq.heappop(heap)
        if cost > best.get(state, float("inf")):
            continue
        if state == goal:
            break
        popped += 1
        if popped > MAX_STATES:
            break
        target = search.exchange_target(state) if exchanges_left else None
        if target is not None and target != state:
            exchanges_left -= 1
            edge = search.exchange(state, target)
            if edge is not None:
                axes, nbytes, c = edge
                if cost + c < best.get(target, float("inf")):
                    best[target] = cost + c
                    parent[target] = (state, Move("exchange", frozenset(), target, axes=axes), nbytes)
                    push(target, cost + c)
        for move in search.moves(state):
            nbytes = search.step_bytes(move, state)
            new_cost = cost + search.step_cost(move, state, nbytes)
            if new_cost < best.get(move.state, float("inf")):
                best[move.state] = new_cost
                parent[move.state] = (state, move, nbytes)
                push(move.state, new_cost)
    if goal not in parent:
        return None
    path = []
    state = goal
    while state != start:
        prev, move, nbytes = parent[state]
        path.append((prev, move, nbytes))
        state = prev
    return path[::-1], best[goal]


def to_plan(search: Search, path: list, cost: float, dtype: torch.dtype) -> Plan:
    atoms = search.atoms
    steps = []
    for before, move, nbytes in path:
        b, a = search.layout(before), search.layout(move.state)
        dims_from = sorted({d for d in range(b.ndim) if b.dims[d] != a.dims[d] and atoms_in(before.dims[d]) & move.ids})
        dims_to = sorted({d for d in range(b.ndim) if b.dims[d] != a.dims[d] and atoms_in(move.state.dims[d]) & move.ids})
        dim, to_dim = _step_dims(move.kind, dims_from, dims_to)
        steps.append(Step(move.kind, move.axes or atoms.group(move.ids), b, a, dim, to_dim, move.reduce_op, nbytes))
    if steps and steps[-1].after != search.dst:
        raise AssertionError(f"planner ended at {steps[-1].after}, not at {search.dst} (from {search.src})")
    return Plan(search.src, search.dst, tuple(steps), cost, dtype)


def _step_dims(kind: str, dims_from: list[int], dims_to: list[int]) -> tuple[int | None, int | None]:
    one = lambda ds: ds[0] if len(ds) == 1 else None  # noqa: E731
    if kind == "all_to_all":
        return one(dims_from), one(dims_to)
    if kind in ("all_gather", "local_partial"):  # local_partial: the dim a shard made partial leaves
        return one(dims_from), None
    if kind in ("reduce_scatter", "local_shard"):
        return one(dims_to), None
    return None, None
