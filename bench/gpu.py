"""One GPU: fxshard's training programs through Inductor's GPU kernels, against DTensor (+ FSDP2) there.

    python bench/gpu.py                         # CUDA; both parts; markdown tables
    python bench/gpu.py --json
    python bench/gpu.py --device cpu --small    # a check of the bench itself where there is no GPU
    python bench/gpu.py --paired                # step times only: both systems in one process, steps alternated

One GPU runs no job of several NCCL ranks, so the bench has two parts, each on the GPU:

- **numerics**: a training step (loss and every parameter's gradient) of each case on 4 simulated
  ranks (``fxshard.simulate(..., grad=True)``: every rank's lowered local program runs on the GPU,
  the collectives done in this process), against the one-GPU step of the unsharded model: the
  largest relative error (``|a - b|.max() / |b|.max()``) over the loss and the gradients.
- **speed**: rank 0 of a fake process group of 4 on the GPU (collectives move nothing: a step is the
  rank's compute and its kernel launches), each case set up on both systems as bench/train.py sets
  them up (bench/systems.py): compile time (the first step), step time (median of the later steps,
  synchronized), peak GPU memory, collective calls per step (the c10d ops the profiler records), and
  in fxshard's generated wrapper code the Triton kernels and, for each collective, how many kernels
  are launched between its start and its wait (0: the wait directly follows it, nothing overlaps);
  and where the first step's Triton kernels were compiled: in Inductor's worker pool, or in this
  process, one after another, because the pool was not up yet.

Each case runs in its own process (Inductor's in-memory kernels and fxshard's plan caches would
otherwise carry over). Inductor's caches are off: both systems compile from scratch.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import time
from typing import Any, Iterator

os.environ["TORCHINDUCTOR_FORCE_DISABLE_CACHES"] = "1"

import torch  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "bench"))

CASES = ("tp", "tp_sp", "fsdp", "fsdp_tp")
WORLD = 4
# big enough that a step is GPU work, not launches; bench/train.py's model at --small
GPU_LLAMA = dict(vocab_size=8192, dim=1024, n_layers=4, n_heads=16, n_kv_heads=8, ffn_dim=2816)
GPU_BATCH, GPU_SEQ = 8, 512
SMALL_LLAMA = dict(vocab_size=2048, dim=256, n_layers=2, n_heads=8, n_kv_heads=4, ffn_dim=768)
SMALL_BATCH, SMALL_SEQ = 8, 128
NUMERICS_LLAMA = dict(vocab_size=1024, dim=256, n_layers=2, n_heads=8, n_kv_heads=4, ffn_dim=512)
STEPS = 8
PAIRS = 20  # --paired: pairs of alternated steps, one of each system


def sizes(small: bool) -> tuple[dict, int, int]:
    return (SMALL_LLAMA, SMALL_BATCH, SMALL_SEQ) if small else (GPU_LLAMA, GPU_BATCH, GPU_SEQ)


# ---------------------------------------------------------------------------------------------- numerics

def numerics(case: str, device: str) -> dict:
    """The largest relative error of one training step on 4 simulated ranks against one device."""
    import copy

    import fxshard
    from fxshard.backend.simulate import fake_world
    from models.llama import Llama, LlamaConfig, fsdp_placements, fsdp_tp_placements, megatron_placements
    from models.llama import tensor_parallel_plan
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import parallelize_module

    config = LlamaConfig(**NUMERICS_LLAMA)
    torch.manual_seed(int(time.time()))  # fresh random weights and data on every run
    model = Llama(config).to(device)
    x, y = (torch.randint(0, config.vocab_size, (8, 64), device=device) for _ in range(2))
    want = model.loss(x, y)
    want.backward()
    want_grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad()
    bandwidth = fxshard.CostModel(default_latency=0.0)
    if case == "tp_sp":
        sharded = copy.deepcopy(model)
        with fake_world(fxshard.MeshSpec(tp=WORLD), device) as mesh:
            with LocalTensorMode(WORLD):
                parallelize_module(sharded, mesh, tensor_parallel_plan(sharded, sequence_parallel=True,
                                                                       loss_parallel=False))
                targets = distribute_tensor(y, mesh, [Replicate()])
            loss, grads = fxshard.simulate(sharded.loss, x, targets, grad=True)
    else:
        if case == "tp":
            mesh, placements = fxshard.MeshSpec(tp=WORLD), megatron_placements(model)
        elif case == "fsdp":
            batch = (Shard(0),)
            mesh, placements = fxshard.MeshSpec(dp=WORLD), {**fsdp_placements(model), 0: batch, 1: batch}
        else:
            batch = (Shard(0), Replicate())
            mesh = fxshard.MeshSpec(dp=2, tp=WORLD // 2)
            placements = {**fsdp_tp_placements(model), 0: batch, 1: batch}
        loss, grads = fxshard.simulate(model.loss, x, y, mesh=mesh, placements=placements, grad=True,
                                       cost_model=bandwidth)
    assert loss.device.type == device, f"the simulated loss is on {loss.device}, not {device}"
    assert set(grads) == set(want_grads), sorted(set(grads) ^ set(want_grads))

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        a, b = a.detach().double(), b.detach().double()
        return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
    errors = {"loss": rel(loss, want), **{n: rel(grads[n], g) for n, g in want_grads.items()}}
    worst = max(errors, key=errors.get)
    return {"case": case, "max_rel_error": errors[worst], "worst": worst, "values": len(errors),
            "finite": all(v == v for v in errors.values())}


# ---------------------------------------------------------------------------------------------- speed

def wrapper_overlap(codes: list[str]) -> dict:
    """Of Inductor's generated wrapper code: Triton kernels defined, kernel launches, collectives started,
    waits on a program input (a collective started before this program: prefetched, or waited later
    by fxshard's regions), and for every collective started and waited in one program the launches
    between its start and its wait."""
    kernels = sum(len(re.findall(r"^def triton_", code, re.M)) for code in codes)
    launch = re.compile(r"\.run\(|extern_kernels\.\w+\(|^\s*cpp_fused_\w+\(")
    call = re.compile(r"torch\.ops\._c10d_functional\.(\w+)\.default\((?:reinterpret_tensor\()?(\w+)")
    between: list[int] = []
    launches = starts = waits_on_inputs = 0
    for code in codes:
        pending: dict[str, int] = {}  # buffer a collective writes -> launches seen since it started
        for line in code.splitlines():
            found = None if line.lstrip().startswith("#") else call.search(line)
            if found and found.group(1) != "wait_tensor":
                # out of place (buf = op(x)), into out= or in place (all_reduce_(buf)): the buffer waited on
                assigned, out = re.match(r"^\s*(\w+)\s*=", line), re.search(r"out=(?:reinterpret_tensor\()?(\w+)", line)
                starts += 1
                pending[(assigned or out or found).group(1) if (assigned or out) else found.group(2)] = 0
            elif found:
                name = found.group(2)
                if name in pending:
                    between.append(pending.pop(name))
                elif re.fullmatch(r"arg\d+_\d+", name):
                    waits_on_inputs += 1
            elif launch.search(line):
                launches += 1
                for name in pending:
                    pending[name] += 1
    return {"triton_kernels": kernels, "launches": launches, "starts": starts, "waits_on_inputs": waits_on_inputs,
            "waits": len(between), "waits_right_after_start": sum(1 for b in between if b == 0),
            "launches_between_median": statistics.median(between) if between else None}


def device_kernels(step: Any) -> dict:
    """The GPU kernels one ``step()`` runs: how many, their summed time, and the costliest by name."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name[:70], []).append(e.device_time)
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:12]
    return {"kernels_per_step": len(kernels), "kernel_ms": sum(e.device_time for e in kernels) / 1e3,
            "top_kernels": [[name, len(ts), round(sum(ts) / 1e3, 3)] for name, ts in top]}


def speed(case: str, system: str, device: str, small: bool, regional: bool = True) -> dict:
    """Rank 0 of a fake process group of 4 on ``device``: one case on one system."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch._inductor.utils import run_and_get_code

    import fxshard
    from models.llama import Llama, LlamaConfig
    from systems import adamw, build, case_mesh
    from train import runtime_collectives

    llama, batch, seq = sizes(small)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    try:
        mesh = case_mesh(case, WORLD, device)
        config = LlamaConfig(**llama)
        torch.manual_seed(0)
        model = Llama(config).to(device)
        model, step, _ = build(case, system, mesh, model, {"cost_model": fxshard.CostModel(),
                                                            "regional": regional})
        optimizer = adamw(model)

        def data(k: int) -> tuple[torch.Tensor, torch.Tensor]:
            g = torch.Generator().manual_seed(k)
            return tuple(torch.randint(0, config.vocab_size, (batch, seq), generator=g).to(device) for _ in range(2))

        def training_step(k: int) -> None:
            step(*data(k))
            optimizer.step()
            optimizer.zero_grad()

        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        sync()
        start = time.perf_counter()
        with where_triton_compiles() as where:
            _, codes = run_and_get_code(lambda: training_step(0))
        sync()
        compile_s = time.perf_counter() - start
        times = []
        for k in range(1, STEPS):
            start = time.perf_counter()
            training_step(k)
            sync()
            times.append(time.perf_counter() - start)
        peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
        calls = runtime_collectives(lambda: training_step(STEPS))
        out = {"case": case, "system": system, "compile_s": compile_s, "step_s": statistics.median(times),
               "step_spread_s": [min(times), max(times)], "peak_bytes": peak, "counts": calls,
               "triton_compiled_in": dict(where)}
        if device == "cuda":
            out.update(device_kernels(lambda: training_step(STEPS + 1)))
        out.update(wrapper_overlap(codes))
        if codes:
            out["code_chars"] = sum(len(c) for c in codes)
            dump = os.environ.get("GPU_BENCH_CODE_DIR")
            if dump:
                pathlib.Path(dump, f"{case}_{system}_{device}.py").write_text("\n\n# ---- next program ----\n\n".join(codes))
        return out
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def where_triton_compiles() -> Iterator[collections.Counter]:
    """Counts of the Triton kernels Inductor compiled in its worker pool ("workers") and in this process
    ("process": the pool was not up yet) within the block."""
    from torch._inductor.async_compile import AsyncCompile

    where: collections.Counter = collections.Counter()
    triton = AsyncCompile.triton

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        where["workers" if AsyncCompile.use_process_pool() else "process"] += 1
        return triton(self, *args, **kwargs)

    AsyncCompile.triton = counted
    try:
        yield where
    finally:
        AsyncCompile.triton = triton


def paired(case: str, device: str, small: bool, regional: bool = True) -> dict:
    """Both systems' steps of one case alternated in one process (rank 0 of a fake group of 4;
    ``systems.alternated``): a host-bound step moves with the machine's speed, which drifted between
    processes minutes apart (runs 7 and 8: the same case's ratio 0.56 and 0.90). No compile time or peak
    memory here: the second system compiled in a process finds torch initialized and the first's memory held."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import fxshard
    from models.llama import Llama, LlamaConfig
    from systems import adamw, alternated, build, case_mesh

    llama, batch, seq = sizes(small)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    try:
        mesh = case_mesh(case, WORLD, device)
        config = LlamaConfig(**llama)
        built = {}
        for system in ("fxshard", "dtensor"):
            torch.manual_seed(0)
            model, step, _ = build(case, system, mesh, Llama(config).to(device),
                                   {"cost_model": fxshard.CostModel(), "regional": regional})
            built[system] = (step, adamw(model))
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

        def timed(system: str, k: int) -> float:
            step, optimizer = built[system]
            g = torch.Generator().manual_seed(k)
            tokens, targets = (torch.randint(0, config.vocab_size, (batch, seq), generator=g).to(device) for _ in range(2))
            sync()
            start = time.perf_counter()
            step(tokens, targets)
            optimizer.step()
            optimizer.zero_grad()
            sync()
            return time.perf_counter() - start

        return {"case": case, **alternated(timed, PAIRS)}
    finally:
        dist.destroy_process_group()


def paired_table(device_name: str, rows: list[dict]) -> str:
    from systems import PAIRED_HEADER, paired_row

    return "\n".join([f"device: {device_name}; torch {torch.__version__}; {PAIRS} pairs of steps alternated in one "
                      "process per case", "", PAIRED_HEADER, *map(paired_row, rows)])


# ---------------------------------------------------------------------------------------------- driver

def child(kind: str, args: list[str]) -> dict:
    """``kind`` (numerics or speed) in a fresh process; an error becomes the row's ``error``."""
    try:
        run = subprocess.run([sys.executable, __file__, "--one", kind, *args], capture_output=True, text=True,
                             timeout=600)
    except subprocess.TimeoutExpired:
        return {"error": "timed out after 600 s"}
    if run.returncode != 0:
        tail = (run.stderr or run.stdout).strip().splitlines()[-3:]
        return {"error": " | ".join(tail)[-400:]}
    return json.loads(run.stdout.strip().splitlines()[-1])


def mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.0f}"


def tables(device_name: str, numeric_rows: list[dict], speed_rows: list[dict]) -> str:
    lines = [f"device: {device_name}; torch {torch.__version__}", "",
             "| case | max relative error (loss, every gradient) | worst | values compared |", "|---|---|---|---|"]
    for r in numeric_rows:
        if "error" in r:
            lines.append(f"| {r.get('case', '?')} | fails: {r['error']} | | |")
        else:
            lines.append(f"| {r['case']} | {r['max_rel_error']:.2e} | {r['worst']} | {r['values']} |")
    lines += ["", "| case | system | calls / step | step ms (min-max) | compile s | peak MiB | Triton kernels | "
              "collectives started in it | waits on an input | waits right after start / waits | launches between (median) | "
              "Triton compiled in workers / in this process |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in speed_rows:
        if "error" in r:
            lines.append(f"| {r['case']} | {r['system']} | fails: {r['error']} | | | | | | | | | |")
            continue
        counts = ", ".join(f"{n} {k}" for k, n in sorted(r["counts"].items())) or "0"
        lo, hi = r["step_spread_s"]
        overlap = (f"{r['triton_kernels']} | {r['starts']} | {r['waits_on_inputs']} | "
                   f"{r['waits_right_after_start']} / {r['waits']} | {r['launches_between_median']} | "
                   f"{r['triton_compiled_in'].get('workers', 0)} / {r['triton_compiled_in'].get('process', 0)}")
        lines.append(f"| {r['case']} | {r['system']} | {counts} | {r['step_s'] * 1e3:.1f} ({lo * 1e3:.1f}-{hi * 1e3:.1f}) | "
                     f"{r['compile_s']:.1f} | {mib(r['peak_bytes'])} | {overlap} |")
    lines += ["", "| case | step time fxshard / DTensor | compile fxshard / DTensor | peak memory fxshard / DTensor |",
              "|---|---|---|---|"]
    by = {(r["case"], r["system"]): r for r in speed_rows}
    for case in dict.fromkeys(r["case"] for r in speed_rows):
        f, d = by.get((case, "fxshard"), {}), by.get((case, "dtensor"), {})

        def ratio(key: str) -> str:
            return f"{f[key] / d[key]:.2f}" if f.get(key) and d.get(key) else "n/a"
        lines.append(f"| {case} | {ratio('step_s')} | {ratio('compile_s')} | {ratio('peak_bytes')} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help=f"bench/train.py's model {SMALL_LLAMA}")
    parser.add_argument("--case", choices=CASES, action="append")
    parser.add_argument("--system", choices=("fxshard", "dtensor"), action="append")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--no-numerics", action="store_true")
    parser.add_argument("--whole", action="store_true", help="fxshard's option regional=False: Inductor compiles "
                        "the whole local program, embedding and output projection included")
    parser.add_argument("--paired", action="store_true", help="step times only: both systems in one process per "
                        "case, their steps alternated (paired)")
    parser.add_argument("--one", nargs="+", help=argparse.SUPPRESS)  # a child: numerics CASE | speed CASE SYSTEM
    args = parser.parse_args()
    if args.one:
        import fxshard  # noqa: F401 (registers the backend)

        kind, case, *rest = args.one
        row = numerics(case, args.device) if kind == "numerics" else \
            paired(case, args.device, args.small, regional=not args.whole) if kind == "paired" else \
            speed(case, rest[0], args.device, args.small, regional=not args.whole)
        print(json.dumps(row))
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --device cpu (a check of the bench, no GPU figures)")
    flags = ["--device", args.device] + (["--small"] if args.small else []) + (["--whole"] if args.whole else [])
    cases = args.case or CASES
    name = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    if args.paired:
        rows = []
        for case in cases:
            rows.append({"case": case, **child("paired", [case, *flags])})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        print(json.dumps({"device": name, "paired": rows}, indent=1) if args.json else paired_table(name, rows))
        return
    numeric_rows = [] if args.no_numerics else [{"case": c, **child("numerics", [c, *flags])} for c in cases]
    for r in numeric_rows:
        print(json.dumps(r), file=sys.stderr, flush=True)
    speed_rows = []
    for case in cases:
        for system in args.system or ("fxshard", "dtensor"):
            speed_rows.append({"case": case, "system": system, **child("speed", [case, system, *flags])})
            print(json.dumps(speed_rows[-1]), file=sys.stderr, flush=True)
    print(json.dumps({"device": name, "numerics": numeric_rows, "speed": speed_rows}, indent=1) if args.json
          else tables(name, numeric_rows, speed_rows))


if __name__ == "__main__":
    main()
