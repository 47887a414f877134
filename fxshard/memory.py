"""How much memory each rank needs for a planned graph: its inputs and a peak-activation estimate.

Sizes come from layouts (the busiest rank's block), so a symbolic mesh gives expressions.
The peak walks the graph in program order: a value is allocated when computed, freed after
its last use; a view of a value shares its storage; outputs live to the end. It estimates
what the local program holds, before Inductor fuses anything away (fusion only lowers it).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import sympy
import torch
import torch.fx as fx

from .graph import LAYOUT
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
    nodes = list(gm.graph.nodes)
    last_use = {}
    for i, node in enumerate(nodes):
        for a in node.all_input_nodes:
            last_use[_storage(a)] = i
    live: dict[fx.Node, Size] = {}
    peak: Size = 0
    for i, node in enumerate(nodes):
        if node.op == "placeholder":
            report.inputs[node.name] = local_bytes(node)
            continue
        if node.op == "call_function" and _storage(node) is node:
            live[node] = local_bytes(node)
            peak = _max(peak, sum(live.values(), 0))
        for a in node.all_input_nodes:
            root = _storage(a)
            if last_use.get(root) == i and root in live and node.op != "output":
                del live[root]
    report.peak_activations = as_size(peak)
    return report


def _storage(node: fx.Node) -> fx.Node:
    """The node whose storage ``node`` views (itself unless it is an alias)."""
    while node.op == "call_function" and node.target in SHARES_STORAGE and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def _max(a: Size, b: Size) -> Size:
    if isinstance(a, int) and isinstance(b, int):
        return max(a, b)
    return sympy.Max(sympy.sympify(a), sympy.sympify(b))
