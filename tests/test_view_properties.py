"""Property test: random layouts x random chains of view-like ops (issue 3).

A chain ``f`` is 1-4 ops drawn from view/reshape, flatten/unflatten, squeeze/unsqueeze,
permute/transpose, split/chunk (one piece), narrow/slice, select, unbind (one piece) and
cat/stack of the tensor with ``t * 2``. It runs on a random mesh (1-3 axes of 2-8, at most 16
ranks) from a random even input layout: DTensor placements (Replicate, Shard, _StridedShard)
or Pieces with sub-axes. Every chain is checked two ways:

1. numerics, always: ``fxshard.simulate(f, x)`` equals ``f(x)`` on one device, exactly (the
   ops only move data and double it);
2. communication, for chains of views, permutes and cat/stack: against an oracle built from
   what each rank holds (DTensor's own split code, or ``Layout.local_indices`` for Piece
   layouts), never from fxshard's propagation. A view keeps row-major element order, so a rank
   can view its block locally iff its elements, read in local order and unraveled into the
   new shape, form a product grid ``I_0 x ... x I_k`` (each ``I_j`` in order of first
   appearance); a permute permutes the grid, a cat/stack with a copy stacks it. When every op
   keeps every rank's elements a grid, fxshard must insert no collective before the graph
   output, the result's layout must hold exactly those grids, and when DTensor placements
   hold them the output needs no redistribution either.
"""
from __future__ import annotations

import itertools
import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import pytest
import torch
import torch.fx as fx
from hypothesis import assume, currently_in_test_context, event, given, note, settings, strategies as st
from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

import fxshard
from fxshard import Layout, LayoutError, MeshSpec, Piece
from fxshard.ops import REDISTRIBUTE
from fxshard.placements import layout_from_placements
from fxshard.registry import RELABELS
from fxshard.sources import relabelled

R = Replicate()
MAX_NUMEL = 2048
Grid = list[list[int]]  # one rank's elements: per-dim global indices, in local order

# ---- chains of ops, as python source -------------------------------------------------------

VIEWS = ("view", "reshape", "flatten", "unflatten", "squeeze", "unsqueeze")
MOVES = ("permute", "transpose", "cat", "stack")
SLICES = ("split", "chunk", "narrow", "slice", "select", "unbind")
VIEW_HEAVY = VIEWS + ("view", "reshape", "reshape", "unflatten")  # regroupings find the interesting cuts

SOURCE = {
    "view": "t.view({})", "reshape": "t.reshape({})", "flatten": "t.flatten({}, {})",
    "unflatten": "t.unflatten({}, {})", "squeeze": "t.squeeze({})", "unsqueeze": "t.unsqueeze({})",
    "permute": "t.permute({})", "transpose": "t.transpose({}, {})",
    "split": "t.split({}, {})[{}]", "chunk": "t.chunk({}, {})[{}]", "narrow": "t.narrow({}, {}, {})",
    "slice": "t[{}{}:{}:{}]", "select": "t.select({}, {})", "unbind": "t.unbind({})[{}]",
    "cat": "torch.cat([t, copy(t)], {})", "stack": "torch.stack([t, copy(t)], {})",
}


@dataclass(frozen=True)
class Op:
    kind: str
    args: tuple

    def __repr__(self) -> str:
        return SOURCE[self.kind].format(*self.args)


def chain_source(ops: Sequence[Op]) -> str:
    return "def f(x):\n    t = x\n" + "".join(f"    t = {op!r}\n" for op in ops) + "    return t\n"


def chain_function(ops: Sequence[Op]) -> Callable:
    """``f(x)``: the chain as a plain python function (Dynamo traces it like user code)."""
    namespace: dict[str, Any] = {"torch": torch, "copy": lambda t: t * 2}
    exec(compile(chain_source(ops), "<chain>", "exec"), namespace)
    return namespace["f"]


def apply(op: Op, t: torch.Tensor) -> torch.Tensor:
    return chain_function([op])(t)


def prime_factors(n: int) -> list[int]:
    out, p = [], 2
    while n > 1:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    return out


@st.composite
def regrouping(draw, shape: Sequence[int]) -> tuple[int, ...]:
    """A shape with as many elements: the prime factors, in order (so shards can stay) or shuffled, cut into dims."""
    factors = [f for s in shape for f in draw(st.permutations(prime_factors(s)))]
    if draw(st.booleans()):
        factors = draw(st.permutations(factors))
    ndim = min(draw(st.sampled_from([2, 3, 1, 4])), max(1, len(factors)))
    cuts = sorted(draw(st.lists(st.integers(0, len(factors)), min_size=ndim - 1, max_size=ndim - 1)))
    bounds = [0] + cuts + [len(factors)]
    out = [math.prod(factors[a:b]) for a, b in zip(bounds, bounds[1:])]
    if len(out) < 5 and draw(st.integers(0, 4)) == 0:
        out.insert(draw(st.integers(0, len(out))), 1)
    return tuple(out)


def _applicable(kind: str, t: torch.Tensor) -> bool:
    n, shape = t.ndim, t.shape
    return {
        "view": n >= 1 and t.is_contiguous(), "reshape": n >= 1, "flatten": n >= 2,
        "unflatten": n >= 1, "squeeze": n >= 2 and 1 in shape, "unsqueeze": 1 <= n <= 4,
        "permute": n >= 2, "transpose": n >= 2,
        "split": any(s >= 2 for s in shape), "chunk": any(s >= 2 for s in shape),
        "narrow": any(s >= 2 for s in shape), "slice": any(s >= 2 for s in shape),
        "select": n >= 2, "unbind": n >= 2,
        "cat": n >= 1 and 2 * t.numel() <= MAX_NUMEL, "stack": 1 <= n <= 4 and 2 * t.numel() <= MAX_NUMEL,
    }[kind]


@st.composite
def op_on(draw, kind: str, t: torch.Tensor) -> Op:
    shape, n = tuple(t.shape), t.ndim
    dim = st.integers(0, n - 1)
    long_dim = st.sampled_from([d for d in range(n) if shape[d] >= 2] or [0])
    if kind in ("view", "reshape"):
        return Op(kind, (draw(regrouping(shape)),))
    if kind == "flatten":
        start = draw(st.integers(0, n - 2))
        return Op(kind, (start, draw(st.integers(start + 1, n - 1))))
    if kind == "unflatten":
        d = draw(dim)
        factors = draw(st.permutations(prime_factors(shape[d])))
        cut = draw(st.integers(0, len(factors)))
        sizes = [math.prod(factors[:cut]), math.prod(factors[cut:])]
        if draw(st.booleans()):
            sizes[draw(st.integers(0, 1))] = -1
        return Op(kind, (d, tuple(sizes)))
    if kind == "squeeze":
        return Op(kind, (draw(st.sampled_from([d for d in range(n) if shape[d] == 1])),))
    if kind == "unsqueeze":
        return Op(kind, (draw(st.integers(0, n)),))
    if kind == "permute":
        return Op(kind, (tuple(draw(st.permutations(range(n)))),))
    if kind == "transpose":
        a, b = draw(st.lists(dim, min_size=2, max_size=2, unique=True))
        return Op(kind, (a, b))
    if kind in ("split", "chunk"):
        d = draw(long_dim)
        k = draw(st.integers(1, shape[d] - 1)) if kind == "split" else draw(st.integers(2, shape[d]))
        pieces = len(t.split(k, d) if kind == "split" else t.chunk(k, d))
        return Op(kind, (k, d, draw(st.integers(0, pieces - 1))))
    if kind == "narrow":
        d = draw(long_dim)
        start = draw(st.integers(0, shape[d] - 1))
        return Op(kind, (d, start, draw(st.integers(1, shape[d] - start))))
    if kind == "slice":
        d = draw(long_dim)
        start = draw(st.integers(0, shape[d] - 1))
        end = draw(st.integers(start + 1, shape[d]))
        return Op(kind, (":, " * d, start, end, draw(st.sampled_from([1, 1, 2]))))
    if kind == "select":
        d = draw(dim)
        return Op(kind, (d, draw(st.integers(-shape[d], shape[d] - 1))))
    if kind == "unbind":
        d = draw(dim)
        return Op(kind, (d, draw(st.integers(0, shape[d] - 1))))
    if kind == "cat":
        return Op(kind, (draw(st.integers(-n, n - 1)),))
    return Op(kind, (draw(st.integers(0, n)),))  # stack


@st.composite
def chains(draw, shape: Sequence[int], kinds: Sequence[str]) -> list[Op]:
    t = torch.empty(shape, device="meta")
    ops = []
    for _ in range(draw(st.integers(1, 4))):
        options = [k for k in kinds if _applicable(k, t)]
        if not options:
            break
        op = draw(op_on(draw(st.sampled_from(options)), t))
        t = apply(op, t)
        ops.append(op)
    return ops


# ---- meshes and input layouts -------------------------------------------------------------------

@st.composite
def meshes(draw) -> MeshSpec:
    sizes: list[int] = []
    for _ in range(draw(st.integers(1, 3))):
        room = 16 // math.prod(sizes)
        if room < 2:
            break
        sizes.append(draw(st.integers(2, min(8, room))))
    return MeshSpec(list(zip("abc", sizes)))


@dataclass(frozen=True)
class Input:
    shape: tuple[int, ...]
    spec: Any  # what ``placements={0: spec}`` gets: DTensor placements or a Layout
    grids: dict[tuple[int, ...], Grid]  # coordinate -> what that rank holds


@st.composite
def placement_inputs(draw, mesh: MeshSpec) -> Input:
    """DTensor placements; every sharded dim is a multiple of its shards (no uneven sizes)."""
    ndim = draw(st.integers(1, 4))
    placements = []
    for _ in mesh.sizes:
        kind, d = draw(st.sampled_from(["S", "S", "S", "R", "SS"])), draw(st.integers(0, ndim - 1))
        placements.append(R if kind == "R" else Shard(d) if kind == "S" else
                          _StridedShard(d, split_factor=draw(st.sampled_from([2, 3]))))
    local = [draw(st.sampled_from([2, 1, 3, 4])) for _ in range(ndim)]
    shape = [1] * ndim
    for p, n in zip(placements, mesh.sizes):
        if not isinstance(p, Replicate):
            shape[p.dim] *= n * (p.split_factor if isinstance(p, _StridedShard) else 1)
    for d in range(ndim):  # the local extents, while the tensor stays small
        if math.prod(shape) * local[d] <= MAX_NUMEL // 2:
            shape[d] *= local[d]
    grids = dtensor_grids(mesh, shape, placements)
    # some _StridedShard factors leave uneven or unfactorizable blocks (fxshard rejects those)
    assume(grids is not None and is_layout(grids, shape, mesh))
    try:
        layout = layout_from_placements(mesh, shape, placements)
    except LayoutError as e:
        raise AssertionError(f"DTensor shards {shape} evenly with {placements}, but fxshard has no layout: {e}")
    assert layout_grids(layout) == grids, f"fxshard's {layout} is not DTensor's {placements} of {shape}"
    return Input(tuple(shape), tuple(placements), grids)


@st.composite
def piece_inputs(draw, mesh: MeshSpec) -> Input:
    """A Layout from Pieces: each mesh axis whole or split into two sub-axes, on any dim, among local pieces."""
    ndim = draw(st.integers(1, 4))
    dims: list[list[Piece]] = [[] for _ in range(ndim)]
    for name, n in zip(mesh.names, mesh.sizes):
        outers = [f for f in range(2, n) if n % f == 0]
        axes = mesh.axis(name).split(draw(st.sampled_from(outers))) if outers and draw(st.booleans()) else \
            (mesh.axis(name),)
        for axis in axes:
            d = draw(st.integers(0, ndim))  # ndim: replicated
            if d < ndim:
                dims[d].append(Piece(axis.size, axis))
    for _ in range(draw(st.integers(0, 3))):
        dims[draw(st.integers(0, ndim - 1))].append(Piece(draw(st.sampled_from([2, 3]))))
    dims = [draw(st.permutations(pieces)) for pieces in dims]
    shape = tuple(math.prod(int(p.size) for p in pieces) for pieces in dims)
    layout = Layout(mesh, shape, dims)
    return Input(shape, layout, layout_grids(layout))


def inputs(mesh: MeshSpec) -> st.SearchStrategy[Input]:
    return st.one_of(placement_inputs(mesh), piece_inputs(mesh))


# ---- the oracle: what each rank holds, from first principles -----------------------------------

def dtensor_block(ids: torch.Tensor, mesh: MeshSpec, placements: Sequence[Any], coord: Sequence[int]) -> torch.Tensor:
    """This rank's block of ``ids`` by DTensor's own split code (mesh dims left to right)."""
    local = ids
    for p, n, c in zip(placements, mesh.sizes, coord):
        if not isinstance(p, Replicate):
            local = p._split_tensor(local, int(n), with_padding=False)[0][c]
    return local


def grid_of(seq: torch.Tensor, shape: Sequence[int]) -> Grid | None:
    """``seq`` (flat row-major indices into ``shape``) as a product grid, or None if it is not one."""
    coords = torch.unravel_index(seq, tuple(shape)) if len(shape) else ()
    grid = [list(dict.fromkeys(c.tolist())) for c in coords]
    if math.prod(len(i) for i in grid) != seq.numel() or not torch.equal(grid_flat(grid, shape), seq):
        return None
    return grid


def grid_flat(grid: Grid, shape: Sequence[int]) -> torch.Tensor:
    """The flat row-major indices of the product grid, in local (row-major) order."""
    flat = torch.zeros(1, dtype=torch.long)
    stride = math.prod(shape)
    for index, size in zip(grid, shape):
        stride //= size
        flat = (flat[:, None] + torch.tensor(index, dtype=torch.long)[None, :] * stride).reshape(-1)
    return flat


def dtensor_grids(mesh: MeshSpec, shape: Sequence[int], placements: Sequence[Any]) -> dict | None:
    """Each rank's grid under DTensor placements; None unless all blocks are grids of one size."""
    ids = torch.arange(math.prod(shape)).reshape(shape)
    blocks = {c: dtensor_block(ids, mesh, placements, c) for c in mesh.coordinates()}
    if len({b.shape for b in blocks.values()}) != 1:
        return None
    grids = {c: grid_of(b.reshape(-1), shape) for c, b in blocks.items()}
    return None if any(g is None for g in grids.values()) else grids


def layout_grids(layout: Layout) -> dict[tuple[int, ...], Grid]:
    return {c: [layout.local_indices(d, c).tolist() for d in range(layout.ndim)] for c in layout.mesh.coordinates()}


def oracle_step(grid: Grid, op: Op, before: Sequence[int], after: Sequence[int]) -> Grid | None:
    """One rank's grid after ``op`` done locally; None if the op cannot be local for this rank."""
    if op.kind in VIEWS:
        return grid_of(grid_flat(grid, before), after)
    if op.kind == "permute":
        return [grid[p] for p in op.args[0]]
    if op.kind == "transpose":
        a, b = op.args
        out = list(grid)
        out[a], out[b] = out[b], out[a]
        return out
    if op.kind == "cat":  # [t, copy(t)]: the copy's elements follow, shifted by the size of the dim
        d = op.args[0] % len(before)
        return grid[:d] + [grid[d] + [i + before[d] for i in grid[d]]] + grid[d + 1:]
    if op.kind == "stack":
        return grid[:op.args[0]] + [[0, 1]] + grid[op.args[0]:]
    raise ValueError(f"the oracle has no rule for {op.kind}")


def is_layout(grids: dict, shape: Sequence[int], mesh: MeshSpec) -> bool:
    """Whether some factorized layout gives every rank exactly its grid.

    In a layout, a rank's indices along dim j are ``corner_j + F_j``: F_j, the sums of the local
    pieces, is the same on every rank, and corner_j sums one digit per sharded piece, each the
    coordinate of one mesh sub-axis times a stride. So: equal F_j everywhere, corners additive
    over mesh axes, each mesh axis made of sub-axes that move one dim each, and the sharded
    digits and F_j tiling ``range(shape[j])`` exactly.
    """
    zero = (0,) * mesh.ndim
    corner = {c: tuple(idx[0] if idx else 0 for idx in g) for c, g in grids.items()}
    free = {c: [[i - b for i in idx] for idx, b in zip(g, corner[c])] for c, g in grids.items()}
    if any(f != free[zero] for f in free.values()) or any(corner[zero]):
        return False

    def unit(m: int, v: int) -> tuple[int, ...]:
        return zero[:m] + (v,) + zero[m + 1:]

    if any(list(b) != [sum(corner[unit(m, v)][j] for m, v in enumerate(c)) for j in range(len(shape))]
           for c, b in corner.items()):
        return False
    digits: list[list[tuple[int, int]]] = [[] for _ in shape]  # per dim: (size, stride) of each sharded digit
    for m, n in enumerate(mesh.sizes):
        moves = axis_digits([corner[unit(m, v)] for v in range(int(n))])
        if moves is None:
            return False
        for j, size, stride in moves:
            digits[j].append((size, stride))
    for j, size in enumerate(shape):
        corners = [0]
        for s, t in digits[j]:
            corners = [b + d * t for b in corners for d in range(s)]
        if sorted(b + f for b in corners for f in free[zero][j]) != list(range(size)):
            return False
    return True


def axis_digits(corners: list[tuple[int, ...]]) -> list[tuple[int, int, int]] | None:
    """How one mesh axis moves a rank's block, as (dim, size, stride) per sub-axis; None if no layout's.

    ``corners[v]``: the block's first index per dim at coordinate v on this axis, 0 on the others.
    Sub-axes are read as prime digits, minor first (any order of the primes), each moving one
    dim by a fixed stride or none (replicated).
    """
    n = len(corners)
    for order in dict.fromkeys(itertools.permutations(prime_factors(n))):
        digits, inner = [], 1
        for size in order:
            moved = [(j, s) for j, s in enumerate(corners[inner]) if s]
            if len(moved) > 1:
                break
            digits += [(j, size, inner, stride) for j, stride in moved]
            inner *= size
        else:
            predicted = [[0] * len(corners[0]) for _ in range(n)]
            for j, size, inner, stride in digits:
                for v in range(n):
                    predicted[v][j] += (v // inner) % size * stride
            if all(tuple(p) == c for p, c in zip(predicted, corners)):
                return [(j, size, stride) for j, size, _, stride in digits]
    return None


def oracle(grids: dict, ops: Sequence[Op], shapes: Sequence[Sequence[int]], mesh: MeshSpec) -> dict | None:
    """Every rank's grid of the result if the chain can run with no communication, else None."""
    for op, before, after in zip(ops, shapes, shapes[1:]):
        grids = {c: oracle_step(g, op, before, after) for c, g in grids.items()}
        if any(g is None for g in grids.values()) or not is_layout(grids, after, mesh):
            return None
    return grids


def dtensor_holding(mesh: MeshSpec, shape: Sequence[int], grids: dict) -> tuple | None:
    """DTensor placements whose blocks are exactly ``grids`` (Shard, _StridedShard, Replicate), if any."""
    ids = torch.arange(math.prod(shape)).reshape(shape)
    zero = (0,) * mesh.ndim
    options = []
    for m, n in enumerate(mesh.sizes):
        moved = {d for v in range(1, n) for d in range(len(shape))
                 if grids[zero[:m] + (v,) + zero[m + 1:]][d] != grids[zero][d]}
        if len(moved) > 1:
            return None
        if not moved:
            options.append([R])
            continue
        d = moved.pop()
        options.append([Shard(d)] + [_StridedShard(d, split_factor=f) for f in range(2, shape[d]) if shape[d] % f == 0])
    want = {c: ids[tuple(torch.tensor(i).reshape([-1 if k == j else 1 for k in range(len(g))])
                         for j, i in enumerate(g))] for c, g in grids.items()}
    for placements in itertools.product(*options):
        if all(torch.equal(dtensor_block(ids, mesh, placements, c), want[c]) for c in grids):
            return placements
    return None


# ---- the check ------------------------------------------------------------------------------------

def shapes_along(shape: Sequence[int], ops: Sequence[Op]) -> list[tuple[int, ...]]:
    t = torch.empty(shape, device="meta")
    out = [tuple(t.shape)]
    for op in ops:
        t = apply(op, t)
        out.append(tuple(t.shape))
    return out


def feeds_only_output(node: fx.Node) -> bool:
    """A value only the graph output reads, itself or through relabellings (stage 3 may move the
    output's redistribution to the source of a relabelling chain, fxshard/sources.py)."""
    return all(u.op == "output" or (u.target in RELABELS and feeds_only_output(u)) for u in node.users)


def result_layout(gm: fx.GraphModule) -> Layout:
    """The layout the chain computes its result in, before any redistribution for the graph output
    (one moved to the source of relabellings before the output is undone: they are replayed on the
    layout it moved from)."""
    (value,) = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    chain = []
    source = value
    while source.target in RELABELS and isinstance(source.args[0], fx.Node):
        chain.append(source)
        source = source.args[0]
    if source.target is not REDISTRIBUTE:
        return value.meta["layout"]
    layout = source.meta["src_layout"]
    for node in reversed(chain):
        layout = relabelled(node, layout)
    return layout


def tell(text: str, count: bool = False) -> None:
    """Hypothesis' note (shown with a failing example) or event (counted in statistics), inside a property."""
    if currently_in_test_context():
        (event if count else note)(text)


def check(mesh: MeshSpec, x_in: Input, ops: list[Op], seed: int) -> None:
    tell(f"{chain_source(ops)}on {mesh}, x: {list(x_in.shape)} {x_in.spec}")
    f = chain_function(ops)
    x = torch.randn(x_in.shape, generator=torch.Generator().manual_seed(seed))
    placements = {0: x_in.spec}
    want = f(x)
    got = fxshard.simulate(f, x, mesh=mesh, placements=placements, strict=True)
    torch.testing.assert_close(got, want, atol=0, rtol=0)

    if not all(op.kind in VIEWS + MOVES for op in ops):
        return
    shapes = shapes_along(x_in.shape, ops)
    assert is_layout(x_in.grids, x_in.shape, mesh)  # the oracle knows a layout when it sees one
    grids = oracle(x_in.grids, ops, shapes, mesh)
    tell(f"oracle: {'no communication' if grids is not None else 'communication'}", count=True)
    if grids is None:
        return
    explained = fxshard.explain(f, x, mesh=mesh, placements=placements, strict=True)
    inside = [str(c) for c in explained.collectives if not feeds_only_output(c.node)]
    assert inside == [], f"every rank can compute its block locally, yet fxshard communicates:\n{explained}"
    layout = result_layout(explained.graph)
    assert layout_grids(layout) == grids, f"the result's layout {layout} is not what the ranks hold:\n{explained}"
    dtensor = dtensor_holding(mesh, shapes[-1], grids)
    tell(f"result as DTensor: {dtensor is not None}", count=True)
    if dtensor is not None:
        assert explained.collectives == [], f"DTensor {dtensor} holds the result as computed:\n{explained}"


# ---- the oracle on cases worked by hand, and what the properties found ------------------------

def tensor_input(mesh: MeshSpec, shape: tuple, spec: Any) -> Input:
    grids = layout_grids(spec) if isinstance(spec, Layout) else dtensor_grids(mesh, shape, spec)
    return Input(shape, spec, grids)


def piece_layout(mesh: MeshSpec, shape: tuple, *dims: Sequence[tuple[int, str | None]]) -> Layout:
    """``(size, axis)`` per piece; an axis ``"b/2"`` or ``"b%2"`` is the major/minor sub-axis of b."""
    def axis(text: str):
        name, _, rest = text.replace("%", "/").partition("/")
        if not rest:
            return mesh.axis(name)
        major, minor = mesh.axis(name).split(mesh.size_of(name) // int(rest))
        return major if "/" in text else minor

    return Layout(mesh, shape, [[Piece(size, axis(a) if a else None) for size, a in pieces] for pieces in dims])


M2, M4, M6, M2x4, M3x2x2 = MeshSpec(a=2), MeshSpec(a=4), MeshSpec(a=6), MeshSpec(a=2, b=4), MeshSpec(a=3, b=2, c=2)

ORACLE_CASES = [  # (mesh, input shape, placements or Layout, chain, no communication possible?)
    (M2, (4, 3), (Shard(0),), [Op("view", ((2, 3, 2),))], True),  # rank a: rows 2a, 2a+1 = [a] [3] [2]
    (M2, (6,), (Shard(0),), [Op("view", ((3, 2),))], False),  # rank 0: 0, 1, 2 = (0,0) (0,1) (1,0)
    (M4, (8,), (Shard(0),), [Op("view", ((2, 4),))], True),  # [2@a/2] [2@a%2 2]
    (M4, (8,), (Shard(0),), [Op("view", ((2, 4),)), Op("view", ((8,),))], True),
    (M2, (6,), (Shard(0),), [Op("view", ((3, 2),)), Op("view", ((6,),))], False),  # the middle is no layout
    (M6, (6,), (Shard(0),), [Op("view", ((2, 3),)), Op("view", ((3, 2),))], True),  # [3@a/2] [2@a%2]
    (M2, (4, 6), (Shard(1),), [Op("transpose", (0, 1)), Op("reshape", ((24,),))], True),  # [2@a 3 4]
    (M2, (4, 6), (Shard(1),), [Op("reshape", ((24,),))], True),  # [4 2@a 3]
    (M2, (4, 6), (Shard(1),), [Op("reshape", ((3, 8),))], False),  # rank 0: columns 0-2 of rows 0-3
    (M2, (2, 4), (Shard(1),), [Op("cat", (0,)), Op("view", ((16,),))], True),  # [2 2 2@a 2]
    # rank (a, b, c) holds element (3b + a, c); as [3, 2, 2] that is ((3b + a) // 2, (3b + a) % 2, c):
    # one element, a grid on every rank, but no layout (dim 0 would mix a and b)
    (M3x2x2, (6, 2), piece_layout(M3x2x2, (6, 2), [(2, "b"), (3, "a")], [(2, "c")]),
     [Op("unflatten", (0, (3, 2)))], False),
    (M2x4, (8,), (_StridedShard(0, split_factor=2), Shard(0)), [Op("unsqueeze", (0,))], True),
]


@pytest.mark.parametrize("mesh, shape, spec, ops, possible", ORACLE_CASES,
                         ids=[f"{shape} {spec} {ops}" for _, shape, spec, ops, _ in ORACLE_CASES])
def test_oracle_on_cases_worked_by_hand(mesh, shape, spec, ops, possible):
    x_in = tensor_input(mesh, shape, spec)
    assert (oracle(x_in.grids, ops, shapes_along(shape, ops), mesh) is not None) == possible


FOUND = [  # minimal cases the properties found; each communicated before its fix
    # views.py: local pieces of adjacent dims were cut one by one ([2@a 2] [3] -> [2@a] [3] [2])
    (M2, (4, 3), (Shard(0),), [Op("view", ((2, 3, 2),))]),
    # views.py: sub-axes of adjacent dims were cut one by one ([2@a/3] [3@a%3] -> [3@a/2] [2@a%2])
    (M6, (6,), (Shard(0),), [Op("view", ((2, 3),)), Op("view", ((3, 2),))]),
    # placements.py: a layout made from these placements had no placements ([2@b/2 2@a 2@b%2])
    (M2x4, (8,), (_StridedShard(0, split_factor=2), Shard(0)), [Op("unsqueeze", (0,))]),
]


@pytest.mark.parametrize("mesh, shape, spec, ops", FOUND, ids=[f"{s} {p} {o}" for _, s, p, o in FOUND])
def test_found_by_the_properties(mesh, shape, spec, ops):
    check(mesh, tensor_input(mesh, shape, spec), ops, seed=0)


# ---- the properties ---------------------------------------------------------------------------------

COMMON = {"deadline": None, "derandomize": True, "database": None}
EXAMPLES = 2 if os.environ.get("FXSHARD_SLOW") == "1" else 1  # the slow tier draws twice as many examples


@settings(max_examples=24 * EXAMPLES, **COMMON)
@given(data=st.data())
def test_views_permutes_and_stacks_need_no_communication_when_ranks_can_view_locally(data):
    mesh = data.draw(meshes(), label="mesh")
    x_in = data.draw(inputs(mesh), label="input")
    ops = data.draw(chains(x_in.shape, VIEW_HEAVY + MOVES), label="chain")
    check(mesh, x_in, ops, data.draw(st.integers(0, 2**31 - 1), label="seed"))


@settings(max_examples=20 * EXAMPLES, **COMMON)
@given(data=st.data())
def test_view_like_chains_compute_the_single_device_result(data):
    mesh = data.draw(meshes(), label="mesh")
    x_in = data.draw(inputs(mesh), label="input")
    ops = data.draw(chains(x_in.shape, VIEW_HEAVY + MOVES + SLICES + SLICES), label="chain")
    check(mesh, x_in, ops, data.draw(st.integers(0, 2**31 - 1), label="seed"))
