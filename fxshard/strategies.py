"""The strategies of a declared signature, and the cheapest one.

A signature (fxshard/rules.py) names the factors of each dim; a strategy assigns each factor
the pieces it is sharded with (one of the layouts an input already has, or local), and says
through which linear group a Partial input may pass to the output. A strategy costs the
planned redistributions of its inputs, plus what an output it leaves Partial will owe.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from .hints import at_hints
from .layout import Layout, LayoutError, Piece
from .mesh import MeshAxis, MeshSpec, is_static
from .rules import Signature

Price = Callable[[Layout, Layout], float]


@dataclass(frozen=True)
class Strategy:
    inputs: tuple[Layout, ...]
    output: Any  # a Layout, or a tuple of them for a multi-output op
    cost: float

    @property
    def key(self) -> tuple:
        """Lower is better: planned cost (inputs, plus what an output left Partial still owes), then
        a Partial output, then the output's local size (less memory and compute per rank)."""
        outs = self.output if isinstance(self.output, tuple) else (self.output,)
        first = outs[0]
        return (round(self.cost, 12), bool(first.partial), numeric_size(first.max_local_shape()))


def numeric_size(shape: Sequence[Any]) -> float:
    n = 1.0
    for s in shape:
        n *= float(s) if isinstance(s, int) else float(at_hints(s))
    return n


def _factor_candidates(sig: Signature, in_layouts: Sequence[Layout], requested: Sequence[Sequence[Layout]] = (),
                       wanted: Sequence[Layout] = ()) -> dict[str, list[tuple[Piece, ...]]]:
    """Each factor's options: the pieces an input has it in, or is already being moved into for
    another consumer (free to share: one reduce_scatter of a gradient serves both of its uses), or
    the program's output wants the output in (a gradient in its parameter's layout), or local."""
    cands: dict[str, list[tuple[Piece, ...]]] = {}
    pairs = list(zip(sig.inputs, in_layouts))
    pairs += [(dims, layout) for dims, layouts in zip(sig.inputs, requested) for layout in layouts]
    pairs += [(sig.output, layout) for layout in wanted]
    for dims, layout in pairs:
        for d, f in enumerate(dims):
            if f is None:
                continue
            options = cands.setdefault(f, [])
            pieces = _sharded_prefix(layout.dims[d])
            if f not in sig.whole and pieces and pieces not in options:
                options.append(pieces)
    for f in {f for dims in (sig.output,) + sig.extra_outputs for f in dims} - {None}:
        cands.setdefault(f, [])  # a factor only an output has (an RNG state's dims) is local
    for options in cands.values():
        options.append(())  # local: always possible
    return cands


def _sharded_prefix(pieces: tuple[Piece, ...]) -> tuple[Piece, ...]:
    """The pieces up to the last sharded one: the trailing local piece is whatever the dim's size
    leaves, so one factor may span dims of different sizes (grouped-query attention's q heads are
    k's heads times the group: the same pieces over k's heads, each of fewer local heads)."""
    last = max((i for i, p in enumerate(pieces) if p.axis is not None), default=-1)
    return pieces[:last + 1]


def fit(pieces: tuple[Piece, ...], size: Any) -> tuple[tuple[Piece, ...], tuple[MeshAxis, ...]]:
    """The major pieces of a factor that a dim of ``size`` holds, and the axes it leaves out.

    A factor spans a smaller dim as its major part (grouped-query attention: k/v head j is q heads
    [jG, (j+1)G)); where the pieces hold more than ``size``, the dim keeps the prefix that ``size``
    allows, a sharded piece it cuts split into sub-axes (q heads [4@tp] over 2 kv heads: [2@tp/2]),
    and is replicated on the axes left out (vLLM: each kv head on the ranks of its q heads).
    """
    sizes = [p.size for p in pieces]
    if not pieces or not is_static(size) or not all(is_static(n) for n in sizes) or any(p.chunked for p in pieces):
        return pieces, ()
    total = 1
    for n in sizes:
        total *= int(n)
    if int(size) % total == 0 or total % int(size):
        return pieces, ()  # it fits (or it cannot: Layout says why)
    kept: list[Piece] = []
    left = int(size)
    for i, p in enumerate(pieces):
        n = int(p.size)
        if left % n == 0:
            kept.append(p)
            left //= n
            continue
        if n % left:
            return pieces, ()
        dropped = tuple(q.axis for q in pieces[i + 1:] if q.axis is not None)
        if left == 1:
            return tuple(kept), ((p.axis,) if p.axis is not None else ()) + dropped
        if p.axis is None:
            return tuple(kept) + (Piece(left),), dropped
        major, minor = p.axis.split(left)
        return tuple(kept) + (Piece(left, major),), (minor,) + dropped
    return tuple(kept), ()


def _partial_candidates(sig: Signature, in_layouts: Sequence[Layout]) -> list[tuple[tuple[int, ...], tuple]]:
    """(group, partial axes) choices: the output stays Partial through one linear group."""
    out: list[tuple[tuple[int, ...], tuple]] = [((), ())]
    for group in sig.partial_groups:
        for i in group:
            p = in_layouts[i].partial if i < len(in_layouts) else ()
            if p and all(op in sig.partial_ops for _, op in p) and (group, p) not in out:
                out.insert(len(out) - 1, (group, p))
    return out


def output_shapes(val: Any) -> tuple:
    if isinstance(val, torch.Tensor):
        return tuple(val.shape)
    return tuple(tuple(v.shape) if isinstance(v, torch.Tensor) else None for v in val)


def choose(sig: Signature, in_layouts: Sequence[Layout], out_shapes: tuple, mesh: MeshSpec,
           cost_of: Callable[[int, Layout], float], price: "Price",
           requested: Sequence[Sequence[Layout]] = (), wanted: Sequence[Layout] = ()) -> Strategy | None:
    """The cheapest strategy of ``sig`` (see Strategy.key); ``cost_of(i, layout)`` prices input i,
    ``price(src, dst)`` a redistribution of the output; ``requested[i]``: layouts input i is moved into
    already; ``wanted``: layouts the program's output requires of the (first) output."""
    if len(sig.inputs) != len(in_layouts):
        return None
    cands = _factor_candidates(sig, in_layouts, requested, wanted)
    factors = sorted(cands)
    best: Strategy | None = None
    for choice in itertools.product(*(cands[f] for f in factors)):
        assign = dict(zip(factors, choice))
        for group, partial in _partial_candidates(sig, in_layouts):
            s = _strategy(sig, assign, group, partial, in_layouts, out_shapes, mesh, cost_of, price, wanted)
            if s is not None and (best is None or s.key < best.key):
                best = s
    return best


def _may_leave_a_rank_empty(pieces: Sequence[Piece]) -> bool:
    """Whether torch.chunk semantics give some rank no element of these pieces (nested chunks: maybe)."""
    chunked = [p for p in pieces if p.chunked]
    if len(chunked) != 1:
        return len(chunked) > 1
    size, n = int(chunked[0].size), int(chunked[0].axis.size)
    return size == 0 or -(-size // -(-size // n)) < n


def _strategy(sig: Signature, assign: Mapping[str, tuple[Piece, ...]], group: tuple[int, ...], partial: tuple,
              in_layouts: Sequence[Layout], out_shapes: tuple, mesh: MeshSpec,
              cost_of: Callable[[int, Layout], float], price: "Price", wanted: Sequence[Layout] = ()) -> Strategy | None:
    try:
        contracted = tuple((p.axis, sig.reduce) for f in sorted(sig.contracted) for p in assign[f] if p.axis is not None)
        if sig.reduce == "avg" and any(p.chunked for f in sig.contracted for p in assign[f]):
            return None
        if sig.reduce in ("max", "min") and any(_may_leave_a_rank_empty(assign[f]) for f in sig.contracted):
            return None  # amax/amin of an empty block has no identity to return

        def partial_of(i: int) -> tuple:
            return (tuple(partial) if i in group else ()) + (contracted if i in sig.addends else ())

        if any(_fitted(sig.inputs[i], in_layouts[i].shape, assign)[1] for i in sig.exact):
            return None
        required = tuple(
            Layout(mesh, layout.shape, _fitted(dims, layout.shape, assign)[0], partial_of(i))
            for i, (dims, layout) in enumerate(zip(sig.inputs, in_layouts)))
        outs = []
        for k, (dims, shape) in enumerate(zip((sig.output,) + sig.extra_outputs,
                                              out_shapes if sig.extra_outputs else (out_shapes,))):
            if shape is None:
                outs.append(None)
                continue
            pieces, left_out = _fitted(dims, shape, assign)
            if left_out and k not in sig.group_sums:
                return None  # an output cannot hold a part of what its factor's pieces say
            summed = tuple((p.axis, "sum") for f in (sig.summed[k] if k < len(sig.summed) else ())
                           for p in assign.get(f, ()) if p.axis is not None)
            outs.append(Layout(mesh, shape, pieces,
                               tuple(partial) + contracted + summed + tuple((a, "sum") for a in left_out)))
        output: Any = tuple(outs) if sig.extra_outputs else outs[0]
    except LayoutError:
        return None
    cost = sum(cost_of(i, dst) for i, dst in enumerate(required))
    first = output[0] if isinstance(output, tuple) else output
    return Strategy(required, output, cost + _debt(first, contracted, price, wanted))


def _debt(out: Layout, contracted: tuple, price: Price, wanted: Sequence[Layout]) -> float:
    """What the output still owes (of the Partial this op makes: one it inherited was owed already):
    the move into the layout the program's output wants it in, if it wants one (a gradient sliced or
    reduce-scattered into its parameter's shard), else the least reduction of that Partial."""
    made = out.with_partial(contracted)
    if wanted:
        return min(0.0 if made == want else price(made, want) for want in wanted)
    return partial_debt(made, price) if contracted else 0.0



def _fitted(dims: Sequence[str | None], shape: Sequence[Any], assign: Mapping[str, tuple[Piece, ...]]
            ) -> tuple[list[tuple[Piece, ...]], tuple[MeshAxis, ...]]:
    """Each dim's pieces (its factor's, ``fit`` to its size) and every axis a dim left out."""
    pieces, left_out = [], ()
    for f, size in zip(dims, shape):
        kept, dropped = fit(assign[f], size) if f is not None else ((), ())
        pieces.append(kept)
        left_out += dropped
    return pieces, left_out


def partial_debt(out: Layout, price: Price) -> float:
    """The least a Partial ``out`` will cost to resolve: reduce_scatter onto one dim, or all_reduce.

    Without it a greedy choice takes a free Partial output (gather the cheap indices of an
    embedding rather than its table) and pays the reduction of a large tensor one op later.
    """
    if not out.partial:
        return 0.0
    resolved = out.with_partial(())
    axes = [a for a, _ in out.partial]
    best = price(out, resolved)
    n = 1
    for a in axes:
        n *= a.size if isinstance(a.size, int) else 0
    for d, pieces in enumerate(out.dims):
        size = out.shape[d]
        if any(p.axis is not None for p in pieces) or not n or not isinstance(size, int) or size % n:
            continue
        try:
            target = resolved.with_dim(d, [Piece(a.size, a) for a in axes] + [Piece(size // n)])
        except LayoutError:
            continue
        best = min(best, price(out, target))
    return best
