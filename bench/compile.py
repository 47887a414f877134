"""Compile time against the number of layers: fxshard's own stages, Inductor, and DTensor's FSDP2.

    python bench/compile.py                 # layers 1, 2, 4, 8, fxshard with regional=True; markdown tables
    python bench/compile.py --layers 1 2 --json
    python bench/compile.py --no-regional   # fxshard gives Inductor whole programs (regional=False)
    python bench/compile.py --warm          # a second run of the same script: Inductor's caches on and filled

bench/train.py's Llama (vocab 2048, dim 256, 8 heads (4 kv), ffn 768) with ``n_layers`` layers,
FSDP on dp=4, AdamW-free (compile only), batch 8 x 128 tokens. One process, rank 0 of a fake
process group of 4 (``fake`` backend: collectives move nothing, so a step costs only compute);
every rank compiles the same programs, so one rank's compile is the job's.

- fxshard: ``fxshard.compile(model.loss)`` with the parameters DTensors ``Shard(0)`` on dp, as
  bench/train.py. Its time is the first training step (forward + backward: Dynamo capture, the
  stages, Inductor on the forward and the backward, the step itself); the stages are read from
  the program's ``StageReporter.times`` (what ``TORCH_LOGS=fxshard`` prints). fxshard's own stages are
  trace .. regions (``fxshard.timing.STAGES``); Dynamo's capture of the function, torch's front end that
  every ``torch.compile`` runs, is a column of its own, and the share of the first step is given both
  without it and with it.
- FSDP2: ``fully_shard`` per block and the root, each block compiled by Inductor (``block.compile()``),
  as bench/train.py; its time is its first step, and Dynamo's part of it (Dynamo's compiles less the
  Inductor compiles they called, ``torch._dynamo.utils.compilation_time_metrics``).

Each system's first step runs in a fresh process of its own (Inductor keeps compiled kernels in
memory, fxshard its plans: a deeper model measured after a shallower one would reuse them; and
torch initializes much lazily, so the second system measured in a process ran faster: 0.94 and
0.96 fxshard / FSDP2 with FSDP2 first, 1.05 and 1.08 with fxshard first, at 1 layer), after a
warm-up (imports, Inductor's first compile); the two processes of a row alternate in which goes
first. Besides wall times the table gives the
CPU seconds of each step 1 (this process and the C++ compilers it waited for), which a loaded
machine inflates less. Inductor's caches are off and it compiles in this process (``compile_threads=1``), so both
compile from scratch on one core. The machine is shared and noisy: the table records the load.

``--warm``: what a user sees the second time a script runs. Inductor's caches are on (its defaults: the FX
graph cache and AOTAutograd's), in a fresh directory for the whole bench; each row runs twice, each time
in fresh processes, and the second is measured: both systems find their kernels in the caches the first
run filled, and fxshard loads each rank's lowered programs instead of running stages 1-5 (``load``:
backend/programs/lowered_cache.py; Dynamo's capture and the cut into regions run again).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
from typing import Any

# before torch reads its config: every run compiles from scratch (unless --warm), in this process
WARM = "--warm" in sys.argv
if not WARM:
    os.environ["TORCHINDUCTOR_FORCE_DISABLE_CACHES"] = "1"
os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"

import torch  # noqa: E402
from systems import cpu_seconds  # noqa: E402
from torch import nn  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

LLAMA = dict(vocab_size=2048, dim=256, n_heads=8, n_kv_heads=4, ffn_dim=768)
BATCH, SEQ, WORLD = 8, 128, 4
# fxshard's own stages; Dynamo's capture (torch's, as in every torch.compile) is reported beside them, not in them
OWN = ("load", "trace", "propagate", "refine", "plan", "split", "unfold", "localize", "lower", "regions")


def _model(layers: int, mesh: Any) -> nn.Module:
    from models.llama import Llama, LlamaConfig

    torch.manual_seed(0)
    return Llama(LlamaConfig(n_layers=layers, **LLAMA))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, LLAMA["vocab_size"], (BATCH, SEQ), generator=g),
            torch.randint(0, LLAMA["vocab_size"], (BATCH, SEQ), generator=g))


def fxshard_compile(layers: int, mesh: Any, regional: bool = True) -> dict:
    """The first step of ``fxshard.compile(model.loss)``: its wall time and the time of each stage."""
    import fxshard
    from fxshard.timing import STAGES
    from models.llama import fsdp_placements
    from torch.distributed.tensor import Shard, distribute_tensor
    from train_llama import distribute_parameters

    model = _model(layers, mesh)
    distribute_parameters(model, mesh, fsdp_placements(model))
    compiled = fxshard.compile(model.loss, cost_model=fxshard.CostModel(), regional=regional)
    tokens, targets = (distribute_tensor(t, mesh, (Shard(0),)) for t in _data())
    torch._dynamo.utils.compilation_time_metrics.clear()
    start, cpu = time.perf_counter(), cpu_seconds()
    compiled(tokens, targets).backward()
    total, cpu = time.perf_counter() - start, cpu_seconds() - cpu
    times = compiled.last.reporter.times
    stages = {s: times.get(s, 0.0) for s in STAGES}
    stages["load"] = times.get("loading the lowered programs", 0.0)  # a second run (--warm): stages 1-5 kept
    capture = times.get("capturing the function with Dynamo", 0.0)
    inductor = sum(t for k, t in times.items() if "Inductor" in k)
    return {"total_s": total, "cpu_s": cpu, "stages_s": stages, "own_s": sum(stages.values()), "capture_s": capture,
            "dynamo_s": dynamo_seconds(), "inductor_s": inductor}


def fsdp2_compile(layers: int, mesh: Any) -> dict:
    """The first step of FSDP2 with each block compiled by Inductor: its wall time."""
    import torch.nn.functional as F
    from torch.distributed.fsdp import fully_shard

    model = _model(layers, mesh)
    for layer in model.layers:
        layer.compile()
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    tokens, targets = _data()
    mine = slice(0, BATCH // WORLD)  # rank 0's sequences
    torch._dynamo.utils.compilation_time_metrics.clear()
    start, cpu = time.perf_counter(), cpu_seconds()
    logits = model(tokens[mine])
    F.cross_entropy(logits.flatten(0, 1), targets[mine].flatten()).backward()
    return {"total_s": time.perf_counter() - start, "cpu_s": cpu_seconds() - cpu, "dynamo_s": dynamo_seconds()}


def dynamo_seconds() -> float:
    """Dynamo's own time since its metrics were cleared: its compiles less the backends they called (fxshard's
    capture calls one that only keeps the graph; FSDP2's blocks call Inductor)."""
    metrics = torch._dynamo.utils.compilation_time_metrics
    return sum(metrics.get("_compile.compile_inner", [])) - sum(metrics.get("OutputGraph.call_user_compiler", []))


def warm_up() -> None:
    """Imports and Inductor's first compile, paid once before any timing (not by the first row): with each
    of its wrappers, whose precompiled headers Inductor keeps on disk for every later process (fxshard
    compiles CPU programs with the C++ one, backend/inductor/cpu_wrapper.py; FSDP2's blocks use the Python one)."""
    from fxshard.backend.inductor.cpu_wrapper import cpu_wrapper_patches

    for patches in ({}, cpu_wrapper_patches()):
        with torch._inductor.config.patch(patches):
            torch.compile(lambda x: torch.relu(x) + 1)(torch.randn(4))
        torch._dynamo.reset()


def measure(layers: int, system: str, regional: bool = True) -> dict:
    """One system's first step (``fxshard`` or ``fsdp2``) at ``layers`` layers, with the load before and after."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
    load_before = os.getloadavg()[0]
    torch._dynamo.reset()
    result = fxshard_compile(layers, mesh, regional) if system == "fxshard" else fsdp2_compile(layers, mesh)
    return {"system": system, "result": result, "load_before": load_before, "load_after": os.getloadavg()[0]}


def tables(rows: list[dict]) -> str:
    lines = ["| layers | fxshard's stages (s) | Dynamo: fxshard's capture, FSDP2's (s) | Inductor in fxshard (s) | "
             "fxshard step 1 (s) | stages / step 1 | stages and capture / step 1 | FSDP2 step 1 (s) | fxshard / FSDP2 | "
             "CPU s: fxshard, FSDP2, ratio | load (1 min) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        f, d = r["fxshard"], r["fsdp2"]
        lines.append(f"| {r['layers']} | {f['own_s']:.1f} | {f['capture_s']:.1f}, {d['dynamo_s']:.1f} | "
                     f"{f['inductor_s']:.1f} | {f['total_s']:.1f} | {f['own_s'] / f['total_s']:.0%} | "
                     f"{(f['own_s'] + f['capture_s']) / f['total_s']:.0%} | {d['total_s']:.1f} | "
                     f"{f['total_s'] / d['total_s']:.2f} | "
                     f"{f['cpu_s']:.1f}, {d['cpu_s']:.1f}, {f['cpu_s'] / d['cpu_s']:.2f} | "
                     f"{r['load_before']:.1f} -> {r['load_after']:.1f} |")
    lines += ["", "| layers | capture | " + " | ".join(OWN) + " |", "|---" * (len(OWN) + 2) + "|"]
    for r in rows:
        lines.append(f"| {r['layers']} | {r['fxshard']['capture_s']:.2f} | "
                     + " | ".join(f"{r['fxshard']['stages_s'][s]:.2f}" for s in OWN) + " |")
    return "\n".join(lines)


def one_row(layers: int, system: str, regional: bool = True) -> dict:
    """One system's part of a row, in this process: a fake process group, the warm-up, its first step."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import fxshard  # noqa: F401 (registers the backend's ops before any timing)

    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    try:
        warm_up()
        return measure(layers, system, regional)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--no-regional", action="store_true", help="fxshard compiles whole programs")
    parser.add_argument("--warm", action="store_true", help="Inductor's caches on and filled by a first run")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a row's system in this process (a child)
    parser.add_argument("--system", choices=("fxshard", "fsdp2"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(one_row(args.one, args.system, not args.no_regional)))
        return
    flags = ["--no-regional"] * args.no_regional + ["--warm"] * args.warm
    with tempfile.TemporaryDirectory(prefix="fxshard-bench-inductor-") as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache) if args.warm else None
        rows = []
        for k, n in enumerate(args.layers):  # each system of each row in a fresh process (module docstring)
            row: dict[str, Any] = {"layers": n, "regional": not args.no_regional, "warm": args.warm}
            order = ("fxshard", "fsdp2") if k % 2 == 0 else ("fsdp2", "fxshard")
            for system in order:
                for _ in range(2 if args.warm else 1):  # warm: the first run fills Inductor's caches
                    run = subprocess.run([sys.executable, __file__, "--one", str(n), "--system", system] + flags,
                                         check=True, capture_output=True, text=True, env=env)
                part = json.loads(run.stdout.strip().splitlines()[-1])
                row[system] = part["result"]
                row.setdefault("load_before", part["load_before"])
                row["load_after"] = part["load_after"]
            row["first"] = order[0]
            rows.append(row)
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)  # a row as soon as it is measured
    print(json.dumps(rows, indent=1) if args.json else tables(rows))


if __name__ == "__main__":
    main()
