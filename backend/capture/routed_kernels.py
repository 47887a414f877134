"""The routed-experts ops' kernels under fxshard's backend: each rank's dispatch and experts as Inductor code.

``fxshard.routing.run_routed`` (and its backward) is what one rank runs for a routed MoE region: the
sort, the counts' all_to_all, the rows' ``all_to_all_single`` with split sizes from them, the regrouping
by expert and the experts' body. Eagerly, that body's pointwise ops run one by one. Here the ops' CPU
and CUDA kernels run it compiled whole (``fullgraph``) by torch.compile: ``.tolist()`` of the counts
gives unbacked sizes, so one program serves every routing (no recompilation as the counts change), and
Inductor fuses the experts' pointwise work around their grouped matmuls. Registered as the ops' kernels
when this module is imported (by stage 1's ``routed_experts.py``, which makes the ops' calls), as torch's
own ops are at theirs; simulated ranks call the Python forms on LocalTensors instead
(``routing.PYTHON_FORMS``). ``FXSHARD_EXPERTS_EAGER=1`` keeps the eager kernels.
"""
from __future__ import annotations

import os
from typing import Any, Callable

import torch

from fxshard.routing import routed_experts, routed_experts_backward, run_routed, run_routed_backward

from fxshard.backend.capture.dynamo_calls import scalar_outputs_captured

__all__ = ["compiled"]

DEVICES = ("cpu", "cuda")
_COMPILED: dict[Callable, Callable] = {}  # explicit cache: run_routed(_backward) -> its compiled form


def compiled(fn: Callable) -> Callable:
    """``fn`` compiled by Inductor, whole: the same ops in the same order, its split sizes unbacked."""
    if fn not in _COMPILED:
        inner = torch.compile(fn, fullgraph=True, dynamic=False)

        def run(*args: Any) -> list:
            with scalar_outputs_captured():
                return inner(*args)

        _COMPILED[fn] = run
    return _COMPILED[fn]


def _eager(group: str | None) -> bool:
    """Eager kernels: asked for, or no dispatch (no group: the pairs' counts are a ``bincount`` whose size the
    data sets, which a compiled program would have to guard)."""
    return group is None or os.environ.get("FXSHARD_EXPERTS_EAGER") == "1"


def _forward(body, rows, keys, extras, num_experts, num_stacks, counts_dtype, *, group=None, group_size=1):
    run = run_routed if _eager(group) else compiled(run_routed)
    return run(body, rows, keys, extras, num_experts, num_stacks, counts_dtype, group, group_size)


def _backward(body, rows, keys, extras, grads, num_experts, num_stacks, counts_dtype, *, group=None, group_size=1):
    run = run_routed_backward if _eager(group) else compiled(run_routed_backward)
    return run(body, rows, keys, extras, grads, num_experts, num_stacks, counts_dtype, group, group_size)


routed_experts.register_kernel(DEVICES, _forward)
routed_experts_backward.register_kernel(DEVICES, _backward)
