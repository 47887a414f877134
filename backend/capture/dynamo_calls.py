"""Every private Dynamo and functorch name fxshard uses, in one module.

torch promises nothing of these names from one release to the next: a new torch's hunt reads this module
(and ``backend/inductor/``'s, tests/test_architecture.py fences them), not the whole backend. A name is
imported where it is called, as its callers imported it before.
"""
from __future__ import annotations

from typing import Any, Callable, ContextManager

import torch
import torch.fx as fx
from torch._dynamo.exc import Unsupported  # what Dynamo raises where it cannot capture (a graph break, fullgraph)

__all__ = ["Unsupported", "dynamic_by_default", "forget_frames", "guard_global_shapes",
           "functional_interpreter", "unwrap_functional", "wrap_functional", "is_functional_tensor",
           "autograd_tensor", "interpreter_stack_cleared"]


# ---- Dynamo ----------------------------------------------------------------------------------------
def dynamic_by_default() -> bool:
    """Whether Dynamo traces sizes as symbols from the first call (``torch.compile(..., dynamic=True)``)."""
    return not torch._dynamo.config.assume_static_by_default


def kept_whole_by_dynamo(fn: Callable) -> Callable:
    """``fn`` as one node of Dynamo's graph (``allow_in_graph``), not inlined: an autograd.Function that
    torch.func must see as itself (a routed body's transformers op, backend/capture/moe_forms.py)."""
    return torch._dynamo.allow_in_graph(fn)


def scalar_outputs_captured() -> ContextManager:
    """Dynamo tracing ``.tolist()`` / ``.item()`` as unbacked sizes instead of breaking the graph there."""
    return torch._dynamo.config.patch(capture_scalar_outputs=True)


def forget_frames(backend: Callable) -> None:
    """Drop the cache entries compiled with ``backend`` from every code object Dynamo compiled.

    After a graph break Dynamo compiles the user's own frames (a module's forward, its resume
    functions); left cached they would run this capture's callbacks in a later one, and each
    capture would count against the recompile limit (8), past which Dynamo stops capturing.
    Resetting a code object drops its other entries too: those only recompile.
    """
    from torch._dynamo import convert_frame
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list, reset_code

    for weak in list(convert_frame.input_codes.seen) + list(convert_frame.output_codes.seen):
        code = weak()
        if code is not None and any(getattr(getattr(e, "backend", None), "compiler_fn", None) is backend
                                    for e in _debug_get_cache_entry_list(code)):
            reset_code(code)


def guard_global_shapes(gm: fx.GraphModule) -> None:
    """Make Dynamo recompile when a DTensor input's global shape changes.

    Dynamo guards a DTensor on its local tensor's shape only (``DTENSOR_SPEC_MATCH`` skips the
    global shape). With uneven shards that is not enough: a batch of 3 rows over 2 ranks gives
    rank 0 the same 2 rows as a batch of 4, so rank 0 would run the program planned for 4 rows
    while rank 1 recompiles, a wrong answer or a hang. The graph itself may have sizes baked in
    (``x.shape[0]`` read in Python), so only Dynamo can recompile it correctly: this adds the guard.
    """
    from torch._dynamo.guards import GuardBuilder, install_guard
    from torch._dynamo.source import AttrSource
    from torch.distributed.tensor import DTensor

    for node in gm.graph.nodes:
        grapharg = node.meta.get("grapharg") if node.op == "placeholder" else None
        if grapharg is None or not isinstance(grapharg.example, DTensor) or grapharg.source is None:
            continue
        install_guard(AttrSource(grapharg.source, "shape").make_guard(GuardBuilder.EQUALS_MATCH))


def is_trampoline_apply(target: Any) -> bool:
    """Whether a Dynamo graph's call target is Dynamo's ``trampoline_autograd_apply``: the ``apply`` of a custom
    autograd.Function it did not lift into ``autograd_function_apply`` (one with no ``setup_context``)."""
    from torch._dynamo.variables.misc import produce_trampoline_autograd_apply

    return getattr(target, "_origin", None) is produce_trampoline_autograd_apply


# ---- functorch: a joint trace runs under ``functionalize``, autograd one level below it -------------------
def functional_interpreter() -> Any:
    """functorch's innermost interpreter (``functionalize``'s, in a joint trace): its ``level()``, and
    ``lower()``, a block run one level below it."""
    from torch._functorch.pyfunctorch import retrieve_current_functorch_interpreter

    return retrieve_current_functorch_interpreter()


def unwrap_functional(x: Any) -> Any:
    """A functional tensor's value one level below functionalization (other values as they are)."""
    from torch._functorch.eager_transforms import _maybe_unwrap_functional_tensor

    return _maybe_unwrap_functional_tensor(x, reapply_views=True)


def wrap_functional(x: Any, level: int) -> Any:
    """A tensor made below functionalization, wrapped as functionalization's at ``level``."""
    from torch._functorch.eager_transforms import _maybe_wrap_functional_tensor

    return _maybe_wrap_functional_tensor(x, level=level)


def is_functional_tensor(x: torch.Tensor) -> bool:
    return torch._C._functorch.is_functionaltensor(x)


def autograd_tensor(x: torch.Tensor) -> torch.Tensor:
    """The tensor beneath functorch's wrappers: the one autograd records (a wrapper says requires_grad False)."""
    while torch._C._functorch.is_functorch_wrapped_tensor(x):
        x = torch._C._functorch.get_unwrapped(x)
    return x


def interpreter_stack_cleared() -> ContextManager:
    """A block run with no functorch transform active (a nested trace that must not see the outer one's)."""
    from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack

    return temporarily_clear_interpreter_stack()
