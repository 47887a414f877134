"""Capture a user function with Dynamo, for explain, simulate and fxshard.compile.

``capture`` takes the function as one graph (fullgraph) and never runs it. ``capture_graphs``
takes every graph Dynamo splits the function into (graph breaks: data-dependent control flow,
``.item()``, a print) as the function runs: Python between graphs reads the outputs of the graph
before it, so the caller says how each run of a graph computes them (``RunGraph``).

Each capture compiles a fresh code object, so Dynamo's per-code cache never serves an earlier
capture; the frames Dynamo compiles after a graph break are the user's own code objects, and
their cache entries are dropped when the capture ends (they would serve a later capture with
this one's callbacks, and count against Dynamo's recompile limit). ``fake_stand_in`` makes the
global-shape stand-in of a DTensor (or any tensor) that fxshard.compile captures with: a fake
tensor, so a model larger than one rank's memory is captured without allocating it.
"""
from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor

from fxshard.backend.inductor.collector import collector_paused
from fxshard.backend.capture.dtensor_rules import lend_rules_to_dtensor
from fxshard.backend.capture.dynamo_calls import forget_frames


@dataclass
class Captured:
    gm: fx.GraphModule
    example_inputs: list[Any]
    objects: list[Any]  # the real object behind each placeholder (argument, parameter, buffer, mesh)
    graph_break: str | None = None  # why Dynamo ended the graph at a graph break; None: it returns
    local_names: list[str] = field(default_factory=list)  # each placeholder's name in the user's code, or ""


# how a run of a captured graph computes its outputs from its inputs (real values, placeholder order)
RunGraph = Callable[[Captured, Sequence[Any]], Sequence[Any]]


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
    """``fn(*args)`` as one graph (fullgraph), never run: the frame returns its outputs on meta."""
    with collector_paused():  # Dynamo's trace of the whole program, nothing run (backend/inductor/collector.py)
        graphs, _ = _compile_and_call(fn, args, lambda captured, inputs: outputs_on_meta(captured), fullgraph=True)
    return graphs[0]


def capture_graphs(fn: Callable, args: Sequence[Any], run: RunGraph) -> tuple[list[tuple[Captured, list[Any]]], Any]:
    """Call ``fn(*args)`` under Dynamo, graph by graph, each run of a graph computed by ``run``.

    Returns every run in the order the function made them, ``(graph, its inputs)`` (a graph
    reached again, as a helper called in a loop, runs again), and what ``fn`` returned.
    """
    runs: list[tuple[Captured, list[Any]]] = []

    def run_and_record(captured: Captured, inputs: Sequence[Any]) -> Sequence[Any]:
        runs.append((captured, list(inputs)))
        return run(captured, inputs)

    _, result = _compile_and_call(fn, args, run_and_record, fullgraph=False)
    return runs, result


def _compile_and_call(fn: Callable, args: Sequence[Any], run: RunGraph, fullgraph: bool) -> tuple[list[Captured], Any]:
    graphs: list[Captured] = []
    lend_rules_to_dtensor()  # for other libraries' ops defined since the backend's import (transformers' MoE)

    def grab(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable:
        args = [n.meta["grapharg"] for n in gm.graph.nodes if n.op == "placeholder"]
        reason = getattr(gm, "compile_subgraph_reason", None)
        ended = reason.reason if reason is not None and getattr(reason, "graph_break", False) else None
        # a value a graph before this one returned reaches it as a local of Dynamo's resume function
        names = [getattr(a.source, "local_name", "").lstrip("_") for a in args]
        captured = Captured(gm, list(example_inputs), [a.example for a in args], ended, names)
        graphs.append(captured)
        return lambda *inputs: run(captured, inputs)

    # Dynamo calls what the backend returns; capturing must not advance the caller's random streams
    with torch.random.fork_rng(devices=list(range(torch.cuda.device_count()))):
        try:
            result = torch.compile(_fresh_entry(fn), backend=grab, fullgraph=fullgraph, dynamic=False)(*args)
        except RuntimeError as e:
            if "Sharding propagation failed" not in str(e):
                raise
            raise RuntimeError(f"{e}\n\n{UNEVEN_LOCAL_OUTPUT_HINT}") from e
        finally:
            forget_frames(grab)
    if not graphs:
        raise RuntimeError("Dynamo produced no graph for the function (it may contain no tensor ops)")
    return graphs, result


def outputs_on_meta(captured: Captured) -> tuple:
    """What a captured frame may return instead of running its graph: the outputs as meta tensors.

    Capturing only needs the graph; running it would compute the whole program at global size.
    """
    out = next(n for n in reversed(captured.gm.graph.nodes) if n.op == "output")
    values = [a.meta.get("example_value") if isinstance(a, fx.Node) else a for a in out.args[0]]
    return tuple(torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
                 if isinstance(v, torch.Tensor) and not isinstance(v, DTensor) else v for v in values)


def fake_stand_in(t: torch.Tensor, mode: FakeTensorMode, requires_grad: bool) -> torch.Tensor:
    """A fake tensor of ``t``'s global shape, dtype and (local) device: what Dynamo traces in its place."""
    local = t._local_tensor if isinstance(t, DTensor) else t
    with mode:
        out = torch.empty(t.shape, dtype=t.dtype, device=local.device)
    return out.requires_grad_(requires_grad)
