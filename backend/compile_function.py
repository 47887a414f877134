"""``fxshard.compile``: compile a global-shape function of a module whose parameters are DTensors,
without asking DTensor to run the program eagerly.

``torch.compile(model, backend="fxshard")`` needs Dynamo to trace the program on DTensors, so
every op must have a DTensor sharding strategy and plain tensors may not mix with DTensors
(DTensor itself runs each op on fake tensors while Dynamo traces). That holds for programs
written for ``parallelize_module``; it does not hold for an unchanged global-shape model whose
parameters were just distributed (a rotary table built inside ``forward``, the CPU attention
kernel, a 2-D FSDP x TP sharding of a vocab-parallel embedding). Here Dynamo traces the program
once on global-shape stand-ins of the parameters and arguments (fake tensors: nothing of global
size is allocated), the DTensors' placements become the input layouts, and each call feeds every
rank's local shards to the compiled program. When a parameter requires grad the program is the
joint forward+backward one: ``loss.backward()`` leaves DTensor gradients with the parameters'
placements in ``param.grad``. Programs are keyed by the arguments' shapes (one per set of sizes).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor
from torch.nn.utils.stateless import _reparametrize_module

from fxshard.costs import CostModel
from fxshard.placements import as_mesh_spec
from fxshard.policies import DEFAULT_TRAINING_SPLIT, MixedPrecision, TrainingSplit

from fxshard.backend.layers.block_regions import captured_with_regions, repeated_blocks
from fxshard.backend.capture.capture import capture, fake_stand_in
from fxshard.backend.capture.mixed_precision import under_policy
from fxshard.backend.driver import compile_program
from fxshard.backend.inductor.compile_local import start_compile_workers
from fxshard.backend.options import Options
from fxshard.backend.capture.inputs import input_layouts, one_mesh
from fxshard.backend.reports.report import StageReporter, label_of


class CompiledFunction:
    """``fn`` compiled by fxshard on its first call; later calls reuse the program for the same shapes."""

    def __init__(self, fn: Callable, device_mesh: Any = None, placements: Mapping[int, Any] | None = None,
                 options: Mapping[str, Any] | None = None):
        self.fn = fn
        self.module = fn if isinstance(fn, torch.nn.Module) else getattr(fn, "__self__", None)
        if self.module is not None and not isinstance(self.module, torch.nn.Module):
            self.module = None
        self.device_mesh = device_mesh
        self.placements = dict(placements or {})
        # the backend options given, with those in force when a program is compiled (``Options.from_backend``)
        self.given = dict(options or {})
        Options.from_backend(self.given)  # an unknown or mistyped one refused now, not at the first call
        self._programs: dict[tuple, tuple[Any, list[tuple[str, Any]]]] = {}
        self.last: Any = None  # the program of the latest call (TrainingProgram or InferenceProgram)

    def _state(self) -> dict[str, torch.Tensor]:
        if self.module is None:
            return {}
        return dict(self.module.named_parameters()) | dict(self.module.named_buffers())

    def __call__(self, *args: Any) -> Any:
        state = self._state()
        training = torch.is_grad_enabled() and any(t.requires_grad for t in state.values())
        key = (training,) + tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else repr(a) for a in args)
        if key not in self._programs:
            self._programs[key] = self._compile(state, args, training)
        runner, sources = self._programs[key]
        self.last = runner
        values = [state[name] if kind == "state" else args[name] for kind, name in sources]
        outs = runner(*values)
        return outs[0] if len(outs) == 1 else outs

    def _compile(self, state: dict[str, torch.Tensor], args: Sequence[Any], training: bool) -> tuple:
        named = [(f"parameter {n!r}", v) for n, v in state.items()] + [(f"argument {i}", a) for i, a in enumerate(args)]
        held = [(n, v.device_mesh) for n, v in named if isinstance(v, DTensor)]
        held += [("device_mesh=", self.device_mesh)] if self.device_mesh is not None else []
        device_mesh = one_mesh([m for _, m in held], "fxshard.compile's parameters and arguments", [n for n, _ in held])
        if device_mesh is None:
            raise ValueError("fxshard.compile needs a DeviceMesh: pass device_mesh= when no parameter or argument "
                             "is a DTensor")
        spec = as_mesh_spec(device_mesh)
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        stand_ins = {name: fake_stand_in(t, mode, training and t.requires_grad) for name, t in state.items()}
        arg_stand_ins = [fake_stand_in(a, mode, False) if isinstance(a, torch.Tensor) else a for a in args]
        options = Options.from_backend(self.given)
        reporter = StageReporter(options.on_graph, options.debug_dir, label=label_of(self.fn))
        if options.inductor:
            start_compile_workers()  # coming up while Dynamo captures and fxshard plans
        with reporter.timed("capturing the function with Dynamo"), _one_graph_needed(label_of(self.fn)):
            if self.module is not None:
                # tie_weights: a tied alias (a head sharing the embedding's weight) is one parameter that
                # named_parameters() lists once; its other names get the same stand-in, or Dynamo would meet the
                # real DTensor there among the fakes (aten.mm got mixed torch.Tensor and DTensor)
                fn = under_policy(self.fn, options.mixed_precision, [self.module])
                with _reparametrize_module(self.module, stand_ins, tie_weights=True):
                    captured = captured_with_regions(lambda: capture(fn, arg_stand_ins), repeated_blocks(self.module))
            else:
                captured = capture(under_policy(self.fn, options.mixed_precision), arg_stand_ins)
        by_id: dict[int, tuple[str, Any]] = {id(t): ("state", n) for n, t in stand_ins.items()}
        by_id.update({id(a): ("arg", i) for i, a in enumerate(arg_stand_ins) if isinstance(a, torch.Tensor)})
        sources: list[tuple[str, Any]] = []
        for obj in captured.objects:
            if not isinstance(obj, torch.Tensor):
                raise RuntimeError("fxshard.compile: the captured program has a non-tensor input it cannot feed")
            if id(obj) not in by_id:
                raise RuntimeError("fxshard.compile: the function reads a tensor that is neither an argument nor a "
                                   "parameter or buffer of its module; pass it as an argument")
            sources.append(by_id[id(obj)])
        unknown = [k for k in self.placements if not isinstance(k, int)]
        if unknown:
            raise KeyError(f"fxshard.compile(placements=...) names {unknown}: give placements by argument index "
                           "(parameters bring their own as DTensors)")
        real = [state[name] if kind == "state" else args[name] for kind, name in sources]
        layouts = input_layouts(real, spec, [name for _, name in sources], self.placements)
        names = [name.replace(".", "_") if kind == "state" else f"arg{name}" for kind, name in sources]
        runner = compile_program(captured.gm, captured.example_inputs, training=training, options=options,
                                 device_mesh=device_mesh, reporter=reporter, mesh=spec, layouts=layouts, names=names)
        return runner, sources


@contextlib.contextmanager
def _one_graph_needed(label: str) -> Iterator[None]:
    """Dynamo's refusal to capture the function whole (a graph break) said as fxshard.compile's, with the door
    that takes it graph by graph. Every rank captures alike, before any collective: all of them raise here."""
    from fxshard.backend.capture.dynamo_calls import Unsupported

    try:
        yield
    except Unsupported as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise RuntimeError(f"fxshard.compile needs {label} as one graph, and Dynamo breaks it ({first}: its "
                           'explanation is above); torch.compile(model, backend="fxshard") compiles and trains a '
                           "function graph by graph, or make the code branchless (torch.where) to keep it one graph"
                           ) from error


def compile(fn: Callable, device_mesh: Any = None, placements: Mapping[int, Any] | None = None,
            strict: bool = False, cost_model: CostModel | None = None, inductor: bool = True,
            bucketing: bool = True, regional: bool = True,
            training_split: TrainingSplit = DEFAULT_TRAINING_SPLIT, mixed_precision: MixedPrecision | None = None,
            on_graph: Callable[[str, Any], None] | None = None, debug_dir: str | None = None) -> CompiledFunction:
    """Compile ``fn`` (a module, or a method of one, or a function) for the mesh of its DTensor
    parameters and arguments; plain tensor arguments are replicated unless ``placements`` (by
    argument index) says otherwise. Returns DTensors; trains when a parameter requires grad. The other
    arguments are the backend options (``backend/__init__.py``; all of them: ``backend/options.py``)."""
    return CompiledFunction(fn, device_mesh, placements, dict(
        strict=strict, cost_model=cost_model, inductor=inductor, bucketing=bucketing, regional=regional,
        training_split=training_split, mixed_precision=mixed_precision, on_graph=on_graph, debug_dir=debug_dir))

