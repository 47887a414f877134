"""Redistribute the source of a relabelling, not the relabelled value.

A value that relabels another (``t(w)``, a permute, a view, an expand: ``registry.RELABELS``)
holds the source's elements under other indices. Gathering ``t(w)`` sharded on dim 1 gathers a
strided block, which lowering wraps in permutes and copies; gathering ``w`` as it is stored
(sharded on dim 0) is one contiguous collective, and ``t`` then runs on the whole tensor for
free. So where a consumer needs a relabelled value in another layout, stage 3 moves a source
of its relabelling chain into the layout that relabels into the wanted one, when that costs
less than moving the value itself (copies lowering adds included; a source already moved so
costs nothing), and replays the chain on the result. Two consumers of different relabellings
of one source (``t(w)`` forward, ``t(t(w))`` backward) then share one redistribution.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.fx as fx

from .costs import DEFAULT_COST_MODEL, CostModel
from .graph import LAYOUT, dtype_of, required_layouts
from .layout import Layout, LayoutError
from .op_kinds import VIEW, Context, Declared
from .planner import plan_redistribute
from .plans import Step
from .registry import RELABELS, entry_of, lookup
from .strategies import numeric_size
from .views import view_layout


@dataclass(frozen=True)
class SourceMove:
    """Move ``source`` into ``layout``, then replay ``chain`` (source side first) on the result;
    ``layouts`` are the chain's outputs' layouts (the last one is the layout wanted)."""

    source: fx.Node
    layout: Layout
    chain: tuple[fx.Node, ...]
    layouts: tuple[Layout, ...]


def relabelled(node: fx.Node, src: Layout) -> Layout | None:
    """The layout of relabelling ``node``'s output when its input has layout ``src`` and nothing
    moves (None: the op needs ``src`` moved first); asked of the op's registry entry, as stage 2 does."""
    return produced(node, [src])


def produced(node: fx.Node, in_layouts: Sequence[Layout]) -> Layout | None:
    """The layout of ``node``'s output when its tensor inputs have ``in_layouts`` and nothing moves (None:
    the op would move one), asked of its registry entry as stage 2 does."""
    entry = lookup(node, has_tensor_inputs=True)
    if entry is None or entry.kind is None or not in_layouts:
        return None
    ctx = Context(in_layouts[0].mesh, list(in_layouts), list(in_layouts),
                  lambda i, dst: 0.0 if dst == in_layouts[i] else math.inf, lambda a, b: 0.0)
    try:
        decision = entry.kind(node, ctx)
    except (LayoutError, ValueError):
        return None
    if decision is None or tuple(decision[0]) != tuple(in_layouts) or not isinstance(decision[1], Layout):
        return None
    return decision[1]


def unrelabelled(node: fx.Node, want: Layout) -> Layout | None:
    """A layout of ``node``'s input that ``node`` relabels into ``want`` without moving anything, or None."""
    entry = entry_of(node.target)
    shape = tuple(node.args[0].meta["val"].shape)
    try:
        if entry is not None and entry.kind is VIEW:
            required, out = view_layout(want, shape)  # a view's inverse is the view back
            candidate = out if required == want else None
        elif entry is not None and isinstance(entry.kind, Declared):
            sig = entry.kind.rule(node)  # a permute or broadcast: each input dim is an output dim's factor
            if sig is None or len(sig.inputs) != 1:
                return None
            dims = [want.dims[sig.output.index(f)] if f in sig.output else () for f in sig.inputs[0]]
            candidate = Layout(want.mesh, shape, dims, want.partial)
        else:
            return None
    except (LayoutError, ValueError):
        return None
    return candidate if candidate is not None and relabelled(node, candidate) == want else None


def relabel_chain(value: fx.Node) -> list[fx.Node]:
    """The relabelling ops that lead to ``value`` (its own first, towards its source), each taking
    its input as that input is laid out (a relabelling that needed its input moved ends the chain)."""
    chain = []
    node = value
    while node.op == "call_function" and node.target in RELABELS and isinstance(node.args[0], fx.Node) \
            and LAYOUT in node.args[0].meta and isinstance(node.args[0].meta.get("val"), torch.Tensor) \
            and (required_layouts(node) or (None,))[0] == node.args[0].meta[LAYOUT]:
        chain.append(node)
        node = node.args[0]
    return chain


def _leads(layout: Layout, names: set[str]) -> bool | None:
    """Whether the first piece on the axes ``names`` leads ``layout``'s block in row-major order (no
    local piece larger than 1 before it); None when no piece is on them."""
    if not _holds(layout, names):
        return None
    for pieces in layout.dims:
        for p in pieces:
            if p.axis is not None and p.axis.name in names:
                return True
            if p.axis is None and p.size != 1:
                return False
    return None


def _holds(layout: Layout, names: set[str]) -> bool:
    return any(p.axis is not None and p.axis.name in names for pieces in layout.dims for p in pieces)


def _copied_block(step: Step) -> Layout | None:
    """The larger block of a collective that acts behind a local piece (lowering permutes it and
    copies: a gather of dim 1 of a matrix), None where it acts on the leading piece."""
    names = {a.name for a in step.axes}
    if all(_leads(layout, names) is not False for layout in (step.before, step.after)):
        return None
    return max((step.before, step.after), key=lambda l: numeric_size(l.max_local_shape()))


def served_by_source(value: fx.Node, want: Layout, asked: Callable[[fx.Node, Layout], bool]) -> bool:
    """Whether a source of ``value``'s relabelling chain is ``asked`` for in the layout that relabels into
    ``want``: stage 3 then moves that source once and replays the chain, so ``value`` in ``want`` is free."""
    layout: Layout | None = want
    for node in relabel_chain(value):
        layout = unrelabelled(node, layout)
        if layout is None:
            return False
        if asked(node.args[0], layout):
            return True
    return False


def moving_cost(value: fx.Node, layout: Layout, want: Layout, cost_model: CostModel | None = None) -> float:
    """The planned cost of moving ``value`` from ``layout`` into ``want``, plus the copies lowering
    adds: its block when it is a strided view (a collective reads contiguous memory) and the block
    of every collective that acts behind a local piece."""
    plan = plan_redistribute(layout, want, dtype=dtype_of(value), cost_model=cost_model)
    collectives = plan.collectives
    copied = [b for b in map(_copied_block, collectives) if b is not None]
    val = value.meta["val"]
    if collectives and not val.is_contiguous():
        copied.append(layout)
    nbytes = sum(numeric_size(l.max_local_shape()) for l in copied) * val.element_size()
    return plan.cost + (cost_model or DEFAULT_COST_MODEL).copy_cost(nbytes)


def source_move(value: fx.Node, want: Layout, cost_model: CostModel | None = None,
                moved: Callable[[fx.Node, Layout], bool] = lambda node, layout: False) -> SourceMove | None:
    """The source of ``value``'s relabelling chain whose move into ``want`` costs less than moving
    ``value`` itself, copies included (a source ``moved`` into that layout already costs nothing),
    the furthest of equals; None where no source does better (ties keep the move where it was)."""
    chain = relabel_chain(value)
    if not chain:
        return None
    best, best_cost = None, moving_cost(value, value.meta[LAYOUT], want, cost_model)
    wants = [want]  # wants[k]: the layout chain[k]'s output must have
    for node in chain:
        w = unrelabelled(node, wants[-1])
        if w is None:
            break
        wants.append(w)
    for k in range(len(wants) - 1, 0, -1):  # the furthest source first
        source = chain[k - 1].args[0]
        cost = 0.0 if moved(source, wants[k]) else moving_cost(source, source.meta[LAYOUT], wants[k], cost_model)
        if cost < best_cost:
            best, best_cost = k, cost
    if best is None:
        return None
    return SourceMove(chain[best - 1].args[0], wants[best], tuple(reversed(chain[:best])),
                      tuple(reversed(wants[:best])))
