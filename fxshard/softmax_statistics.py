"""Stage 3's last step: a softmax's max and sum over a sharded dim gathered in one call, not reduced in two.

Softmax and log-softmax over a dim sharded on some mesh axes (vocab-parallel cross-entropy; attention
over sharded keys) decompose into ``m = amax(x)``, all_reduced (max), then ``s = sum(exp(x - m))``,
all_reduced (sum): two collectives, the second reading the first, which no bucketing merges. Each rank
can instead compute its own block's statistics, its max ``a_r`` and ``s_r = sum(exp(x_r - a_r))``, and
gather the pairs in one all_gather; then every rank combines them whole, as online softmax does::

    m = max_r a_r        s = sum_r s_r * exp(a_r - m)

In global terms the rewrite is a view: ``x`` [..., V] with V = k blocks of r on the axes becomes
[..., k, r], its k-dim sharded as V was; the statistics are per block ([..., k, 1], sharded), the
pairs [..., k, 2] are gathered (the k-dim made whole), and the max and the weighted sum over the k-dim
replace the two reduced values for every reader. The same values up to rounding; a block whose max is
-inf (masked attention keys) contributes 0 (its shift is taken as 0, not -inf, so no -inf - -inf).

It is applied where the cost model prices the gather below the two all_reduces: one latency instead
of two, for k/2 times the (small: two floats per row and rank) bytes. Like ``reduce_together``, it
rewrites the planned graph, which the cost model cannot see as one call.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.fx as fx

from .costs import CostModel
from .graph import ARG_LAYOUTS, LAYOUT, NEEDED_BY, PLAN, SRC_LAYOUT, argument_leaves
from .layout import Layout
from .mesh import is_static
from .ops import REDISTRIBUTE
from .planner import redistribute_cost
from .redistribute import redistribute_node

aten = torch.ops.aten


def gather_softmax_statistics(gm: fx.GraphModule, cost_model: CostModel | None = None) -> None:
    """Rewrite every softmax whose max and sum are all_reduced over a sharded dim (in place)."""
    changed = False
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is aten.amax.default:
            found = _match(node)
            if found is not None and _cheaper(*found, cost_model):
                _rewrite(gm.graph, node, *found, cost_model)
                changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()


def _match(amax: fx.Node) -> tuple[fx.Node, int, fx.Node, fx.Node] | None:
    """(x, dim, the reduced max, the reduced sum) of ``amax(x, [dim], True)`` all_reduced (max) and read by
    ``sum(exp(x - max), [dim], True)`` all_reduced (sum) over the same axes, which shard only ``dim``
    of ``x``, as whole blocks; else None."""
    x = amax.args[0]
    dims = amax.args[1] if len(amax.args) > 1 else amax.kwargs.get("dim", ())
    keepdim = amax.args[2] if len(amax.args) > 2 else amax.kwargs.get("keepdim", False)
    layout = x.meta.get(LAYOUT) if isinstance(x, fx.Node) else None
    if not (keepdim and isinstance(layout, Layout) and not layout.partial and len(dims) == 1 and len(amax.users) == 1):
        return None
    d = dims[0] % layout.ndim
    reduced_max = next(iter(amax.users))
    axes = _blocks_axes(layout, d)
    if axes is None or not _all_reduces(reduced_max, "max", axes):
        return None
    for sub in reduced_max.users:
        if sub.target is not aten.sub.Tensor or tuple(sub.args) != (x, reduced_max) or sub.kwargs:
            continue
        for exp in sub.users:
            if exp.target is not aten.exp.default:
                continue
            for total in exp.users:
                if total.target is aten.sum.dim_IntList and len(total.args) == 3 and total.args[2] is True \
                        and [k % layout.ndim for k in total.args[1]] == [d] \
                        and len(total.users) == 1 and _all_reduces(next(iter(total.users)), "sum", axes):
                    return x, d, reduced_max, next(iter(total.users))
    return None


def _blocks_axes(layout: Layout, d: int) -> tuple | None:
    """The axes sharding dim ``d`` of ``layout`` as whole blocks (sharded pieces, then one local piece of
    more than one element), where no other dim is sharded on them; else None."""
    pieces = layout.dims[d]
    if len(pieces) < 2 or pieces[-1].axis is not None or pieces[-1].size == 1 \
            or any(p.axis is None or p.chunked or not is_static(p.size) for p in pieces[:-1]):
        return None  # (a symbolic number of blocks: ``explain`` prices the two reductions)
    axes = tuple(p.axis for p in pieces[:-1])
    others = {p.axis for k, dim in enumerate(layout.dims) if k != d for p in dim if p.axis is not None}
    return None if any(a in others for a in axes) else axes


def _all_reduces(node: fx.Node, op: str, axes: tuple) -> bool:
    """``node`` is a redistribution that only reduces a Partial ``op`` over exactly ``axes``."""
    if node.op != "call_function" or node.target is not REDISTRIBUTE:
        return False
    src, dst = node.meta[SRC_LAYOUT], node.meta[LAYOUT]
    return src.reduce_ops == {op} and {a for a, _ in src.partial} == set(axes) and dst == src.with_partial(())


def _cheaper(x: fx.Node, d: int, reduced_max: fx.Node, reduced_sum: fx.Node, cost_model: CostModel | None) -> bool:
    layout = x.meta[LAYOUT]
    pairs = _blocked(layout, d, 2)
    gather = redistribute_cost(pairs, _blocked(layout, d, 2, whole=True), x.meta["val"].dtype, cost_model)
    return gather < reduced_max.meta[PLAN].cost + reduced_sum.meta[PLAN].cost


def _blocked(layout: Layout, d: int, size: int, whole: bool = False, blocks: int | None = None) -> Layout:
    """``layout`` with dim ``d`` as [k blocks, ``size``]: the blocks sharded as dim ``d`` was, or ``whole``
    (gathered); ``blocks`` replaces k (1: combined over the blocks)."""
    sharded = layout.dims[d][:-1]
    k = math.prod(int(p.size) for p in sharded) if blocks is None else blocks
    shape = [*layout.shape[:d], k, size, *layout.shape[d + 1:]]
    return Layout(layout.mesh, shape, [*layout.dims[:d], () if whole else sharded, (), *layout.dims[d + 1:]])


def _rewrite(graph: fx.Graph, amax: fx.Node, x: fx.Node, d: int, reduced_max: fx.Node, reduced_sum: fx.Node,
             cost_model: CostModel | None) -> None:
    layout = x.meta[LAYOUT]
    blocks, stats = _blocked(layout, d, int(layout.dims[d][-1].size)), _blocked(layout, d, 1)
    pairs, gathered = _blocked(layout, d, 2), _blocked(layout, d, 2, whole=True)
    one_each, combined = _blocked(layout, d, 1, whole=True), _blocked(layout, d, 1, whole=True, blocks=1)
    emit = _Emitter(graph, amax)
    xb = emit(aten.view.default, (x, list(blocks.shape)), blocks)
    block_max = emit(aten.amax.default, (xb, [d + 1], True), stats)
    shift = emit(aten.nan_to_num.default, (block_max, 0.0, 0.0, 0.0), stats)  # a -inf block: shift 0 (sum 0)
    shifted = emit(aten.sub.Tensor, (xb, shift), blocks)
    block_sum = emit(aten.sum.dim_IntList, (emit(aten.exp.default, (shifted,), blocks), [d + 1], True), stats)
    pair = emit(aten.cat.default, ([block_max, block_sum], d + 1), pairs)
    gathered_pairs = redistribute_node(graph, pair, pairs, gathered, cost_model)
    gathered_pairs.meta[NEEDED_BY] = list(reduced_max.meta[NEEDED_BY]) + list(reduced_sum.meta[NEEDED_BY])
    emit.after = gathered_pairs
    maxima = emit(aten.slice.Tensor, (gathered_pairs, d + 1, 0, 1), one_each)
    sums = emit(aten.slice.Tensor, (gathered_pairs, d + 1, 1, 2), one_each)
    top = emit(aten.amax.default, (maxima, [d], True), combined)
    weights = emit(aten.exp.default, (emit(aten.sub.Tensor, (maxima, top), one_each),), one_each)
    total = emit(aten.sum.dim_IntList, (emit(aten.mul.Tensor, (sums, weights), one_each), [d], True), combined)
    for old, new in ((reduced_max, top), (reduced_sum, total)):
        old.replace_all_uses_with(emit(aten.view.default, (new, list(old.meta[LAYOUT].shape)), old.meta[LAYOUT]))
    # the two reductions and what only they read: the per-rank sum of exp(x - max), the local max
    dead = [reduced_sum, reduced_sum.args[0], reduced_sum.args[0].args[0], reduced_max, amax]
    for node in dead:
        if not node.users:
            graph.erase_node(node)


class _Emitter:
    """Adds planned nodes in order after ``after``: each with its global fake value and its layouts."""

    def __init__(self, graph: fx.Graph, after: fx.Node):
        self.graph, self.after = graph, after

    def __call__(self, target: Any, args: tuple, layout: Layout) -> fx.Node:
        with self.graph.inserting_after(self.after):
            node = self.graph.call_function(target, args)
        node.meta["val"] = target(*fx.node.map_arg(args, lambda a: a.meta["val"]))
        node.meta[LAYOUT] = layout
        node.meta[ARG_LAYOUTS] = tuple(a.meta[LAYOUT] for a in argument_leaves(args) if isinstance(a, fx.Node))
        self.after = node
        return node

