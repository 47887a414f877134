"""What a compiled program returns: DTensors, and plain tensors where the user's program has them.

A parallel style's default ``use_local_output=True`` ends a module with ``to_local()``: eager, each
rank then holds a plain tensor, the whole value of a replicated DTensor or its own block of a
sharded one (Hugging Face ``generate()`` reads the logits so). The program returns the same: the
block of the layout eager holds, as a plain tensor. A plain value eager computes from plain
tensors alone is whole on every rank.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.fx as fx

from fxshard.graph import outputs
from fxshard.layout import Layout
from fxshard.placements import layout_as_dtensor, placements_from_layout

from .trace import DERIVED, TracedProgram

AS_PLANNED = "as planned"  # a value computed on to_local() shards: stage 2 checked its local shape is eager's


def plain_outputs(gm: fx.GraphModule) -> list[bool]:
    """Which outputs of Dynamo's graph are plain tensors in the user's program, not DTensors."""
    from torch.distributed.tensor import DTensor

    values = [n.meta.get("example_value") if isinstance(n, fx.Node) else n for n in outputs(gm)]
    return [isinstance(v, torch.Tensor) and not isinstance(v, DTensor) for v in values]


def eager_layouts(gm: fx.GraphModule, program: TracedProgram, count: int) -> list[Any]:
    """Per output of the first ``count`` of ``program``: None for a DTensor, else the layout whose
    local block eager holds (AS_PLANNED for a value computed on to_local() shards)."""
    plain, views = plain_outputs(gm), list(program.output_views)[:count]
    if len(plain) != count or len(views) != count:
        return [None] * count
    nodes = outputs(program.gm)[:count]
    return [None if not is_plain else view if isinstance(view, Layout) else AS_PLANNED if view == DERIVED
            else Layout.replicated(program.mesh, node.meta["val"].shape)
            for node, is_plain, view in zip(nodes, plain, views)]


def returned(local: torch.Tensor, layout: Layout, device_mesh: Any, eager: Any) -> Any:
    """This rank's output as the user's program has it: a DTensor (``eager`` None), or the plain
    block of the layout eager holds, moved there if the plan left it in another."""
    if eager is None:
        return layout_as_dtensor(local, device_mesh, layout)
    if eager == AS_PLANNED or eager == layout:
        return local
    out = layout_as_dtensor(local, device_mesh, layout)
    return out.redistribute(device_mesh, placements_from_layout(eager)).to_local()


def wanted(eager: Sequence[Any]) -> list[Layout | None]:
    """The output layouts to ask the planner for, so that no output moves after the program."""
    return [e if isinstance(e, Layout) else None for e in eager]
