"""Stage 3: insert a planned ``fxshard.redistribute`` wherever a consumer needs another layout.

Layout pins (``fxshard.constrain``) have done their job once propagation honoured them and
are removed here. The plan of every inserted node is in ``node.meta["plan"]``, the consumers that need it in
``node.meta["needed_by"]`` (as text; ``redistribution_reason`` says it in words). A relabelled value
(``t(w)``, a view) is moved at its source where that costs less, its relabelling replayed after
(fxshard/sources.py): an FSDP weight is gathered as stored, not as a strided block of its transpose.
A value made by pointwise ops and views of smaller ones is computed again in the wanted layout
where moving its inputs costs less (fxshard/rebuild.py): a loss's one-hot targets, from token ids.
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from .costs import CostModel
from .graph import ARG_LAYOUTS, LAYOUT, NEEDED_BY, PLAN, SRC_LAYOUT, argument_leaves, copy_node
from .layout import Layout
from .ops import CONSTRAIN, REDISTRIBUTE, SUMMED
from .planner import plan_redistribute
from .rebuild import Rebuild, rebuild, replay, shared_leaves
from .sources import SourceMove, source_move


def insert_redistributes(gm: fx.GraphModule, cost_model: CostModel | None = None) -> fx.GraphModule:
    """Rewrite ``gm`` (propagated) in place so every edge carries the layout its consumer needs."""
    graph = gm.graph
    made: dict[tuple[fx.Node, Layout], fx.Node] = {}  # (value, layout) -> the value in that layout
    moves: dict[tuple[fx.Node, Layout], list[fx.Node]] = {}  # (value, layout) -> the redistributions behind it
    bypassed: list[fx.Node] = []
    seeded, replayed = [], set()  # inputs moved once for several values replayed from them (rebuild.shared_leaves)
    for leaf, layout, values in shared_leaves(_wanted_moves(graph), cost_model):
        made[(leaf, layout)] = redistribute_node(graph, leaf, leaf.meta[LAYOUT], layout, cost_model)
        moves[(leaf, layout)] = [made[(leaf, layout)]]
        seeded.append(made[(leaf, layout)])
        replayed.update(values)
    for node in list(graph.nodes):
        required = node.meta.get(ARG_LAYOUTS)
        if required is None:
            continue
        queue = list(required)

        def fix(a):
            if not _laid_out(a):
                return a
            want = queue.pop(0)
            have = a.meta[LAYOUT]
            if have == want:
                return a
            key = (a, want)
            if key not in made:
                asked = lambda n, layout: (n, layout) in made  # noqa: E731
                move = source_move(a, want, cost_model, moved=asked)
                again = rebuild(a, want, cost_model, moved=asked, always=a in replayed) if move is None else None
                if move is not None:
                    source_key = (move.source, move.layout)
                    if source_key not in made:
                        made[source_key] = redistribute_node(graph, move.source, move.source.meta[LAYOUT],
                                                             move.layout, cost_model, after=a)
                        moves[source_key] = [made[source_key]]
                    made[key] = _replay(graph, move, made[source_key], before=node)
                    moves[key] = moves[source_key]
                    bypassed.extend(move.chain)
                elif again is not None:
                    made[key] = _rebuilt(graph, again, made, moves, before=node, cost_model=cost_model)
                    bypassed.extend(n for n, _ in again.nodes)
                else:
                    made[key] = redistribute_node(graph, a, have, want, cost_model)
                    moves[key] = [made[key]]
            for behind in moves[key]:
                behind.meta[NEEDED_BY].append(_consumer(node))
            return made[key]

        if node.op == "output":
            node.args = pytree.tree_map(fix, node.args)
        else:
            node.args, node.kwargs = pytree.tree_map(fix, (node.args, node.kwargs))
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in seeded:  # right before its first reader (made before them all); none: a source moved instead
        if node.users:
            min(node.users, key=order.__getitem__).prepend(node)
        else:
            graph.erase_node(node)
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in sorted(set(bypassed), key=order.__getitem__, reverse=True):  # relabellings no one reads now
        if not node.users:
            graph.erase_node(node)
    for node in list(graph.nodes):
        if node.target in (CONSTRAIN, SUMMED):  # placed as they ask: marks no later stage reads
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
    graph.lint()
    gm.recompile()
    return gm


def _wanted_moves(graph: fx.Graph) -> list[tuple[fx.Node, Layout]]:
    """Every (value, layout) a consumer reads it in that it does not have, as ``insert_redistributes`` meets them."""
    wanted = []
    for node in graph.nodes:
        required = node.meta.get(ARG_LAYOUTS)
        if required is None:
            continue
        queue = list(required)
        for a in argument_leaves((node.args, node.kwargs)):
            if _laid_out(a):
                want = queue.pop(0)
                if a.meta[LAYOUT] != want:
                    wanted.append((a, want))
    return wanted


def _laid_out(a: object) -> bool:
    """An argument whose layout ``ARG_LAYOUTS`` lists: a tensor node with a layout."""
    return isinstance(a, fx.Node) and LAYOUT in a.meta and isinstance(a.meta.get("val"), torch.Tensor)


def redistribute_node(graph: fx.Graph, x: fx.Node, src: Layout, dst: Layout, cost_model: CostModel | None,
                       after: fx.Node | None = None) -> fx.Node:
    """A planned redistribution of ``x`` from ``src`` to ``dst``, placed right after ``after`` (default: ``x``)."""
    val = x.meta["val"]
    plan = plan_redistribute(src, dst, dtype=val.dtype, cost_model=cost_model)
    with graph.inserting_after(after if after is not None else x):
        node = graph.call_function(REDISTRIBUTE, (x, str(src), str(dst), list(val.shape)))
    node.meta.update({"val": val, LAYOUT: dst, SRC_LAYOUT: src, PLAN: plan, NEEDED_BY: []})
    return node


def _replay(graph: fx.Graph, move: SourceMove, moved: fx.Node, before: fx.Node) -> fx.Node:
    """``move``'s relabelling chain applied to the moved source, placed right before its consumer."""
    value = moved
    for original, layout in zip(move.chain, move.layouts):
        with graph.inserting_before(before):
            value = copy_node(graph, original, lambda a, src=original.args[0], new=value: new if a is src else a)
        value.meta.update({ARG_LAYOUTS: (value.args[0].meta[LAYOUT],), LAYOUT: layout})
    return value


def _rebuilt(graph: fx.Graph, plan: Rebuild, made: dict, moves: dict, before: fx.Node,
             cost_model: CostModel | None) -> fx.Node:
    """``plan`` replayed right before ``before``, its leaves moved (once each: ``made``/``moves`` as
    ``insert_redistributes`` keeps them); the replayed value. Every copy is ``made`` for later consumers."""
    behind: list[fx.Node] = []

    def value_of(leaf: fx.Node, layout: Layout) -> fx.Node:
        if leaf.meta[LAYOUT] == layout:
            return leaf
        key = (leaf, layout)
        if key not in made:
            made[key] = redistribute_node(graph, leaf, leaf.meta[LAYOUT], layout, cost_model)
            moves[key] = [made[key]]
        behind.extend(moves[key])
        return made[key]

    copies = replay(graph, plan, value_of, before)
    for key, copy in copies.items():
        if key not in made:
            made[key], moves[key] = copy, behind
    return copies[plan.nodes[-1]]


def redistribution_reason(node: fx.Node) -> str:
    """Why stage 3 inserted this redistribution: which consumers need which layout of what."""
    users = ", ".join(node.meta.get(NEEDED_BY, ())) or "the output"
    return f"{users} needs %{node.args[0].name} as {node.meta['layout']}, it is {node.meta['src_layout']}"


def _consumer(node: fx.Node) -> str:
    if node.op == "output":
        return "the output"
    if node.target is CONSTRAIN:
        return f"the layout pinned at %{node.name} (a DTensor parallel style or fxshard.constrain)"
    name = getattr(node.target, "__name__", str(node.target))
    return f"%{node.name} ({name})"
