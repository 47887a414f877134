"""Graph-level marker ops: a layout pin and a planned redistribution.

Both are real custom ops so that they survive make_fx and print as one readable call.
``constrain`` exists only in traced global graphs (stage 1-2); ``redistribute`` exists in
stage 3-4 graphs and is replaced by collectives in stage 5. Neither runs eagerly outside
a trace: running one means a graph skipped its lowering.
"""
from __future__ import annotations

from typing import Sequence

import torch


@torch.library.custom_op("fxshard::constrain", mutates_args=())
def constrain_op(x: torch.Tensor, placements: str) -> torch.Tensor:
    """Pin ``x`` to DTensor ``placements`` (text form, see placements_to_str)."""
    return x.clone()


@constrain_op.register_fake
def _(x: torch.Tensor, placements: str) -> torch.Tensor:
    return torch.empty_like(x)


def _constrain_backward(ctx: object, grad: torch.Tensor) -> tuple:
    # a pin says where a value lives, not where its gradient does: the plan of the backward chooses
    return grad, None


constrain_op.register_autograd(_constrain_backward)


@torch.library.custom_op("fxshard::redistribute", mutates_args=())
def redistribute_op(x: torch.Tensor, src: str, dst: str, out_shape: Sequence[int]) -> torch.Tensor:
    raise RuntimeError(
        f"fxshard.redistribute({src} -> {dst}) ran without being lowered to collectives; "
        "lower the graph (fxshard.lowering.lower) before running it"
    )


@redistribute_op.register_fake
def _(x: torch.Tensor, src: str, dst: str, out_shape: Sequence[int]) -> torch.Tensor:
    return x.new_empty(list(out_shape))


CONSTRAIN = torch.ops.fxshard.constrain.default
REDISTRIBUTE = torch.ops.fxshard.redistribute.default


def constrain(x: torch.Tensor, placements: Sequence[object] | object) -> torch.Tensor:
    """Pin ``x`` to DTensor ``placements`` (over the program's mesh) inside a compiled model.

    Like ``with_sharding_constraint``: propagation gives ``x`` exactly this layout and plans
    the redistributions into and out of it. On a DTensor (``torch.compile`` with DTensor inputs,
    or eagerly) it is DTensor's own ``redistribute``; on a plain tensor (global shapes: ``simulate``,
    ``explain``, one device) the marker op, eagerly a copy of ``x``.
    """
    from torch.distributed.tensor.placement_types import Placement

    if isinstance(placements, Placement):  # a bare placement: a one-axis mesh (checked when planned)
        placements = (placements,)
    return _pin(x, tuple(placements))


@torch.compiler.allow_in_graph
def _pin(x: torch.Tensor, placements: tuple) -> torch.Tensor:
    """``constrain``, one call in Dynamo's graph with the placements as its constants.

    Dynamo does not trace into it: reading a placement's fields under Dynamo fails for some
    (``_StridedShard.split_factor``, a property of an opaque object). Stage 1 runs it on global
    tensors, where it is the marker op.
    """
    from torch.distributed.tensor import DTensor

    from .placements import placements_to_str

    if isinstance(x, DTensor):
        return x.redistribute(placements=placements)
    return constrain_op(x, placements_to_str(placements))
