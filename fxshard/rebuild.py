"""Serve a value in another layout by computing it again there from its small inputs.

A loss's backward builds its one-hot targets, ``where(eq(arange(V), targets[:, None]) & mask, -g/n, 0)``,
as large as the logits out of a few KiB of token ids, a factory and scalars. Where a consumer
needs them in another layout (vocab-sharded, next to a vocab-parallel loss's sharded logits
gradient, while the token ids are batch-sharded), moving them is an all_to_all of the logits'
size; computing them again in that layout moves the token ids alone. So stage 3, where a
consumer needs a value in another layout, replays the pointwise ops and views that made it, each
in the layout its output must have, reading its inputs moved into the layouts the replay needs
(a factory or a replicated scalar is sliced where it is: nothing moves) whenever that costs
less than moving the value (copies lowering adds and the replayed blocks' writes included). A
Partial value is never replayed nor read as a leaf other than where it is: its reduction stays
where the plan put it, in its dtype (a float16 sum reduced before its cast to float32 rounds otherwise).

It is ``sources.py`` (move the source of a relabelling) for chains with several inputs and
pointwise ops; refinement prices plans with it (``refine.planned_cost``), so that a plan whose
redistributions are cheap this way wins.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.fx as fx

from .costs import DEFAULT_COST_MODEL, CostModel
from .graph import ARG_LAYOUTS, LAYOUT, copy_node, tensor_inputs
from .layout import Layout, LayoutError
from .planner import redistribute_cost
from .registry import CHEAP_FOLLOWERS, RELABELS
from .sources import moving_cost, produced, unrelabelled
from .strategies import numeric_size

REBUILD_DEPTH = 6  # the longest chain of ops replayed for one value


@dataclass(frozen=True)
class Rebuild:
    """Replay ``nodes`` (inputs first; the last one makes the value) each in its layout, reading
    ``leaves`` (value, layout: moved into it unless it has it) and each other's replays."""

    nodes: tuple[tuple[fx.Node, Layout], ...]
    leaves: tuple[tuple[fx.Node, Layout], ...]
    cost: float


def replayable(node: fx.Node) -> bool:
    """A pointwise op, a relabelling or a dtype cast (no collective, no random draw, no reduction, one
    output): running it again costs a fused read of its inputs."""
    if node.op != "call_function" or not isinstance(node.meta.get("val"), torch.Tensor):
        return False
    if node.target in RELABELS or node.target in CHEAP_FOLLOWERS:
        return True
    tags = getattr(node.target, "tags", ())
    return torch.Tag.pointwise in tags and torch.Tag.nondeterministic_seeded not in tags


def broadcast_layout(want: Layout, shape: Sequence[int]) -> Layout | None:
    """The layout of a pointwise op's input of ``shape`` when its output is to have ``want``: the output
    dim's pieces on each dim it broadcasts to with its full size, none on a dim of size 1."""
    offset = len(want.shape) - len(shape)
    if offset < 0:
        return None
    dims = [want.dims[offset + i] if size == want.shape[offset + i] else () for i, size in enumerate(shape)]
    try:
        return Layout(want.mesh, shape, dims, ())
    except LayoutError:
        return None


def _replay_layouts(node: fx.Node, want: Layout) -> list[Layout] | None:
    """The layouts of ``node``'s tensor inputs under which it makes ``want`` without moving anything."""
    ins = tensor_inputs(node)
    if node.target in RELABELS:
        if len(ins) != 1:
            return None
        layout = unrelabelled(node, want)
        return None if layout is None else [layout]
    layouts = [broadcast_layout(want, tuple(a.meta["val"].shape)) for a in ins]
    if any(l is None for l in layouts) or produced(node, layouts) != want:
        return None
    if len({(a, l) for a, l in zip(ins, layouts)}) != len(set(ins)):
        return None  # one input wanted in two layouts: not replayed (one copy of the op reads it once)
    return layouts


def replay(graph: fx.Graph, plan: Rebuild, value_of: Callable[[fx.Node, Layout], fx.Node],
           before: fx.Node) -> dict[tuple[fx.Node, Layout], fx.Node]:
    """``plan``'s ops copied into ``graph`` right before ``before``, reading ``value_of(leaf, layout)``;
    each copy's layouts set as stage 2 would. Returns (node, layout) -> its copy."""
    made: dict[tuple[fx.Node, Layout], fx.Node] = {}

    def source(a: fx.Node, layout: Layout) -> fx.Node:
        return made[(a, layout)] if (a, layout) in made else value_of(a, layout)

    for node, layout in plan.nodes:
        wanted = iter(zip(tensor_inputs(node), _replay_layouts(node, layout) or ()))

        def arg(a: fx.Node) -> fx.Node:
            if not isinstance(a.meta.get("val"), torch.Tensor):
                return a
            original, need = next(wanted)
            return source(original, need)

        with graph.inserting_before(before):
            copy = copy_node(graph, node, arg)
        copy.meta.update({ARG_LAYOUTS: tuple(_replay_layouts(node, layout) or ()), LAYOUT: layout})
        made[(node, layout)] = copy
    return made


class Rebuilds:
    """What one propagated graph's rebuilds cost, cached while its layouts stand (one propagation, or one
    plan priced): the price of serving each (value, layout), each value's source bytes, the searches."""

    def __init__(self, cost_model: CostModel | None = None) -> None:
        self.cost_model = cost_model
        self.prices: dict[tuple[fx.Node, Layout], float] = {}
        self.sources: dict[fx.Node, float] = {}
        self.searched: dict = {}

    def serving_cost(self, value: fx.Node, want: Layout) -> float:
        """What serving ``value`` in ``want`` costs the plan: moving it, or rebuilding it there where that
        is cheaper (as stage 3 will)."""
        key = (value, want)
        price = self.prices.get(key)
        if price is None:
            price = redistribute_cost(value.meta[LAYOUT], want, value.meta["val"].dtype, self.cost_model)
            if price > 0.0:
                again = rebuild(value, want, self.cost_model, sources=self.sources, searched=self.searched)
                if again is not None:
                    price = min(price, again.cost)
            self.prices[key] = price
        return price


def rebuild(value: fx.Node, want: Layout, cost_model: CostModel | None = None,
            moved: Callable[[fx.Node, Layout], bool] = lambda node, layout: False,
            sources: dict | None = None, searched: dict | None = None, always: bool = False) -> Rebuild | None:
    """The cheapest replay of ``value``'s pointwise ops and views into ``want``, if it costs less than moving
    ``value`` (a leaf ``moved`` into its layout already costs nothing); None otherwise. Only a value at
    least twice the bytes it is made of is searched (``source_bytes``: most activations are made of
    others as large, and moving those costs as much), unless ``always`` (a leaf of it is moved for
    others already: ``shared_leaf``). ``sources``, ``searched``: caches (``Rebuilds``)."""
    have = value.meta.get(LAYOUT)
    if want.partial or not replayable(value) or not isinstance(have, Layout) or have.partial or have.is_replicated:
        return None  # (a replicated value is sliced where it is: no communication to save)
    if not always and 2 * source_bytes(value, {} if sources is None else sources) > _bytes(value):
        return None
    model = cost_model or DEFAULT_COST_MODEL
    own = moving_cost(value, have, want, cost_model)
    best = _cheapest(value, want, 0, model, cost_model, moved, {} if searched is None else searched)
    if best is None or best[0] >= own:
        return None
    cost, nodes, leaves = best
    return Rebuild(tuple(dict.fromkeys(nodes)), tuple(dict.fromkeys(leaves)), cost)


def shared_leaves(values: Sequence[tuple[fx.Node, Layout]], cost_model: CostModel | None = None
                  ) -> list[tuple[fx.Node, Layout, list[fx.Node]]]:
    """The inputs that several of ``values`` (each wanted in a layout it does not have) are made of by
    pointwise ops and views, where moving that input once and replaying each value from it costs less
    than moving each value: (input, the layout to move it into, the values to replay). Token ids
    behind a loss's mask, its clamped targets and its one-hot compare: moved themselves, a call per
    value (and per dtype, bucketed); the ids, one."""
    by_leaf: dict[fx.Node, list[tuple[fx.Node, Layout]]] = {}
    for value, want in dict.fromkeys(values):
        leaf = _single_leaf(value)
        if leaf is not None:
            by_leaf.setdefault(leaf, []).append((value, want))
    found = []
    for leaf, group in by_leaf.items():
        if len(group) < 2 or not isinstance(leaf.meta.get(LAYOUT), Layout) or leaf.meta[LAYOUT].partial:
            continue
        by_layout: dict[Layout, list[tuple[fx.Node, Layout, Rebuild]]] = {}
        for v, want in group:  # each value replayed from the input moved (for free here), where that is cheaper
            plan = rebuild(v, want, cost_model, moved=lambda n, _, leaf=leaf: n is leaf, always=True)
            layouts = {layout for n, layout in plan.leaves if n is leaf} if plan is not None else set()
            if len(layouts) == 1:
                by_layout.setdefault(layouts.pop(), []).append((v, want, plan))
        for layout, members in by_layout.items():
            if all(n.target in RELABELS for _, _, p in members for n, _ in p.nodes):
                continue  # relabellings of one source: sources.source_move moves it once for all already
            once = moving_cost(leaf, leaf.meta[LAYOUT], layout, cost_model) + sum(p.cost for _, _, p in members)
            if len(members) > 1 and once < sum(moving_cost(v, v.meta[LAYOUT], w, cost_model) for v, w, _ in members):
                found.append((leaf, layout, [v for v, _, _ in members]))
                break
    return found


def _single_leaf(value: fx.Node) -> fx.Node | None:
    """The one input ``value`` is made of through replayable ops (``REBUILD_DEPTH`` deep) that would move
    (replicated inputs, factories among them, are sliced where they are); None if none or several."""
    if not replayable(value):
        return None
    leaves: set[fx.Node] = set()
    stack = [(a, 1) for a in tensor_inputs(value)]
    while stack:
        node, depth = stack.pop()
        ins = tensor_inputs(node) if node.op == "call_function" else []
        if ins and replayable(node) and depth < REBUILD_DEPTH:
            stack += [(a, depth + 1) for a in ins]
            continue
        layout = node.meta.get(LAYOUT)
        if not (isinstance(layout, Layout) and layout.is_replicated and not layout.partial):
            leaves.add(node)
    return next(iter(leaves)) if len(leaves) == 1 else None


def source_bytes(node: fx.Node, cache: dict[fx.Node, float], depth: int = 0) -> float:
    """The fewest bytes ``node`` can be replayed from: through replayable ops (``REBUILD_DEPTH`` deep), the
    smaller of each input's own bytes and its source bytes; a factory's nothing."""
    found = cache.get(node)
    if found is None:
        own = _bytes(node)
        ins = tensor_inputs(node) if node.op == "call_function" else [node]
        if not ins:
            found = 0.0
        elif depth >= REBUILD_DEPTH or not replayable(node):
            found = own
        else:
            found = min(own, sum(source_bytes(a, cache, depth + 1) for a in ins))
        cache[node] = found
    return found


_Plan = tuple[float, list[tuple[fx.Node, Layout]], list[tuple[fx.Node, Layout]]]


def _cheapest(node: fx.Node, want: Layout, depth: int, model: CostModel, cost_model: CostModel | None,
              moved: Callable[[fx.Node, Layout], bool], seen: dict,
              taken: frozenset[tuple[fx.Node, Layout]] = frozenset()) -> _Plan | None:
    """(cost, replayed nodes, leaves) of ``node`` in ``want``: moved as it is, or replayed from its inputs;
    a leaf ``taken`` by an earlier input of the same replay is read for free (one move serves both)."""
    key = (node, want, taken)
    if key in seen:
        return seen[key]
    have = node.meta.get(LAYOUT)
    free = isinstance(have, Layout) and (have == want or moved(node, want) or (node, want) in taken)
    if not free and (not isinstance(have, Layout) or have.partial):
        return None  # a Partial reduced where it is: its sum's rounding is the plan's (a wider dtype, say)
    best: _Plan = (0.0 if free else moving_cost(node, have, want, cost_model), [], [(node, want)])
    if depth < REBUILD_DEPTH and replayable(node) and best[0] > 0.0:
        layouts = _replay_layouts(node, want)
        if layouts is not None:
            total, nodes, leaves = model.copy_cost(_block_bytes(node, want)), [], []
            for a, layout in zip(tensor_inputs(node), layouts):
                sub = _cheapest(a, layout, depth + 1, model, cost_model, moved, seen, taken | frozenset(leaves))
                if sub is None or total + sub[0] >= best[0]:
                    total = math.inf
                    break
                total += sub[0]
                nodes += sub[1]
                leaves += sub[2]
            if total < best[0]:
                best = (total, nodes + [(node, want)], leaves)
    seen[key] = best
    return best


def _bytes(node: fx.Node) -> float:
    val = node.meta.get("val")
    return numeric_size(val.shape) * val.element_size() if isinstance(val, torch.Tensor) else 0.0


def _block_bytes(node: fx.Node, layout: Layout) -> float:
    return numeric_size(layout.max_local_shape()) * node.meta["val"].element_size()
