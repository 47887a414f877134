"""``fxshard.explain``: the sharded global graph of a function, and what it communicates.

Runs stages 1-3 only; needs a mesh shape, not a process group.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch.fx as fx

from fxshard.costs import CostModel
from fxshard.graph import PLAN, output_layouts
from fxshard.hints import assumptions, describe, size_hints
from fxshard.layout import Layout
from fxshard.memory import MemoryReport, memory_report
from fxshard.mesh import MeshAxis, Size, as_size
from fxshard.printing import format_graph
from fxshard.redistribute import redistribution_reason

from .driver import plan_function
from .report import StageReporter, label_of


@dataclass(frozen=True)
class Collective:
    kind: str
    axes: tuple[MeshAxis, ...]
    bytes_per_rank: Size
    node: fx.Node  # the redistribution it belongs to

    @property
    def reason(self) -> str:
        """Which consumer needed which layout of which producer."""
        return redistribution_reason(self.node)

    def __str__(self) -> str:
        return f"{self.kind}({','.join(str(a) for a in self.axes)}) {self.bytes_per_rank} B/rank at %{self.node.name}"


@dataclass
class Explanation:
    graph: fx.GraphModule
    traced: str  # the stage-1 graph, printed
    input_layouts: dict[str, Layout]
    output_layouts: tuple[Layout, ...]
    collectives: list[Collective]
    assumptions: list[str] = field(default_factory=list)  # symbolic meshes: divisibility taken from the hints
    hints: str = ""  # the symbol values decisions used (fxshard/hints.py)

    @property
    def bytes_per_rank(self) -> Size:
        return sum((c.bytes_per_rank for c in self.collectives), 0)

    def bytes_by_axes(self) -> dict[str, Size]:
        """Bytes received per rank, by the mesh axes (or flattened group) each collective runs on."""
        out: dict[str, Size] = {}
        for c in self.collectives:
            key = ",".join(str(a) for a in c.axes)
            out[key] = as_size(out.get(key, 0) + c.bytes_per_rank)
        return out

    @property
    def memory(self) -> MemoryReport:
        return memory_report(self.graph)

    def report(self) -> str:
        """Every collective with why it is there, totals per mesh axis, memory per rank."""
        lines = [f"{c}: {c.reason}" for c in self.collectives] or ["no communication"]
        lines += [f"total on {axes}: {b} B/rank" for axes, b in self.bytes_by_axes().items()]
        lines.append(str(self.memory))
        if self.assumptions:
            lines.append("assuming " + "; ".join(self.assumptions) + f" (taken from the hints: {self.hints})")
        return "\n".join(lines)

    def to_html(self, path: Any, title: str = "fxshard explanation") -> Any:
        """Write one self-contained HTML page: graph (redistributions highlighted), communication
        with reasons, totals per axis, memory. Returns the path."""
        from .html_report import write_html

        return write_html(self, path, title)

    def summary(self) -> str:
        if not self.collectives:
            return "communication: none"
        counts: dict[str, int] = {}
        for c in self.collectives:
            key = f"{c.kind}({','.join(str(a) for a in c.axes)})"
            counts[key] = counts.get(key, 0) + 1
        kinds = ", ".join(f"{n} x {k}" for k, n in counts.items())
        return f"communication: {kinds}; {self.bytes_per_rank} bytes received per rank"

    def __str__(self) -> str:
        return format_graph(self.graph) + "\n" + self.summary()


def collectives_of(gm: fx.GraphModule) -> list[Collective]:
    out = []
    for node in gm.graph.nodes:
        plan = node.meta.get(PLAN)
        if plan is None:
            continue
        for step in plan.collectives:
            out.append(Collective(step.kind, step.axes, step.bytes_per_rank, node))
    return out


def explain(fn: Callable, *args: Any, mesh: Any = None, placements: Mapping[Any, Any] | None = None,
            strict: bool = False, cost_model: CostModel | None = None,
            hints: Mapping[str, int] | None = None) -> Explanation:
    """Shard ``fn(*args)`` over ``mesh`` (a MeshSpec, DeviceMesh or {axis: size}; default: the DTensor
    arguments' and parameters') and explain the result.

    ``placements`` maps an argument index or a parameter/buffer name to DTensor placements or a
    Layout; DTensor arguments bring their own; everything else is replicated. ``hints`` gives
    symbolic mesh sizes a number where a decision needs one (default 8; fxshard/hints.py).
    """
    traced: list[str] = []  # the stage-1 graph as printed before planning annotates it

    def keep_trace(stage: str, gm: fx.GraphModule) -> None:
        if stage == "trace":
            traced.append(format_graph(gm))

    with size_hints(hints), assumptions() as assumed:
        _, planned = plan_function(fn, args, mesh=mesh, placements=placements, strict=strict, cost_model=cost_model,
                                   reporter=StageReporter(keep_trace, label=label_of(fn)))
        gm = planned.graph
        return Explanation(gm, traced[0], dict(planned.program.input_layouts), output_layouts(gm),
                           collectives_of(gm), sorted(assumed), describe())
