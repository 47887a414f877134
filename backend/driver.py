"""The one path every entry point takes: inputs -> layouts -> trace -> plan -> (split) -> runner.

``plan_program`` runs stages 1-3 on a captured graph with concrete example inputs (training:
the joint graph, planned whole and split); ``compile_program`` adds stages 4-6 for this rank
(the backend and ``fxshard.compile``); ``plan_function`` first captures a Python function with
Dynamo as one graph and turns every way its inputs were given a sharding into layouts
(``simulate(grad=True)``, ``lowered_graphs``; ``explain`` and ``simulate`` plan graph by graph:
``graph_runs.py``). Each stage is timed (``fxshard.timing``) and reported (``StageReporter``:
``on_graph``, ``debug_dir``, ``TORCH_LOGS``).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx as fx

from fxshard.costs import CostModel
from fxshard.graph import code_on_demand, outputs
from fxshard.layout import Layout
from fxshard.mesh import MeshSpec
from fxshard.pipeline import shard_graph
from fxshard.placements import as_mesh_spec
from fxshard.policies import DEFAULT_TRAINING_SPLIT, MixedPrecision, TrainingSplit
from fxshard.timing import stage

from fxshard.backend.capture import outputs as outputs_
from fxshard.backend.capture.capture import Captured, capture
from fxshard.backend.capture.mixed_precision import under_policy
from fxshard.backend.inductor.collector import collector_paused
from fxshard.backend.programs.fold import Shortened, shorten, unfolder
from fxshard.backend.programs.fold_lowered import FoldedLowering, lower_folded
from fxshard.backend.inductor.compile_local import start_compile_workers
from fxshard.backend.programs.inference import InferenceProgram
from fxshard.backend.capture.inputs import find_device_mesh, input_layouts, named_inputs
from fxshard.backend.programs.joint import TrainingPlan, plan_training
from fxshard.backend.programs.lowered_cache import load_lowered, lowered_key, read_lowered_graphs, store_lowered, store_regions
from fxshard.backend.reports.report import StageReporter, label_of
from fxshard.backend.capture.trace import TracedProgram, trace_global
from fxshard.backend.programs.training import LoweredTraining, TrainingProgram
from fxshard.backend.options import Options, in_force


@dataclass
class PlannedProgram:
    """Stages 1-3 of one program: its trace (names, positions, input layouts) and its planned graph."""

    program: TracedProgram  # the forward trace, or the joint one for training (of the short program, folded)
    graph: fx.GraphModule | None  # the planned global graph (training: the planned joint graph; None: folded)
    # the forward and backward cut from the joint graph, or (folded) what unfolds them when first read
    planned_training: TrainingPlan | Callable[[], TrainingPlan] | None = None
    # per output the user's program has: None (a DTensor) or the layout of the plain block eager holds
    # (backend/capture/outputs.py); empty when placements= shards plain tensors (a global program throughout)
    eager_outputs: list[Any] = field(default_factory=list)
    # a training program of repeated layers planned folded: the four-layer plan ``training`` was unfolded
    # from, and how it was shortened (stages 4-6 run on it: ``fold_lowered.py``)
    folded: tuple[TrainingPlan, Shortened] | None = None

    @property
    def training(self) -> TrainingPlan | None:
        """The planned forward and backward (a folded plan's unfolded on first reading: ``fold.unfolder``)."""
        if callable(self.planned_training):
            self.planned_training = self.planned_training()
        return self.planned_training

    @property
    def is_training(self) -> bool:
        return self.planned_training is not None

    @property
    def forward(self) -> fx.GraphModule:
        return self.training.forward if self.training is not None else self.graph


def plan_program(gm: fx.GraphModule, inputs: Sequence[Any], *, training: bool, mesh: MeshSpec | None = None,
                 layouts: Mapping[int, Layout] | None = None, names: Sequence[str] | None = None,
                 strict: bool = False, cost_model: CostModel | None = None,
                 reporter: StageReporter | None = None,
                 training_split: TrainingSplit = DEFAULT_TRAINING_SPLIT, fold: bool = False) -> PlannedProgram:
    """Stages 1-3 of ``gm`` for ``inputs`` (concrete sizes). ``layouts``: by input position (default:
    DTensors bring theirs, plain tensors are replicated); ``training``: the joint program, cut into
    forward and backward as ``training_split`` says (``fxshard.policies.TrainingSplit``); ``fold``: a
    training program's repeated layers planned once where ``FXSHARD_FOLD`` allows (``fold.py``: the plan has no
    joint graph then; its stages show the four layers planned)."""
    reporter = reporter or StageReporter()
    with reporter.timing(), code_on_demand(), collector_paused():
        if training and fold:
            folded = _plan_folded(gm, inputs, reporter, mesh=mesh, layouts=layouts, names=names, strict=strict,
                                  cost_model=cost_model, training_split=training_split)
            if folded is not None:
                return folded
        return _plan_program(gm, inputs, training=training, mesh=mesh, layouts=layouts, names=names, strict=strict,
                             cost_model=cost_model, reporter=reporter, training_split=training_split)


def _plan_folded(gm: fx.GraphModule, inputs: Sequence[Any], reporter: StageReporter,
                 **options: Any) -> PlannedProgram | None:
    """Stages 1-3 of a training program of repeated layers on four of them, made whole (``fold.py``); None
    where it has no such layers or its middle layers were not planned alike. The stages' graphs reported are
    the four layers' plan: what stage 3 planned."""
    short = shorten(gm) if in_force().fold else None
    if short is None:
        return None
    split = options.pop("training_split")
    plan = plan_training(short.gm, inputs, split=split, **options)
    with stage("unfold"):
        unfolding = unfolder(plan, short)
    if unfolding is None:
        return None
    reporter("plan", plan.joint)
    reporter("plan_forward", plan.forward)
    reporter("plan_backward", plan.backward)

    def whole() -> TrainingPlan:  # read for the summary line, ``plan``, simulate; the step runs without it
        with stage("unfold"):
            unfolded = unfolding()
        return unfolded if unfolded is not None else plan_training(gm, inputs, split=split, **options)

    eager = outputs_.eager_layouts(short.gm, plan.program, plan.num_outputs) if options["layouts"] is None else []
    return PlannedProgram(plan.program, None, whole, eager, folded=(plan, short))


def _plan_program(gm: fx.GraphModule, inputs: Sequence[Any], *, training: bool, mesh: MeshSpec | None,
                  layouts: Mapping[int, Layout] | None, names: Sequence[str] | None, strict: bool,
                  cost_model: CostModel | None, reporter: StageReporter,
                  training_split: TrainingSplit = DEFAULT_TRAINING_SPLIT) -> PlannedProgram:
    if training:
        plan = plan_training(gm, inputs, mesh=mesh, layouts=layouts, names=names, strict=strict, cost_model=cost_model,
                             split=training_split)
        reporter("plan", plan.joint)
        reporter("plan_forward", plan.forward)
        reporter("plan_backward", plan.backward)
        eager = outputs_.eager_layouts(gm, plan.program, plan.num_outputs) if layouts is None else []
        return PlannedProgram(plan.program, plan.joint, plan, eager)
    with stage("trace"):
        program = trace_global(gm, inputs, mesh=mesh, layouts=layouts, names=names)
    reporter("trace", program.gm)
    eager = outputs_.eager_layouts(gm, program, len(outputs(program.gm))) if layouts is None else []
    planned = shard_graph(program.gm, program.mesh, program.input_layouts, strict=strict, cost_model=cost_model,
                          output_layouts=wanted_output_layouts(gm, program, eager))
    reporter("plan", planned)
    return PlannedProgram(program, planned, eager_outputs=eager)


def wanted_output_layouts(gm: fx.GraphModule, program: TracedProgram,
                          eager: Sequence[Any]) -> list[Layout | None] | None:
    """The layouts the caller needs of the outputs (None: any): what Python reads at a graph break,
    and the plain blocks eager holds (``eager``: ``PlannedProgram.eager_outputs``)."""
    read = read_by_python(gm, program)
    plain = outputs_.wanted(eager)
    if not any(p is not None for p in plain):
        return read
    return [r if r is not None else p for r, p in zip(read or plain, plain)]


def read_by_python(gm: fx.GraphModule, program: TracedProgram) -> list[Layout | None] | None:
    """The layouts a graph that ends at a graph break must return: its scalars replicated.

    Python reads them (``if loss > 0``, ``.item()``), and a DTensor's value is read from its local
    tensor: a Partial sum would give each rank its own share. Other outputs keep their layouts.
    """
    reason = getattr(gm, "compile_subgraph_reason", None)
    if reason is None or not getattr(reason, "graph_break", False):
        return None
    return [Layout.replicated(program.mesh, ()) if node.meta["val"].dim() == 0 else None
            for node in outputs(program.gm)]


def compile_program(gm: fx.GraphModule, inputs: Sequence[Any], *, training: bool, options: Options | None = None,
                    device_mesh: Any = None, reporter: StageReporter | None = None,
                    **given: Any) -> InferenceProgram | TrainingProgram:
    """Stages 1-6: the callable that runs this rank's program, as ``options`` say (default: those in force);
    ``given``: the program's ``mesh``, input ``layouts`` and ``names``, as ``plan_program``'s. ``device_mesh``
    defaults to the one of the DTensor inputs. Stages 1-5 are skipped where an earlier run kept this rank's
    lowered programs (``lowered_cache.py``); whoever watches the stages sees the lowered programs that run."""
    options = options or in_force()
    reporter = reporter or StageReporter()
    if options.inductor:
        start_compile_workers()  # up by the time stage 6 compiles (compile_local.py)
    device_mesh = device_mesh or find_device_mesh(inputs, gm)
    plan_options = dict(given, strict=options.strict, cost_model=options.cost_model,
                        training_split=options.training_split)
    # the options are in the key (folding too: a loaded program is what this run would plan, as every other rank's)
    key = lowered_key(gm, inputs, device_mesh, dict(given, training=training, options=options.cache_text()))
    run_options = dict(inductor=options.inductor, bucketing=options.bucketing, regional=options.regional,
                       reporter=reporter)
    if key is not None:
        with reporter.timed("loading the lowered programs"), collector_paused():
            kept = load_lowered(key)
        if kept is not None:
            for text in kept.summaries:
                reporter.say(text)
            if isinstance(kept.lowered, LoweredTraining):
                runner = TrainingProgram(_planner(gm, inputs, plan_options), device_mesh,
                                         eager_layouts=kept.eager_layouts, lowered=kept.lowered, kept=kept.regions,
                                         **run_options)
                runner.read_lowered = lambda: read_lowered_graphs(key)  # only the regions were read
            else:
                runner = InferenceProgram(None, device_mesh, kept.lowered.tensor_positions,
                                          kept.lowered.input_layouts, eager_layouts=kept.eager_layouts,
                                          lowered=kept.lowered, **run_options)
            _show_lowered(runner, reporter)
            return runner
    planned = plan_program(gm, inputs, training=training, reporter=reporter, fold=options.fold, **plan_options)
    device_mesh = device_mesh or planned.program.device_mesh
    program, eager = planned.program, planned.eager_outputs
    runner: Any
    if planned.is_training:
        with reporter.timing(), code_on_demand(), collector_paused():
            folded = _lowered_folded(planned, device_mesh)
            # a folded plan is unfolded only should someone read it (its summary line, ``plan``)
            plan = planned.training if folded is None else (lambda: planned.training)
            runner = TrainingProgram(plan, device_mesh, eager_layouts=eager, folded=folded, **run_options)
        reporter.stage_summary()
        _show_lowered(runner, reporter)
        summaries = ([reporter.summarize(g, keep=key is not None)
                      for g in (planned.training.forward, planned.training.backward)]
                     if reporter.summarizes(keep=key is not None) else [])
    else:
        with reporter.timing(), code_on_demand(), collector_paused():
            runner = InferenceProgram(planned.graph, device_mesh, program.tensor_positions,
                                      [program.input_layouts[n] for n in program.input_names], eager_layouts=eager,
                                      **run_options)
        reporter.stage_summary()
        _show_lowered(runner, reporter)
        summaries = [reporter.summarize(planned.graph, keep=key is not None)]
    if key is not None:
        kept_summaries = [text for text in summaries if text]
        with collector_paused():
            if isinstance(runner, TrainingProgram) and runner.folded is not None:  # kept as its four layers
                short, layers = runner.folded.kept
                store_lowered(key, short, eager, kept_summaries, folded=layers)
            else:
                store_lowered(key, runner.lowered, eager, kept_summaries)
        if isinstance(runner, TrainingProgram):  # its regions too, once the first call has cut them
            runner.on_regions = lambda regions: store_regions(key, runner.lowered, eager, kept_summaries, regions)
    return runner


def _show_lowered(runner: InferenceProgram | TrainingProgram, reporter: StageReporter) -> None:
    """Stage 5's graphs as they run, to whoever watches: lowered here, unfolded from a folded plan's four layers
    (read only for the watcher: the step runs the regions unfolded from them), or loaded from disk."""
    if not reporter.wants_graphs():
        return
    if isinstance(runner, TrainingProgram):
        reporter("lower", runner.forward_graph)
        reporter("lower_backward", runner.backward_graph)
    else:
        reporter("lower", runner.local_graph)


def _lowered_folded(planned: PlannedProgram, device_mesh: Any) -> FoldedLowering | None:
    """Stages 4-5 of a folded plan on its four layers (``fold_lowered.lower_folded``); None where it was not
    folded, or (not seen) its lowered layers are not alike: the unfolded plan is lowered whole then, the same
    program on every rank."""
    if planned.folded is None:
        return None
    lowered = lower_folded(*planned.folded, device_mesh)
    if lowered is None:
        warnings.warn("fxshard: the lowered layers of a folded plan are not alike; lowering the whole plan "
                      "(please report this: FXSHARD_FOLD=0 plans the whole model)", stacklevel=2)
    return lowered


def _planner(gm: fx.GraphModule, inputs: Sequence[Any], plan_options: Mapping[str, Any]) -> Callable[[], TrainingPlan]:
    """What plans a loaded training program again should someone read its plan (``TrainingProgram.plan``):
    ``fxshard.compile``'s inputs are fake stand-ins, kept; real inputs (the backend's first call) are not kept
    alive for that, and reading the plan says how to have it."""
    if any(isinstance(x, torch.Tensor) and not _fake(x) for x in inputs):
        def unavailable() -> TrainingPlan:
            raise RuntimeError("this program's lowered forward and backward were loaded from disk, planned by an "
                               "earlier run (backend/programs/lowered_cache.py), and its planned global graphs are not kept: "
                               "set FXSHARD_LOWERED_CACHE=0 to plan it in this run")
        return unavailable

    def plan_again() -> TrainingPlan:
        planned = plan_program(gm, inputs, training=True, reporter=StageReporter(), fold=True, **plan_options)
        assert planned.training is not None
        return planned.training
    return plan_again


def _fake(x: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.distributed.tensor import DTensor

    return isinstance(x._local_tensor if isinstance(x, DTensor) else x, FakeTensor)


def plan_function(fn: Callable, args: Sequence[Any], *, mesh: Any = None, placements: Mapping[Any, Any] | None = None,
                  training: bool = False, strict: bool = False, cost_model: CostModel | None = None,
                  reporter: StageReporter | None = None,
                  training_split: TrainingSplit = DEFAULT_TRAINING_SPLIT,
                  fold: bool = False, mixed_precision: MixedPrecision | None = None) -> tuple[Captured, PlannedProgram]:
    """Capture ``fn(*args)`` with Dynamo and plan it: ``mesh`` (a MeshSpec, DeviceMesh or {axis: size};
    default: the DTensor arguments' and parameters') and ``placements`` (argument index or parameter
    name -> placements) say how it is sharded; ``training_split`` and ``fold`` as ``plan_program``'s;
    ``mixed_precision``: ``fn`` run under that policy (``backend/capture/mixed_precision.py``)."""
    reporter = reporter or StageReporter(label=label_of(fn))
    captured = capture(under_policy(fn, mixed_precision), args)
    if mesh is None:
        device_mesh = find_device_mesh(captured.example_inputs)
        if device_mesh is None:
            raise ValueError("give mesh= (a MeshSpec, DeviceMesh or {axis: size}) unless the function's parameters "
                             "or arguments are DTensors")
        mesh = device_mesh
    spec = as_mesh_spec(mesh)
    names = named_inputs(fn, args, captured.objects)
    layouts = input_layouts(captured.objects, spec, [key for _, key in names], placements)
    if training and not any(isinstance(o, torch.Tensor) and o.requires_grad for o in captured.objects):
        raise ValueError("grad=True but no input of the function requires grad")
    planned = plan_program(captured.gm, captured.example_inputs, training=training, mesh=spec, layouts=layouts,
                           names=[n for n, _ in names], strict=strict, cost_model=cost_model, reporter=reporter,
                           training_split=training_split, fold=fold)
    return captured, planned
