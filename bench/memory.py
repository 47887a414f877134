"""Peak memory per rank of one training step: fxshard vs DTensor + Inductor, a Llama of >= 1.5 GiB.

    python bench/memory.py                      # every case, 4 gloo ranks on CPU; prints a markdown table
    python bench/memory.py --case fsdp --json

Model: ``LLAMA`` below (examples/models/llama.py; its exact fp32 size is printed), batch
``BATCH`` x ``SEQ`` tokens. Each system is set up as bench/train.py sets it up, by bench/systems.py (TP: torchtitan's plan
through ``parallelize_module``, the model compiled by ``backend="fxshard"`` or ``"inductor"``, the loss
outside under ``loss_parallel``; FSDP and FSDP x TP: FSDP2, ``fully_shard`` per block and the root,
each block compiled by Inductor, against ``fxshard.compile(model.loss)`` on DTensor parameters with
the same shardings). Parameters are built on the meta device and materialized shard by shard, so
no rank ever holds the whole model. No optimizer: a step is forward + backward, gradients set to
None before it (as ``optimizer.zero_grad()`` leaves them), so its peak is what the two systems do
differently: gathered parameters, activations, gradients, communication buffers.

Method. Each system runs in fresh processes (one per rank), one system at a time. Two steps run
first (the first compiles), then two measured steps, each after a barrier:

- tensor bytes (the table's main figure): the profiler's memory events (``profile_memory=True``,
  every allocation and free of torch's CPU allocator on the calling thread, time-ordered); the
  peak of their running sum is the most bytes of tensors the step held at once beyond what it
  started with. It is exact, independent of malloc's caching, and sees Inductor's buffers and the
  collectives' outputs (allocated by the caller); it misses scratch a gloo worker thread allocates.
- RSS: the peak resident set during the step (VmHWM, its mark reset just before) minus VmRSS just
  before (bench/load.py's way). glibc keeps freed heap memory resident, which would hide what the
  warm-up steps already touched, so the ranks run with ``MALLOC_MMAP_THRESHOLD_`` fixed at 64 KiB:
  every tensor of that size is mapped on allocation and unmapped on free. It sees everything
  (gloo's scratch too), and with it noise: Python objects, the profiler-free step's own bookkeeping.

"per rank" is the busiest rank's (the maximum over ranks). "peak" adds the rank's parameter shards
(live throughout, equal on both systems) to the step's tensor-byte increase. fxshard's estimate is
``fxshard.memory.step_memory`` of its planned forward and backward graphs (``peak``: the forward's
peak, or what the forward keeps plus the backward's peak; before Inductor's fusion).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import sys
from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "bench"))

LLAMA = dict(vocab_size=40960, dim=2048, n_layers=4, n_heads=16, n_kv_heads=8, ffn_dim=8192)
SMALL = dict(vocab_size=2048, dim=256, n_layers=2, n_heads=8, n_kv_heads=4, ffn_dim=768)  # --small: a quick check
BATCH, SEQ = 4, 64  # the batch splits over dp=4: FSDP2 needs a sequence per rank
CASES = ("fsdp", "tp", "tp_sp", "fsdp_tp")
MIB = 2**20


def model_bytes(config: Any) -> int:
    """The model's fp32 parameter bytes, counted on the meta device."""
    from models.llama import Llama

    with torch.device("meta"):
        model = Llama(config)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _materialize(model: nn.Module) -> None:
    """Allocate each rank's parameter shards (the model was sharded on meta) and fill them as Llama would."""
    model.to_empty(device="cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            local.fill_(1.0) if name.endswith("norm.weight") else local.normal_(0.0, 0.02)


def _data(config: Any, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return (torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=g),
            torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=g))


def _build(case: str, system: str, mesh: Any, config: Any) -> tuple[nn.Module, Callable, dict]:
    """(model, step (tokens, targets) -> loss, planned graphs {"forward", "backward"} once compiled (fxshard)),
    the model built on meta and its shards allocated where they lie (bench/systems.py)."""
    import fxshard
    from models.llama import Llama
    from systems import build

    with torch.device("meta"):
        model = Llama(config)
    planned: dict = {}
    on_graph = {"on_graph": lambda stage, gm: planned.__setitem__(stage.removeprefix("plan_"), gm)
                if stage in ("plan_forward", "plan_backward") else None}
    model, step, compiled = build(case, system, mesh, model, {"cost_model": fxshard.CostModel()},
                                  tp_options=on_graph, materialize=_materialize)
    if compiled is None:
        return model, step, planned

    def fx_step(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = step(tokens, targets)
        planned.update(forward=compiled.last.plan.forward, backward=compiled.last.plan.backward)
        return loss
    return model, fx_step, planned


def tensor_peak(step: Callable[[], Any]) -> int:
    """Most bytes of CPU tensors ``step()`` holds at once beyond what it started with: the running sum of
    the profiler's allocation (+) and free (-) events, in time order."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def rss_peak(step: Callable[[], Any]) -> int:
    """Peak resident bytes during ``step()`` minus the resident bytes just before (VmHWM after a reset)."""
    from load import reset_peak_rss, status_mib

    before = reset_peak_rss()
    step()
    return int((status_mib("VmHWM") - before) * MIB)


def run(rank: int, world_size: int, device: str, case: str, system: str, llama: dict) -> dict:
    import torch.distributed as dist

    import fxshard  # noqa: F401 (registers fxshard's ops on this rank)
    from fxshard.memory import step_memory
    from models.llama import LlamaConfig
    from systems import case_mesh

    config = LlamaConfig(**llama)
    mesh = case_mesh(case, world_size, device)
    model, step, planned = _build(case, system, mesh, config)
    for k in range(2):  # the first step compiles, the second runs warm
        step(*_data(config, k))
        model.zero_grad(set_to_none=True)
    measured = {}
    for k, (name, measure) in enumerate((("rss", rss_peak), ("tensors", tensor_peak))):
        gc.collect()
        dist.barrier()
        measured[name] = measure(lambda: step(*_data(config, 2 + k)))
        model.zero_grad(set_to_none=True)
    params = sum((p.to_local() if isinstance(p, DTensor) else p).numel() * 4 for p in model.parameters())
    out = {"params": params, **measured}
    if planned:
        est = step_memory(planned["forward"], planned["backward"])
        out["estimate"] = {"forward": int(est.forward_peak), "kept": int(est.kept), "backward": int(est.backward_peak),
                           "peak": int(est.peak)}
    return out


def run_rank(rank: int, world_size: int, device: str, case: str, system: str, llama: dict) -> dict:
    from systems import reported

    return reported(run, rank, case, system, world_size, device, case, system, llama)


def measure(case: str, llama: dict) -> dict:
    """Both systems on one case, one after the other; per system the busiest rank's figures."""
    from ranks import spawn

    out: dict = {"case": case}
    for system in ("fxshard", "dtensor"):
        results = list(spawn(run_rank, 4, 1800.0, "cpu", case=case, system=system, llama=llama).values())
        errors = [r for r in results if "error" in r]
        if errors:
            out[system] = errors[0]
            continue
        busiest = {key: max(r[key] for r in results) for key in ("params", "rss", "tensors")}
        if "estimate" in results[0]:
            busiest["estimate"] = {k: max(r["estimate"][k] for r in results) for k in results[0]["estimate"]}
        busiest["per_rank"] = [{k: r[k] for k in ("rss", "tensors")} for r in results]
        out[system] = busiest
    return out


def table(rows: list[dict]) -> str:
    lines = ["| case | params / rank | fxshard step (tensors / RSS) | DTensor step (tensors / RSS) | "
             "fxshard estimate | peak ratio (params + step) | step ratio (tensors / RSS) |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        f, d = r["fxshard"], r["dtensor"]
        if "error" in f or "error" in d:
            lines.append(f"| {r['case']} | | {f.get('error', '')} | {d.get('error', '')} | | | |")
            continue
        est = f.get("estimate", {}).get("peak")
        lines.append(
            f"| {r['case']} | {f['params'] / MIB:.0f} MiB | {f['tensors'] / MIB:.0f} / {f['rss'] / MIB:.0f} MiB | "
            f"{d['tensors'] / MIB:.0f} / {d['rss'] / MIB:.0f} MiB | "
            f"{est / MIB if est is not None else float('nan'):.0f} MiB | "
            f"{(f['params'] + f['tensors']) / (d['params'] + d['tensors']):.2f} | "
            f"{f['tensors'] / d['tensors']:.2f} / {f['rss'] / d['rss']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    from models.llama import LlamaConfig

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=CASES, action="append")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--small", action="store_true", help=f"the model {SMALL}: a check of the bench, minutes")
    args = parser.parse_args()
    llama = SMALL if args.small else LLAMA
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(64 * 1024)  # read by glibc when each rank starts (see above)
    size = model_bytes(LlamaConfig(**llama))
    print(f"Llama {llama}: {size} B of fp32 parameters ({size / 2**30:.3f} GiB); batch {BATCH} x {SEQ} tokens; "
          "4 gloo ranks; forward + backward, no optimizer", flush=True)
    rows = []
    for case in args.case or CASES:
        rows.append(measure(case, llama))
        print(json.dumps(rows[-1]), flush=True)
    print(json.dumps(rows, indent=1) if args.json else table(rows))


if __name__ == "__main__":
    main()
