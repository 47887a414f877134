"""The torch.compile backend "fxshard": tracing, DTensor in/out, the entry point.

``torch.compile(model, backend="fxshard")`` finds this through the ``torch_dynamo_backends``
entry point. A graph with no DTensor and no mesh in it (a plain model, the plain pieces between a
parallelized model's graph breaks, FSDP2's compute between its hooks) has nothing to plan: Inductor
compiles it as ``backend="inductor"`` does. Options (``torch.compile(..., options={...})``): ``strict``
(error on ops without a sharding rule), ``inductor`` (False runs the lowered graph, or the plain one, as it is),
``bucketing`` (False leaves each collective and its wait where fxshard lowered them: see
``backend/inductor/compile_local.py``), ``regional`` (default True: each distinct layer compiled once, not the whole local program:
less compile time, the same buckets, collectives overlapped within a layer only: ``backend/layers/regions.py``),
``cost_model`` (a ``fxshard.CostModel``), ``training_split`` (a ``fxshard.TrainingSplit``: which gathered
values the forward keeps for the backward; ``TrainingSplit(keep_gathered_activations=False)`` gathers a
sequence-parallel block's input again in the backward, as Megatron-LM: less memory, one all_gather more
per block), ``on_graph`` (a callback receiving each stage's graph
as ``(stage_name, GraphModule)``, for inspection), ``debug_dir`` (writes each stage's graph there
as text: ``<graph>_<n>_<stage>.txt``), ``placements="auto"`` with ``memory_budget`` (bytes per rank) and
``mesh`` (a DeviceMesh): a plain module placed by ``fxshard.auto_placements`` (``backend/auto_placements.py``). Every option, with the environment's switches (``FXSHARD_FOLD``,
``FXSHARD_LOWERED_CACHE``, ``FXSHARD_CPU_WRAPPER``) and the tuned thresholds, is a field of
``backend/options.py``'s ``Options``.

Watching the stages (``on_graph``, ``debug_dir``, ``TORCH_LOGS="+fxshard"``; ``fxshard.compile`` takes the
first two too) changes nothing that runs: the graphs shown are those of the program that runs. ``lower`` (and
``lower_backward`` for training) is this rank's lowered program as it runs. A training program of
``Options.min_layers`` (five) or more alike layers is planned folded
(``backend/programs/fold.py``): its ``plan``, ``plan_forward`` and ``plan_backward`` are the four layers stage 3
planned, and its ``lower``/``lower_backward`` the whole program unfolded from them. A program loaded from the
lowered cache (a second run: ``backend/programs/lowered_cache.py``) ran no trace and no plan: its watcher sees
``lower`` (and ``lower_backward``) alone, the programs loaded from disk; ``FXSHARD_LOWERED_CACHE=0`` plans it
again, every stage shown.

When autograd records and an input requires grad, the backend compiles the joint
forward+backward program (backend/programs/joint.py, training.py): gradients come back as DTensors
with their parameters' placements.

Sizes: fxshard plans for concrete sizes. When Dynamo hands over a graph with dynamic sizes
(automatic dynamic shapes after a size changed, or ``dynamic=True``), the backend compiles one
program per distinct set of input sizes and picks it per call (``backend/programs/sizes.py``): a program
never runs on sizes it was not planned for.

Logging the PyTorch way: ``TORCH_LOGS="fxshard"`` prints what each stage did and how long it
took, and a summary per compiled graph (communication and memory per rank);
``TORCH_LOGS="+fxshard"`` every stage's graph too; under ``TORCH_TRACE`` each stage is a
structured artifact (``fxshard_<stage>``) for tlparse.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

__all__ = ["fxshard_backend"]

# Dynamo traces a DTensor program through DTensor's own sharding rules: lend it fxshard's for the
# ops it lacks (CPU flash attention), before torch.compile's first trace (this module is imported
# when torch.compile resolves backend="fxshard")
from fxshard.backend.capture.dtensor_rules import lend_rules_to_dtensor  # noqa: E402

lend_rules_to_dtensor()


def fxshard_backend(gm: fx.GraphModule, example_inputs: list[Any], options: dict | None = None,
                    mode: str | None = None) -> Callable:
    from fxshard.backend.capture.inputs import find_device_mesh
    from fxshard.backend.options import Options
    from fxshard.backend.programs.sizes import per_size
    from fxshard.backend.reports.report import StageReporter

    if (options or {}).get("mixed_precision") is not None:
        raise ValueError(
            "torch.compile(..., options={'mixed_precision': ...}): Dynamo captured this graph with the parameters in "
            "their own dtype before the backend ran, and the model's code may have read that dtype (x.dtype) into "
            "it. Give the policy to the model instead, where it is captured: "
            "torch.compile(fxshard.with_mixed_precision(model, policy), backend='fxshard'); fxshard.compile(model, "
            "mixed_precision=policy), fxshard.explain and fxshard.simulate take mixed_precision= themselves")
    given = Options.from_backend(options)
    if given.placements == "auto":
        from fxshard.backend.auto_placements import backend_program

        reporter = StageReporter(given.on_graph, given.debug_dir)
        return per_size(gm, example_inputs, lambda inputs: backend_program(gm, inputs, given, reporter, _trains(inputs)),
                        reporter.graph_id)
    if find_device_mesh(example_inputs, gm) is None:
        return _plain_program(gm, example_inputs, given.inductor, mode)
    reporter = StageReporter(given.on_graph, given.debug_dir)
    return per_size(gm, example_inputs, lambda inputs: _compile(gm, inputs, given, reporter), reporter.graph_id)


def _plain_program(gm: fx.GraphModule, example_inputs: list[Any], inductor: bool, mode: str | None) -> Callable:
    """A Dynamo graph with no DTensor and no mesh (a plain model, a plain piece between graph breaks):
    nothing to plan, so Inductor compiles it as ``backend="inductor"`` would, through AOTAutograd (training too)."""
    if not inductor:
        return gm.forward
    from fxshard.backend.inductor.inductor_calls import compile_plain

    return compile_plain(gm, example_inputs, mode)


def _compile(gm: fx.GraphModule, inputs: Sequence[Any], options: Any, reporter: Any) -> Callable:
    """Stages 1-6 for inputs of concrete sizes: the program that runs each call of those sizes."""
    from fxshard.backend.driver import compile_program

    return compile_program(gm, inputs, training=_trains(inputs), options=options, reporter=reporter)


def _trains(inputs: Sequence[Any]) -> bool:
    """Autograd is recording and some input requires grad: compile the joint program (training)."""
    return torch.is_grad_enabled() and any(
        isinstance(x, torch.Tensor) and x.requires_grad and x.dtype.is_floating_point for x in inputs)
