"""Numbers for symbolic mesh sizes where a decision needs one, and the divisibility they assumed.

Ranking two plans, or deciding whether a view's cut divides a sharded piece, needs a value for
``tp`` when the mesh says only ``Symbol("tp")``. Each symbol takes its hint (8 unless
``size_hints`` says otherwise); the expressions fxshard reports stay symbolic, and the
divisibility a cut took from a hint is recorded where ``assumptions()`` collects it
(``Explanation.assumptions``).

Both live in context variables, set for the duration of a ``with`` block: a plan made under
other hints is another plan (the planner's cache is keyed by ``current()``), and nothing leaks
from one explanation into the next.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator, Mapping

import sympy

DEFAULT_HINT = 8
_HINTS: contextvars.ContextVar[tuple[tuple[str, int], ...]] = contextvars.ContextVar("fxshard_size_hints", default=())
_ASSUMED: contextvars.ContextVar[set[str] | None] = contextvars.ContextVar("fxshard_assumptions", default=None)


def current() -> tuple[tuple[str, int], ...]:
    """The hints in force, as a hashable key (empty: every symbol at ``DEFAULT_HINT``)."""
    return _HINTS.get()


def hint_of(symbol: sympy.Symbol) -> int:
    return dict(_HINTS.get()).get(str(symbol), DEFAULT_HINT)


def at_hints(expr: Any) -> Any:
    """``expr`` with every symbol replaced by its hint."""
    expr = sympy.sympify(expr)
    return expr.subs({s: hint_of(s) for s in expr.free_symbols})


def describe() -> str:
    shown = ", ".join(f"{k}={v}" for k, v in _HINTS.get())
    return shown or f"every symbol = {DEFAULT_HINT}"


@contextlib.contextmanager
def size_hints(hints: Mapping[str, int] | None) -> Iterator[None]:
    """Within this block symbols named in ``hints`` take those values for decisions."""
    if not hints:
        yield
        return
    merged = dict(_HINTS.get()) | {str(k): int(v) for k, v in hints.items()}
    token = _HINTS.set(tuple(sorted(merged.items())))
    try:
        yield
    finally:
        _HINTS.reset(token)


def assume(fact: str) -> None:
    """Record that a decision took ``fact`` (``"tp divides 16"``) from the hints."""
    collected = _ASSUMED.get()
    if collected is not None:
        collected.add(fact)


@contextlib.contextmanager
def assumptions() -> Iterator[set[str]]:
    """Collects the facts decisions assume inside the block (see ``assume``)."""
    token = _ASSUMED.set(set())
    try:
        yield _ASSUMED.get()
    finally:
        _ASSUMED.reset(token)
