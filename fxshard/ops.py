"""Graph-level marker ops: a layout pin, a place where partial sums are summed, a mixed-precision cast, and a
planned redistribution.

All are real custom ops so that they survive make_fx and print as one readable call.
``constrain`` and ``summed`` exist only in traced global graphs (stage 1-2; the planner removes
them, having placed what they ask for); ``cast_for_compute`` only in the program Dynamo's graph
is traced from (stage 1 traces it as a cast, its backward as a cast and ``summed``);
``redistribute`` exists in stage 3-4 graphs and is replaced by collectives in stage 5.
``redistribute`` never runs eagerly: running one means a graph skipped its lowering.
"""
from __future__ import annotations

from typing import Any, Sequence

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


@torch.library.custom_op("fxshard::summed", mutates_args=())
def summed_op(x: torch.Tensor) -> torch.Tensor:
    """``x`` with its partial sums summed here: a value Partial over some axes is reduced before this point, in
    ``x``'s dtype (a mixed-precision policy's ``reduce_dtype``), not carried on."""
    return x.clone()


@summed_op.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


summed_op.register_autograd(lambda ctx, grad: grad)


@torch.library.custom_op("fxshard::cast_for_compute", mutates_args=())
def cast_for_compute_op(x: torch.Tensor, dtype: torch.dtype, summed_in: torch.dtype) -> torch.Tensor:
    """A parameter cast to the dtype the program computes in; its gradient is cast to ``summed_in``, summed over
    the ranks there (``summed``) and cast back to ``x``'s dtype (``fxshard.MixedPrecision``)."""
    return x.to(dtype)


@cast_for_compute_op.register_fake
def _(x: torch.Tensor, dtype: torch.dtype, summed_in: torch.dtype) -> torch.Tensor:
    return torch.empty_like(x, dtype=dtype)


def _setup_cast(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    ctx.dtype, ctx.summed_in = inputs[0].dtype, inputs[2]


def _cast_backward(ctx: Any, grad: torch.Tensor) -> tuple:
    return torch.ops.fxshard.summed(grad.to(ctx.summed_in)).to(ctx.dtype), None, None


cast_for_compute_op.register_autograd(_cast_backward, setup_context=_setup_cast)


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
SUMMED = torch.ops.fxshard.summed.default
CAST_FOR_COMPUTE = torch.ops.fxshard.cast_for_compute.default
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
