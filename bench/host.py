"""Host time of a training step: fxshard against DTensor (+ FSDP2) where the model computes almost nothing.

    python bench/host.py                 # every case, 2 runs of each system, markdown
    python bench/host.py --case tp --runs 3

On a GPU a rank's step is bound by the CPU that launches it until its kernels outlast the launching
(bench/results/gpu.md: TP at 4 layers, dim 1024, the same 10.5 ms of kernels on both systems, the step
2.5-5 ms longer on fxshard). This bench measures that host work on the CPU: bench/train.py's systems
(bench/systems.py) on a 4-layer Llama of dim 64, rank 0 of a fake process group of 4, one thread;
per step (forward, backward, AdamW) the process's CPU time (less sensitive to a shared machine's load
than wall time), median of ``STEPS`` steps after two warm ones, each run in a fresh process.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

os.environ["TORCHINDUCTOR_FORCE_DISABLE_CACHES"] = "1"

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "bench"))

CASES = ("tp", "tp_sp", "fsdp", "fsdp_tp")
TINY = dict(vocab_size=256, dim=64, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=128)
BATCH, SEQ, STEPS = 8, 16, 60


def one(case: str, system: str) -> dict:
    """CPU ms per step of ``case`` on ``system``, in this process."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import fxshard
    from models.llama import Llama, LlamaConfig
    from systems import adamw, build, case_mesh

    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        torch.manual_seed(0)
        model, step, _ = build(case, system, case_mesh(case, 4, "cpu"), Llama(LlamaConfig(**TINY)),
                               {"cost_model": fxshard.CostModel()})
        optimizer = adamw(model)
        x, y = (torch.randint(0, TINY["vocab_size"], (BATCH, SEQ)) for _ in range(2))

        def training_step() -> None:
            step(x, y)
            optimizer.step()
            optimizer.zero_grad()

        training_step()
        training_step()
        times = []
        for _ in range(STEPS):
            start = time.process_time()
            training_step()
            times.append(time.process_time() - start)
        return {"case": case, "system": system, "cpu_ms": statistics.median(times) * 1e3}
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=CASES, action="append")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # case system, in this process
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(*args.one)))
        return
    lines = ["| case | fxshard CPU ms / step (runs) | DTensor (runs) | ratio of medians |", "|---|---|---|---|"]
    for case in args.case or CASES:
        ms: dict[str, list[float]] = {"fxshard": [], "dtensor": []}
        for _ in range(args.runs):  # the systems alternate, so a load that comes and goes touches both
            for system in ms:
                run = subprocess.run([sys.executable, __file__, "--one", case, system], capture_output=True,
                                     text=True, check=True)
                ms[system].append(json.loads(run.stdout.strip().splitlines()[-1])["cpu_ms"])
        f, d = (statistics.median(ms[s]) for s in ("fxshard", "dtensor"))
        lines.append(f"| {case} | {f:.1f} ({', '.join(f'{t:.1f}' for t in ms['fxshard'])}) | "
                     f"{d:.1f} ({', '.join(f'{t:.1f}' for t in ms['dtensor'])}) | {f / d:.2f} |")
        print(lines[-1], file=sys.stderr, flush=True)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
