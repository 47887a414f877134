"""Programs tests/test_edge_placements.py runs on real gloo ranks (a module of its own: spawned ranks
import it by name)."""
from __future__ import annotations

from typing import Callable

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

# a reduce op -> the value its shares stand for (stacked on dim 0), on one device
REDUCE = {"product": lambda s: s.prod(0), "max": lambda s: s.amax(0), "min": lambda s: s.amin(0)}


def shares(world_size: int, shape: tuple[int, ...] = (4, 6)) -> list[torch.Tensor]:
    """Every rank's share of a Partial: random, positive (a product of them neither vanishes nor flips sign)."""
    return [torch.rand(shape, generator=torch.Generator().manual_seed(100 + r)) + 0.5 for r in range(world_size)]


def uses(mesh) -> dict[str, tuple[Callable, Callable]]:
    """name -> (the program on a Partial DTensor, the same on the full tensor, on one device)."""
    return {
        "sin + sum": (lambda t: torch.sin(t) + t.sum(0), lambda v: torch.sin(v) + v.sum(0)),
        "to Replicate": (lambda t: t.redistribute(mesh, [Replicate()]) * 1, lambda v: v),
        "to Shard(0)": (lambda t: t.redistribute(mesh, [Shard(0)]) * 1, lambda v: v),
    }


def partial_reductions(rank: int, world_size: int, device: str, inductor: bool,
                       ops: tuple[str, ...] = tuple(REDUCE)) -> dict:
    """Each reduce op x each use: a Partial input made from this rank's share, compiled with
    backend="fxshard"; per case the largest error of the full result against one device, and the
    collectives (with their reduce op) the lowered program issues."""
    mesh = init_device_mesh(device, (world_size,), mesh_dim_names=("tp",))
    mine = shares(world_size)
    out: dict[str, tuple[float, list[str]]] = {}
    for op in ops:
        full = REDUCE[op](torch.stack(shares(world_size)))
        for name, (fn, reference) in uses(mesh).items():
            lowered: list[str] = []

            def on_graph(stage: str, gm: torch.fx.GraphModule) -> None:
                if stage == "lower":
                    lowered.extend(f"{n.target.__name__.split('.')[0]}({n.args[1]})" for n in gm.graph.nodes
                                   if n.op == "call_function" and "_c10d_functional" in str(n.target)
                                   and "wait" not in str(n.target))

            torch._dynamo.reset()
            compiled = torch.compile(fn, backend="fxshard", options={"inductor": inductor, "on_graph": on_graph})
            x = DTensor.from_local(mine[rank], mesh, [Partial(op)], run_check=False)
            y = compiled(x)
            got = y.full_tensor() if isinstance(y, DTensor) else y
            out[f"{op}: {name}"] = (float((got - reference(full)).abs().max()), lowered)
    return out
