"""``dst.copy_(src)`` in a joint trace: functionalization's ``aten.copy`` with the derivative autograd lacks.

In the joint trace autograd runs below functionalization (backend/capture/trace.py's ``_joint``), so it
records the functional ops functionalization emits, not the program's in-place ones. For
``copy_`` that op is ``aten.copy``, which has no derivative in torch ("derivative for aten::copy
is not implemented"; AOTAutograd, running autograd above functionalization, records ``copy_``'s
instead). A write into a slice of a new tensor (DeepseekV3's ``key_states[..., :d].copy_(k_nope)``)
is then untrainable. Here the copy is applied one level below functionalization as a
``torch.autograd.Function`` (as backend/capture/custom_functions.py applies a user's Function), whose
forward is the same ``aten.copy`` and whose backward is ``copy_``'s: no gradient to the
overwritten values, the output's gradient summed back to ``src``'s shape and dtype. The result is
written into ``dst`` as functionalization writes an in-place op's (replace, commit, sync), so the
traced graph is the one functionalization alone gives.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from fxshard.backend.capture.dynamo_calls import functional_interpreter, is_functional_tensor, unwrap_functional


def is_copy_(target: Any) -> bool:
    """A Dynamo node's in-place copy: ``x.copy_(y)`` as a method, ``torch.Tensor.copy_`` or the ATen op."""
    return target in ("copy_", torch.Tensor.copy_, torch.ops.aten.copy_.default)


def needs_own_copy(args: Sequence[Any], kwargs: Mapping[str, Any]) -> bool:
    """Whether autograd would meet the copy ``copy_(*args, **kwargs)``: grad recording on and a gradient
    through ``dst`` or ``src`` (which the functional wrappers do not say: their unwrapped tensors,
    autograd's, do)."""
    dst = args[0] if args else kwargs.get("self")
    src = args[1] if len(args) > 1 else kwargs.get("src")
    if not (torch.is_grad_enabled() and isinstance(dst, torch.Tensor) and isinstance(src, torch.Tensor)
            and is_functional_tensor(dst)):
        return False
    return any(unwrap_functional(t).requires_grad for t in (dst, src))


class _Copy(torch.autograd.Function):
    """``aten.copy(dst, src)`` (src cast and broadcast into dst's shape) with ``copy_``'s derivative."""

    @staticmethod
    def forward(ctx: Any, dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        ctx.src_shape, ctx.src_dtype = src.shape, src.dtype
        return torch.ops.aten.copy.default(dst, src)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        return None, grad.sum_to_size(ctx.src_shape).to(ctx.src_dtype)


def copy_into(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    """``dst.copy_(src)`` inside ``torch.func.functionalize`` with autograd below it (``needs_own_copy``)."""
    interpreter = functional_interpreter()
    level = interpreter.level()
    inner_dst = unwrap_functional(dst)
    inner_src = unwrap_functional(src)
    with interpreter.lower():
        value = _Copy.apply(inner_dst, inner_src)
    torch._functionalize_replace(dst, value)
    torch._functionalize_commit_update(dst)
    torch._functionalize_sync(dst)
    return dst
