"""Custom ``torch.autograd.Function``s in a traced program (Dynamo's ``autograd_function_apply``, and the old-style
ones Dynamo leaves as calls of their ``apply``).

Stage 1 traces under functorch's ``functionalize``, which has no rule for a custom Function
(torch raises "NYI: Functionalize rule for custom_function_call"). This is that rule: the
Function is applied one level below functionalization, on the unwrapped tensors, so the
forward's ATen ops are traced (each body functionalized on its own) and autograd, which runs
below functionalization in the joint trace, records the Function's own backward, not the
derivative of its forward's ops.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_map

from fxshard.backend.capture.dynamo_calls import (functional_interpreter, is_trampoline_apply, unwrap_functional,
                                                  wrap_functional)


_TENSOR = object()  # where a saved value is a tensor (kept by ctx.save_for_backward)


def is_autograd_function(target: Any) -> bool:
    return target is torch.ops.higher_order.autograd_function_apply


def is_unlifted_function(target: Any) -> bool:
    """Dynamo's call of a Function it did not lift into ``autograd_function_apply``: one written the old way,
    ``forward(ctx, ...)`` with no ``setup_context`` (torchao's float8 matmul and casts), left as its ``apply``."""
    return is_trampoline_apply(target)


def mutates_inputs(kwargs: dict) -> bool:
    """Whether the Function modifies its inputs in place (``ctx.mark_dirty``): not a functional program."""
    return bool(kwargs.get("dirty_idx"))


def apply_autograd_function(fwd: fx.GraphModule, bwd: fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
    """``autograd_function_apply(fwd, bwd, *args)`` inside ``torch.func.functionalize``.

    ``fwd(*args)`` returns (outputs, saved values); ``bwd(*output grads, *saved)`` returns the
    inputs' gradients (Dynamo's bodies of the Function's forward and backward). A Function that
    modifies its inputs (``mutates_inputs``) is refused by the caller.
    """
    non_differentiable = set(kwargs.get("non_differentiable_idx", ()))
    interpreter = functional_interpreter()
    level = interpreter.level()
    inner = tree_map(unwrap_functional, args)
    with interpreter.lower():
        out = _function(fwd, bwd, non_differentiable).apply(*inner)
    return tree_map(lambda t: wrap_functional(t, level), out)


def apply_unlifted_function(apply: Any, *args: Any, **kwargs: Any) -> Any:
    """``apply(*args)`` (``is_unlifted_function``) inside ``torch.func.functionalize``, which refuses a Function
    without ``setup_context``: run one level below functionalization, as ``apply_autograd_function`` runs its
    bodies, so autograd records the Function's own backward. Its forward's ops are traced as it writes them
    (the Functions torchao writes are functional)."""
    interpreter = functional_interpreter()
    level = interpreter.level()
    inner, inner_kwargs = tree_map(unwrap_functional, (args, kwargs))
    with interpreter.lower():
        out = apply(*inner, **inner_kwargs)
    return tree_map(lambda t: wrap_functional(t, level), out)


def _functional(gm: fx.GraphModule) -> Any:
    """``gm`` run functionalized: a body's in-place ops on its own temporaries become functional ops."""
    run = torch.func.functionalize(lambda *a: fx.Interpreter(gm).run(*a), remove="mutations")
    return lambda *a: run(*(x.detach() if isinstance(x, torch.Tensor) else x for x in a))


def _function(fwd: fx.GraphModule, bwd: fx.GraphModule, non_differentiable: set[int]) -> type:
    """A torch.autograd.Function running Dynamo's two bodies, as ``autograd_function_apply`` does."""

    class Apply(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, *args: Any) -> Any:
            output, saved = _functional(fwd)(*args)
            ctx.save_for_backward(*(s for s in saved if isinstance(s, torch.Tensor)))
            ctx.saved = [_TENSOR if isinstance(s, torch.Tensor) else s for s in saved]
            outs = output if isinstance(output, (tuple, list)) else [output]
            ctx.mark_non_differentiable(*(o for k, o in enumerate(outs) if k in non_differentiable))
            return output

        @staticmethod
        def backward(ctx: Any, *grads: Any) -> Any:
            tensors = iter(ctx.saved_tensors)
            saved = [next(tensors) if s is _TENSOR else s for s in ctx.saved]
            return _functional(bwd)(*grads, *saved)

    return Apply
