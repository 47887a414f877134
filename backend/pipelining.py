"""Pipeline parallelism: a global-shape model split by module names into stages, each stage one
fxshard program on its own sub-mesh of a (pp, dp, tp) DeviceMesh, run by ``torch.distributed.pipelining``.

A stage is the whole model deep-copied with the modules of other stages replaced by pass-throughs
(torchtitan's split: the model's ``forward`` is unchanged and parameter names stay the model's).
``explain_pipeline`` plans every stage's training program in turn, each on the microbatch's global
shapes: a stage's activation input has the layout the previous stage's plan gives its output, so
what crosses a boundary is each rank's local block, nothing gathered; the last stage computes the
loss. ``PipelineRank`` builds this rank's stage: parameters distributed on ``mesh[dp, tp]`` of its pp
coordinate, the planned program lowered for this rank, and a ``PipelineStage`` whose module takes and
returns local blocks (DTensors only inside), on the pp process group, for single-stage schedules
(GPipe, 1F1B). ``simulate_pipeline`` runs the same plan on simulated ranks. Training only: the
schedule's default ``scale_grads`` expects ``loss_fn`` to average over the microbatch.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from fxshard.costs import CostModel
from fxshard.graph import outputs
from fxshard.layout import Layout
from fxshard.memory import MemoryReport
from fxshard.mesh import MeshSpec
from fxshard.placements import as_mesh_spec, placements_from_layout, user_layout

from fxshard.backend.capture.capture import Captured
from fxshard.backend.driver import PlannedProgram, plan_function
from fxshard.backend.explain import Explanation, collectives_of
from fxshard.backend.reports.report import StageReporter


class PassThrough(nn.Module):
    """A module of another stage: returns its first argument (the activation flowing through)."""

    def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        return x


def split_model(model: nn.Module, modules: Sequence[str]) -> nn.Module:
    """A deep copy of ``model`` keeping the submodules named in ``modules`` (and their parents);
    every other leaf-most submodule becomes a ``PassThrough``, so names and ``forward`` stay the model's."""
    stage = copy.deepcopy(model)
    kept = tuple(modules)
    missing = [m for m in kept if m not in dict(stage.named_modules())]
    if missing:
        raise KeyError(f"split_model: {missing} are not submodules of {type(model).__name__}; "
                       f"its top-level modules: {[n for n, _ in model.named_children()]}")

    def keep(name: str) -> bool:
        return any(name == k or name.startswith(k + ".") for k in kept)

    def ancestor(name: str) -> bool:
        return any(k.startswith(name + ".") for k in kept)

    for name, _ in list(stage.named_modules()):
        if not name or keep(name) or ancestor(name) or not _still_there(stage, name):
            continue
        parent, _, leaf = name.rpartition(".")
        owner = stage.get_submodule(parent) if parent else stage
        owner._modules[leaf] = PassThrough()
    return stage


def _still_there(root: nn.Module, name: str) -> bool:
    try:
        return not isinstance(root.get_submodule(name), PassThrough)
    except AttributeError:  # inside a module replaced already
        return False


class StageProgram(nn.Module):
    """The global-shape program of one stage: the stage module, and on the last stage the loss."""

    def __init__(self, module: nn.Module, loss_fn: Callable | None = None):
        super().__init__()
        self.module = module
        self.loss_fn = loss_fn

    def forward(self, x: torch.Tensor, *targets: torch.Tensor) -> torch.Tensor:
        out = self.module(x)
        return self.loss_fn(out, *targets) if self.loss_fn is not None else out


@dataclass
class StageTrace:
    """What planning one stage captured: its program, the example arguments, Dynamo's capture, the plan."""

    program: StageProgram
    args: list[torch.Tensor]
    captured: Captured
    planned: PlannedProgram


@dataclass
class StagePlan:
    """One stage's planned training program on its sub-mesh, for one microbatch."""

    index: int
    modules: tuple[str, ...]
    input_layouts: tuple[Layout, ...]  # global microbatch: the activation (or the first stage's inputs), targets
    input_dtypes: tuple[torch.dtype, ...]
    n_args: int  # how many of the inputs come through the pipeline (the rest: targets, by keyword)
    output_layout: Layout  # what the stage hands on (the last stage: its loss)
    output_dtype: torch.dtype
    explanation: Explanation  # the planned joint forward+backward graph, its collectives
    trace: StageTrace | None = field(default=None, repr=False)  # what PipelineRank and simulate_pipeline run

    @property
    def memory(self) -> MemoryReport:
        return self.explanation.memory

    @property
    def send_bytes(self) -> int:
        """Bytes one rank sends to the next stage per microbatch (its local block of the output);
        the gradient coming back is as large."""
        numel = 1
        for s in self.output_layout.max_local_shape():
            numel *= int(s)
        return numel * torch.empty((), dtype=self.output_dtype).element_size()


@dataclass
class PipelinePlan:
    """Every stage's plan: ``str()`` shows per stage its layouts, collectives, memory and boundary bytes."""

    stages: list[StagePlan]
    mesh: MeshSpec  # each stage's mesh (the pp axis taken out)
    pp: str
    n_microbatches: int
    microbatch_shapes: tuple[tuple[int, ...], ...]  # global shapes of the first stage's inputs per microbatch
    placements: dict[str, Any] = field(default_factory=dict)  # parameter name -> placements on ``mesh``
    input_placements: tuple[Any, ...] = ()  # of the first stage's inputs and of the targets

    @property
    def boundary_bytes(self) -> list[int]:
        """Bytes each rank sends across boundary k per microbatch (forward; the backward returns as many)."""
        return [s.send_bytes for s in self.stages[:-1]]

    def __str__(self) -> str:
        lines = [f"pipeline: {len(self.stages)} stages on {self.pp}, each on {self.mesh}; "
                 f"{self.n_microbatches} microbatches of {list(self.microbatch_shapes)}"]
        for s in self.stages:
            e = s.explanation
            lines.append(f"stage {s.index} ({', '.join(s.modules)}):")
            lines.append("  inputs: " + ", ".join(str(l) for l in s.input_layouts))
            lines.append(f"  output: {s.output_layout}")
            lines.append(f"  forward+backward {e.summary()}")
            lines.append(f"  {e.memory}")
            if s.index < len(self.stages) - 1:
                lines.append(f"  to stage {s.index + 1}: {s.send_bytes} B per rank per microbatch (its local block), "
                             f"the gradient back as many")
        return "\n".join(lines)


def explain_pipeline(model: nn.Module, stages: Sequence[Sequence[str]], inputs: Sequence[torch.Tensor],
                     targets: Sequence[torch.Tensor], *, mesh: Any, placements: Mapping[str, Any],
                     input_placements: Sequence[Any], loss_fn: Callable, n_microbatches: int, pp: str = "pp",
                     cost_model: CostModel | None = None) -> PipelinePlan:
    """Plan the pipeline of ``model`` split into ``stages`` (module names per stage) over ``mesh``
    (a (pp, ...) MeshSpec, DeviceMesh or {axis: size}); no process group needed.

    ``inputs``/``targets``: a whole global batch (the first stage's arguments, the loss's targets),
    split into ``n_microbatches`` along dim 0; ``placements``: parameter name -> placements on the
    stage mesh; ``input_placements``: one per input, then per target. ``loss_fn(output, *targets)``.
    """
    full = as_mesh_spec(mesh)
    if pp not in full.names:
        raise ValueError(f"explain_pipeline: the mesh {full} has no pipeline axis {pp!r}; name it with pp=")
    if int(full.size_of(pp)) != len(stages):
        raise ValueError(f"explain_pipeline: {len(stages)} stages on a pp axis of size {full.size_of(pp)}: "
                         "one stage per pp coordinate")
    spec = MeshSpec({n: s for n, s in zip(full.names, full.sizes) if n != pp})
    firsts = [_microbatch(t, n_microbatches, "input") for t in inputs]
    target_mb = [_microbatch(t, n_microbatches, "target") for t in targets]
    plans: list[StagePlan] = []
    carried: tuple[torch.Tensor, Layout] | None = None
    for index, modules in enumerate(stages):
        last = index == len(stages) - 1
        program = StageProgram(split_model(model, modules), loss_fn if last else None)
        args = list(firsts) if carried is None else [carried[0]]
        given = list(input_placements[:len(inputs)]) if carried is None else [carried[1]]
        if last:
            args += target_mb
            given += list(input_placements[len(inputs):])
        by_key: dict[Any, Any] = {"module." + n: p for n, p in placements.items() if _has_param(program, n)}
        by_key.update({k: p for k, p in enumerate(given)})
        reporter = StageReporter(label=f"pipeline stage {index}")
        captured, planned = plan_function(program, args, mesh=spec, placements=by_key, training=True,
                                          cost_model=cost_model, reporter=reporter)
        training = planned.training
        assert training is not None
        out = outputs(training.forward)[0].meta["val"]
        layouts = tuple(user_layout(f"stage {index} input {k}", p, spec, a.shape) for k, (p, a) in
                        enumerate(zip(given, args)))
        explanation = Explanation(planned.graph, "", dict(planned.program.input_layouts), training.output_layouts,
                                  collectives_of(planned.graph))
        plans.append(StagePlan(index, tuple(modules), layouts, tuple(a.dtype for a in args),
                               len(firsts) if carried is None else 1, training.output_layouts[0], out.dtype,
                               explanation, StageTrace(program, args, captured, planned)))
        carried = (torch.zeros(out.shape, dtype=out.dtype, requires_grad=True), training.output_layouts[0])
    return PipelinePlan(plans, spec, pp, n_microbatches, tuple(tuple(t.shape) for t in firsts), dict(placements),
                        tuple(input_placements))


def _microbatch(t: torch.Tensor, n: int, what: str) -> torch.Tensor:
    if t.shape[0] % n:
        raise ValueError(f"explain_pipeline: a {what} batch of {t.shape[0]} does not split into {n} equal "
                         "microbatches; give a batch divisible by n_microbatches")
    return t[: t.shape[0] // n]


def _has_param(program: StageProgram, name: str) -> bool:
    try:
        program.module.get_parameter(name)
        return True
    except AttributeError:
        return False


class LocalBlocks(nn.Module):
    """What ``PipelineStage`` runs: local blocks in, local blocks out; the stage's planned program
    sees DTensors on the stage mesh in between (``from_local`` with the planned layouts, ``to_local``)."""

    def __init__(self, program: StageProgram, trace: StageTrace, device_mesh: Any, plan: StagePlan,
                 inductor: bool = True):
        from fxshard.backend.programs.training import TrainingProgram

        super().__init__()
        self.program = program  # registered: the schedule scales and the optimizer steps its parameters
        self.device_mesh, self.plan = device_mesh, plan
        planned = trace.planned
        assert planned.training is not None
        self.runner = TrainingProgram(planned.training, device_mesh, inductor=inductor,
                                      reporter=StageReporter(label=f"pipeline stage {plan.index}"))
        by_arg = {id(a): k for k, a in enumerate(trace.args)}
        state = dict(trace.program.named_parameters()) | dict(trace.program.named_buffers())
        by_state = {id(t): name for name, t in state.items()}
        # what feeds each captured input: ("arg", k) or ("state", name of a parameter or buffer)
        self.sources = [("arg", by_arg[id(o)]) if id(o) in by_arg else ("state", by_state[id(o)])
                        for o in trace.captured.objects]

    def forward(self, *blocks: torch.Tensor, **targets: torch.Tensor) -> torch.Tensor:
        values = list(blocks) + list(targets.values())
        wrapped = [self._wrap(b, layout) for b, layout in zip(values, self.plan.input_layouts)]
        state = dict(self.program.named_parameters()) | dict(self.program.named_buffers())
        out = self.runner(*[wrapped[key] if kind == "arg" else state[key] for kind, key in self.sources])[0]
        want = _placements(self.plan.output_layout, self.plan.index)
        if not isinstance(out, DTensor) or tuple(out.placements) != tuple(want):
            raise RuntimeError(f"pipeline stage {self.plan.index} returned {_describe(out)}; its plan hands on "
                               f"{self.plan.output_layout} ({want})")
        return out.to_local()

    def _wrap(self, block: torch.Tensor, layout: Layout) -> DTensor:
        shape = tuple(int(s) for s in layout.shape)
        return DTensor.from_local(block, self.device_mesh, _placements(layout, self.plan.index), run_check=False,
                                  shape=torch.Size(shape), stride=_contiguous_strides(shape))


def _describe(x: Any) -> str:
    return f"a DTensor with placements {x.placements}" if isinstance(x, DTensor) else f"a {type(x).__name__}"


def _placements(layout: Layout, index: int) -> tuple:
    p = placements_from_layout(layout)
    if p is None:
        raise ValueError(f"pipeline stage {index}: the boundary layout {layout} has no DTensor placements; "
                         "pin the stage output with fxshard.constrain to one DTensor can express")
    return p


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


class PipelineRank:
    """This rank's stage of a planned pipeline: the stage module with DTensor parameters on its
    sub-mesh (``module``, for the optimizer), and the ``PipelineStage`` (``stage``) a schedule runs.

    ``step(schedule, inputs, targets)`` feeds the first stage the rank's local block of the batch
    and the last one the targets; it returns the microbatch losses on the last stage. ``sent`` lists
    the bytes of every block this rank sent: ("forward" | "backward", microbatch, bytes).
    """

    def __init__(self, plan: PipelinePlan, model: nn.Module, device_mesh: Any, inductor: bool = True):
        names = tuple(device_mesh.mesh_dim_names or ())
        if plan.pp not in names:
            raise ValueError(f"PipelineRank: the DeviceMesh has axes {names}, no pipeline axis {plan.pp!r}")
        self.plan, self.index = plan, device_mesh.get_local_rank(plan.pp)
        self.stage_mesh = device_mesh[tuple(n for n in names if n != plan.pp)]
        if as_mesh_spec(self.stage_mesh) != plan.mesh:
            raise ValueError(f"PipelineRank: the stage mesh {as_mesh_spec(self.stage_mesh)} is not the planned "
                             f"{plan.mesh}")
        stage_plan = plan.stages[self.index]
        self.is_first, self.is_last = self.index == 0, self.index == len(plan.stages) - 1
        self.module = split_model(model, stage_plan.modules)
        for name, param in list(self.module.named_parameters()):
            owner, _, leaf = name.rpartition(".")
            target = self.module.get_submodule(owner) if owner else self.module
            target.register_parameter(leaf, nn.Parameter(
                distribute_tensor(param.detach(), self.stage_mesh, plan.placements.get(name, _replicated(plan.mesh)))))
        program = StageProgram(self.module)  # the planned program computes the loss: names only
        assert stage_plan.trace is not None
        # the program explain_pipeline planned, lowered for this rank: no second capture or plan
        self.local = LocalBlocks(program, stage_plan.trace, self.stage_mesh, stage_plan, inductor)
        self.sent: list[tuple[str, int, int]] = []
        self.stage = self._pipeline_stage(stage_plan, device_mesh.get_group(plan.pp))

    def _pipeline_stage(self, stage_plan: StagePlan, group: Any) -> Any:
        from torch.distributed.pipelining import PipelineStage

        coordinate = tuple(int(c) for c in self.stage_mesh.get_coordinate())
        # the stage takes its metadata (shapes, and requires_grad: whether gradients cross) from these
        example = [_block(layout, coordinate, dtype, not self.is_first) for layout, dtype in
                   zip(stage_plan.input_layouts[:stage_plan.n_args], stage_plan.input_dtypes)]
        out = _block(stage_plan.output_layout, coordinate, stage_plan.output_dtype, True)
        sent = self.sent

        class RecordingStage(PipelineStage):
            """A ``PipelineStage`` that notes the bytes of each block it sends (the boundary traffic)."""

            def get_fwd_send_ops(self, fwd_chunk_id: int) -> list:
                ops = super().get_fwd_send_ops(fwd_chunk_id)
                sent.extend(("forward", fwd_chunk_id, _nbytes(op.tensor)) for op in ops)
                return ops

            def get_bwd_send_ops(self, bwd_chunk_id: int) -> list:
                ops = super().get_bwd_send_ops(bwd_chunk_id)
                sent.extend(("backward", bwd_chunk_id, _nbytes(op.tensor)) for op in ops)
                return ops

        return RecordingStage(self.local, self.index, len(self.plan.stages), torch.device(out.device),
                              input_args=tuple(example), output_args=out, group=group)

    @staticmethod
    def loss_fn(output: torch.Tensor, target: Any = None) -> torch.Tensor:
        """The schedule's loss: the last stage's output already is the microbatch loss."""
        return output

    def schedule(self, kind: Callable, **options: Any) -> Any:
        """A single-stage schedule (``ScheduleGPipe``, ``Schedule1F1B``) over this stage, with the
        plan's microbatch count and the stage's loss."""
        return kind(self.stage, self.plan.n_microbatches, loss_fn=self.loss_fn, **options)

    def step(self, schedule: Any, inputs: Sequence[torch.Tensor] = (), targets: Sequence[torch.Tensor] = ()) -> list:
        """One schedule step on this rank's local blocks of the batch; the microbatch losses (last stage)."""
        self._check_batch(list(inputs) if self.is_first else [], list(targets) if self.is_last else [])
        losses: list = []
        args = tuple(inputs) if self.is_first else ()
        if self.is_last:
            kwargs = {f"target{k}": t for k, t in enumerate(targets)}
            schedule.step(*args, target=targets[0], losses=losses, return_outputs=False, **kwargs)
        else:
            schedule.step(*args, return_outputs=False)
        return [loss.detach() for loss in losses]

    def _check_batch(self, inputs: list[torch.Tensor], targets: list[torch.Tensor]) -> None:
        """The rank's batch must split into the planned microbatches: n_microbatches x the planned local block."""
        coordinate = tuple(int(c) for c in self.stage_mesh.get_coordinate())
        stage = self.plan.stages[self.index]
        given = inputs + targets
        layouts = list(stage.input_layouts[:len(inputs)]) + list(stage.input_layouts[stage.n_args:])
        for k, (t, layout) in enumerate(zip(given, layouts)):
            block = tuple(int(s) for s in layout.local_shape(coordinate))
            want = (block[0] * self.plan.n_microbatches,) + block[1:]
            what = f"target {k - len(inputs)}" if k >= len(inputs) else f"input {k}"
            if tuple(t.shape) != want:
                raise ValueError(f"pipeline stage {self.index}: {what} has shape {tuple(t.shape)} on this rank; "
                                 f"the plan splits {want} into {self.plan.n_microbatches} microbatches of {block} "
                                 f"(this rank's block of {layout}); pass the rank's local rows of the planned batch")


def _block(layout: Layout, coordinate: tuple[int, ...], dtype: torch.dtype, grad: bool) -> torch.Tensor:
    """An empty local block of ``layout`` on this rank, requiring grad when it is a float that gets one."""
    return torch.empty(layout.local_shape(coordinate), dtype=dtype).requires_grad_(grad and dtype.is_floating_point)


def _replicated(mesh: MeshSpec) -> tuple:
    from torch.distributed.tensor import Replicate

    return tuple(Replicate() for _ in mesh.names)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def simulate_pipeline(plan: PipelinePlan, inputs: Sequence[torch.Tensor],
                      targets: Sequence[torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The pipeline on simulated ranks, without a process group: each stage's lowered forward and
    backward run on every rank of its mesh in lockstep, microbatch by microbatch, and a stage's
    input blocks are the blocks the stage before returned on the same rank (what the P2P send
    carries; its gradient goes back the same way). Each rank's batch rows are split into the
    microbatches as the schedule splits them. Returns the mean loss and each parameter's full gradient.
    """
    from fxshard.lowering.groups import MeshGroups

    from fxshard.backend.programs.lower_for_rank import lower_for_rank
    from fxshard.backend.simulate import fake_world, run_lockstep

    coords = plan.mesh.coordinates()
    first = [_rank_microbatches(t, p, plan, coords, f"input {k}") for k, (t, p) in
             enumerate(zip(inputs, plan.input_placements))]
    wanted = [_rank_microbatches(t, p, plan, coords, f"target {k}") for k, (t, p) in
              enumerate(zip(targets, plan.input_placements[len(inputs):]))]
    losses: list[torch.Tensor] = []
    grads: dict[str, torch.Tensor] = {}
    with fake_world(plan.mesh) as device_mesh:
        groups = MeshGroups(device_mesh)
        programs = [[tuple(lower_for_rank(g, c, groups) for g in (s.trace.planned.training.forward,
                                                                   s.trace.planned.training.backward))
                     for c in coords] for s in plan.stages]
        for m in range(plan.n_microbatches):
            feeds = [[b[m] for b in per_rank] for per_rank in zip(*first, *wanted)]
            losses.append(_simulate_microbatch(plan, programs, feeds, len(first), coords, grads, run_lockstep))
    return torch.stack(losses).mean(), grads


def _simulate_microbatch(plan: PipelinePlan, programs: list, feeds: list[list[torch.Tensor]], n_inputs: int,
                         coords: list, grads: dict[str, torch.Tensor], run_lockstep: Callable) -> torch.Tensor:
    """One microbatch through every stage and back (``feeds``: each rank's inputs, then targets);
    adds the parameters' gradients into ``grads``; returns the microbatch loss."""
    carried = [f[:n_inputs] for f in feeds]
    saved = []
    for stage, ranks in zip(plan.stages, programs):
        extra = [f[n_inputs:] if stage is plan.stages[-1] else [] for f in feeds]
        outs = run_lockstep([fwd for fwd, _ in ranks], [_feed(stage, carried[r] + extra[r], c)
                                                          for r, c in enumerate(coords)])
        k = stage.trace.planned.training.num_outputs
        saved.append([o[k:] for o in outs])
        carried = [o[:k] for o in outs]  # rank r's blocks go to rank r of the next stage: the P2P send
    loss = carried[0][0]
    tangents = [[torch.ones((), dtype=loss.dtype)] for _ in coords]
    for stage, ranks, kept in reversed(list(zip(plan.stages, programs, saved))):
        back = run_lockstep([bwd for _, bwd in ranks], [kept[r] + tangents[r] for r in range(len(coords))])
        tangents = _collect(stage, back, coords, grads, plan.n_microbatches)
    return loss


def _rank_microbatches(t: torch.Tensor, placements: Any, plan: PipelinePlan, coords: list,
                       what: str) -> list[list[torch.Tensor]]:
    """Each rank's block of the whole batch ``t``, split into the microbatches (as the schedule splits it)."""
    layout = user_layout(what, placements, plan.mesh, t.shape)
    return [list(layout.shard(t, c).tensor_split(plan.n_microbatches)) for c in coords]


def _feed(stage: StagePlan, values: list[torch.Tensor], coordinate: tuple) -> list[torch.Tensor]:
    """A rank's inputs of the stage's forward: parameter blocks, and ``values`` for the arguments."""
    trace = stage.trace
    program = trace.planned.program
    by_arg = {id(a): k for k, a in enumerate(trace.args)}
    out = []
    for pos, name in zip(program.tensor_positions, program.input_names):
        obj = trace.captured.objects[pos]
        if id(obj) in by_arg:
            out.append(values[by_arg[id(obj)]])
        else:
            out.append(program.input_layouts[name].shard(obj.detach(), coordinate))
    return out


def _collect(stage: StagePlan, back: list[list[torch.Tensor]], coords: list, grads: dict[str, torch.Tensor],
             n: int) -> list[list[torch.Tensor]]:
    """Accumulate the stage's parameter gradients (full, over ``n`` microbatches) into ``grads``; return
    each rank's gradient blocks of the stage's activation input (what goes back to the stage before)."""
    trace = stage.trace
    training, program = trace.planned.training, trace.planned.program
    by_arg = {id(a): k for k, a in enumerate(trace.args)}
    names = {id(p): n_ for n_, p in trace.program.module.named_parameters()}
    to_previous: list[list[torch.Tensor]] = [[] for _ in coords]
    for j, (k, layout) in enumerate(zip(training.grad_inputs, training.grad_layouts)):
        obj = trace.captured.objects[program.tensor_positions[k]]
        if by_arg.get(id(obj)) == 0 and stage.index > 0:
            for r in range(len(coords)):
                to_previous[r].append(back[r][j])
        elif id(obj) in names:
            full = layout.unshard({c: back[r][j] for r, c in enumerate(coords)}) / n
            grads[names[id(obj)]] = grads.get(names[id(obj)], 0) + full
    return to_previous
