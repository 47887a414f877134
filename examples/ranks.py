"""Run a function on local ranks: gloo on CPU (127.0.0.1) or NCCL on GPUs, each rank its own process.

``spawn(run, world_size)`` calls ``run(rank, world_size, device, **kwargs)`` on every rank and
returns each rank's result; a rank that fails or hangs fails the call (bounded by ``timeout``).
"""
from __future__ import annotations

import os
import socket
from typing import Any, Callable

import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(run: Callable, rank: int, world_size: int, port: int, results: "mp.Queue", device: str,
            kwargs: dict) -> None:
    import tempfile
    import traceback

    # each rank compiles into its own Inductor cache: no two processes write one cache entry at once
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR",
                          os.path.join(tempfile.gettempdir(), f"fxshard-inductor-rank{rank}"))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=world_size)
    try:
        results.put((rank, run(rank, world_size, device, **kwargs)))
    except BaseException:
        results.put((rank, {"exception": traceback.format_exc()}))  # fail the parent now, not at its timeout
        raise
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(run: Callable, world_size: int = 2, timeout: float = 240.0, device: str = "cpu",
          **kwargs: Any) -> dict[int, dict]:
    """Run ``run`` on ``world_size`` local ranks; raises if a rank fails or hangs."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(run, r, world_size, port, results, device, kwargs)) for r in range(world_size)]
    for p in procs:
        p.start()
    out: dict[int, dict] = {}
    try:
        for _ in range(world_size):
            rank, value = results.get(timeout=timeout)
            if "exception" in value:
                raise RuntimeError(f"rank {rank} failed:\n{value['exception']}")
            out[rank] = value
    finally:
        for p in procs:
            p.join(timeout=0 if p.exitcode is None and len(out) < world_size else 10)
            if p.is_alive():
                p.kill()
                p.join()
    failed = [p.exitcode for p in procs if p.exitcode not in (0, None)]
    if failed or len(out) != world_size:
        raise RuntimeError(f"ranks failed (exit codes {[p.exitcode for p in procs]})")
    return out
