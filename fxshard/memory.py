"""How much memory each rank needs for a planned graph: its inputs and a peak-activation estimate.

Sizes come from layouts (the busiest rank's block), so a symbolic mesh gives expressions.
The peak walks the graph in program order: a value is allocated when computed, freed after
its last use; a view of a value shares its storage; outputs live to the end. It estimates
what the local program holds, before Inductor fuses anything away (fusion only lowers it).
``step_memory`` combines a training program's forward and backward into one step's peak.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import sympy
import torch
import torch.fx as fx

from .costs import numel
from .graph import LAYOUT, requirements
from .layout import Layout
from .mesh import Size, as_size
from .registry import SHARES_STORAGE


@dataclass
class MemoryReport:
    inputs: dict[str, Size] = field(default_factory=dict)  # placeholder -> bytes on the busiest rank
    peak_activations: Size = 0  # most bytes of intermediate values alive at once

    @property
    def input_bytes(self) -> Size:
        return as_size(sum(self.inputs.values(), 0))

    @property
    def total(self) -> Size:
        return as_size(self.input_bytes + self.peak_activations)

    def __str__(self) -> str:
        return (f"memory per rank: inputs {self.input_bytes} B ({len(self.inputs)} tensors), "
                f"peak activations {self.peak_activations} B")


@dataclass
class StepMemory:
    """One training step's memory beyond what it starts with (parameters, optimizer state), per rank:
    the forward's peak, and the backward's on top of what the forward computed and kept for it."""

    forward_peak: Size  # the forward's values alive at once (its outputs and saved values included)
    kept: Size  # the values the forward computes and returns: outputs and values saved for the backward
    backward_peak: Size  # the backward's values alive at once (its gradients included)

    @property
    def peak(self) -> Size:
        return _max(self.forward_peak, as_size(self.kept + self.backward_peak))


def step_memory(forward: fx.GraphModule, backward: fx.GraphModule) -> StepMemory:
    """The step memory of a planned (or lowered) forward and backward pair: ``TrainingPlan.forward/.backward``."""
    return StepMemory(memory_report(forward).peak_activations, kept_bytes(forward),
                      memory_report(backward).peak_activations)


def kept_bytes(gm: fx.GraphModule) -> Size:
    """Bytes of the values ``gm`` computes and returns, each storage once; inputs it passes through are
    not its own (a parameter saved for the backward is the caller's)."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    roots = {_storage(a) for a in output.all_input_nodes}
    return as_size(sum((local_bytes(r) for r in roots if r.op == "call_function"), 0))


def local_bytes(node: fx.Node) -> Size:
    """Bytes of ``node``'s value on the busiest rank (0 for non-tensors)."""
    layout, val = node.meta.get(LAYOUT), node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return 0
    numel: Size = 1
    shape = layout.max_local_shape() if isinstance(layout, Layout) else tuple(val.shape)
    for s in shape:
        numel = numel * s
    return as_size(numel * val.element_size())


def memory_report(gm: fx.GraphModule) -> MemoryReport:
    report = MemoryReport()
    for node in gm.graph.find_nodes(op="placeholder"):
        report.inputs[node.name] = local_bytes(node)
    report.peak_activations = _peak(gm, with_moves=False)
    return report


def propagated_peak(gm: fx.GraphModule) -> Size:
    """``memory_report``'s peak activations of a graph propagated only (stage 2, no redistribution in it yet),
    with a buffer for every move its consumers ask for (a value wanted in another layout than its own: stage
    3's copy of it), alive from its first such consumer to its last, the value moved freed at its last move
    where no later consumer reads it as it is: what ``fxshard.auto_placements`` prices a candidate's memory by
    without planning it."""
    return _peak(gm, with_moves=True)


def _peak(gm: fx.GraphModule, with_moves: bool) -> Size:
    """The most bytes of values alive at once, in program order (``with_moves``: and of the moves asked for)."""
    nodes = list(gm.graph.nodes)
    last_use: dict[fx.Node, int] = {}
    moves: dict[tuple[fx.Node, Layout], list[int]] = {}
    for i, node in enumerate(nodes):
        moved: set[fx.Node] = set()
        if with_moves and node.op != "placeholder":
            for a, want in requirements(node):
                if isinstance(want, Layout) and a.meta.get(LAYOUT) != want:
                    uses = moves.setdefault((a, want), [])
                    if not uses:  # the move runs before its first consumer: the value lives until then
                        last_use[_storage(a)] = i
                    uses.append(i)
                    moved.add(a)
        for a in node.all_input_nodes:
            if a not in moved:  # read as it is (a moved value's later consumers read the move's buffer)
                last_use[_storage(a)] = i
    starting: dict[int, list[tuple[tuple[fx.Node, Layout], Size]]] = {}
    for (a, want), uses in moves.items():
        val = a.meta.get("val")
        if isinstance(val, torch.Tensor):
            starting.setdefault(uses[0], []).append(((a, want), as_size(numel(want.max_local_shape())
                                                                        * val.element_size())))
    live: dict[Any, Size] = {}
    peaks: list[Size] = [0]  # the live bytes after each allocation: the peak is their maximum
    for i, node in enumerate(nodes):
        if node.op == "placeholder":
            continue
        allocated = starting.get(i, [])
        live.update(allocated)
        if node.op == "call_function" and _storage(node) is node:
            live[node] = local_bytes(node)
            allocated = True
        if allocated:
            peaks.append(as_size(sum(live.values(), 0)))
        for a in node.all_input_nodes:
            root = _storage(a)
            if last_use.get(root) == i and root in live and node.op != "output":
                del live[root]
        for key in [k for k in live if isinstance(k, tuple) and moves[k][-1] == i]:
            del live[key]
    return as_size(_max(*peaks))


def _storage(node: fx.Node) -> fx.Node:
    """The node whose storage ``node`` views (itself unless it is an alias)."""
    while node.op == "call_function" and node.target in SHARES_STORAGE and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def _max(*sizes: Size) -> Size:
    """The largest of ``sizes``; symbolic ones as one ``sympy.Max`` of those no other one bounds.

    Folding a graph's ~100 live sums into ``sympy.Max`` one by one compared every pair of them through
    sympy's assumptions (~10 s for a two-layer Llama at a symbolic tp). Most are dominated cheaply: a
    sum of positive terms (bytes over the mesh sizes, ``8192 + 51200/tp``) is at most another whose
    coefficient of every term is at least as large (``_dominated``); sympy compares only the rest."""
    if all(isinstance(s, int) for s in sizes):
        return max(sizes)
    distinct = list(dict.fromkeys(sympy.expand(sympy.sympify(s)) for s in sizes))
    terms = [_positive_terms(s) for s in distinct]
    kept = [s for i, s in enumerate(distinct)
            if not any(j != i and _dominated(terms[i], terms[j], i < j) for j in range(len(distinct)))]
    return sympy.Max(*kept)


def _positive_terms(size: sympy.Expr) -> dict[sympy.Expr, sympy.Expr] | None:
    """``size`` as {term: coefficient} where every term is positive and every coefficient a number (a size
    over positive mesh sizes); None for another expression (``ceiling``, a difference)."""
    terms = size.as_coefficients_dict()
    if all(c.is_number and c >= 0 and (t == 1 or t.is_positive) for t, c in terms.items()):
        return terms
    return None


def _dominated(a: dict | None, b: dict | None, a_first: bool) -> bool:
    """Whether the sum ``a`` is at most ``b`` term by term (``_positive_terms``); of two equal sums the later one
    is the dominated one (``a_first``: ``a`` comes first), so that one of them stays."""
    if a is None or b is None or any(t not in b for t in a):
        return False
    if all(a.get(t, 0) == c for t, c in b.items()):
        return not a_first
    return all(c <= b[t] for t, c in a.items())
