"""``fxshard.explain``: the sharded global graph of a function, and what it communicates.

Runs stages 1-3 only; needs a mesh shape, not a process group. A function Dynamo splits into
several graphs (graph breaks) is explained graph run by graph run (``Explanations``), each
planned with the layouts the runs before it left their outputs in (``graph_runs.py``).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
import torch.fx as fx

from fxshard.costs import CostModel
from fxshard.policies import MixedPrecision
from fxshard.backend.capture.mixed_precision import under_policy
from fxshard.graph import PLAN, output_layouts
from fxshard.hints import assumptions, describe, size_hints
from fxshard.layout import Layout
from fxshard.memory import MemoryReport, memory_report
from fxshard.mesh import MeshAxis, Size, as_size
from fxshard.printing import format_graph
from fxshard.redistribute import redistribution_reason
from fxshard.routing import ROUTED_OPS, dispatches

from fxshard.backend.capture.capture import Captured, capture_graphs, outputs_on_meta
from fxshard.backend.driver import PlannedProgram
from fxshard.backend.graph_runs import RunPlanner
from fxshard.backend.simulate import SimulatedGraphs, holds_every_rank
from fxshard.backend.reports.flops import flops_by_rank
from fxshard.backend.reports.report import StageReporter, label_of


@dataclass(frozen=True)
class Collective:
    kind: str
    axes: tuple[MeshAxis, ...]
    bytes_per_rank: Size
    node: fx.Node  # the redistribution it belongs to (or the routed op that runs it)
    carries: str = ""  # a routed op's all_to_all: what it carries (its bytes depend on the routing)

    @property
    def reason(self) -> str:
        """Which consumer needed which layout of which producer (a routed op's: what it carries)."""
        if self.carries:
            return f"routed experts: {self.carries}"
        return redistribution_reason(self.node)

    def __str__(self) -> str:
        return f"{self.kind}({','.join(str(a) for a in self.axes)}) {self.bytes_per_rank} B/rank at %{self.node.name}"


class Communication:
    """Totals over ``collectives``: of one graph (``Explanation``) or of all a function's (``Explanations``)."""

    collectives: list[Collective]

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

    def summary(self) -> str:
        if not self.collectives:
            return "communication: none"
        counts: dict[str, int] = {}
        for c in self.collectives:
            key = f"{c.kind}({','.join(str(a) for a in c.axes)})"
            counts[key] = counts.get(key, 0) + 1
        kinds = ", ".join(f"{n} x {k}" for k, n in counts.items())
        return f"communication: {kinds}; {self.bytes_per_rank} bytes received per rank"


@dataclass
class Explanation(Communication):
    """One graph: its sharded global graph (stage 3), the layouts at its ends, its collectives."""

    graph: fx.GraphModule
    traced: str  # the stage-1 graph, printed
    input_layouts: dict[str, Layout]
    output_layouts: tuple[Layout, ...]
    collectives: list[Collective]
    assumptions: list[str] = field(default_factory=list)  # symbolic meshes: divisibility taken from the hints
    hints: str = ""  # the symbol values decisions used (fxshard/hints.py)
    graph_break: str | None = None  # why Dynamo ended this graph at a graph break (None: the function returns)
    # the all_to_alls of routed-experts ops (a dropless MoE's dispatch), bytes in the routing's row counts
    dispatches: list[Collective] = field(default_factory=list)

    @property
    def graphs(self) -> list[Explanation]:
        return [self]

    @property
    def memory(self) -> MemoryReport:
        return memory_report(self.graph)

    @property
    def flops_by_rank(self) -> list[int]:
        """Each rank's FLOPs (its local program's, as torch's FlopCounterMode counts them), rank by rank."""
        return flops_by_rank(self.graph)

    def report(self) -> str:
        """Every collective with why it is there, totals per mesh axis, memory per rank."""
        lines = [f"{c}: {c.reason}" for c in self.collectives] or ["no communication"]
        lines += [f"{c}: {c.reason}" for c in self.dispatches]
        lines += [f"total on {axes}: {b} B/rank" for axes, b in self.bytes_by_axes().items()]
        lines.append(str(self.memory))
        if self.assumptions:
            lines.append("assuming " + "; ".join(self.assumptions) + f" (taken from the hints: {self.hints})")
        return "\n".join(lines)

    def to_html(self, path: Any, title: str = "fxshard explanation") -> Any:
        """Write one self-contained HTML page: graph (redistributions highlighted), communication
        with reasons, totals per axis, memory. Returns the path."""
        from fxshard.backend.reports.html_report import write_html

        return write_html(self, path, title)

    def summary(self) -> str:
        text = super().summary()
        if not self.dispatches:
            return text
        total = sum((c.bytes_per_rank for c in self.dispatches), 0)
        return text + f"; routed experts: {len(self.dispatches)} x all_to_all, {total} bytes received per rank"

    def __str__(self) -> str:
        return format_graph(self.graph) + "\n" + self.summary()


@dataclass
class Explanations(Communication):
    """A function Dynamo split into several graphs: the explanation of each graph run, in the order
    they ran (a graph reached again runs again), and the totals over all of them."""

    graphs: list[Explanation]

    @property
    def collectives(self) -> list[Collective]:  # type: ignore[override]
        return [c for e in self.graphs for c in e.collectives]

    @property
    def flops_by_rank(self) -> list[int]:
        """Each rank's FLOPs summed over the graph runs."""
        per_graph = [e.flops_by_rank for e in self.graphs]
        return [sum(f) for f in zip(*per_graph)]

    def __len__(self) -> int:
        return len(self.graphs)

    def __getitem__(self, k: int) -> Explanation:
        return self.graphs[k]

    def __iter__(self) -> Iterator[Explanation]:
        return iter(self.graphs)

    def _sections(self, body: Callable[[Explanation], str]) -> str:
        parts = [f"graph {k}{_ending(e)}\n{body(e)}" for k, e in enumerate(self.graphs)]
        return "\n\n".join(parts)

    def report(self) -> str:
        """Each graph's report, then the totals over all graphs."""
        totals = [f"total on {axes} over {len(self.graphs)} graphs: {b} B/rank"
                  for axes, b in self.bytes_by_axes().items()]
        return "\n".join([self._sections(Explanation.report)] + [""] * bool(totals) + totals)

    def __str__(self) -> str:
        return self._sections(str) + f"\n\nover {len(self.graphs)} graphs, " + self.summary()


def _ending(e: Explanation) -> str:
    if e.graph_break is None:
        return ""
    return f" (Dynamo ends it at a graph break: {e.graph_break.strip().splitlines()[0]})"


def dispatches_of(gm: fx.GraphModule) -> list[Collective]:
    """The all_to_alls routed-experts ops run (fxshard/routing.py), bytes as functions of the routing."""
    return [Collective("all_to_all", d.axes, d.bytes_per_rank, node, d.what)
            for node in gm.graph.nodes if node.target in ROUTED_OPS for d in dispatches(node)]


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
            hints: Mapping[str, int] | None = None,
            mixed_precision: MixedPrecision | None = None) -> Explanation | Explanations:
    """Shard ``fn(*args)`` over ``mesh`` (a MeshSpec, DeviceMesh or {axis: size}; default: the DTensor
    arguments' and parameters') and explain the result.

    ``placements`` maps an argument index or a parameter/buffer name to DTensor placements or a
    Layout; DTensor arguments bring their own; everything else is replicated. ``hints`` gives
    symbolic mesh sizes a number where a decision needs one (default 8; fxshard/hints.py).
    ``mixed_precision`` (``fxshard.MixedPrecision``): the program as it runs under that policy.
    A function Dynamo splits into several graphs gives ``Explanations``, one per graph run.
    """
    with size_hints(hints), assumptions() as assumed:
        planner = RunPlanner(fn, args, mesh=mesh, placements=placements, strict=strict, cost_model=cost_model)
        explanations = _explain_runs(under_policy(fn, mixed_precision), args, planner)
        planner.check_placements()
        for e in explanations:
            e.assumptions, e.hints = sorted(assumed), describe()
    return explanations[0] if len(explanations) == 1 else Explanations(explanations)


def _explain_runs(fn: Callable, args: Sequence[Any], planner: RunPlanner) -> list[Explanation]:
    """The explanation of every graph run of ``fn(*args)``.

    A function that is one graph is captured without running it (its outputs on meta). One that
    Dynamo splits runs graph by graph, so that the Python between graphs reads real values (an
    ``if`` on a meta tensor or its ``.item()`` fails, and so does the first capture of such a
    function): in global shapes, or, for DTensors made under LocalTensorMode, on simulated ranks.
    """
    label = label_of(fn)
    seen: list[Captured] = []

    def on_meta(captured: Captured, inputs: Sequence[Any]) -> Sequence[Any]:
        seen.append(captured)
        return outputs_on_meta(captured)

    try:
        runs, _ = capture_graphs(fn, args, on_meta)
        if len(runs) == 1:
            return [_explain_run(planner, *runs[0], label)[0]]
    except Exception:
        # after a graph, Python (or a frame Dynamo skipped: a data-dependent loop) met its meta outputs
        # (an ``if``, ``.item()``, a meta tensor beside a real one); an error of the graph itself recurs below
        if not seen:
            raise
    explanations: list[Explanation] = []
    with contextlib.ExitStack() as stack:
        simulated = SimulatedGraphs(planner, stack)
        on_ranks: list[bool] = []  # decided at the first run, for all

        def run(captured: Captured, inputs: Sequence[Any]) -> Sequence[Any]:
            explanation, planned = _explain_run(planner, captured, inputs, label)
            explanations.append(explanation)
            if not on_ranks:
                on_ranks.append(any(holds_every_rank(x) for x in inputs))
            if on_ranks[0]:
                return simulated.run(captured, inputs, planned)
            with torch.no_grad():
                outs = tuple(captured.gm(*inputs))
            planner.carry(outs, explanation.output_layouts)
            return outs

        capture_graphs(fn, args, run)
    return explanations


def _explain_run(planner: RunPlanner, captured: Captured, inputs: Sequence[Any],
                 label: str) -> tuple[Explanation, PlannedProgram]:
    traced: list[str] = []  # the stage-1 graph as printed before planning annotates it

    def keep_trace(stage: str, gm: fx.GraphModule) -> None:
        if stage == "trace":
            traced.append(format_graph(gm))

    planned = planner.plan(captured, inputs, StageReporter(keep_trace, label=label))
    gm = planned.graph
    return Explanation(gm, traced[0], dict(planned.program.input_layouts), output_layouts(gm), collectives_of(gm),
                       graph_break=captured.graph_break, dispatches=dispatches_of(gm)), planned
