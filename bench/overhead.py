"""Per-call runtime overhead of a compiled fxshard program, against DTensor and plain Inductor.

    python bench/overhead.py            # markdown tables (about 5 minutes on 2 busy cores)
    python bench/overhead.py --quick    # the MLP rows and the static-cache decode only
    python bench/overhead.py --json

Everything runs in one process per row, on a fake process group of 2 (this process is rank 0; the
collectives are dispatched but move nothing), one intra-op thread: what is measured is the fixed
cost of a call (Dynamo's guards, reading DTensor inputs, fxshard's runtime wrapper, building the
output DTensors) plus negligible compute, which decides the step time of small models on CPU.

- MLP rows: a tensor-parallel MLP (8 -> 16 -> 8, ColwiseParallel + RowwiseParallel on tp=2) on a
  4 x 8 input; per-call wall time, median of ``CALLS`` calls after warm-up, for DTensor eager,
  DTensor + ``torch.compile`` (Inductor), fxshard, and the unsharded module under Inductor.
  "plain output": the styles' default ``use_local_output=True``; "DTensor output": ``False``.
- decode rows: ``examples/generate.py``'s model, plan and sharded KV cache, greedy ``generate()``
  of ``NEW_TOKENS`` tokens for a batch of 2 after a prompt of 16; tokens/s is the median of
  ``REPEATS`` generate calls after one that compiles, and the programs compiled during those timed
  calls (fxshard's ``lower`` stages: a recompilation per token would show here).

Each figure is given as wall time and, in parentheses, this process's CPU time (``time.process_time``),
which a busy machine disturbs less. Ratios are fxshard / DTensor + Inductor, of times (MLP) and of
tokens/s (decode).
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
import warnings
from typing import Any, Callable

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
CALLS, NEW_TOKENS, PROMPT, BATCH, REPEATS = 500, 16, 16, 2, 3
SYSTEMS = ("dtensor", "dtensor_inductor", "fxshard", "local_inductor")
MLP_CASES = ("mlp_plain", "mlp_dtensor")
DECODE_CASES = ("decode_static", "decode_dynamic")


def fake_mesh(world_size: int = 2) -> Any:
    """A 1-D mesh 'tp' on a fake process group; this process is rank 0."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    return init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))


def per_call_us(fn: Callable[[], Any], calls: int = CALLS) -> tuple[float, float]:
    """(median wall time, mean CPU time) of one ``fn()`` in microseconds, after 10 warm-up calls. The
    CPU time of this process is what a busy machine disturbs least."""
    with torch.no_grad():
        for _ in range(10):
            fn()
        times = []
        cpu = time.process_time()
        for _ in range(calls):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        cpu = time.process_time() - cpu
    return statistics.median(times) * 1e6, cpu / calls * 1e6


def mlp_row(case: str, system: str) -> dict:
    """Per-call time of the tensor-parallel MLP under ``system``."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import fxshard.backend  # noqa: F401  (the backend, as torch.compile would import it)

    mesh = fake_mesh()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    local = case == "mlp_plain"
    if system != "local_inductor":
        parallelize_module(model, mesh, {"0": ColwiseParallel(use_local_output=local),
                                         "2": RowwiseParallel(use_local_output=local)})
    if system != "dtensor":
        model = torch.compile(model, backend="fxshard" if system == "fxshard" else "inductor")
    x = torch.randn(4, 8)
    wall, cpu = per_call_us(lambda: model(x))
    return {"case": case, "system": system, "us_per_call": wall, "cpu_us_per_call": cpu}


def decode_row(case: str, system: str) -> dict:
    """tokens/s of examples/generate.py's greedy decoding under ``system`` (one device for 'local')."""
    sys.path.insert(0, str(ROOT / "examples"))
    from generate import build_model, sharded_cache, tensor_parallel_plan
    from torch.distributed.tensor.experimental import implicit_replication
    from torch.distributed.tensor.parallel import parallelize_module

    import fxshard.backend  # noqa: F401  (lends DTensor fxshard's rules for CPU flash attention)

    warnings.filterwarnings("ignore")
    cache = case.split("_")[1]
    mesh = fake_mesh()
    model = build_model()
    torch.manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (BATCH, PROMPT))
    options = dict(attention_mask=torch.ones_like(ids), pad_token_id=model.config.eos_token_id,
                   max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    lowered: list[str] = []
    if system == "local_inductor":
        from transformers import DynamicCache, StaticCache

        model.forward = torch.compile(model.forward, backend="inductor")
        fresh: Callable[[], Any] = lambda: (  # noqa: E731
            StaticCache(config=model.config, max_cache_len=PROMPT + NEW_TOKENS) if cache == "static"
            else DynamicCache(config=model.config))
    else:
        parallelize_module(model, mesh, tensor_parallel_plan(model))
        if system != "dtensor":
            on_graph = {"on_graph": lambda stage, gm: lowered.append(stage) if stage == "lower" else None}
            model.forward = torch.compile(model.forward, backend="fxshard" if system == "fxshard" else "inductor",
                                          options=on_graph if system == "fxshard" else None)
        fresh = lambda: sharded_cache(model, mesh, cache, BATCH, PROMPT + NEW_TOKENS)  # noqa: E731
    with torch.no_grad(), implicit_replication():
        start = time.perf_counter()
        model.generate(ids, past_key_values=fresh(), **options)
        first = time.perf_counter() - start
        compiled_first = len(lowered)
        times, cpu = [], []
        for _ in range(REPEATS):
            kv = fresh()
            start, start_cpu = time.perf_counter(), time.process_time()
            model.generate(ids, past_key_values=kv, **options)
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
    return {"case": case, "system": system, "tokens_per_s": BATCH * NEW_TOKENS / statistics.median(times),
            "tokens_per_cpu_s": BATCH * NEW_TOKENS / statistics.median(cpu),
            "first_generate_s": first, "fxshard_programs_first": compiled_first,
            "fxshard_programs_timed": len(lowered) - compiled_first}


def one_row(case: str, system: str) -> dict:
    torch.set_num_threads(1)
    row = mlp_row(case, system) if case in MLP_CASES else decode_row(case, system)
    row["load_1min"] = os.getloadavg()[0]
    return row


def tables(rows: list[dict]) -> str:
    """The MLP table (us per call) and the decode table (tokens/s), each as wall time and CPU time,
    with fxshard's ratios to DTensor + Inductor."""
    by = {(r["case"], r["system"]): r for r in rows}
    head = "| DTensor eager | DTensor + Inductor | fxshard | {} | fxshard / DTensor+Inductor |"
    lines = ["| MLP, us per call: wall (CPU) " + head.format("local Inductor") + "", "|---" * 6 + "|"]
    for case in MLP_CASES:
        lines += _row(case, [by.get((case, s), {}) for s in SYSTEMS], "us_per_call", "cpu_us_per_call", "{:.0f}")
    lines += ["", "| decode, tokens/s: wall (per CPU s) " + head.format("one device, Inductor") +
              " fxshard programs: first generate, timed ones |", "|---" * 7 + "|"]
    for case in DECODE_CASES:
        found = _row(case, [by.get((case, s), {}) for s in SYSTEMS], "tokens_per_s", "tokens_per_cpu_s", "{:.0f}")
        fx = by.get((case, "fxshard"), {})
        lines += [line + f" {fx.get('fxshard_programs_first', '-')}, {fx.get('fxshard_programs_timed', '-')} |"
                  for line in found]
    loads = [r["load_1min"] for r in rows]
    lines += ["", f"load average (1 min) during the rows: {min(loads):.1f} to {max(loads):.1f}"]
    return "\n".join(lines)


def _row(case: str, cells: list[dict], wall: str, cpu: str, fmt: str) -> list[str]:
    """One table row (none if nothing was measured): each system's wall (CPU) figure, then fxshard's
    ratios to DTensor + Inductor."""
    if not any(cells):
        return []
    text = [f"{fmt.format(c[wall])} ({fmt.format(c[cpu])})" if c else "-" for c in cells]
    fx, ref = cells[2], cells[1]
    ratio = f"{fx[wall] / ref[wall]:.2f} ({fx[cpu] / ref[cpu]:.2f})" if fx and ref else "-"
    return [f"| {case} | " + " | ".join(text) + f" | {ratio} |"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="the MLP rows and the static-cache decode only")
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # a row in this process (the parent's child)
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(one_row(*args.one)))
        return
    cases = MLP_CASES + (DECODE_CASES[:1] if args.quick else DECODE_CASES)
    rows = []
    for case in cases:  # each row in a fresh process: Dynamo's caches are per code object, shared by models
        for system in args.systems:
            run = subprocess.run([sys.executable, __file__, "--one", case, system], capture_output=True, text=True)
            if run.returncode != 0:
                print(f"{case} / {system} failed:\n{run.stderr[-3000:]}", file=sys.stderr)
                continue
            rows.append(json.loads(run.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)  # a row as soon as it is measured
    print(json.dumps(rows, indent=1) if args.json else tables(rows))


if __name__ == "__main__":
    main()
