"""Run a function on every rank: spawned local processes (gloo on CPU, NCCL on GPUs) or under torchrun.

``launch(run, world_size)`` calls ``run(rank, world_size, device, **kwargs)`` on every rank and
returns each rank's result. Under ``torchrun`` (``RANK`` in the environment) this process is one
rank: the process group comes from torchrun's environment and the results are gathered from
all ranks. Otherwise ``spawn`` starts ``world_size`` processes on 127.0.0.1.

What spawned ranks get, and what the parent promises:
- one intra-op thread each (``threads=``), and one Inductor compile thread: ranks share the
  machine's cores, and more threads than cores only make everything slower;
- fxshard's progress (what each stage did and how long it took) printed as it happens, rank 0's
  by default; a rank busy too long fails the call saying what it was doing;
- a rank that failed fails the call at once, with its traceback; a rank whose collective failed because
  a peer was gone waits a few seconds for that peer's words or exit code, which lead the error (never a
  hang: the peers left waiting are killed); a rank that returned its result is given ``shutdown_grace``
  seconds to leave cleanly, and is never killed before.
"""
from __future__ import annotations

import faulthandler
import logging
import multiprocessing.util
import os
import pickle
import queue
import shutil
import socket
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PROGRESS = "fxshard.progress"  # fxshard's stage logger: INFO when a stage is done, DEBUG when it starts
PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")  # gloo, when a peer died
_EXIT_CODES = "a negative code is the signal that ended it; -9: killed, e.g. out of memory"


def launch(run: Callable, world_size: int, timeout: float = 900.0, device: str = "cpu",
           setup: Callable[[str], None] | None = None, **kwargs: Any) -> dict[int, Any]:
    """``run(rank, world_size, device, **kwargs)`` on every rank, spawned here or under torchrun.

    ``setup(workdir)`` runs once per node before any rank starts (files every rank reads, such
    as a checkpoint), and ``run`` then gets ``workdir=`` too. Returns {rank: result} for all ranks.
    """
    if "RANK" in os.environ:
        return _as_torchrun_rank(run, device, setup, kwargs)
    if setup is None:
        return spawn(run, world_size, timeout, device, **kwargs)
    with tempfile.TemporaryDirectory(prefix="fxshard-") as workdir:
        setup(workdir)
        return spawn(run, world_size, timeout, device, workdir=workdir, **kwargs)


def _as_torchrun_rank(run: Callable, device: str, setup: Callable[[str], None] | None,
                      kwargs: dict) -> dict[int, Any]:
    """This process is one rank of a torchrun job: same path as a spawned rank, results gathered."""
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    show_progress(rank == 0)
    node_leader = int(os.environ.get("LOCAL_RANK", rank)) == 0
    workdir = None
    try:
        if setup is not None:  # one per node, by its local rank 0; the same path on every rank of the job
            run_id = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("MASTER_PORT", "0")
            workdir = os.path.join(tempfile.gettempdir(), f"fxshard-{run_id}")
            if node_leader:
                os.makedirs(workdir, exist_ok=True)
                setup(workdir)
            dist.barrier()
            kwargs = dict(kwargs, workdir=workdir)
        result = run(rank, world_size, device, **kwargs)
        results = _all_gather_pickled(result, world_size)  # every rank is done with the workdir once this returns
        if workdir is not None and node_leader:
            shutil.rmtree(workdir, ignore_errors=True)
        return dict(enumerate(results))
    finally:
        dist.destroy_process_group()


def _all_gather_pickled(obj: Any, world_size: int) -> list[Any]:
    """Every rank's ``obj``, as ``dist.all_gather_object`` gives it, without numpy (which torch's
    version needs and a plain ``pip install torch`` does not bring)."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
    dist.all_gather(sizes, torch.tensor([data.numel()]))
    longest = max(int(n) for n in sizes)
    blocks = [torch.zeros(longest, dtype=torch.uint8) for _ in range(world_size)]
    dist.all_gather(blocks, torch.cat([data, torch.zeros(longest - data.numel(), dtype=torch.uint8)]))
    return [pickle.loads(bytes(b[:int(n)].tolist())) for b, n in zip(blocks, sizes)]


def show_progress(enabled: bool = True) -> None:
    """Print fxshard's progress lines (each stage and how long it took) on this process's stderr."""
    if not enabled or logging.getLogger("fxshard").handlers:  # TORCH_LOGS="fxshard" shows them already
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger(PROGRESS)
    logger.addHandler(handler)
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)


# ---- spawned ranks ----------------------------------------------------------------------------------
class _Forward(logging.Handler):
    """Sends fxshard's progress records to the parent: stage starts (DEBUG) and what finished (INFO)."""

    def __init__(self, channel: Any, rank: int):
        super().__init__(logging.DEBUG)
        self.channel, self.rank = channel, rank

    def emit(self, record: logging.LogRecord) -> None:
        stage = getattr(record, "fxshard_stage", None)
        if stage is not None or record.levelno >= logging.INFO:
            self.channel.put(("progress", self.rank, stage, record.getMessage()))


def _worker(run: Callable, rank: int, world_size: int, port: int, channel: Any, device: str, threads: int,
            kwargs: dict) -> None:
    faulthandler.enable(all_threads=True)  # a rank that crashes in native code (SIGSEGV, SIGABRT) says where
    torch.set_num_threads(threads)
    import torch._inductor.config as inductor_config

    inductor_config.compile_threads = 1  # no pool of compile workers per rank
    # the ranks share Inductor's on-disk cache, as torchrun's ranks on one node do: an entry is keyed by its
    # program's code and input shapes (ranks whose local programs differ get entries of their own), and
    # Inductor writes entries atomically and builds each kernel under a file lock
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    logger = logging.getLogger(PROGRESS)
    logger.addHandler(_Forward(channel, rank))
    logger.setLevel(logging.DEBUG)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=world_size)
    outcome = {"exit code": 1}
    multiprocessing.util.Finalize(None, lambda: _leave_before_teardown(outcome["exit code"]), exitpriority=-1000)
    try:
        channel.put(("result", rank, run(rank, world_size, device, **kwargs)))
        outcome["exit code"] = 0
    except BaseException:
        channel.put(("failed", rank, traceback.format_exc()))  # fail the parent now, not at its timeout
        raise
    finally:
        dist.destroy_process_group()


def _leave_before_teardown(exit_code: int) -> None:
    """The rank's last act, after every other exit handler (its queue flushed, the program's own
    handlers run): leave without tearing the interpreter down. Gloo's worker threads may still hold
    tensors with Python references; freeing them during interpreter finalization aborts the process
    (SIGABRT, "terminate called without an active exception"; pytorch/pytorch#179291) after the
    rank's work is done and its result delivered."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _peer_lost(error: str) -> bool:
    """Whether a rank's traceback is gloo's report of a peer that went away (not the rank's own fault)."""
    return any(marker in error for marker in PEER_LOST)


class RanksFailed(RuntimeError):
    """A rank raised, died, or did not finish within the timeout."""


def spawn(run: Callable, world_size: int = 2, timeout: float = 900.0, device: str = "cpu", threads: int = 1,
          progress: int | None = 0, shutdown_grace: float = 120.0, **kwargs: Any) -> dict[int, Any]:
    """Run ``run`` on ``world_size`` local processes; {rank: result}, or ``RanksFailed``.

    ``timeout``: seconds until every rank has returned its result; ``progress``: the rank whose
    progress lines are printed (None: none); ``threads``: intra-op threads per rank.
    """
    if "fxshard" in os.environ.get("TORCH_LOGS", ""):
        progress = None  # every rank logs its progress itself
    ctx = mp.get_context("spawn")
    channel = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(run, r, world_size, port, channel, device, threads, kwargs))
             for r in range(world_size)]
    start = time.monotonic()
    for p in procs:
        p.start()
    watch = _Watch(procs, start, progress)
    try:
        results = watch.collect(channel, timeout)
    except BaseException:
        for p in procs:  # a rank failed or timed out: the others may wait forever in a collective
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join()
        raise
    watch.join_all(shutdown_grace)
    return results


class _Watch:
    """The parent's view of its ranks: results, what each is busy with, how they exit."""

    def __init__(self, procs: list, start: float, progress: int | None):
        self.procs, self.start, self.progress = procs, start, progress
        self.busy: dict[int, str] = {}  # rank -> the fxshard stage it started last, while it runs
        self.done: dict[int, str] = {}  # rank -> the last thing it reported finished

    def collect(self, channel: Any, timeout: float, wait_for_peers: float = 10.0) -> dict[int, Any]:
        """{rank: result} once every rank returned one; ``RanksFailed`` naming the rank that broke the run
        first: a peer's broken connection waits ``wait_for_peers`` s for who broke it, to say so first."""
        results: dict[int, Any] = {}
        lost: dict[int, str] = {}  # rank -> its traceback, of a collective whose peer was gone
        gone_since: float | None = None  # a rank exited without a word: its last words may still be in transit
        lost_since: float | None = None
        while len(results) < len(self.procs):
            deadline = self.deadline(timeout)
            try:
                kind, rank, *payload = channel.get(timeout=min(1.0, max(deadline - time.monotonic(), 0.01)))
            except queue.Empty:
                now = time.monotonic()
                gone = self._gone(results, lost)
                gone_since = gone_since or (now if gone else None)
                if (gone and (lost or now - gone_since > 5.0)) or (lost and now - lost_since > wait_for_peers):
                    raise RanksFailed(self._failure_message(lost, results)) from None
                if now >= deadline:
                    raise RanksFailed(self._timeout_message(results, timeout)) from None
                continue
            if kind == "progress":
                self._progress(rank, *payload)
            elif kind == "failed" and _peer_lost(payload[0]):  # not this rank's fault: who else failed?
                lost[rank] = payload[0]
                lost_since = lost_since or time.monotonic()
            elif kind == "failed":
                raise RanksFailed(self._failure_message({**lost, rank: payload[0]}, results))
            else:
                results[rank] = payload[0]
        return results

    def deadline(self, timeout: float) -> float:
        """When the call times out: ``timeout`` s after the ranks were started (asked again after every word
        from a rank, so that a test may count from what the ranks said)."""
        return self.start + timeout

    def _progress(self, rank: int, stage: str | None, message: str) -> None:
        if stage is not None:
            self.busy[rank] = stage
            return
        self.busy.pop(rank, None)
        self.done[rank] = message
        if rank == self.progress:
            print(f"[rank {rank}, {time.monotonic() - self.start:5.1f} s] {message}", file=sys.stderr, flush=True)

    def _failure_message(self, failures: dict[int, str], results: dict[int, Any]) -> str:
        """The ranks' tracebacks, led by the ranks that broke the others: a rank that exited without a result
        (killed, crashed, ``os._exit``) or failed on its own; a peer's broken connection comes last."""
        gone = [f"rank {r} exited with code {self.procs[r].exitcode} without returning a result ({_EXIT_CODES}); "
                "its stderr above says why\n" for r in self._gone(results, failures)]
        own = [f"rank {r} failed:\n{error}" for r, error in sorted(failures.items()) if not _peer_lost(error)]
        broken = [f"rank {r} failed (a peer it was waiting for in a collective was gone):\n{error}"
                  for r, error in sorted(failures.items()) if _peer_lost(error)]
        return "".join(gone) + "".join(text if text.endswith("\n") else text + "\n" for text in own + broken)

    def _gone(self, results: dict[int, Any], failures: dict[int, str]) -> list[int]:
        """The ranks that exited without a result or a traceback (killed, crashed, ``os._exit``)."""
        return [r for r, p in enumerate(self.procs)
                if r not in results and r not in failures and p.exitcode is not None]

    def _timeout_message(self, results: dict[int, Any], timeout: float) -> str:
        lines = [f"ranks timed out after {timeout:.0f} s:"]
        for rank in range(len(self.procs)):
            if rank in results:
                continue
            if rank in self.busy:
                doing = self.busy[rank]
            elif rank in self.done:
                doing = f"running its own code (fxshard's last word: {self.done[rank]!r})"
            else:
                doing = "starting or tracing (no fxshard stage had finished)"
            lines.append(f"  rank {rank} timed out after {timeout:.0f} s while {doing}")
        lines.append("a rank busy compiling needs a longer timeout on a loaded machine (the timeout= argument)")
        return "\n".join(lines)

    def join_all(self, grace: float) -> None:
        """Every rank returned its result: let each leave cleanly; kill only one stuck past ``grace``."""
        deadline = time.monotonic() + grace
        for p in self.procs:
            p.join(timeout=max(deadline - time.monotonic(), 0.0))
        stuck = [r for r, p in enumerate(self.procs) if p.is_alive()]
        for r in stuck:
            self.procs[r].kill()
            self.procs[r].join()
        crashed = {r: p.exitcode for r, p in enumerate(self.procs) if p.exitcode != 0 and r not in stuck}
        if stuck or crashed:
            raise RanksFailed(
                "every rank returned its result, but "
                + "; ".join([f"rank {r} did not exit within {grace:.0f} s (killed)" for r in stuck]
                            + [f"rank {r} exited with code {c}" for r, c in crashed.items()]))
