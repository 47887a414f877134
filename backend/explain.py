"""``fxshard.explain``: the sharded global graph of a function, and what it communicates.

Runs stages 1-3 only; needs a mesh shape, not a process group.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch.fx as fx

from fxshard.layout import Layout
from fxshard.mesh import MeshAxis, Size
from fxshard.pipeline import output_layouts, shard_graph
from fxshard.placements import as_mesh_spec
from fxshard.planner import CostModel
from fxshard.printing import format_graph

from .capture import capture, input_layouts_by_position
from .trace import TracedProgram, trace_global


@dataclass(frozen=True)
class Collective:
    kind: str
    axes: tuple[MeshAxis, ...]
    bytes_per_rank: Size
    node: fx.Node

    def __str__(self) -> str:
        return f"{self.kind}({','.join(str(a) for a in self.axes)}) {self.bytes_per_rank} B/rank at %{self.node.name}"


@dataclass
class Explanation:
    graph: fx.GraphModule
    traced: str  # the stage-1 graph, printed
    input_layouts: dict[str, Layout]
    output_layouts: tuple[Layout, ...]
    collectives: list[Collective]

    @property
    def bytes_per_rank(self) -> Size:
        return sum((c.bytes_per_rank for c in self.collectives), 0)

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
        plan = node.meta.get("plan")
        if plan is None:
            continue
        for step in plan.collectives:
            out.append(Collective(step.kind, step.axes, step.bytes_per_rank, node))
    return out


def trace_function(fn: Callable, args: tuple, mesh: Any, placements: Mapping[Any, Any] | None) -> TracedProgram:
    spec = as_mesh_spec(mesh)
    captured = capture(fn, args)
    layouts, names = input_layouts_by_position(fn, args, captured, spec, placements)
    return trace_global(captured.gm, captured.example_inputs, mesh=spec, extra_layouts=layouts, names=names)


def explain(fn: Callable, *args: Any, mesh: Any, placements: Mapping[Any, Any] | None = None,
            strict: bool = False, cost_model: CostModel | None = None) -> Explanation:
    """Shard ``fn(*args)`` over ``mesh`` (a MeshSpec, DeviceMesh or {axis: size}) and explain the result.

    ``placements`` maps an argument index or a parameter/buffer name to DTensor placements or a
    Layout; DTensor arguments bring their own; everything else is replicated.
    """
    program = trace_function(fn, args, mesh, placements)
    traced = format_graph(program.gm)
    gm = shard_graph(program.gm, program.mesh, program.input_layouts, strict=strict, cost_model=cost_model)
    return Explanation(gm, traced, dict(program.input_layouts), output_layouts(gm), collectives_of(gm))
