"""Training steps: fxshard vs DTensor + torch.compile(inductor), same model, placements and ranks.

    python bench/train.py           # 4 gloo ranks on CPU; prints a markdown table
    python bench/train.py --json
    python bench/train.py --no-bucketing   # fxshard's collectives as lowered (backend option bucketing=False)
    python bench/train.py --whole          # fxshard compiles whole programs (backend option regional=False)
    python bench/train.py --paired         # step times only: both systems in one job, steps alternated

Rows (Llama, ``LLAMA`` below, AdamW, batch ``BATCH`` x ``SEQ`` tokens; set up by bench/systems.py):

- TP (tp=4): torchtitan's Megatron plan through ``parallelize_module``, vocab-parallel logits; both
  systems compile the model's forward (fxshard: ``backend="fxshard"``, which compiles the joint
  program; DTensor: ``backend="inductor"``) and compute the loss outside it under ``loss_parallel()``.
- TP + SP (tp=4): the same with torchtitan's sequence parallelism (``SequenceParallel`` norms, the
  residual stream sharded on the sequence between the blocks).
- TP, fxshard's way (``tp_loss``, tp=4): DTensor's row as TP's; fxshard's as in the FSDP rows, the unchanged
  model with its parameters DTensors of the Megatron plan's shardings and ``fxshard.compile(model.loss)``:
  the vocab-parallel loss planned and compiled with the model rather than run by DTensor's
  ``loss_parallel()`` after it (the same global mean).
- FSDP in bf16 (``fsdp_bf16``, dp=4): FSDP's row with FSDP2's ``MixedPrecisionPolicy(bf16, fp32)`` and fxshard's
  ``MixedPrecision(bf16, fp32)``; TP in float8 (``tp_float8``, tp=4): TP's row with torchao's tensorwise float8
  ``Float8Linear`` projections (DTensor through torchao's float8 TP styles).
- FSDP (dp=4) and FSDP x TP (2 x 2): DTensor's way is FSDP2 (``fully_shard`` per block and the root,
  on top of the TP plan for 2-D) with each block compiled by Inductor, and torchtitan's loss (the
  rank's loss sum over an all-reduced count of the batch's valid tokens: the global mean, as
  fxshard's); fxshard's is the unchanged
  model whose parameters are DTensors with the same shardings, ``fxshard.compile(model.loss)``. Both
  read each rank's rows of the batch locally (fxshard: ``DTensor.from_local``, as a data loader would
  feed it), so no collective builds the batch.

Per system: compile time (the first step, which compiles; wall and, in brackets, rank 0's CPU seconds
with the C++ compilers it waited for, which the four ranks' waits for each other and for the cores do
not inflate), step time (median of the later steps),
collective calls per step and the bytes one rank receives per step. A step is forward, backward and
the optimizer's step: DTensor leaves some gradients Partial (TP+SP's norm weights) and the optimizer
reduces them. Calls are counted at runtime, on both systems the same way: the process-group ops
(``c10d::*``) the profiler records during one more compiled step, so what Inductor bucketed counts
once (fxshard's programs as lowered, one collective per redistribution, are given too). Bytes:
fxshard's are read from its lowered forward and backward programs; DTensor's are recorded by
``CommDebugMode`` around one eager forward and backward (bucketing merges collectives, it does not
change their bytes); both add what ``CommDebugMode`` records around an optimizer step. One formula
for both (``fxshard.backend.reports.traffic``).
fxshard plans with its default cost model (``CostModel()``: 10 us and 100 GB/s a collective; a
training plan's moves of one block's parameters, and of its gradients, priced as the one call each
becomes). Until refinement priced blocks so, this bench used a bandwidth-only model (the default
then planned FSDP as a replicated batch); now the bandwidth-only model keeps the output projection
vocab-sharded at this size (8% fewer bytes, 17 calls against 9).
Inductor's caches are off, so both systems compile from scratch. The machine is small and noisy:
read the ratios, not the absolute times.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time
from typing import Any

import torch
from torch import nn

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "bench"))

LLAMA = dict(vocab_size=2048, dim=256, n_layers=2, n_heads=8, n_kv_heads=4, ffn_dim=768)
BATCH, SEQ, STEPS = 8, 128, 6
PAIRS = 20  # --paired: pairs of alternated steps, one of each system
CASES = ("tp", "tp_sp", "tp_loss", "fsdp", "fsdp_tp", "fsdp_bf16", "tp_float8")


def _counts_bytes(calls: list) -> tuple[dict[str, int], int]:
    from fxshard.backend.reports.traffic import summarize

    return summarize(calls)


def runtime_collectives(step: Any) -> dict[str, int]:
    """Collective calls ``step()`` makes on the process group, by kind: the c10d ops the profiler records
    (a functional collective and a ``torch.distributed`` call each end in one; a bucket is one call)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    counts: dict[str, int] = {}
    for event in prof.events():
        kind = _c10d_kind(event.name)
        if kind is not None:
            counts[kind] = counts.get(kind, 0) + 1
    return counts


def _c10d_kind(name: str) -> str | None:
    """A profiler event's collective kind: c10d::_allgather_base_ -> all_gather; None for anything else."""
    if not name.startswith("c10d::"):
        return None
    for part, kind in (("allgather", "all_gather"), ("reduce_scatter", "reduce_scatter"), ("allreduce", "all_reduce"),
                       ("alltoall", "all_to_all"), ("broadcast", "broadcast"), ("scatter", "scatter")):
        if part in name:
            return kind
    return None if "barrier" in name else name


def _data(config: Any, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return (torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=g),
            torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=g))


def _build(case: str, system: str, mesh: Any, config: Any, options: dict) -> tuple[nn.Module, Any, Any]:
    """(model, step function (tokens, targets) -> loss, what fxshard compiled: the collectives of its
    lowered programs by stage (tp) or its compiled function; None for DTensor) (bench/systems.py)."""
    import fxshard
    from fxshard.backend.reports.traffic import collective_calls
    from models.llama import Llama
    from systems import TP_CASES, build

    torch.manual_seed(0)
    graphs: dict = {}  # tp: the collectives of fxshard's lowered programs, by stage, read as they are reported
    on_graph = {"on_graph": lambda stage, gm: graphs.__setitem__(stage, collective_calls(gm))
                if stage.startswith("lower") else None}
    model, step, compiled = build(case, system, mesh, Llama(config),
                                  {"cost_model": fxshard.CostModel(), **options},
                                  tp_options=on_graph)
    return model, step, graphs if case in TP_CASES and compiled is None else compiled


def run(rank: int, world_size: int, device: str, case: str, system: str, options: dict | None = None) -> dict:
    import fxshard  # noqa: F401 (registers the op library on this rank)
    from comm import CommBytesMode
    from fxshard.backend.reports.traffic import collective_calls
    from models.llama import LlamaConfig
    from systems import adamw, case_mesh, cpu_seconds

    config = LlamaConfig(**LLAMA)
    mesh = case_mesh(case, world_size, device)
    model, step, compiled = _build(case, system, mesh, config, options or {})
    optimizer = adamw(model)
    times, losses = [], []
    for k in range(STEPS):
        tokens, targets = _data(config, k)
        start, cpu = time.perf_counter(), cpu_seconds()
        losses.append(step(tokens, targets))
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
        if k == 0:
            compile_cpu = cpu_seconds() - cpu
    first_loss = float(losses[0].full_tensor())  # the global mean on both systems: they train the same model

    def training_step() -> None:  # one more step, profiled, not timed: the optimizer's collectives count too
        step(*_data(config, STEPS))
        optimizer.step()

    calls = runtime_collectives(training_step)
    optimizer.zero_grad()
    lowered = None
    if system == "fxshard":
        if isinstance(compiled, dict):  # torch.compile(backend="fxshard"): the stages it reported
            sized = compiled["lower"] + compiled["lower_backward"]
        else:
            sized = collective_calls(compiled.last.forward_graph) + collective_calls(compiled.last.backward_graph)
        lowered = _counts_bytes(sized)[0]
    else:
        tokens, targets = _data(config, 0)
        with CommBytesMode() as mode:
            torch._dynamo.config.disable = True
            try:
                step(tokens, targets)
            finally:
                torch._dynamo.config.disable = False
        optimizer.zero_grad()
        sized = mode.calls
    step(*_data(config, STEPS + 1))
    with CommBytesMode() as mode:  # a gradient left Partial (DTensor's TP+SP norms) is reduced by the optimizer
        optimizer.step()
    optimizer.zero_grad()
    nbytes = _counts_bytes(list(sized) + mode.calls)[1]
    return {"compile_s": times[0], "compile_cpu_s": compile_cpu, "step_s": statistics.median(times[1:]),
            "counts": calls, "lowered": lowered,
            "bytes": nbytes, "first_loss": first_loss}


def run_paired(rank: int, world_size: int, device: str, case: str, options: dict | None = None) -> dict:
    """Both systems built and compiled in this job on the one mesh, then their steps alternated
    (``systems.alternated``: ``PAIRS`` pairs). Compile times are not read here: the second system
    compiled in a process finds torch initialized."""
    import fxshard  # noqa: F401 (registers the op library on this rank)
    from models.llama import LlamaConfig
    from systems import adamw, alternated, case_mesh

    config = LlamaConfig(**LLAMA)
    mesh = case_mesh(case, world_size, device)
    built = {}
    for system in ("fxshard", "dtensor"):
        model, step, _ = _build(case, system, mesh, config, options or {})
        built[system] = (step, adamw(model))

    def timed(system: str, k: int) -> float:
        step, optimizer = built[system]
        tokens, targets = _data(config, k)
        start = time.perf_counter()
        step(tokens, targets)
        optimizer.step()
        optimizer.zero_grad()
        return time.perf_counter() - start

    return alternated(timed, PAIRS)


def run_paired_rank(rank: int, world_size: int, device: str, case: str, options: dict | None = None) -> dict:
    from systems import reported

    return reported(run_paired, rank, case, "fxshard and dtensor", world_size, device, case, options)


def measure_paired(case: str, options: dict | None = None) -> dict:
    from ranks import spawn

    results = spawn(run_paired_rank, 4, 900.0, "cpu", case=case, options=options)
    return {"case": case, **results[0]}


def paired_table(rows: list[dict]) -> str:
    from systems import PAIRED_HEADER, paired_row

    return "\n".join([f"{PAIRS} pairs of steps alternated in one job per case", "", PAIRED_HEADER,
                      *map(paired_row, rows)])


def run_rank(rank: int, world_size: int, device: str, case: str, system: str, options: dict | None = None) -> dict:
    from systems import reported

    return reported(run, rank, case, system, world_size, device, case, system, options)


def measure(case: str, options: dict | None = None) -> dict:
    from ranks import spawn

    out = {"case": case}
    for system in ("fxshard", "dtensor"):
        results = spawn(run_rank, 4, 900.0, "cpu", case=case, system=system, options=options)
        out[system] = results[0]
    return out


def _ratio(a: dict, b: dict, key: str) -> str:
    if "error" in a or "error" in b or not b.get(key):
        return "n/a"
    return f"{a[key] / b[key]:.2f}"


def _loss(result: dict) -> str:
    return f"{result['first_loss']:.4f}" if "first_loss" in result else "n/a"


def table(rows: list[dict]) -> str:
    lines = ["| case | fxshard collective calls / step | DTensor collective calls / step | bytes ratio | "
             "step time ratio | compile time ratio (CPU) | step 1 loss fxshard, DTensor |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        f, d = r["fxshard"], r["dtensor"]

        def cell(x: dict) -> str:
            if "error" in x:
                return f"fails: {x['error']}"
            counts = ", ".join(f"{n} {k}" for k, n in sorted(x["counts"].items()))
            if x.get("lowered"):
                counts += f" ({sum(x['lowered'].values())} as lowered)"
            return f"{counts}; {x['bytes'] / 2**20:.2f} MiB; step {x['step_s'] * 1e3:.0f} ms; compile {x['compile_s']:.0f} s"
        lines.append(f"| {r['case']} | {cell(f)} | {cell(d)} | {_ratio(f, d, 'bytes')} | "
                     f"{_ratio(f, d, 'step_s')} | {_ratio(f, d, 'compile_s')} ({_ratio(f, d, 'compile_cpu_s')}) | "
                     f"{_loss(f)}, {_loss(d)} |")
    return "\n".join(lines)


def main() -> None:
    # compile times without Inductor's on-disk caches: every run compiles from scratch, both systems
    os.environ["TORCHINDUCTOR_FORCE_DISABLE_CACHES"] = "1"
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--case", choices=CASES, action="append")
    parser.add_argument("--no-bucketing", action="store_true", help="fxshard's backend option bucketing=False")
    parser.add_argument("--whole", action="store_true", help="fxshard's backend option regional=False")
    parser.add_argument("--paired", action="store_true", help="step times only, both systems in one job, their "
                        "steps alternated (run_paired)")
    args = parser.parse_args()
    options = {"bucketing": not args.no_bucketing, "regional": not args.whole}  # fxshard's backend options
    if args.paired:
        rows = [measure_paired(case, options) for case in (args.case or CASES)]
        print(json.dumps(rows, indent=1) if args.json else paired_table(rows))
        return
    rows = [measure(case, options) for case in (args.case or CASES)]
    print(json.dumps(rows, indent=1) if args.json else table(rows))


if __name__ == "__main__":
    main()
