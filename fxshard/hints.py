"""Numbers for symbolic mesh sizes where a decision needs one.

Ranking two plans, or deciding whether a view's cut divides a sharded piece, needs a value for
``tp`` when the mesh says only ``Symbol("tp")``. Each symbol takes its hint (8 unless
``size_hints`` says otherwise); the expressions fxshard reports stay symbolic, and the
divisibility a cut took from a hint is listed (``Explanation.assumptions``).
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Mapping

import sympy

DEFAULT_HINT = 8
_hints: dict[str, int] = {}


def hint_of(symbol: sympy.Symbol) -> int:
    return _hints.get(str(symbol), DEFAULT_HINT)


def at_hints(expr: Any) -> Any:
    """``expr`` with every symbol replaced by its hint."""
    expr = sympy.sympify(expr)
    return expr.subs({s: hint_of(s) for s in expr.free_symbols})


def describe() -> str:
    shown = ", ".join(f"{k}={v}" for k, v in sorted(_hints.items()))
    return shown or f"every symbol = {DEFAULT_HINT}"


@contextlib.contextmanager
def size_hints(hints: Mapping[str, int] | None) -> Iterator[None]:
    """Within this block symbols named in ``hints`` take those values for decisions (plans are
    re-planned: cached plans were ranked under other numbers)."""
    if not hints:
        yield
        return
    from .planner import clear_plan_cache

    saved = dict(_hints)
    _hints.update({str(k): int(v) for k, v in hints.items()})
    clear_plan_cache()
    try:
        yield
    finally:
        _hints.clear()
        _hints.update(saved)
        clear_plan_cache()
