"""Stage 6 for training: the lowered forward and backward of this rank behind one autograd node.

The caller's DTensors enter the node as they are (it unwraps them and returns their gradients as
DTensors on their specs, as ``to_local()``'s backward would) and the outputs leave through
``DTensor.from_local``, so autograd sees an ordinary DTensor program:
``loss.backward()`` runs the compiled backward, and each parameter's gradient arrives as a
DTensor with the parameter's placements (the plan computed it in that layout), ready for
``torch.optim``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor

from fxshard.graph import code_on_demand
from fxshard.layout import Layout
from fxshard.lowering.groups import MeshGroups
from fxshard.lowering.localize import complete_fake_values

from fxshard.backend.inductor.collector import collector_paused
from fxshard.backend.layers.end_regions import worth_compiling
from fxshard.backend.inductor.compile_local import BucketPolicy, block_bytes, bucketed_uncompiled, compile_local
from fxshard.backend.capture.inputs import DTensorGradients, InputReader
from fxshard.backend.capture.outputs import OutputWriter
from fxshard.backend.programs.joint import TrainingPlan
from fxshard.backend.layers.regional_program import Region, RegionalProgram, RegionRole, Schedule, region_schedule
from fxshard.backend.layers.regions import program_copy
from fxshard.backend.programs.lower_for_rank import lower_for_rank
from fxshard.backend.programs.stage6 import cut_into_regions
from fxshard.backend.reports.report import StageReporter


@dataclass
class LoweredTraining:
    """What running a training step needs of its plan: this rank's lowered forward and backward (stages 4-5)
    and the program's signature. Kept on disk whole (``lowered_cache.py``): a second run starts here."""

    forward: fx.GraphModule  # this rank's local forward: primals -> (*outputs, *saved)
    backward: fx.GraphModule  # (*saved, *tangents) -> gradients of grad_inputs
    tensor_positions: list[int]  # of each primal in the caller's inputs
    input_layouts: list[Layout]  # of each primal
    output_layouts: tuple[Layout, ...]  # of the forward outputs
    grad_inputs: tuple[int, ...]  # which primals get a gradient, in the backward's output order
    grad_names: tuple[str, ...]  # their names (the parameters' gradients bucket by block)
    num_outputs: int


def _end_worth_compiling(region: Region, inputs: list[torch.Tensor]) -> bool:
    """Whether a prologue or an epilogue is compiled (``end_regions.py``), read from its values' layouts and
    dtypes (a region a second run loaded comes without fake values: computed here, as compiling would)."""
    complete_fake_values(region.graph, inputs)
    return worth_compiling(region.graph)


def lower_training(plan: TrainingPlan, coordinate: tuple[int, ...], groups: MeshGroups) -> LoweredTraining:
    """Stages 4-5 of a training plan for the rank at ``coordinate``."""
    forward, backward = (lower_for_rank(g, coordinate, groups) for g in (plan.forward, plan.backward))
    program = plan.program
    return LoweredTraining(forward, backward, list(program.tensor_positions),
                           [program.input_layouts[n] for n in program.input_names], tuple(plan.output_layouts),
                           tuple(plan.grad_inputs), tuple(program.input_names[k] for k in plan.grad_inputs),
                           plan.num_outputs)


@dataclass
class KeptRegions:
    """A training step's regions as a second run needs them (``lowered_cache.py`` keeps them): each program's
    schedule and regions (their graphs) and the bucket cap."""

    schedules: dict[str, Schedule]  # "forward", "backward"
    regions: dict[str, list[Region]]
    cap: int


class TrainingProgram:
    """Runs this rank's forward under autograd; the backward runs when the loss's does.

    Built from a ``TrainingPlan`` (stages 4-5 run here), from its ``lowered`` programs and a function
    that plans again should anyone read ``plan`` (a second run's programs loaded from disk), or from a folded
    plan's lowered four layers (``folded``: a ``fold_lowered.FoldedLowering``, which gives the step its
    signature, bucket cap and regions, and its whole lowered programs should anyone read them)."""

    def __init__(self, plan: TrainingPlan | Callable[[], TrainingPlan], device_mesh: Any, inductor: bool = True,
                 bucketing: bool = True, reporter: StageReporter | None = None, eager_layouts: Sequence[Any] = (),
                 regional: bool = True, lowered: LoweredTraining | None = None, kept: KeptRegions | None = None,
                 folded: Any = None):
        coordinate = tuple(int(c) for c in device_mesh.get_coordinate())
        if folded is not None:
            lowered = folded.signature
        if lowered is None:
            assert isinstance(plan, TrainingPlan), "a TrainingProgram without its plan needs its lowered programs"
            lowered = lower_training(plan, coordinate, MeshGroups(device_mesh))
        self._plan = plan
        self.lowered = lowered
        self.folded = folded
        self.device_mesh = device_mesh
        self.coordinate = coordinate
        # reads the lowered programs where only the regions were loaded (a second run) or the step is folded,
        # should anyone ask
        self.read_lowered: Callable[[], tuple[fx.GraphModule, fx.GraphModule]] | None = \
            folded.lowered_graphs if folded is not None else None
        self.num_outputs, self.grad_inputs = lowered.num_outputs, lowered.grad_inputs
        self.positions = list(lowered.tensor_positions)
        self.input_layouts = list(lowered.input_layouts)
        self.eager = list(eager_layouts) or [None] * len(lowered.output_layouts)  # plain outputs (outputs.py)
        self.read_inputs = InputReader(self.positions, self.input_layouts, coordinate)
        self.input_gradient = DTensorGradients()
        self.write_outputs = OutputWriter(lowered.output_layouts, device_mesh, self.eager)
        self.inductor = inductor
        # a bucket per block's parameter gathers and gradient reduce_scatters, others capped at a block's
        # bytes (compile_local.py); the backward's outputs are the gradients of the grad_inputs
        cap = kept.cap if kept is not None else folded.cap() if folded is not None else block_bytes(self.forward_graph)
        self.buckets = ({"forward": BucketPolicy(cap), "backward": BucketPolicy(cap, lowered.grad_names)}
                        if bucketing else None)
        # compile each distinct layer once (backend/layers/regions.py); the cache is shared by forward and backward
        self.regional = regional
        self.region_cache: dict = {}
        self._region_split: tuple[list, list] | None = None
        self._region_graphs: dict[str, fx.GraphModule] = {}  # the programs the regions cut (copies: _regions)
        self._schedules: dict[str, Schedule] = {}  # how each runs its regions, where they were loaded from disk
        if kept is not None:  # a second run's regions (lowered_cache.py): no lowered program to cut
            self._region_split = (kept.regions["forward"], kept.regions["backward"])
            self._schedules = dict(kept.schedules)
        # called with the regions once cut (what lowered_cache.py keeps for a second run)
        self.on_regions: Callable[[KeptRegions], None] | None = None
        self.reporter = reporter or StageReporter()
        self._forward: Callable | None = None
        self._backward: Callable | None = None

    @property
    def forward_graph(self) -> fx.GraphModule:
        """This rank's lowered forward (stage 5)."""
        return self.lowered_graphs()[0]

    @property
    def backward_graph(self) -> fx.GraphModule:
        """This rank's lowered backward (stage 5)."""
        return self.lowered_graphs()[1]

    def lowered_graphs(self) -> tuple[fx.GraphModule, fx.GraphModule]:
        """This rank's lowered forward and backward, read (from disk, or unfolded) where the step runs without."""
        lowered = self.lowered
        if lowered.forward is None:  # a second run loaded the regions alone (lowered_cache.py), or folded
            if self.read_lowered is None:
                raise RuntimeError("this training program's regions were loaded from disk without its lowered "
                                   "programs; set FXSHARD_LOWERED_CACHE=0 to plan and lower it in this run")
            lowered.forward, lowered.backward = self.read_lowered()
        return lowered.forward, lowered.backward

    @property
    def plan(self) -> TrainingPlan:
        """The planned global programs (stages 1-3); planned again on first reading where the lowered
        programs were loaded from disk."""
        if not isinstance(self._plan, TrainingPlan):
            self._plan = self._plan()
        return self._plan

    def __call__(self, *args: Any) -> tuple:
        outs = _TrainingStep.apply(self, *self.read_inputs(args, differentiable=True))
        return self.write_outputs(outs)

    def run_forward(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The forward program on ``inputs`` (a list it takes over and empties)."""
        return self._run("forward", inputs)

    def run_backward(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The backward program on ``inputs`` (a list it takes over and empties: see ``_run``)."""
        return self._run("backward", inputs)

    def _run(self, which: str, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Run the forward or backward program; Inductor compiles it on its first call, with these inputs
        (regionally: each region as the first call reaches it, so that call is timed with the compile).
        Takes ``inputs`` over and empties it, so a regional program frees each input after its last
        reader (``RegionalProgram.call_boxed``)."""
        args = [x.detach().contiguous() for x in inputs]
        inputs.clear()
        run = getattr(self, f"_{which}")
        if run is None and not self.inductor:
            run = getattr(self, f"{which}_graph")
            setattr(self, f"_{which}", run)
        if run is not None:
            return list(_as_tuple(_call(run, args)))
        if self.regional and self._region_split is None:
            # fxshard's stage, not Inductor's; graphs write their code when run or read (fxshard.graph)
            with torch.no_grad(), self.reporter.timed("regions"), collector_paused(), code_on_demand():
                self._regions()
        with torch.no_grad(), self.reporter.timed(f"compiling the local {which} with Inductor"):
            run = self._compiled(args, which)
            setattr(self, f"_{which}", run)
            return list(_as_tuple(_call(run, args)))

    def _compiled(self, inputs: list[torch.Tensor], which: str) -> Callable:
        """The whole program compiled, or (``regional``, a model with layers) a program that compiles its
        regions on its first call."""
        regions = self._regions()[0 if which == "forward" else 1] if self.regional else []  # cut by _run
        if not regions:
            gm = self.forward_graph if which == "forward" else self.backward_graph
            return compile_local(gm, inputs, self.buckets and self.buckets[which], training=True)
        return RegionalProgram(self._region_graphs.get(which), regions, self._compile_region, self.region_cache,
                               schedule=self._schedules.get(which))

    def _compile_region(self, region: Region, inputs: list[torch.Tensor]) -> Callable:
        """A layer's region compiled, and the prologue or the epilogue where that pays (``end_regions.py``);
        a region between two layers (collectives alone) and an end with little to compile run as their graphs
        (regions.py). All bucket their collectives by the blocks stage 6 tagged on the whole programs (stage6.py)."""
        policy = self.buckets and BucketPolicy(self.buckets["forward"].cap, tagged=True)
        if region.role is RegionRole.LAYER or (region.role is not RegionRole.BETWEEN
                                               and _end_worth_compiling(region, inputs)):
            return compile_local(region.graph, inputs, policy, training=True)
        # bucketing rewrites the graph it is given: the region's stays as cut (regions a second run loads
        # share one graph per key, lowered_cache.store_regions, and come without fake values)
        graph = program_copy(region.graph)
        complete_fake_values(graph, inputs)
        return bucketed_uncompiled(graph, policy)

    def _regions(self) -> tuple[list, list]:
        """The forward's and the backward's regions, cut at the first call (``stage6.cut_into_regions``): a folded
        step's from its four layers' lowered programs, unfolded (``fold_lowered.py``), the others' (and a folded
        one's whose bucketed layers do not unfold) from the whole lowered programs."""
        if self._region_split is None:
            cut = None
            kind = dict(num_outputs=self.num_outputs, grad_names=self.lowered.grad_names,
                        bucketing=self.buckets is not None, overlap=self.buckets is not None)
            if self.folded is not None:
                short = self.folded.short_lowered
                cut = cut_into_regions((short.forward, short.backward), unfold=self.folded.unfolded_regions, **kind)
            if cut is None:
                cut = cut_into_regions(self.lowered_graphs(), **kind)
            self._region_graphs = dict(zip(("forward", "backward"), cut.graphs))
            self._region_split = (cut.regions[0], cut.regions[1])
            self._on_cut()
        return self._region_split

    def _on_cut(self) -> None:
        """The regions, once cut, to whom keeps them (``on_regions``), with their schedules."""
        forward, backward = self._region_split
        if self.on_regions is not None and forward and backward:
            self._schedules = {"forward": region_schedule(self._region_graphs["forward"], forward),
                               "backward": region_schedule(self._region_graphs["backward"], backward)}
            self.on_regions(KeptRegions(dict(self._schedules), {"forward": forward, "backward": backward},
                                        self.buckets["forward"].cap if self.buckets else 0))


class _TrainingStep(torch.autograd.Function):
    """The step as one autograd node. DTensor inputs enter as they are and are unwrapped here; their
    gradients leave as DTensors on their specs (``inputs.DTensorGradients``)."""

    @staticmethod
    def forward(ctx: Any, runner: TrainingProgram, *inputs: torch.Tensor) -> tuple:  # type: ignore[override]
        ctx.gradient_of = [(x._spec, x._local_tensor.stride()) if isinstance(x, DTensor) else None for x in inputs]
        results = runner.run_forward([x._local_tensor if isinstance(x, DTensor) else x for x in inputs])
        n = runner.num_outputs
        outs, saved = results[:n], results[n:]
        ctx.runner = runner
        ctx.out_meta = [(o.shape, o.dtype, o.device) for o in outs]
        ctx.save_for_backward(*saved)
        ctx.mark_non_differentiable(*[o for o in outs if not o.dtype.is_floating_point])
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor | None) -> tuple:  # type: ignore[override]
        runner: TrainingProgram = ctx.runner
        tangents = [g if g is not None else torch.zeros(shape, dtype=dtype, device=device)
                    for g, (shape, dtype, device) in zip(grad_outputs, ctx.out_meta)]
        args = [*ctx.saved_tensors, *tangents]
        del tangents, grad_outputs
        # as AOTAutograd's backward: autograd's references to the saved values go now (unless the graph is
        # retained), so the program frees each as its last reader runs rather than when the step ends
        ctx.maybe_clear_saved_tensors()
        grads = runner.run_backward(args)
        result: list[torch.Tensor | None] = [None] * len(runner.positions)
        for k, g in zip(runner.grad_inputs, grads):
            result[k] = runner.input_gradient(g, ctx.gradient_of[k])
        return (None, *result)


def _call(run: Callable, args: list[torch.Tensor]) -> Any:
    """``run`` on ``args``, handing the list over where ``run`` takes it (``RegionalProgram``): the other
    programs (a whole program compiled, a graph) hold their inputs until they return."""
    if isinstance(run, RegionalProgram):
        return run.call_boxed(args)
    return run(*args)


def _as_tuple(x: Any) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)
