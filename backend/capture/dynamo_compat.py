"""torch 2.11's Dynamo graphs read as torch 2.13's: the DTensor API calls.

torch 2.13's Dynamo records a DTensor API call as it is written: ``DTensor.from_local(x, mesh,
placements)`` a call_function, ``x.redistribute(mesh, placements)`` and ``x.to_local()``
call_methods, the mesh a graph input. torch 2.11's records each as the call of a closure that holds
its non-tensor arguments (``args_as_value``, ``kwargs_as_value``) and takes the tensor alone:
``prim from_local``, ``prim_redistribute``, ``prim_to_local``. fxshard's trace reads such a call as
the one it stands for (``dtensor_prim``, ``prim_arguments``), so every later stage sees one form.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

# the closure's name (Dynamo sets it for debugging) -> the DTensor API call it stands for
_PRIMS = {"prim from_local": "from_local", "prim_redistribute": "redistribute", "prim_to_local": "to_local"}


def dtensor_prim(target: Any) -> str | None:
    """``"from_local"``, ``"redistribute"`` or ``"to_local"`` for a torch 2.11 Dynamo closure standing
    for that call; None for anything else (torch 2.13 records the calls themselves)."""
    if getattr(target, "__closure__", None) is None:
        return None
    return _PRIMS.get(getattr(target, "__name__", ""))


def prim_arguments(target: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[tuple, dict]:
    """The ``(args, kwargs)`` of the call a ``dtensor_prim`` closure stands for: the tensor it is
    given, then the arguments it holds (its cells ``args_as_value``, ``kwargs_as_value``)."""
    cells = dict(zip(target.__code__.co_freevars, (c.cell_contents for c in target.__closure__)))
    return (args[0], *cells.get("args_as_value", ()), *args[1:]), {**cells.get("kwargs_as_value", {}), **kwargs}
