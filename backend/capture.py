"""Capture a user function with Dynamo (fullgraph), for explain, simulate and fxshard.compile.

Each capture compiles a fresh code object, so Dynamo's per-code cache never serves an
earlier capture and never hits its recompile limit. ``fake_stand_in`` makes the global-shape
stand-in of a DTensor (or any tensor) that fxshard.compile captures with: a fake tensor, so a
model larger than one rank's memory is captured without allocating it.
"""
from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor


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
        return _outputs_on_meta(gm)

    # Dynamo calls what the backend returns once; it must not advance the caller's random streams
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


def _outputs_on_meta(gm: fx.GraphModule) -> Callable:
    """What the captured frame returns instead of running ``gm``: its outputs as meta tensors.

    Capturing only needs the graph; running it would compute the whole program at global size.
    """
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    values = [a.meta.get("example_value") if isinstance(a, fx.Node) else a for a in out.args[0]]
    meta = tuple(torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
                 if isinstance(v, torch.Tensor) and not isinstance(v, DTensor) else v for v in values)
    return lambda *args: meta


def fake_stand_in(t: torch.Tensor, mode: FakeTensorMode, requires_grad: bool) -> torch.Tensor:
    """A fake tensor of ``t``'s global shape, dtype and (local) device: what Dynamo traces in its place."""
    local = t._local_tensor if isinstance(t, DTensor) else t
    with mode:
        out = torch.empty(t.shape, dtype=t.dtype, device=local.device)
    return out.requires_grad_(requires_grad)
