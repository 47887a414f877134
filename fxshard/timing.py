"""Stage timing: the passes say which stage they are in, whoever compiles says how to time it.

``fxshard/`` knows no logger: a pass wraps its work in ``with stage("refine"):`` and the timer in
force (a context variable, set for a ``with timed_by(timer):`` block, as the backend's
``StageReporter`` does) measures it; without one ``stage`` costs nothing.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Callable, ContextManager, Iterator

Timer = Callable[[str], ContextManager[None]]  # a stage's name -> the block that measures it

# fxshard's stages, in the order a compile runs them (Inductor's is the backend's, after them); "unfold" (a
# model's repeated layers planned once: the plan of a four-layer program made whole, backend/programs/fold.py) runs
# where a training step's layers were folded; "regions" (the cut into regional programs and the merge of
# their buckets) runs at the first call, when Inductor compiles a regional program (backend/layers/regions.py)
STAGES = ("trace", "propagate", "refine", "plan", "split", "unfold", "localize", "lower", "regions")

_TIMER: contextvars.ContextVar[Timer | None] = contextvars.ContextVar("fxshard_stage_timer", default=None)


@contextlib.contextmanager
def stage(name: str) -> Iterator[None]:
    """The block is stage ``name`` (one of ``STAGES``): timed by the timer in force, if any."""
    timer = _TIMER.get()
    if timer is None:
        yield
        return
    with timer(name):
        yield


@contextlib.contextmanager
def timed_by(timer: Timer) -> Iterator[None]:
    """Within this block every ``stage`` is measured by ``timer``."""
    token = _TIMER.set(timer)
    try:
        yield
    finally:
        _TIMER.reset(token)
