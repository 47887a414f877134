"""The torch.compile backend "fxshard": tracing, DTensor in/out, the entry point.

``torch.compile(model, backend="fxshard")`` finds this through the ``torch_dynamo_backends``
entry point. Options (``torch.compile(..., options={...})``): ``strict`` (error on ops
without a sharding rule), ``inductor`` (False runs the lowered graph without Inductor),
``cost_model`` (a ``fxshard.CostModel``), ``on_graph`` (a callback receiving each stage's graph
as ``(stage_name, GraphModule)``, for inspection), ``debug_dir`` (writes each stage's graph there
as text: ``<graph>_<n>_<stage>.txt``).

When autograd records and an input requires grad, the backend compiles the joint
forward+backward program (backend/joint.py, training.py): gradients come back as DTensors
with their parameters' placements.

Logging the PyTorch way: ``TORCH_LOGS="fxshard"`` prints a summary per compiled graph
(communication and memory per rank), ``TORCH_LOGS="+fxshard"`` every stage's graph too; under
``TORCH_TRACE`` each stage is a structured artifact (``fxshard_<stage>``) for tlparse.
"""
from __future__ import annotations

from typing import Any, Callable

import torch.fx as fx

__all__ = ["fxshard_backend"]

_OPTIONS = {"strict", "inductor", "cost_model", "on_graph", "debug_dir"}


def fxshard_backend(gm: fx.GraphModule, example_inputs: list[Any], options: dict | None = None,
                    mode: str | None = None) -> Callable:
    from fxshard.pipeline import shard_graph

    from .compile import ShardedCallable
    from .trace import find_device_mesh, trace_global

    options = dict(options or {})
    unknown = set(options) - _OPTIONS
    if unknown:
        raise ValueError(f"unknown fxshard options {sorted(unknown)}; known: {sorted(_OPTIONS)}")
    from .report import StageReporter

    on_graph = StageReporter(options.get("on_graph"), options.get("debug_dir"))
    if find_device_mesh(example_inputs, gm) is None:
        # nothing is distributed: fxshard has nothing to do, Inductor compiles the program as is
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs) if options.get("inductor", True) else gm.forward
    if _trains(example_inputs):
        from .joint import plan_training
        from .training import TrainingCallable

        plan = plan_training(gm, example_inputs, strict=options.get("strict", False),
                             cost_model=options.get("cost_model"))
        on_graph("plan", plan.joint)
        on_graph("plan_forward", plan.forward)
        on_graph("plan_backward", plan.backward)
        training = TrainingCallable(plan, plan.program.device_mesh, inductor=options.get("inductor", True))
        on_graph("lower", training.forward_graph)
        on_graph("lower_backward", training.backward_graph)
        on_graph.summarize(plan.forward)
        on_graph.summarize(plan.backward)
        return training
    program = trace_global(gm, example_inputs)
    on_graph("trace", program.gm)
    planned = shard_graph(program.gm, program.mesh, program.input_layouts, strict=options.get("strict", False),
                          cost_model=options.get("cost_model"))
    on_graph("plan", planned)
    sharded = ShardedCallable(planned, program.device_mesh, program.tensor_positions,
                              [program.input_layouts[n] for n in program.input_names],
                              inductor=options.get("inductor", True))
    on_graph("lower", sharded.local_graph)
    on_graph.summarize(planned)
    return sharded


def _trains(example_inputs: list[Any]) -> bool:
    """Autograd is recording and some input requires grad: compile the joint program (training)."""
    import torch

    return torch.is_grad_enabled() and any(
        isinstance(x, torch.Tensor) and x.requires_grad and x.dtype.is_floating_point for x in example_inputs)
