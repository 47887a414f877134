"""Capture a user function with Dynamo (fullgraph) for explain/simulate, and name its inputs.

Each capture compiles a fresh code object, so Dynamo's per-code cache never serves an
earlier capture and never hits its recompile limit.
"""
from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor

from fxshard.layout import Layout
from fxshard.mesh import MeshSpec
from fxshard.placements import user_layout


@dataclass
class Captured:
    gm: fx.GraphModule
    example_inputs: list[Any]
    objects: list[Any]  # the real object behind each placeholder (argument, parameter, buffer, mesh)


UNEVEN_LOCAL_OUTPUT_HINT = (
    "fxshard: DTensor could not run this program while Dynamo traced it (the error above). If a dim does not "
    "divide by the mesh size and the model was parallelized with parallel styles that hand plain local shards on "
    "(ColwiseParallel/RowwiseParallel's default use_local_output=True), DTensor.from_local assumed even shards and "
    "got a wrong global size. Pass use_local_output=False to the styles (the model then runs in global shapes, "
    "which is what fxshard compiles), or make that dim divisible by the mesh size.")


def _fresh_entry(fn: Callable) -> Callable:
    def entry(*args: Any) -> Any:
        return fn(*args)

    return types.FunctionType(entry.__code__.replace(), entry.__globals__, "fxshard_capture", None,
                              entry.__closure__)


def capture(fn: Callable, args: Sequence[Any]) -> Captured:
    result: dict[str, Any] = {}

    def grab(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable:
        if result:
            raise RuntimeError("fxshard.explain/simulate captured more than one graph; the function must be one "
                               "graph (fullgraph) without data-dependent control flow")
        objects = [n.meta["grapharg"].example for n in gm.graph.nodes if n.op == "placeholder"]
        result.update(gm=gm, example_inputs=list(example_inputs), objects=objects)
        return gm.forward

    # capturing runs fn once; it must not advance the caller's random streams (dropout)
    with torch.random.fork_rng(devices=list(range(torch.cuda.device_count()))):
        try:
            torch.compile(_fresh_entry(fn), backend=grab, fullgraph=True, dynamic=False)(*args)
        except RuntimeError as e:
            if "Sharding propagation failed" not in str(e):
                raise
            raise RuntimeError(f"{e}\n\n{UNEVEN_LOCAL_OUTPUT_HINT}") from e
    if not result:
        raise RuntimeError("Dynamo produced no graph for the function (it may contain no tensor ops)")
    return Captured(result["gm"], result["example_inputs"], result["objects"])


def named_inputs(fn: Callable, args: Sequence[Any], captured: Captured) -> list[tuple[str, Any]]:
    """(name, key) for each placeholder: argument index or parameter/buffer name (None for others)."""
    named: dict[int, tuple[str, Any]] = {}
    module = fn if isinstance(fn, torch.nn.Module) else getattr(fn, "__self__", None)  # model or model.loss
    if isinstance(module, torch.nn.Module):
        for name, t in list(module.named_parameters()) + list(module.named_buffers()):
            named.setdefault(id(t), (name.replace(".", "_"), name))
    for i, a in enumerate(args):
        named.setdefault(id(a), (f"arg{i}", i))
    out = []
    for k, obj in enumerate(captured.objects):
        out.append(named.get(id(obj), (f"input{k}", None)))
    return out


def input_layouts_by_position(fn: Callable, args: Sequence[Any], captured: Captured, mesh: MeshSpec,
                              placements: Mapping[Any, Any] | None) -> tuple[dict[int, Layout], list[str]]:
    """Layouts for plain-tensor inputs from the user's ``placements`` map, and input names."""
    placements = dict(placements or {})
    names = named_inputs(fn, args, captured)
    known_keys = {key for _, key in names if key is not None}
    unknown = [k for k in placements if k not in known_keys]
    if unknown:
        choices = sorted(str(k) for k in known_keys)
        raise KeyError(f"placements names {unknown}, which are not inputs of the function; "
                       f"use argument indices or parameter names: {choices}")
    layouts: dict[int, Layout] = {}
    for pos, ((_, key), obj) in enumerate(zip(names, captured.objects)):
        if key not in placements or not isinstance(obj, torch.Tensor):
            continue
        if isinstance(obj, DTensor):
            raise ValueError(f"input {key!r} is already a DTensor with placements {obj.placements}; "
                             "do not also give it placements")
        layouts[pos] = user_layout(_describe(key), placements[key], mesh, obj.shape)
    return layouts, [n for n, _ in names]


def _describe(key: Any) -> str:
    """How an error names an input: ``argument 0`` or ``parameter 'up.weight'``."""
    return f"argument {key}" if isinstance(key, int) else f"parameter {key!r}"
