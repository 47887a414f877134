"""Stage 3's last step: a mean's two reductions made independent, so that one collective carries both.

A mean over sharded values (``cross_entropy``'s default, any ``x.sum() / mask.sum()``) divides a
Partial sum by a count that is itself reduced first. Propagation keeps the quotient Partial (a
Partial numerator over a whole denominator is linear) and reduces it at the output: two
all_reduces, the second reading the first, which no bucketing can merge. Reducing the numerator
before the division moves the same bytes, and then the two reductions are independent; Inductor's
all_reduce bucketing (and ``bucketed_uncompiled``) issues them as one call when their dtypes match:

- ``count_in_float``: a count (the integer sum of a boolean tensor) that its readers make a float
  after its reduction is converted before it, and reduced as that float, when every partial and
  the total are integers the float represents exactly (the boolean tensor's global size bounds them);
- ``reduce_before_scaling``: a reduction of ``num / d`` (or ``num * d``, through ``detach``, ``neg``,
  ``clone``), ``d`` whole on every rank and made by a reduction over the same mesh axes, becomes the
  reduction of ``num``, the division then computed whole. A ``d`` reduced over fewer axes (a count
  of dp-sharded targets, a loss sharded on dp x tp) is first made Partial on the others too, held by
  their first coordinate and zero elsewhere (``local_partial``: exact, and free), and reduced over
  all of them: the same group as ``num``'s, so one call carries both.

Both rewrite the planned graph (its layouts and redistributions), not the plan's bytes: the cost
model prices one call per redistribution and cannot see that two of them share a call.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .costs import CostModel
from .graph import ARG_LAYOUTS, LAYOUT, NEEDED_BY, SRC_LAYOUT, reachable, tensor_inputs, value
from .layout import Layout
from .ops import REDISTRIBUTE
from .redistribute import redistribute_node

aten = torch.ops.aten
# ops linear in one tensor argument (the index), the others whole: a Partial sum passes through them
_LINEAR = {aten.div.Tensor: (0,), aten.mul.Tensor: (0, 1), aten.detach.default: (0,), aten.neg.default: (0,),
           aten.clone.default: (0,), aten.alias.default: (0,)}
_COUNTS = (aten.sum.default, aten.sum.dim_IntList)
_REACH = 4  # how many single-input ops a denominator may pass through after its reduction


def reduce_together(gm: fx.GraphModule, cost_model: CostModel | None = None) -> None:
    """Apply both rewrites to a planned graph, in place."""
    for node in list(gm.graph.nodes):  # each rewrite erases only the reduction it was given
        if _is_sum_reduction(node):
            count_in_float(gm.graph, node, cost_model)
    for node in list(gm.graph.nodes):  # each rewrite erases only the reduction it was given
        if _is_sum_reduction(node):
            reduce_before_scaling(gm.graph, node, cost_model)
    gm.graph.lint()
    gm.recompile()


def _is_sum_reduction(node: fx.Node) -> bool:
    """A redistribution that only sums a Partial (an all_reduce): its layout is its source's, whole."""
    if node.op != "call_function" or node.target is not REDISTRIBUTE:
        return False
    src, dst = node.meta[SRC_LAYOUT], node.meta[LAYOUT]
    return bool(src.partial) and src.reduce_ops == {"sum"} and dst == src.with_partial(())


def _axes(node: fx.Node) -> frozenset:
    return frozenset(axis for axis, _ in node.meta[SRC_LAYOUT].partial)


def count_in_float(graph: fx.Graph, reduction: fx.Node, cost_model: CostModel | None) -> bool:
    """``reduce(int_sum(mask))``, every reader of which makes it a float (``.to(float)``, or dividing or
    multiplying a float by it), -> ``reduce(to_float(int_sum(mask)))``, where that float holds every
    partial and the total exactly: at most the mask's global number of elements."""
    count = reduction.args[0]
    if not (count.op == "call_function" and count.target in _COUNTS and len(count.users) == 1
            and value(count.args[0]).dtype == torch.bool):
        return False
    dtype = _float_of_readers(reduction)
    if dtype is None or value(count.args[0]).numel() > 2 / torch.finfo(dtype).eps:  # 2**24 for float32
        return False  # no one float, or a count it cannot hold exactly
    src, dst = reduction.meta[SRC_LAYOUT], reduction.meta[LAYOUT]
    with graph.inserting_after(count):
        convert = graph.call_function(aten._to_copy.default, (count,), {"dtype": dtype})
    convert.meta.update({"val": value(count).to(dtype), LAYOUT: src, ARG_LAYOUTS: (src,)})
    moved = redistribute_node(graph, convert, src, dst, cost_model)
    moved.meta[NEEDED_BY] = list(reduction.meta[NEEDED_BY])
    reduction.replace_all_uses_with(moved)
    graph.erase_node(reduction)
    return True


def _float_of_readers(reduction: fx.Node) -> torch.dtype | None:
    """The one floating dtype every reader of ``reduction`` converts it to, or None."""
    dtypes = set()
    for user in reduction.users:
        if user.op != "call_function":
            return None
        if user.target is aten._to_copy.default and set(user.kwargs) <= {"dtype", "device", "layout"}:
            dtypes.add(user.kwargs.get("dtype"))
        elif user.target in (aten.div.Tensor, aten.mul.Tensor) and not user.kwargs:
            others = [a for a in user.args if a is not reduction]
            if len(others) != 1 or not isinstance(others[0], fx.Node) \
                    or value(others[0]).dtype != value(user).dtype:
                return None
            dtypes.add(value(user).dtype)
        else:
            return None
    dtype = dtypes.pop() if len(dtypes) == 1 else None
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None


def reduce_before_scaling(graph: fx.Graph, reduction: fx.Node, cost_model: CostModel | None) -> bool:
    """``reduce(f(num, d))`` -> ``f(reduce(num), d)`` for ``f`` linear in ``num`` where ``d`` is the result of a
    reduction over the same axes (or over fewer of them, widened first: ``_reduce_over``): the two
    reductions then read nothing of each other."""
    chain = _linear_chain(reduction)
    axes = _axes(reduction)
    found = [(k, d) for k, (node, i) in enumerate(chain) if (d := _scaling_reduction(node, i, axes)) is not None]
    if not found:
        return False
    deepest, scale = found[-1]
    if _axes(scale) != axes:
        _reduce_over(graph, scale, reduction.meta[SRC_LAYOUT], cost_model)
    whole = reduction.meta[LAYOUT]
    for node, i in chain[:deepest + 1]:
        layouts = list(node.meta[ARG_LAYOUTS])
        layouts[_tensor_position(node, i)] = whole
        node.meta[ARG_LAYOUTS], node.meta[LAYOUT] = tuple(layouts), whole
    node, i = chain[deepest]
    num = node.args[i]
    moved = redistribute_node(graph, num, num.meta[LAYOUT], whole, cost_model)
    moved.meta[NEEDED_BY] = [_consumer(node)]
    node.args = node.args[:i] + (moved,) + node.args[i + 1:]
    reduction.replace_all_uses_with(reduction.args[0])
    graph.erase_node(reduction)
    return True


def _linear_chain(reduction: fx.Node) -> list[tuple[fx.Node, int]]:
    """The ops above ``reduction`` it could move through, nearest first: (op, index of its Partial
    argument); each read by the next alone, its Partial argument in its own layout, shape and dtype."""
    chain, node = [], reduction.args[0]
    reader = reduction
    while node.op == "call_function" and node.target in _LINEAR and list(node.users) == [reader]:
        partial = [i for i in _LINEAR[node.target] if i < len(node.args) and isinstance(node.args[i], fx.Node)
                   and isinstance(node.args[i].meta.get(LAYOUT), Layout) and node.args[i].meta[LAYOUT].partial]
        if len(partial) != 1 or node.kwargs:
            break
        i = partial[0]
        x = node.args[i]
        others = [a for a in tensor_inputs(node) if a is not x]
        if x.meta[LAYOUT] != node.meta[LAYOUT] or _metadata(x) != _metadata(node) \
                or any(a.meta[LAYOUT].partial for a in others):
            break
        chain.append((node, i))
        node, reader = x, node
    return chain


def _scaling_reduction(node: fx.Node, i: int, axes: frozenset) -> fx.Node | None:
    """The sum reduction over ``axes`` (or over some of them) that ``node``'s other tensor argument comes
    from through at most ``_REACH`` single-input ops, not read by ``node``'s Partial argument; or None."""
    num = node.args[i]
    for other in (a for a in tensor_inputs(node) if a is not num):
        for _ in range(_REACH + 1):
            if _is_sum_reduction(other):
                if _axes(other) <= axes and other not in reachable(num, lambda n: n.all_input_nodes):
                    return other
                break
            ins = tensor_inputs(other) if other.op == "call_function" else []
            if len(ins) != 1:
                break
            other = ins[0]
    return None


def _reduce_over(graph: fx.Graph, reduction: fx.Node, wider: Layout, cost_model: CostModel | None) -> None:
    """``reduction`` (a sum over some of ``wider``'s Partial axes) made a sum over all of them: its value
    made Partial on the others first (``local_partial``: the first coordinate holds it, the others
    hold zero), so that it and a reduction over ``wider``'s axes run in the same group."""
    src, whole = reduction.meta[SRC_LAYOUT], reduction.meta[LAYOUT]
    held = {axis for axis, _ in src.partial}
    widened = src.with_partial(tuple(src.partial) + tuple((a, op) for a, op in wider.partial if a not in held))
    x = reduction.args[0]
    spread = redistribute_node(graph, x, src, widened, cost_model, after=reduction)
    spread.meta[NEEDED_BY] = list(reduction.meta[NEEDED_BY])
    reduced = redistribute_node(graph, spread, widened, whole, cost_model)
    reduced.meta[NEEDED_BY] = list(reduction.meta[NEEDED_BY])
    reduction.replace_all_uses_with(reduced)
    graph.erase_node(reduction)


def _tensor_position(node: fx.Node, i: int) -> int:
    """The index among ``node``'s tensor arguments (``ARG_LAYOUTS``'s order) of its argument ``i``."""
    return sum(1 for a in node.args[:i] if isinstance(a, fx.Node) and isinstance(value(a), torch.Tensor))


def _metadata(node: fx.Node) -> tuple:
    val = value(node)
    return (tuple(val.shape), val.dtype)


def _consumer(node: fx.Node) -> str:
    """A reader of a redistribution as ``redistribution_reason`` names it."""
    return "the output" if node.op == "output" else f"%{node.name} ({getattr(node.target, '__name__', node.target)})"

