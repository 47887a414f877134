"""Second opinions on a greedy propagation: pin the inputs it moved, keep whichever plan is cheaper.

Propagation chooses each op's strategy from what it knows at that op, so it happily moves
the small operand: at the first embedding of a dp x tp model it all-gathers a few KiB of
token ids rather than a weight, and from then on every activation is replicated on dp with
its hidden dim sharded there, paying an all-reduce at every matmul. No single op sees that.

The repair is a small search over one decision that matters globally: which values keep the
layout they have. Each round pins some of the inputs the best plan so far redistributed, or
every activation, so that moving them becomes very expensive (though still possible),
propagates again, and keeps the new plan only if its total planned cost is lower. Programs whose plan moves
no input (Megatron TP, sequence parallel) are propagated once, as before. Which rounds are
tried is a policy (``fxshard.policies.Refinement``).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Mapping, Sequence

import torch.fx as fx

from . import graph
from .costs import DEFAULT_COST_MODEL, CostModel
from .graph import LAYOUT, PROPAGATED, requirements
from .layer_names import block_of, unnumbered
from .layout import Layout
from .planner import plan_redistribute, redistribute_cost
from .policies import DEFAULT_REFINEMENT, Pin, Refinement
from .rebuild import Rebuilds
from .registry import FACTORIES, RELABELS
from .sources import served_by_source
from .timing import stage


def planned_cost(gm: fx.GraphModule, cost_model: CostModel | None = None,
                 output_names: Sequence[str | None] = (), arguments: TensorArguments | None = None) -> float:
    """The modeled cost of every redistribution a propagated graph asks for (each edge once; a value
    cheaper to compute again where it is wanted at that price: ``rebuild.Rebuilds``). The moves of one
    block's parameters pay one latency per kind of move, as do the reductions of one block's gradients
    (``output_names``: per output, the input it is the gradient of; training programs only): stage 6
    buckets each into one call (``layer_names.block_of``; FSDP2's grouping), so twenty small gathers of one
    layer cost one gather's latency, not twenty. ``arguments``: the nodes' tensor arguments, read once for
    the pricings of one refinement."""
    arguments = arguments or TensorArguments()
    asked = _all_requirements(gm, arguments)
    return _priced(asked, _asked(asked), cost_model, output_names, arguments)


def _all_requirements(gm: fx.GraphModule, arguments: TensorArguments | None = None,
                      ) -> list[tuple[fx.Node, list[tuple[fx.Node, Layout]]]]:
    """Each node with its ``requirements``: read once per pricing (the pricing reads them twice)."""
    arguments = arguments or TensorArguments()
    return [(node, arguments.requirements(node)) for node in gm.graph.nodes]


class TensorArguments:
    """Each node's tensor arguments (``graph.tensor_inputs``) and the input each is a view of
    (``input_root``), read once for all the pricings of one refinement: its propagations change the layouts
    a node requires of its arguments, never the arguments (refinement prices a 64-layer program's 16k nodes
    about ten times)."""

    def __init__(self) -> None:
        self._of: dict[fx.Node, list[fx.Node]] = {}
        self._roots: dict[fx.Node, fx.Node | None] = {}

    def root(self, node: fx.Node) -> fx.Node | None:
        """``input_root(node)``."""
        try:
            return self._roots[node]
        except KeyError:
            root = self._roots[node] = input_root(node)
            return root

    def requirements(self, node: fx.Node) -> list[tuple[fx.Node, Layout]]:
        """``graph.requirements(node)``."""
        args = self._of.get(node)
        if args is None:
            args = self._of[node] = graph.tensor_inputs(node)
        return requirements(node, args)


def _priced(asked: list[tuple[fx.Node, list]], edges: Iterable[tuple[fx.Node, Layout]],
            cost_model: CostModel | None, output_names: Sequence[str | None], arguments: TensorArguments) -> float:
    rebuilds, bare_model = Rebuilds(cost_model), _without_latency(cost_model)
    groups = _block_groups(asked, output_names, arguments)
    total, latency = 0.0, {}
    for a, want in edges:
        group = groups.get((a, want))
        if group is None:
            total += rebuilds.serving_cost(a, want)
            continue
        dtype = a.meta["val"].dtype
        plan = plan_redistribute(a.meta[LAYOUT], want, dtype=dtype, cost_model=cost_model, fill_shards=False)
        bare = redistribute_cost(a.meta[LAYOUT], want, dtype, bare_model)  # priced alike: no shard filled
        steps = tuple((step.kind, step.axes) for step in plan.collectives)
        # one call per block, kind and axes; per dtype too unless it only gathers (stage 6 packs the
        # gathers of several dtypes as bytes, backend/inductor/bucket_copies.py; a reduction adds in its dtype)
        key = group + (None if all(kind == "all_gather" for kind, _ in steps) else dtype, steps)
        total += bare
        latency[key] = max(latency.get(key, 0.0), plan.cost - bare)
    return total + sum(latency.values())


def _block_groups(asked: list[tuple[fx.Node, list]], output_names: Sequence[str | None],
                  arguments: TensorArguments) -> dict[tuple[fx.Node, Layout], tuple]:
    """The moves stage 6 buckets per block: of a view of an input (``("in", block)``) and into an output
    that is an input's gradient (``("out", block)``). Training programs only (some output is a
    gradient): an inference plan priced so gathers a toy model's weights rather than move its few
    activations, trading away the weight memory tensor parallelism is for, which no price here sees."""
    groups: dict[tuple[fx.Node, Layout], tuple] = {}
    if not any(name is not None for name in output_names):
        return groups
    for node, required in asked:
        if node.op == "output":
            for (a, want), name in zip(required, output_names):
                if name is not None and isinstance(want, Layout):
                    groups[(a, want)] = ("out", block_of(name))
            continue
        for a, want in required:
            root = arguments.root(a)
            if root is not None and isinstance(want, Layout):
                groups.setdefault((a, want), ("in", block_of(root.name)))
    return groups


def _without_latency(cost_model: CostModel | None) -> CostModel:
    model = cost_model or DEFAULT_COST_MODEL
    return dataclasses.replace(model, default_latency=0.0, latency=tuple((axis, 0.0) for axis, _ in model.latency))


def input_root(node: fx.Node) -> fx.Node | None:
    """The placeholder ``node`` is a view of (through relabelling ops), or None."""
    return graph.input_root(node, RELABELS)


def moved_inputs(gm: fx.GraphModule, arguments: TensorArguments | None = None) -> dict[str, int]:
    """Placeholders some consumer wants (or a view of which it wants) in another layout, with their bytes."""
    arguments = arguments or TensorArguments()
    moved = {}
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        for a, want in arguments.requirements(node):
            root = arguments.root(a)
            if root is not None and a.meta[LAYOUT] != want:
                val = root.meta["val"]
                moved[root.name] = val.numel() * val.element_size()
    return moved


def _snapshot(gm: fx.GraphModule) -> dict:
    return {n: {k: n.meta[k] for k in PROPAGATED if k in n.meta} for n in gm.graph.nodes}


def _restore(gm: fx.GraphModule, snapshot: dict) -> None:
    for n in gm.graph.nodes:
        for k in PROPAGATED:
            n.meta.pop(k, None)
        n.meta.update(snapshot[n])


def propagate_with_pins(run: Callable[..., None], gm: fx.GraphModule,
                        cost_model: CostModel | None = None,
                        policy: Refinement = DEFAULT_REFINEMENT,
                        output_names: Sequence[str | None] = ()) -> frozenset[str]:
    """``run(pinned)`` (and ``run(pinned, foreseen)``: ``propagate``'s arguments) propagates ``gm`` in place;
    leaves the cheapest plan found (``planned_cost``: ``output_names`` say which outputs are which
    inputs' gradients). Returns its pins.

    The plans tried are ``policy``'s (fxshard/policies.py): reducing shared partials once
    (``Pin.REDUCE_SHARED``), every activation pinned (``Pin.ACTIVATIONS``), the smallest moved
    inputs pinned one by one (each with its kind in the other layers: ``smallest_classes``), all
    of them pinned; then the best one's requests foreseen.
    """
    arguments = TensorArguments()  # the graph is the same for every pricing below
    with stage("propagate"):
        run(frozenset())
        best = (planned_cost(gm, cost_model, output_names, arguments), _snapshot(gm), frozenset(),
                moved_inputs(gm, arguments))
    with stage("refine"):
        return _refine(run, gm, cost_model, policy, best, output_names, arguments)


def _refine(run: Callable[..., None], gm: fx.GraphModule, cost_model: CostModel | None,
            policy: Refinement, best: tuple, output_names: Sequence[str | None],
            arguments: TensorArguments) -> frozenset[str]:
    """The rounds of ``propagate_with_pins`` after the greedy plan ``best``: (cost, snapshot, pins, moved)."""
    tried: set[frozenset[str]] = {frozenset()}
    if policy.reduce_shared and _has_shared_partial(gm):
        tried.add(frozenset({Pin.REDUCE_SHARED}))
        run(frozenset({Pin.REDUCE_SHARED}))
        cost = planned_cost(gm, cost_model, output_names, arguments)
        if cost < best[0]:
            best = (cost, _snapshot(gm), frozenset({Pin.REDUCE_SHARED}), moved_inputs(gm, arguments))
    for _ in range(policy.rounds):
        _, _, pinned, moved = best
        free = {k: v for k, v in moved.items() if k not in pinned}
        if not free:
            break
        improved = False
        everything = [pinned | {Pin.ACTIVATIONS}] if policy.pin_activations else []
        for pins in everything + [pinned | c for c in smallest_classes(free, policy.max_singles)] + [pinned | set(free)]:
            if pins in tried:
                continue
            tried.add(pins)
            run(pins)
            cost = planned_cost(gm, cost_model, output_names, arguments)
            if cost < best[0]:
                best, improved = (cost, _snapshot(gm), pins, moved_inputs(gm, arguments)), True
        if not improved:
            break
    if policy.foresee:
        best = _foresee(run, gm, cost_model, best, output_names, arguments)
    _restore(gm, best[1])
    return best[2]


def smallest_classes(moved: Mapping[str, int], count: int) -> list[frozenset[str]]:
    """The ``count`` smallest of the ``moved`` inputs (name -> bytes), each with the inputs of its class:
    the same name but for the numbers in it (the layer index) and the same bytes. Pinning one layer's
    norm weight and pinning another's price the same (the layers are alike), so each class is tried
    once, all of it pinned: at 8 layers the six smallest inputs (norm weights) are two classes, two
    propagations for six."""
    def class_of(name: str) -> tuple[str, int]:
        return unnumbered(name), moved[name]

    classes: dict[tuple[str, int], set[str]] = {}
    for name in moved:
        classes.setdefault(class_of(name), set()).add(name)
    smallest = sorted(moved, key=lambda k: (moved[k], k))[:count]
    return list(dict.fromkeys(frozenset(classes[class_of(k)]) for k in smallest))


def _foresee(run: Callable[..., None], gm: fx.GraphModule, cost_model: CostModel | None, best: tuple,
             output_names: Sequence[str | None], arguments: TensorArguments) -> tuple:
    """The best plan propagated again with the redistributions it asks for known from the start: an op
    before the consumer asking for one (a weight gradient's matmul before the input gradient's, which
    gathers the output gradient) may read it, or a relabelling of it, instead of moving something else.
    Both plans priced as stage 3 will make them (``shared_cost``)."""
    _restore(gm, best[1])
    foreseen: dict[fx.Node, set[Layout]] = {}
    for a, want in _asked(_all_requirements(gm, arguments)):
        foreseen.setdefault(a, set()).add(want)
    if not foreseen:
        return best
    before = shared_cost(gm, cost_model, output_names, arguments)
    run(best[2], foreseen)
    if shared_cost(gm, cost_model, output_names, arguments) < before:
        return (planned_cost(gm, cost_model, output_names, arguments), _snapshot(gm), best[2],
                moved_inputs(gm, arguments))
    return best


def shared_cost(gm: fx.GraphModule, cost_model: CostModel | None = None,
                output_names: Sequence[str | None] = (), arguments: TensorArguments | None = None) -> float:
    """``planned_cost`` with what stage 3 shares through relabellings free: a value wanted in a layout
    that a source of its relabelling chain is moved into already (``sources.served_by_source``)."""
    arguments = arguments or TensorArguments()
    asked = _all_requirements(gm, arguments)
    edges = _asked(asked)
    return _priced(asked, [(a, want) for a, want in edges
                           if not served_by_source(a, want, lambda n, layout: (n, layout) in edges)],
                   cost_model, output_names, arguments)


def requested_moves(gm: fx.GraphModule) -> list[tuple[fx.Node, Layout]]:
    """Every (value, layout) a propagated graph's consumers want a value in other than its own, once each, in
    program order: the redistributions stage 3 will insert (before it shares any through relabellings)."""
    return list(_asked(_all_requirements(gm)))


def _asked(asked: list[tuple[fx.Node, list]]) -> dict[tuple[fx.Node, Layout], None]:
    """Every (value, layout) the consumers in ``asked`` (``_all_requirements``) want a value in other
    than its own, once each, in program order."""
    return {(a, want): None for _, required in asked for a, want in required
            if isinstance(want, Layout) and a.meta[LAYOUT] != want}


def _has_shared_partial(gm: fx.GraphModule) -> bool:
    """Whether some Partial value has several consumers (the greedy plan may reduce views of it twice)."""
    return any(isinstance(n.meta.get(LAYOUT), Layout) and n.meta[LAYOUT].partial and len(n.users) > 1
               for n in gm.graph.nodes)


def is_pinned(node: fx.Node, pinned: frozenset[str]) -> bool:
    """Whether moving ``node`` costs the pin penalty: a view of a pinned input, or an activation
    (a value that is no view of an input) when ``Pin.ACTIVATIONS`` is pinned; never a factory (moving
    one moves no data: it is built, or sliced, where it is wanted)."""
    return bool(pinned) and pin_of(node) in pinned


def pin_of(node: fx.Node) -> str | None:
    """The pin that pins ``node`` (``is_pinned``): its input's name, ``Pin.ACTIVATIONS``, or None (a factory)."""
    if node.op == "call_function" and node.target in FACTORIES:
        return None
    root = input_root(node)
    return root.name if root is not None else Pin.ACTIVATIONS
