"""examples/ranks.py, which the examples and the gloo tests launch ranks with: what a rank gets,
how a slow or stuck rank ends the call, and that a rank leaving cleanly is never killed."""
from __future__ import annotations

import inspect
import pathlib
import re
import sys
import time

import pytest

HERE = pathlib.Path(__file__).resolve().parent
EXAMPLES = HERE.parent / "examples"


@pytest.fixture(scope="module")
def ranks():
    sys.path[:0] = [str(EXAMPLES), str(HERE)]  # spawned ranks import these modules by name
    try:
        import rank_programs
        import ranks

        yield ranks, rank_programs
    finally:
        sys.path.remove(str(EXAMPLES))
        sys.path.remove(str(HERE))


# 11 s (--slow): longer than the 10 s after which the launcher used to kill a rank that had already returned;
# by default 3 s, and the grace a leaving rank gets by default is read off ``spawn``
@pytest.mark.parametrize("exit_delay", [3.0, pytest.param(11.0, marks=pytest.mark.slow)])
def test_each_rank_gets_one_thread_says_what_it_does_and_may_take_its_time_to_leave(ranks, capfd, exit_delay):
    launcher, programs = ranks
    assert inspect.signature(launcher.spawn).parameters["shutdown_grace"].default >= 60
    results = launcher.spawn(programs.threads_and_slow_exit, 2, timeout=120, exit_delay=exit_delay)
    assert results == {r: {"threads": 1, "compile_threads": 1} for r in range(2)}
    err = capfd.readouterr().err
    assert "[rank 0, " in err and "fxshard graph toy: counting threads took" in err, err[-2000:]
    assert "[rank 1, " not in err  # rank 0's progress only


def test_a_rank_stuck_on_its_way_out_is_reported_not_hidden(ranks):
    launcher, programs = ranks
    with pytest.raises(launcher.RanksFailed, match=r"every rank returned its result, but rank \d did not exit "
                                                   r"within 1 s \(killed\)"):
        launcher.spawn(programs.threads_and_slow_exit, 2, timeout=120, shutdown_grace=1, exit_delay=30.0)


def test_a_timeout_says_which_rank_and_what_it_was_doing(ranks, monkeypatch):
    """Rank 1 is inside a stage when the call times out: the error names the rank and the stage. The timeout
    counts from rank 1's word that it is in the stage: how long ranks take to start is the machine's load."""
    launcher, programs = ranks

    class FromTheStage(launcher._Watch):
        in_stage_since: float | None = None

        def _progress(self, rank: int, stage: str | None, message: str) -> None:
            if rank == 1 and stage is not None and self.in_stage_since is None:
                self.in_stage_since = time.monotonic()
            super()._progress(rank, stage, message)

        def deadline(self, timeout: float) -> float:
            if self.in_stage_since is None:  # not there yet: only a rank that never gets there times out
                return self.start + 600.0
            return self.in_stage_since + timeout
    monkeypatch.setattr(launcher, "_Watch", FromTheStage)
    with pytest.raises(launcher.RanksFailed, match=r"rank 1 timed out after 2 s while compiling the local program "
                                                   r"with Inductor \(fxshard graph -\)"):
        launcher.spawn(programs.busy_in_a_stage, 2, timeout=2, seconds=300.0)


def test_a_rank_that_crashes_is_named_before_the_peers_it_broke(ranks, capfd):
    """A rank killed by a signal leaves its peers with a broken connection; the error names the dead
    rank and its exit code first, and the dead rank's stderr has its Python stack (faulthandler)."""
    launcher, programs = ranks
    with pytest.raises(launcher.RanksFailed, match=r"rank 1 (died with exit code -6|exited with code -6)"):
        launcher.spawn(programs.one_rank_crashes_in_a_collective, 2, timeout=60)
    assert "Fatal Python error: Aborted" in capfd.readouterr().err


@pytest.mark.parametrize("how, where, culprit", [
    ("exit", "backward", r"rank 1 exited with code 3 without returning a result"),
    ("raise", "forward", r"rank 1 failed:\n(.|\n)*RuntimeError: rank 1 fails in its compiled step"),
], ids=["exits-in-the-backward", "raises-between-graphs"])
def test_a_rank_failing_in_a_compiled_step_is_named_first_never_a_hang(ranks, how, where, culprit):
    """Rank 1 fails inside a torch.compile training step while rank 0 runs on into a collective: the call
    ends well within its timeout, its error led by rank 1; rank 0's broken connection, if reported, after."""
    launcher, programs = ranks
    with pytest.raises(launcher.RanksFailed) as failed:
        launcher.spawn(programs.one_rank_fails_in_a_compiled_step, 2, timeout=300, how=how, where=where)
    assert re.match(culprit, str(failed.value)), str(failed.value)[:2000]


def test_a_peers_broken_connection_waits_for_the_traceback_of_the_rank_that_broke_it(ranks):
    """Rank 1's collective fails first (its peer is gone) and rank 0's own error arrives after: the error
    leads with rank 0's, not with rank 1's broken connection (which named the wrong rank)."""
    import queue
    import types

    launcher, _ = ranks
    channel = queue.Queue()
    channel.put(("failed", 1, "RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer"))
    channel.put(("failed", 0, "NotImplementedError: the cause"))
    procs = [types.SimpleNamespace(exitcode=None) for _ in range(2)]  # both still running
    with pytest.raises(launcher.RanksFailed) as failed:
        launcher._Watch(procs, time.monotonic(), progress=None).collect(channel, timeout=60)
    assert re.match(r"rank 0 failed:\nNotImplementedError: the cause\nrank 1 failed \(a peer it was waiting for",
                    str(failed.value)), str(failed.value)


def test_torchrun_results_are_gathered_without_numpy(ranks, monkeypatch):
    """Under torchrun the ranks' results are gathered by pickling into tensors: the README's quickstart
    venv (plain torch) has no numpy, which dist.all_gather_object needs."""
    import torch
    import torch.distributed as dist

    launcher, _ = ranks
    monkeypatch.setattr(torch.Tensor, "numpy", lambda self, *a, **k: (_ for _ in ()).throw(RuntimeError("no numpy")))
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        result = {"losses": [1.5, 2.25], "counts": {"all_reduce": 3}, "name": "rank 0"}
        assert launcher._all_gather_pickled(result, 1) == [result]
    finally:
        dist.destroy_process_group()
