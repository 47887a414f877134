"""What a compiled program returns: DTensors, and plain tensors where the user's program has them.

A parallel style's default ``use_local_output=True`` ends a module with ``to_local()``: eager, each
rank then holds a plain tensor, the whole value of a replicated DTensor or its own block of a
sharded one (Hugging Face ``generate()`` reads the logits so). The program returns the same: the
block of the layout eager holds, as a plain tensor. A plain value eager computes from plain
tensors alone is whole on every rank.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor

from fxshard.graph import outputs
from fxshard.layout import Layout
from fxshard.placements import as_dtensor, placements_from_layout, written_placements

from fxshard.backend.capture.trace import DERIVED, TracedProgram

AS_PLANNED = "as planned"  # a value computed on to_local() shards: stage 2 checked its local shape is eager's


def plain_outputs(gm: fx.GraphModule) -> list[bool]:
    """Which outputs of Dynamo's graph are plain tensors in the user's program, not DTensors."""
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


class OutputWriter:
    """This rank's outputs as the user's program has them, per call; what depends only on the program
    (placements, global shapes and strides, the DTensorSpec) is worked out once, on the first call."""

    def __init__(self, layouts: Sequence[Layout], device_mesh: Any, eager: Sequence[Any]):
        self.outputs = [_writer(layout, device_mesh, e) for layout, e in zip(layouts, eager)]

    def __call__(self, local: Sequence[torch.Tensor]) -> tuple:
        return tuple(write(o) for write, o in zip(self.outputs, local))


def _writer(layout: Layout, device_mesh: Any, eager: Any) -> Callable[[torch.Tensor], Any]:
    """One output's writer: a DTensor (``eager`` None), or the plain block of the layout eager holds,
    moved there after the program if the plan left it in another."""
    if eager is None:
        return AsDTensor(layout, device_mesh)
    if eager == AS_PLANNED or eager == layout:
        return _plain
    return Redistributed(AsDTensor(layout, device_mesh), eager)


def _plain(local: torch.Tensor) -> torch.Tensor:
    return local


class AsDTensor:
    """Wraps a local block of ``layout`` as a DTensor, as ``layout_as_dtensor`` does, without redoing
    per call what depends only on the layout: the first output of each dtype goes through
    ``DTensor.from_local`` (all its checks); later ones share its spec, built as from_local's
    ``run_check=False`` path builds one (``DTensor.__new__``, whose ``__init__`` does nothing but costs
    a Dynamo-disabled call). A block that requires grad always goes through ``from_local``: its
    autograd node carries the gradient back into the program."""

    def __init__(self, layout: Layout, device_mesh: Any):
        self.layout = layout
        self.device_mesh = device_mesh
        self.written: tuple[tuple, Any] | None = None  # (placements, shard order), on the first call
        self.specs: dict[torch.dtype, Any] = {}  # the DTensorSpec of the outputs, by dtype

    def __call__(self, local: torch.Tensor) -> Any:
        spec = None if local.requires_grad else self.specs.get(local.dtype)
        if spec is not None:
            return DTensor.__new__(DTensor, local.view_as(local), spec, requires_grad=False)
        if self.written is None:
            self.written = written_placements(self.layout)
        out = as_dtensor(local, self.device_mesh, self.written[0], self.layout.shape, self.written[1])
        if not local.requires_grad:
            self.specs[local.dtype] = out._spec
        return out


class Redistributed:
    """A plain output whose plan left it in another layout than the block eager holds: redistributed
    to that one after the program (the planner is asked for it, so this is rare)."""

    def __init__(self, as_planned: AsDTensor, eager: Layout):
        self.as_planned = as_planned
        self.target = placements_from_layout(eager)

    def __call__(self, local: torch.Tensor) -> torch.Tensor:
        out = self.as_planned(local)
        return out.redistribute(self.as_planned.device_mesh, self.target).to_local()


def wanted(eager: Sequence[Any]) -> list[Layout | None]:
    """The output layouts to ask the planner for, so that no output moves after the program."""
    return [e if isinstance(e, Layout) else None for e in eager]
