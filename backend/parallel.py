"""``fxshard.compile``: compile a global-shape function of a module whose parameters are DTensors,
without asking DTensor to run the program eagerly.

``torch.compile(model, backend="fxshard")`` needs Dynamo to trace the program on DTensors, so
every op must have a DTensor sharding strategy and plain tensors may not mix with DTensors
(DTensor itself runs each op on fake tensors while Dynamo traces). That holds for programs
written for ``parallelize_module``; it does not hold for an unchanged global-shape model whose
parameters were just distributed (a rotary table built inside ``forward``, the CPU attention
kernel, a 2-D FSDP x TP sharding of a vocab-parallel embedding). Here Dynamo traces the program
once on plain global-shape stand-ins of the parameters and arguments (zeros: an index is in
range), the DTensors' placements become the input layouts, and each call feeds every rank's
local shards to the compiled program. When a parameter requires grad the program is the joint
forward+backward one: ``loss.backward()`` leaves DTensor gradients with the parameters'
placements in ``param.grad``.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch
from torch.distributed.tensor import DTensor
from torch.nn.utils.stateless import _reparametrize_module

from fxshard.layout import Layout
from fxshard.placements import as_mesh_spec, layout_from_placements, user_layout
from fxshard.costs import CostModel

from .capture import capture
from .driver import compile_program


class CompiledFunction:
    """``fn`` compiled by fxshard on its first call; later calls reuse the program for the same shapes."""

    def __init__(self, fn: Callable, device_mesh: Any = None, placements: Mapping[int, Any] | None = None,
                 strict: bool = False, cost_model: CostModel | None = None, inductor: bool = True):
        self.fn = fn
        self.module = fn if isinstance(fn, torch.nn.Module) else getattr(fn, "__self__", None)
        if self.module is not None and not isinstance(self.module, torch.nn.Module):
            self.module = None
        self.device_mesh = device_mesh
        self.placements = dict(placements or {})
        self.strict, self.cost_model, self.inductor = strict, cost_model, inductor
        self._programs: dict[tuple, tuple[Any, list[tuple[str, Any]]]] = {}
        self.last: Any = None  # the program of the latest call (TrainingCallable or ShardedCallable)

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

    def _mesh(self, values: Sequence[Any]) -> Any:
        meshes = {id(v.device_mesh): v.device_mesh for v in values if isinstance(v, DTensor)}
        if self.device_mesh is not None:
            meshes[id(self.device_mesh)] = self.device_mesh
        unique = []
        for m in meshes.values():
            if not any(m == u for u in unique):
                unique.append(m)
        if len(unique) != 1:
            raise ValueError(f"fxshard.compile needs one DeviceMesh: found {len(unique)} among the DTensor "
                             "parameters and arguments (pass device_mesh= when none is a DTensor)")
        return unique[0]

    def _compile(self, state: dict[str, torch.Tensor], args: Sequence[Any], training: bool) -> tuple:
        device_mesh = self._mesh(list(state.values()) + list(args))
        spec = as_mesh_spec(device_mesh)
        stand_ins = {name: _stand_in(t, training) for name, t in state.items()}
        arg_stand_ins = [_stand_in(a, False) if isinstance(a, torch.Tensor) else a for a in args]
        if self.module is not None:
            with _reparametrize_module(self.module, stand_ins):
                captured = capture(self.fn, arg_stand_ins)
        else:
            captured = capture(self.fn, arg_stand_ins)
        by_id: dict[int, tuple[str, Any]] = {id(t): ("state", n) for n, t in stand_ins.items()}
        by_id.update({id(a): ("arg", i) for i, a in enumerate(arg_stand_ins) if isinstance(a, torch.Tensor)})
        sources: list[tuple[str, Any]] = []
        layouts: dict[int, Layout] = {}
        names: list[str] = []
        for pos, obj in enumerate(captured.objects):
            if not isinstance(obj, torch.Tensor):
                sources.append(("arg", None))
                names.append(f"input{pos}")
                continue
            if id(obj) not in by_id:
                raise RuntimeError("fxshard.compile: the function reads a tensor that is neither an argument nor a "
                                   "parameter or buffer of its module; pass it as an argument")
            kind, name = by_id[id(obj)]
            sources.append((kind, name))
            names.append(name.replace(".", "_") if kind == "state" else f"arg{name}")
            real = state[name] if kind == "state" else args[name]
            layouts[pos] = self._layout(spec, real, kind, name)
        if any(kind == "arg" and name is None for kind, name in sources):
            raise RuntimeError("fxshard.compile: the captured program has a non-tensor input it cannot feed")
        runner = compile_program(captured.gm, captured.example_inputs, training=training, device_mesh=device_mesh,
                                 mesh=spec, extra_layouts=layouts, names=names, strict=self.strict,
                                 cost_model=self.cost_model, inductor=self.inductor)
        return runner, sources

    def _layout(self, spec: Any, real: torch.Tensor, kind: str, name: Any) -> Layout:
        if isinstance(real, DTensor):
            return layout_from_placements(spec, real.shape, real.placements)
        if kind == "arg" and name in self.placements:
            return user_layout(f"argument {name}", self.placements[name], spec, real.shape)
        return Layout.replicated(spec, real.shape)


def _stand_in(t: torch.Tensor, training: bool) -> torch.Tensor:
    """A plain tensor of ``t``'s global shape and dtype (zeros: any index it holds is in range)."""
    local = t._local_tensor if isinstance(t, DTensor) else t
    out = torch.zeros(t.shape, dtype=t.dtype, device=local.device)
    return out.requires_grad_(training and t.requires_grad)


def compile(fn: Callable, device_mesh: Any = None, placements: Mapping[int, Any] | None = None,
            strict: bool = False, cost_model: CostModel | None = None, inductor: bool = True) -> CompiledFunction:
    """Compile ``fn`` (a module, or a method of one, or a function) for the mesh of its DTensor
    parameters and arguments; plain tensor arguments are replicated unless ``placements`` (by
    argument index) says otherwise. Returns DTensors; trains when a parameter requires grad."""
    return CompiledFunction(fn, device_mesh, placements, strict, cost_model, inductor)
