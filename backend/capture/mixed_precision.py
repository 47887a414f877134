"""A mixed-precision policy (``fxshard.MixedPrecision``) applied to the program before Dynamo captures it.

Under a policy the function runs with each floating parameter of its modules read as ``fxshard::cast_for_compute``
of it (a cast to ``param_dtype`` whose backward sums the gradient in the policy's reduce dtype: fxshard/ops.py),
its floating tensor arguments cast to ``param_dtype`` (``cast_forward_inputs``), and its floating outputs cast
to ``output_dtype``. The casts are in the program Dynamo captures, so its graph is the program the policy makes
(code that reads a dtype, ``cos.to(x.dtype)``, reads the cast one: a rewrite of a graph Dynamo captured in fp32
could not change what it baked in), its placeholders are the fp32 parameters themselves (``placements=`` names
them as before), and the planner places each cast like any op: on a parameter's shard, before the gather an FSDP
plan makes, as FSDP2 casts before its all-gather. ``torch.compile`` hands the backend a graph already captured,
so that door takes the policy as ``with_mixed_precision(model, policy)`` (the module's forward wrapped alike).
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import torch
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils import _pytree as pytree

from fxshard.ops import CAST_FOR_COMPUTE
from fxshard.policies import MixedPrecision

from fxshard.backend.capture.inputs import modules_of


def under_policy(fn: Callable, policy: MixedPrecision | None,
                 modules: Sequence[torch.nn.Module] | None = None) -> Callable:
    """``fn`` run as ``policy`` says (``fn`` itself without one); ``modules``: whose parameters are cast
    (default: the modules ``fn`` is or is a method of, or closes over)."""
    if policy is None or (policy.param_dtype is None and policy.output_dtype is None):
        return fn
    modules = list(modules_of(fn)) if modules is None else list(modules)

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = pytree.tree_map(lambda x: _cast_argument(x, policy), (args, kwargs))
        out = _call_cast(modules, policy, fn, args, kwargs)
        return pytree.tree_map(lambda x: _cast_output(x, policy), out)

    return run


def with_mixed_precision(module: torch.nn.Module, policy: MixedPrecision) -> torch.nn.Module:
    """``module`` (in place, and returned) whose forward runs as ``policy`` says: for
    ``torch.compile(with_mixed_precision(model, policy), backend="fxshard")``, the door that cannot wrap the
    model itself. Its parameters, their names and its state dict stay as they are."""
    if not isinstance(policy, MixedPrecision):
        raise TypeError(f"with_mixed_precision(module, {policy!r}): expected a fxshard.MixedPrecision")
    module.forward = under_policy(module.forward, policy, [module])
    return module


def _call_cast(modules: Sequence[torch.nn.Module], policy: MixedPrecision, fn: Callable, args: tuple,
               kwargs: dict) -> Any:
    """``fn(*args, **kwargs)`` with each floating parameter of ``modules`` read as cast for compute (``torch.func``'s
    reparametrization, which Dynamo traces: the graph's placeholders stay the parameters; tied ones read alike)."""
    if not modules or policy.param_dtype is None:
        return fn(*args, **kwargs)
    dtype = policy.param_dtype
    cast = {name: CAST_FOR_COMPUTE(p, dtype, policy.summed_in or p.dtype)
            for name, p in modules[0].named_parameters() if p.dtype.is_floating_point and p.dtype != dtype}
    with _reparametrize_module(modules[0], cast, tie_weights=True):
        return _call_cast(modules[1:], policy, fn, args, kwargs)


def _cast_argument(x: Any, policy: MixedPrecision) -> Any:
    if (policy.cast_forward_inputs and policy.param_dtype is not None and isinstance(x, torch.Tensor)
            and x.dtype.is_floating_point):
        return x.to(policy.param_dtype)
    return x


def _cast_output(x: Any, policy: MixedPrecision) -> Any:
    if policy.output_dtype is not None and isinstance(x, torch.Tensor) and x.dtype.is_floating_point:
        return x.to(policy.output_dtype)
    return x
