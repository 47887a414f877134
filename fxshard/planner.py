"""Redistribution plans: the cheapest sequence of steps from one layout to another.

Dijkstra over layouts (written over atoms, see ``atoms.py``). From each layout the moves
are collectives on a group of atoms (one mesh axis, a sub-axis, or several flattened into
one group) that move those atoms toward where the target has them: all_gather, all_reduce,
reduce_scatter, all_to_all, local_shard and local_partial. Moves are target-directed: an
atom is inserted into a dim only where the target has it, so the graph stays small; the one
exception is a partial sum, which may be reduce-scattered early into any dim ("parked") so
that later steps move 1/n of the data. One
more edge, ``exchange``, goes straight to the target's shards from the first few layouts
with no reduction pending: an all_to_all with per-peer sizes over the atoms that differ, in
which every rank receives exactly the elements it lacks (the lower bound; see
``exchange.py``). Step costs are alpha-beta per group (``CostModel``) plus local copies.

Bytes are those the busiest rank receives over the network, per step; a plan's
``bytes_per_rank`` adds its steps' figures.
"""
from __future__ import annotations

import functools
import heapq
import itertools
from dataclasses import dataclass
from typing import Iterator, Sequence

import sympy
import torch

from .atoms import LOCAL, AtomError, Atoms, State, atoms_in, canonical_dim, local_numel, localized, moving_atoms, stride_of
from .layout import Layout, LayoutError
from .mesh import MeshAxis, Size, as_size

STEP_KINDS = ("all_gather", "all_reduce", "reduce_scatter", "all_to_all", "exchange", "local_shard", "local_partial")
MAX_STATES = 4000  # a search that pops more layouts than this falls back to its best plan so far
EXCHANGE_TRIES = 3  # exchanges are priced from the first layouts popped with no reduction pending


@dataclass(frozen=True)
class CostModel:
    """Alpha-beta cost per collective: ``latency + bytes / bandwidth`` of its mesh axes.

    ``bandwidth`` and ``latency`` map axis names to bytes/s and seconds; other axes use the
    defaults (one node). A collective over several axes (a flattened group) runs at the
    slowest bandwidth and the largest latency among them. ``copy_bandwidth`` prices local
    copies (slicing, permutes, packing).
    """

    default_bandwidth: float = 100e9
    default_latency: float = 10e-6
    copy_bandwidth: float = 1000e9
    bandwidth: tuple[tuple[str, float], ...] = ()
    latency: tuple[tuple[str, float], ...] = ()

    def axis_bandwidth(self, axis: MeshAxis) -> float:
        return self._bandwidths.get(axis.name, self.default_bandwidth)

    def axis_latency(self, axis: MeshAxis) -> float:
        return self._latencies.get(axis.name, self.default_latency)

    @functools.cached_property
    def _bandwidths(self) -> dict[str, float]:
        return dict(self.bandwidth)

    @functools.cached_property
    def _latencies(self) -> dict[str, float]:
        return dict(self.latency)

    def collective_cost(self, axes: Sequence[MeshAxis], nbytes: Size) -> float:
        return max(self.axis_latency(a) for a in axes) + _numeric(nbytes) / min(self.axis_bandwidth(a) for a in axes)

    def copy_cost(self, nbytes: Size) -> float:
        return _numeric(nbytes) / self.copy_bandwidth


DEFAULT_COST_MODEL = CostModel()


@dataclass(frozen=True)
class Step:
    """One step of a plan: ``kind`` on the flattened group ``axes`` (mesh order, major first)."""

    kind: str
    axes: tuple[MeshAxis, ...]
    before: Layout
    after: Layout
    dim: int | None = None  # the tensor dim gathered / sharded (all_to_all: the gathered one), if one
    to_dim: int | None = None  # all_to_all: the dim that becomes sharded, if one
    reduce_op: str | None = None
    bytes_per_rank: Size = 0

    def __post_init__(self) -> None:
        if self.kind not in STEP_KINDS:
            raise ValueError(f"unknown step kind {self.kind!r}; expected one of {STEP_KINDS}")
        if not self.axes:
            raise ValueError(f"a {self.kind} step needs at least one mesh axis")

    @property
    def axis(self) -> MeshAxis:
        """The one mesh axis of a single-axis step."""
        if len(self.axes) != 1:
            raise ValueError(f"step {self} runs on a flattened group of {len(self.axes)} axes")
        return self.axes[0]

    @property
    def group_size(self) -> Size:
        n: Size = 1
        for a in self.axes:
            n = n * a.size
        return as_size(n)

    @property
    def is_local(self) -> bool:
        return self.kind.startswith("local")

    def __str__(self) -> str:
        where = f" dim {self.dim}" if self.dim is not None else ""
        if self.to_dim is not None:
            where = f" dim {self.dim if self.dim is not None else '*'}->{self.to_dim}"
        op = f" {self.reduce_op}" if self.reduce_op else ""
        return f"{self.kind}({','.join(str(a) for a in self.axes)}{where}{op})"


@dataclass(frozen=True)
class Plan:
    src: Layout
    dst: Layout
    steps: tuple[Step, ...]
    cost: float
    dtype: torch.dtype = torch.float32

    @property
    def bytes_per_rank(self) -> Size:
        return as_size(sum((s.bytes_per_rank for s in self.steps), 0))

    @property
    def collectives(self) -> tuple[Step, ...]:
        return tuple(s for s in self.steps if not s.is_local)

    def __str__(self) -> str:
        return f"{self.src} -> {self.dst}: " + (", ".join(str(s) for s in self.steps) or "no-op")


def numel(shape: Sequence[Size]) -> Size:
    n: Size = 1
    for s in shape:
        n = n * s
    return as_size(n)


def dtype_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _numeric(x: Size) -> float:
    """A float for ranking costs; symbolic sizes are evaluated at their hints (fxshard/hints.py)."""
    if isinstance(x, (int, float)):
        return float(x)
    from .hints import at_hints

    return float(at_hints(x))


def collective_bytes(kind: str, n: Size, local_bytes: Size) -> Size:
    """Bytes one rank receives in a collective over ``n`` ranks on ``local_bytes`` per rank."""
    if kind == "all_gather":
        return as_size((n - 1) * local_bytes)
    factor = {"all_reduce": 2, "reduce_scatter": 1, "all_to_all": 1}.get(kind, 0)
    if not factor:
        return 0
    if isinstance(n, int) and isinstance(local_bytes, int):
        return -(-factor * (n - 1) * local_bytes // n)  # uneven chunks: the busiest rank rounds up
    return as_size(sympy.sympify(factor * (n - 1) * local_bytes) / n)


# ---- the public entry points -------------------------------------------------------------------

def plan_redistribute(src: Layout, dst: Layout, shape: Sequence[int] | None = None,
                      dtype: torch.dtype = torch.float32, cost_model: CostModel | None = None) -> Plan:
    """The cheapest steps that turn a tensor of layout ``src`` into layout ``dst`` on every rank."""
    if shape is not None and tuple(shape) != tuple(src.shape):
        raise ValueError(f"shape {list(shape)} does not match the layouts' shape {list(src.shape)}")
    if src.shape != dst.shape or src.mesh != dst.mesh:
        raise LayoutError(f"cannot redistribute between different shapes or meshes: {src} ({list(src.shape)}, "
                          f"{src.mesh}) -> {dst} ({list(dst.shape)}, {dst.mesh})")
    return _plan_cached(src, dst, dtype, cost_model or DEFAULT_COST_MODEL)


def redistribute_cost(src: Layout, dst: Layout, dtype: torch.dtype = torch.float32,
                      cost_model: CostModel | None = None) -> float:
    if src == dst:
        return 0.0
    return plan_redistribute(src, dst, dtype=dtype, cost_model=cost_model).cost


def clear_plan_cache() -> None:
    _plan_cached.cache_clear()


# ---- the search --------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Move:
    kind: str
    ids: frozenset
    state: State
    reduce_op: str | None = None
    axes: tuple = ()  # the exchange's group (its atoms are not in ``ids``)


class _Search:
    """Everything one planning problem needs: atoms, target, sizes, costs."""

    def __init__(self, src: Layout, dst: Layout, dtype: torch.dtype, model: CostModel):
        self.src, self.dst, self.model = src, dst, model
        self.itemsize = dtype_size(dtype)
        self.atoms = Atoms.of([src, dst])
        self.sizes = [a.size for a in self.atoms.axes]
        self.start, self.goal = self.atoms.state(src), self.atoms.state(dst)
        self.goal_where = _where(self.goal)
        self.goal_strides = [stride_of(p) for p in self.goal[0]]
        self._local_bytes: dict = {}
        self._groups: dict = {}

    # -- moves --------------------------------------------------------------------------------
    def moves(self, state: State) -> Iterator[_Move]:
        """Moves of atoms not yet where the goal has them, grouped by (from, to) kind."""
        where = _where(state)
        strides = [stride_of(p) for p in state[0]]
        classes: dict[tuple, list[int]] = {}
        for a in range(len(self.sizes)):
            here, there = where.get(a), self.goal_where.get(a)
            if here == there and (here is None or here[0] == "p" or self._in_place(state, strides[here[1]], a, here[1])):
                continue
            key = (here[0] if here else "free", there[0] if there else "free", here and here[0] == "p" and here[1])
            classes.setdefault(key, []).append(a)
        for (src_kind, dst_kind, _), members in classes.items():
            for ids in _groups(members, self.atoms.axes):
                yield from self._moves_for(state, where, src_kind, dst_kind, ids)

    def _in_place(self, state: State, dim_strides: dict, a: int, d: int) -> bool:
        """Whether atom ``a``, in dim ``d`` at ``dim_strides[a]``, sits where the goal has it."""
        if dim_strides[a] == -1:  # uneven: only an identical dim is in place
            return state[0][d] == self.goal[0][d]
        return dim_strides[a] == self.goal_strides[d].get(a)

    def _moves_for(self, state: State, where: dict, src_kind: str, dst_kind: str, ids: frozenset) -> Iterator[_Move]:
        dims, partial = state
        if src_kind == "p":
            op = where[next(iter(ids))][1]
            rest = tuple(p for p in partial if p[0] not in ids)
            yield _Move("all_reduce", ids, (dims, rest), op)
            if dst_kind == "d":
                new = self._insert(dims, ids, padded_reduce=True)
                if new is not None:
                    yield _Move("reduce_scatter", ids, (new, rest), op)
            for e in range(len(dims)):  # reduce early into any dim: later steps move 1/n of the data
                parked = self._park(dims, ids, e)
                if parked is not None:
                    yield _Move("reduce_scatter", ids, (parked, rest), op)
            return
        if src_kind == "d":
            if any(self._chunked(dims, a) for a in ids) and not self._gatherable_chunk(dims, ids):
                return
            gathered = tuple(localized(p, ids) for p in dims)
            yield _Move("all_gather", ids, (gathered, partial))
            if dst_kind == "d" and not any(self._chunked(dims, a) for a in ids):
                new = self._insert(gathered, ids, even_only=True)
                if new is not None and _disjoint_places(dims, new, ids):
                    yield _Move("all_to_all", ids, (new, partial))
            return
        # free atoms: shard locally toward the target, or make them partial
        if dst_kind == "d":
            new = self._insert(dims, ids, local_chunk=True)
            if new is not None:
                yield _Move("local_shard", ids, (new, partial))
        elif dst_kind == "p":
            op = self.goal_where[next(iter(ids))][1]
            if all(o == op for _, o in partial):
                yield _Move("local_partial", ids, (dims, tuple(sorted(partial + tuple((a, op) for a in ids)))), op)

    def _insert(self, dims: tuple, ids: frozenset, even_only: bool = False, local_chunk: bool = False,
                padded_reduce: bool = False) -> tuple | None:
        """``dims`` with ``ids`` sharded where the target has them, if the rest of each dim allows."""
        out = list(dims)
        for e, target in enumerate(self.goal[0]):
            mine = ids & atoms_in(target)
            if not mine:
                continue
            keep = atoms_in(dims[e]) | mine
            candidate = localized(target, atoms_in(target) - keep)
            if localized(candidate, mine) != dims[e]:
                return None
            chunked = [i for i, p in enumerate(candidate) if p[2] and p[1] in mine]
            if chunked:
                if padded_reduce and len(ids) == 1 and len(candidate) == 1:
                    out[e] = candidate  # a padded reduce_scatter (DTensor's way), then the tail is cut
                    continue
                if even_only or not local_chunk or len(ids) != 1:
                    return None
                if any(p[1] == LOCAL for p in candidate[:chunked[0]]):
                    return None  # an uneven shard of a strided block: no local lowering
            out[e] = candidate
        return tuple(out)

    def _park(self, dims: tuple, ids: frozenset, e: int) -> tuple | None:
        """``dims`` with ``ids`` sharding the front of dim ``e``'s last local piece, where it divides."""
        pieces = dims[e]
        last = max((i for i, p in enumerate(pieces) if p[1] == LOCAL), default=None)
        if last is None or (last + 1 < len(pieces) and pieces[last + 1][2]):
            return None
        n = self.group(ids)[1]
        size = pieces[last][0]
        if not (isinstance(size, int) and isinstance(n, int) and size % n == 0):
            return None
        new = pieces[:last] + tuple((self.sizes[a], a, False) for a in sorted(ids)) + \
            ((size // n, LOCAL, False),) + pieces[last + 1:]
        out = list(dims)
        out[e] = canonical_dim(new)
        return tuple(out)

    @staticmethod
    def _chunked(dims: tuple, a: int) -> bool:
        return any(p[1] == a and p[2] for pieces in dims for p in pieces)

    @staticmethod
    def _gatherable_chunk(dims: tuple, ids: frozenset) -> bool:
        """An uneven all_gather pads one chunked piece that is its dim's only piece."""
        return len(ids) == 1 and any(len(p) == 1 and p[0][1] in ids for p in dims)

    # -- costs --------------------------------------------------------------------------------
    def estimate(self, state: State) -> float:
        """A lower bound on the cost left: one latency if a sharded atom is misplaced or a sum pending.

        Local moves only add shards where the goal has them and make free atoms partial, so
        they never turn a state that needs a collective into one that does not.
        """
        if state == self.goal:
            return 0.0
        goal_partial = set(self.goal[1])
        if any(p not in goal_partial for p in state[1]):
            return self._min_latency
        for d, pieces in enumerate(state[0]):
            strides = stride_of(pieces)
            for a in strides:
                if self.goal_where.get(a) != ("d", d) or not self._in_place(state, strides, a, d):
                    return self._min_latency
        return 0.0

    @functools.cached_property
    def _min_latency(self) -> float:
        return min(self.model.axis_latency(a) for a in self.atoms.axes) if self.atoms.axes else 0.0

    def local_bytes(self, state: State) -> Size:
        got = self._local_bytes.get(state)
        if got is None:
            got = self._local_bytes[state] = local_numel(state, self.src.shape, self.sizes) * self.itemsize
        return got

    def group(self, ids: frozenset) -> tuple[tuple[MeshAxis, ...], Size]:
        """(the flattened group of ``ids`` as mesh axes, its size), cached."""
        got = self._groups.get(ids)
        if got is None:
            got = self._groups[ids] = (self.atoms.group(ids), self.atoms.group_size(ids))
        return got

    def step_bytes(self, move: _Move, before: State) -> Size:
        if move.kind.startswith("local"):
            return 0
        n = self.group(move.ids)[1]
        local = self.local_bytes(before)
        if move.kind == "reduce_scatter" and any(p[2] for pieces in move.state[0] for p in pieces if p[1] in move.ids):
            local = as_size(self.local_bytes(move.state) * n)  # padded to n equal chunks
        return collective_bytes(move.kind, n, local)

    def step_cost(self, move: _Move, before: State, nbytes: Size) -> float:
        if move.kind.startswith("local"):
            return self.model.copy_cost(self.local_bytes(move.state))
        return self.model.collective_cost(self.group(move.ids)[0], nbytes)

    # -- the exchange edge --------------------------------------------------------------------
    def exchange_target(self, state: State) -> State | None:
        """The goal's dims with ``state``'s partial axes, if no reduction is pending (then local_partial ends)."""
        if not set(state[1]) <= set(self.goal[1]):
            return None
        return (self.goal[0], state[1])

    def exchange(self, state: State, target: State) -> tuple[tuple, Size, float] | None:
        """(group, bytes, cost) of one exchange from ``state`` to ``target``, when possible."""
        if not self.src.mesh.is_static or not all(isinstance(s, int) for s in self.src.shape):
            return None
        moving = moving_atoms(state, target)
        if not moving:
            return None
        group = self.atoms.group(moving)
        received = _received_even(state, target, self.sizes)
        if received is None:  # uneven or non-nesting: count on the layouts
            from .exchange import received_elements

            before, after = self.atoms.layout(state, self.src.shape), self.atoms.layout(target, self.src.shape)
            received = received_elements(before, after)
        nbytes = received * self.itemsize
        pack = 2 * (self.local_bytes(state) + self.local_bytes(target))  # index gathers on both ends
        cost = self.model.collective_cost(group, nbytes) + self.model.copy_cost(pack)
        return group, nbytes, cost


def _received_even(state: State, target: State, sizes: Sequence[Size]) -> int | None:
    """Elements of its target block the busiest rank lacks (closed form of exchange.received_elements).

    Atoms are the finest sub-axes of the search, so a digit fixed by two different atoms (or
    two parts of one) in the two states is fixed differently on some rank.
    """
    need, both_free = 1, 1
    for here, there in zip(state[0], target[0]):
        if any(p[2] for p in here + there):
            return None
        s_spans, t_spans = _spans(here), _spans(there)
        total = 1
        for p in here:
            total *= p[0]
        bounds = {1, total} | {b for _, lo, n in s_spans + t_spans for b in (lo, lo * n)}
        if not all(isinstance(b, int) for b in bounds):
            return None
        edges = sorted(bounds)
        if any(hi % lo for lo, hi in zip(edges, edges[1:])):
            return None
        for lo, hi in zip(edges, edges[1:]):
            a, b = _digit(s_spans, lo, hi), _digit(t_spans, lo, hi)
            if a is not None and b is not None and a != b:
                return _dst_numel(target)
            if b is None:
                need *= hi // lo
                if a is None:
                    both_free *= hi // lo
    return need - both_free


def _digit(spans: list, lo: int, hi: int) -> tuple | None:
    for atom, s_lo, n in spans:
        if s_lo <= lo and hi <= s_lo * n:
            return (atom, lo // s_lo, hi // lo)
    return None


def _dst_numel(state: State) -> int:
    n = 1
    for pieces in state[0]:
        for s, a, _ in pieces:
            if a == LOCAL:
                n *= s
    return n


def _where(state: State) -> dict[int, tuple]:
    """Atom -> ("d", dim) or ("p", op); free atoms are absent."""
    out: dict[int, tuple] = {}
    for d, pieces in enumerate(state[0]):
        for _, a, _ in pieces:
            if a != LOCAL:
                out[a] = ("d", d)
    for a, op in state[1]:
        out[a] = ("p", op)
    return out


def _disjoint_places(before: tuple, after: tuple, ids: frozenset) -> bool:
    """An all_to_all gathers some index digits and scatters others: the two sets must not overlap.

    (Where an atom leaves a digit that another atom of the group takes, ranks swap whole blocks:
    that is a permutation, which the exchange does, not an all_to_all.)
    """
    for b, a in zip(before, after):
        left = [(s, s * n) for x, s, n in _spans(b) if x in ids]
        taken = [(s, s * n) for x, s, n in _spans(a) if x in ids]
        try:
            if any(lo1 < hi2 and lo2 < hi1 for lo1, hi1 in left for lo2, hi2 in taken):
                return False
        except TypeError:  # symbolic sizes it cannot order: no all_to_all
            return False
    return True


def _spans(pieces: tuple) -> list[tuple[int, Size, Size]]:
    """(atom, stride, size) of each sharded piece of an even dim."""
    out, inner = [], 1
    for s, a, _ in reversed(pieces):
        if a != LOCAL:
            out.append((a, inner, s))
        inner = inner * s
    return out


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


@functools.lru_cache(maxsize=65536)
def _plan_cached(src: Layout, dst: Layout, dtype: torch.dtype, model: CostModel) -> Plan:
    if src == dst:
        return Plan(src, dst, (), 0.0, dtype)
    try:
        search = _Search(src, dst, dtype, model)
    except AtomError:
        return _exchange_only(src, dst, dtype, model)
    found = _dijkstra(search)
    if found is None:
        raise LayoutError(f"no redistribution plan from {src} to {dst} on {src.mesh} (shape {list(src.shape)})")
    return _to_plan(search, *found, dtype)


def _dijkstra(search: _Search) -> tuple[list, float] | None:
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
                    parent[target] = (state, _Move("exchange", frozenset(), target, axes=axes), nbytes)
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


def _to_plan(search: _Search, path: list, cost: float, dtype: torch.dtype) -> Plan:
    atoms, shape = search.atoms, search.src.shape
    steps = []
    for before, move, nbytes in path:
        b, a = atoms.layout(before, shape), atoms.layout(move.state, shape)
        dims_from = sorted({d for d in range(b.ndim) if b.dims[d] != a.dims[d] and atoms_in(before[0][d]) & move.ids})
        dims_to = sorted({d for d in range(b.ndim) if b.dims[d] != a.dims[d] and atoms_in(move.state[0][d]) & move.ids})
        dim, to_dim = _step_dims(move.kind, dims_from, dims_to)
        steps.append(Step(move.kind, move.axes or atoms.group(move.ids), b, a, dim, to_dim, move.reduce_op, nbytes))
    if steps and steps[-1].after != search.dst:
        raise AssertionError(f"planner ended at {steps[-1].after}, not at {search.dst} (from {search.src})")
    return Plan(search.src, search.dst, tuple(steps), cost, dtype)


def _step_dims(kind: str, dims_from: list[int], dims_to: list[int]) -> tuple[int | None, int | None]:
    one = lambda ds: ds[0] if len(ds) == 1 else None  # noqa: E731
    if kind == "all_to_all":
        return one(dims_from), one(dims_to)
    if kind in ("all_gather",):
        return one(dims_from), None
    if kind in ("reduce_scatter", "local_shard"):
        return one(dims_to), None
    return None, None


def _exchange_only(src: Layout, dst: Layout, dtype: torch.dtype, model: CostModel) -> Plan:
    """Layouts the atom states cannot hold together: reduce partials, then one exchange."""
    from .exchange import received_elements

    steps: list[Step] = []
    cur = src
    removed = [(a, op) for a, op in src.partial if (a, op) not in dst.partial]
    if removed:
        kept = tuple(p for p in src.partial if p not in removed)
        after = cur.with_partial(kept)
        axes = tuple(a for a, _ in removed)
        n = numel([a.size for a in axes])
        nbytes = collective_bytes("all_reduce", n, numel(cur.max_local_shape()) * dtype_size(dtype))
        steps.append(Step("all_reduce", axes, cur, after, reduce_op=removed[0][1], bytes_per_rank=nbytes))
        cur = after
    if cur.partial != dst.partial or not src.mesh.is_static:
        raise LayoutError(f"no redistribution plan from {src} to {dst}: their sub-axes do not nest")
    kept = {a.name for a, _ in dst.partial}
    names = {a.name for a in cur.sharded_axes() + dst.sharded_axes()} - kept
    group = tuple(src.mesh.axis(n) for n in src.mesh.names if n in names)
    if group and cur != dst:
        nbytes = received_elements(cur, dst) * dtype_size(dtype)
        steps.append(Step("exchange", tuple(group), cur, dst, bytes_per_rank=nbytes))
    cost = sum(model.collective_cost(s.axes, s.bytes_per_rank) for s in steps)
    return Plan(src, dst, tuple(steps), cost, dtype)
