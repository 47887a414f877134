"""The one path from a captured graph to a runnable program: trace -> plan -> (split) -> runner.

The backend and ``fxshard.compile`` both come here with Dynamo's graph, concrete example
inputs and the layouts they know of plain-tensor inputs; each stage is timed and reported
(``StageReporter``: ``on_graph``, ``debug_dir``, ``TORCH_LOGS``).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch.fx as fx

from fxshard.layout import Layout
from fxshard.mesh import MeshSpec
from fxshard.pipeline import shard_graph
from fxshard.costs import CostModel

from .compile import ShardedCallable
from .joint import plan_training
from .report import StageReporter
from .trace import trace_global
from .training import TrainingCallable


def compile_program(gm: fx.GraphModule, inputs: Sequence[Any], *, training: bool, device_mesh: Any = None,
                    mesh: MeshSpec | None = None, extra_layouts: dict[int, Layout] | None = None,
                    names: Sequence[str] | None = None, strict: bool = False, cost_model: CostModel | None = None,
                    inductor: bool = True, reporter: StageReporter | None = None) -> ShardedCallable | TrainingCallable:
    """Stages 1-6 of ``gm`` for ``inputs`` (concrete sizes): the callable that runs this rank's program.

    ``training``: the joint forward+backward program (gradients as DTensors), else the forward.
    ``device_mesh`` defaults to the one of the DTensor inputs.
    """
    reporter = reporter or StageReporter()
    if training:
        with reporter.timed("tracing and planning the joint forward+backward graph"):
            plan = plan_training(gm, inputs, mesh=mesh, extra_layouts=extra_layouts, names=names, strict=strict,
                                 cost_model=cost_model)
        reporter("plan", plan.joint)
        reporter("plan_forward", plan.forward)
        reporter("plan_backward", plan.backward)
        with reporter.timed("lowering the forward and backward"):
            runner: Any = TrainingCallable(plan, device_mesh or plan.program.device_mesh, inductor=inductor,
                                           reporter=reporter)
        reporter("lower", runner.forward_graph)
        reporter("lower_backward", runner.backward_graph)
        reporter.summarize(plan.forward)
        reporter.summarize(plan.backward)
        return runner
    with reporter.timed("tracing"):
        program = trace_global(gm, inputs, mesh=mesh, extra_layouts=extra_layouts, names=names)
    reporter("trace", program.gm)
    with reporter.timed("planning"):
        planned = shard_graph(program.gm, program.mesh, program.input_layouts, strict=strict, cost_model=cost_model)
    reporter("plan", planned)
    with reporter.timed("lowering"):
        runner = ShardedCallable(planned, device_mesh or program.device_mesh, program.tensor_positions,
                                 [program.input_layouts[n] for n in program.input_names], inductor=inductor,
                                 reporter=reporter)
    reporter("lower", runner.local_graph)
    reporter.summarize(planned)
    return runner
