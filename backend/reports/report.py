"""What the backend tells about each compiled graph: logs, structured traces, files.

``TORCH_LOGS="fxshard"`` shows the INFO summary, ``"+fxshard"`` the DEBUG stage graphs (any
logger under ``fxshard`` follows TORCH_LOGS, as a qualified module name).
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import pathlib
import re
import time
from typing import Callable, Iterator

import torch.fx as fx

from fxshard.graph import PLAN
from fxshard.memory import memory_report
from fxshard.printing import format_graph
from fxshard.timing import STAGES, timed_by

log = logging.getLogger("fxshard")
# what each stage did and how long it took (INFO); when a stage starts (DEBUG, with
# extra={"fxshard_stage": ...}): a launcher enables DEBUG here alone to say what a rank is busy with
progress = logging.getLogger("fxshard.progress")


class StageReporter:
    """Called as ``reporter(stage, gm)`` for each stage; passes it on to the user's ``on_graph``."""

    def __init__(self, on_graph: Callable[[str, fx.GraphModule], None] | None = None,
                 debug_dir: str | pathlib.Path | None = None, label: str | None = None):
        self.on_graph = on_graph
        self.graph_id = label if label is not None else dynamo_compile_id()
        self.debug_dir = pathlib.Path(debug_dir) if debug_dir is not None else None
        self.stage_index = itertools.count()
        self.times: dict[str, float] = {}  # seconds per stage (fxshard.timing.STAGES) or timed block, summed

    def __call__(self, stage: str, gm: fx.GraphModule) -> None:
        if self.on_graph is not None:
            self.on_graph(stage, gm)
        wants_text = self.debug_dir is not None or log.isEnabledFor(logging.DEBUG) or _tracing()
        if not wants_text:
            return
        text = format_graph(gm)
        log.debug("fxshard graph %s, stage %s:\n%s", self.graph_id, stage, text)
        _trace(f"fxshard_{stage}", text)
        if self.debug_dir is not None:
            self.debug_dir.mkdir(parents=True, exist_ok=True)
            path = self.debug_dir / f"graph{re.sub(r'[^A-Za-z0-9.]+', '-', self.graph_id)}_{next(self.stage_index)}_{stage}.txt"
            path.write_text(text + "\n")

    @contextlib.contextmanager
    def timed(self, doing: str) -> Iterator[None]:
        """Logs ``fxshard graph N: <doing> took X s`` (INFO on ``fxshard.progress``) once the block ran;
        adds the time to ``times[doing]``."""
        progress.debug("fxshard graph %s: %s ...", self.graph_id, doing,
                       extra={"fxshard_stage": f"{doing} (fxshard graph {self.graph_id})"})
        start = time.perf_counter()
        yield
        took = time.perf_counter() - start
        self.times[doing] = self.times.get(doing, 0.0) + took
        progress.info("fxshard graph %s: %s took %.2f s", self.graph_id, doing, took)

    @contextlib.contextmanager
    def timing(self) -> Iterator[None]:
        """Within the block each stage of fxshard's passes (``fxshard.timing.stage``) is timed here."""
        with timed_by(self.timed):
            yield

    def stage_summary(self) -> None:
        """One INFO line: the seconds of each of fxshard's stages so far (Inductor's come as it compiles)."""
        shown = ", ".join(f"{s} {self.times[s]:.2f} s" for s in STAGES if s in self.times)
        total = sum(self.times.get(s, 0.0) for s in STAGES)
        progress.info("fxshard graph %s: fxshard's stages took %.2f s (%s)", self.graph_id, total, shown)

    def wants_graphs(self) -> bool:
        """Whether someone reads the stages' graphs (``on_graph``, ``debug_dir``, DEBUG logs, a structured
        trace): then stage 5's graphs are shown too, read where the step runs without (``driver._show_lowered``)."""
        return (self.on_graph is not None or self.debug_dir is not None or log.isEnabledFor(logging.DEBUG)
                or _tracing())

    def summarizes(self, keep: bool = False) -> bool:
        """Whether ``summarize`` writes its line: INFO is on, or ``keep`` asks for the text."""
        return keep or log.isEnabledFor(logging.INFO)

    def summarize(self, planned: fx.GraphModule, keep: bool = False) -> str:
        """One INFO line per compiled graph: its collectives and memory per rank. Returns the line's text
        after the graph's id, computed where INFO is on or ``keep`` asks for it (a program kept on disk
        keeps its lines, for a later run that loads it to log), else empty."""
        if not self.summarizes(keep):
            return ""
        counts: dict[str, int] = {}
        total = 0
        for node in planned.graph.nodes:
            plan = node.meta.get(PLAN)
            for step in plan.collectives if plan is not None else ():
                key = f"{step.kind}({','.join(str(a) for a in step.axes)})"
                counts[key] = counts.get(key, 0) + 1
                total = total + step.bytes_per_rank
        comm = ", ".join(f"{n} x {k}" for k, n in counts.items()) or "none"
        text = f"communication {comm}; {total} B received per rank; {memory_report(planned)}"
        self.say(text)
        return text

    def say(self, text: str) -> None:
        """``text`` on one INFO line, after the graph's id."""
        log.info("fxshard graph %s: %s", self.graph_id, text)


def label_of(fn: Callable) -> str:
    """How logs name the program of a function: its qualified name (``Llama.loss``)."""
    return getattr(fn, "__qualname__", type(fn).__name__)


def dynamo_compile_id() -> str:
    """Dynamo's id of the graph being compiled (``0/0``: frame 0, its first compile), as TORCH_LOGS
    prefixes its lines with it; ``-`` outside a Dynamo compile."""
    from torch._guards import CompileContext

    compile_id = CompileContext.current_compile_id()
    return str(compile_id) if compile_id is not None else "-"


def _tracing() -> bool:
    """Whether a structured trace is written (``TORCH_TRACE``: what tlparse reads): the trace log's file handler
    has a directory. torch gives the trace log that handler in every process, without a directory where
    ``TORCH_TRACE`` is unset, and it removes itself at its first record; until then it traces nothing and
    must not count (a program would format every stage's graph for it, and read the lowered graphs that a
    step loaded from disk runs without). Handlers others attach to every logger (pytest's log capture) do not
    count either."""
    from torch._logging import _internal

    lazy = getattr(_internal, "LazyTraceHandler", None)
    return lazy is not None and _internal.trace_log.isEnabledFor(logging.DEBUG) and any(
        isinstance(h, lazy) and h.root_dir is not None for h in _internal.trace_log.handlers)


def _trace(name: str, text: str) -> None:
    from torch._logging import trace_structured

    trace_structured("artifact", metadata_fn=lambda: {"name": name, "encoding": "string"}, payload_fn=lambda: text)
