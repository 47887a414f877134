"""Collective bucketing and overlap: fxshard's own passes against torch's, on bench/train.py's training steps.

    python bench/overlap_passes.py                       # fsdp, tp, fsdp_tp at 2 layers; markdown
    python bench/overlap_passes.py --layers 2 4 --json
    python bench/overlap_passes.py --case fsdp --variant fxshard --variant torch_manual
    python bench/overlap_passes.py 2> rows.jsonl; python bench/overlap_passes.py --from-log rows.jsonl

torch 2.13 ships two passes that do the job of fxshard's buckets, prefetch and windows
(backend/inductor/buckets.py, bucket_traces.py, bucket_copies.py, collective_windows.py,
backend/layers/prefetch.py):

- ``schedule_overlap_bucketing`` (torch/_inductor/fx_passes/overlap_scheduling.py): a post-grad pass of
  Inductor's, on under ``config.aten_distributed_optimizations.enable_overlap_scheduling``
  (post_grad.py:391): it pre-buckets FSDP-like collectives (an all_gather of one graph input, a
  reduce_scatter flowing to an output) under a cap from its bandwidth model, buckets the others and
  schedules starts early and waits late from runtime estimates;
- ``manual_overlap_bucketing`` (overlap_manual_scheduling.py): called by no Inductor pass; one hands it
  the module paths to bucket (one bucket per module and kind) and it prefetches each module's gather a
  module ahead and defers its reduce_scatter's wait a module. It finds a node's module in
  ``nn_module_stack`` (graph_view.py:15-24) or a ``module_stack_fn``.

Variants (each in its own process: Inductor's config is global), on bench/systems.py's setups:

- ``fxshard``: fxshard as it is (``bucketing=True``);
- ``torch_auto``: ``bucketing=False`` and ``schedule_overlap_bucketing`` switched on through Inductor's
  config. On a CPU its estimates need two stand-ins: compute estimated by roofline, not benchmarked
  (``compute_estimator="analytical"``), and a memory bandwidth for the roofline (``CPU_DRAM_GBPS``:
  torch asks Triton for the GPU's, ``torch/_inductor/utils.py:3184``; ``torch_manual`` needs it too);
- ``torch_manual``: ``bucketing=False, regional=False`` and ``manual_overlap_bucketing`` as Inductor's
  ``post_grad_custom_post_pass``, the plan ``root, layers.0, ..., layers.{L-1}``. fxshard's lowered
  programs carry no ``nn_module_stack`` (their nodes' meta: ``val``, ``mutation_region_id``,
  ``fxshard_lowered_move``), so ``_ModulePlan`` gives the pass a ``module_stack_fn``: an all_gather's
  module from the parameter it reads (placeholders are named after parameters), a reduce_scatter's
  from the parameter whose gradient it makes (the backward returns one gradient per parameter input of
  the forward, in order). Whole programs only: cut into regions, a layer's program is compiled once
  for every layer and names none;
- ``none``: ``bucketing=False`` alone, the floor: each collective where fxshard lowered it.

One process, rank 0 of a fake process group of 4 (as bench/host.py): collectives cost nothing, so a
step's time is the compute and the per-call costs; the counts are exact. Per variant: collective
calls per step and the largest all_gather (the profiler's ``c10d::*`` events during one more step,
as bench/train.py counts them), compile time (the first step: wall and CPU), step time (median of
``STEPS`` later steps, CPU time of the process, one thread).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import re
import statistics
import subprocess
import sys
import time
from typing import Any

os.environ["TORCHINDUCTOR_FORCE_DISABLE_CACHES"] = "1"

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "bench"))

CASES = ("fsdp", "tp", "fsdp_tp")
VARIANTS = ("fxshard", "torch_auto", "torch_manual", "none")
STEPS = 8
CPU_DRAM_GBPS = 20  # the roofline's memory bandwidth on this CPU (torch's own asks Triton for a GPU's)


class _ModulePlan:
    """``manual_overlap_bucketing`` as Inductor's ``post_grad_custom_post_pass``, with the modules of
    fxshard's collectives read from parameter names (``module_stack_fn``). The forward is compiled
    first: its parameter placeholders name the backward's outputs."""

    def __init__(self, layers: int) -> None:
        self.plan = ["root", *(f"layers.{k}" for k in range(layers))]
        self.parameters: list[str] = []  # the forward's parameter inputs, in order
        self.tagged = 0  # collectives given a module, forward and backward

    def uuid(self) -> str:  # Inductor's FX graph cache asks (its caches are off here)
        return "overlap_passes._ModulePlan"

    def __call__(self, graph: Any) -> None:
        from torch._inductor.fx_passes.overlap_manual_scheduling import manual_overlap_bucketing

        inputs = [n.name for n in graph.nodes if n.op == "placeholder"]
        if not any(name.startswith(("saved_", "tangent")) for name in inputs):
            self.parameters = [name for name in inputs if not re.fullmatch(r"arg\d+", name)]
        _inputs_first(graph)
        manual_overlap_bucketing(graph.owning_module, self.plan, insert_overlap_deps=True,
                                 module_stack_fn=self._modules)

    def _modules(self, node: Any) -> list[tuple[str, type]]:
        name = None
        if "all_gather_into_tensor" in str(node.target):
            sources = _placeholders(node)
            name = sources[0] if len(sources) == 1 else None
        elif "reduce_scatter_tensor" in str(node.target):
            position = _output_position(node)
            name = self.parameters[position] if position is not None and position < len(self.parameters) else None
        if name is None:
            return []
        self.tagged += 1
        layer = re.match(r"(?:saved_)?layers_(\d+)_", name)
        return [(f"layers.{layer.group(1)}" if layer else "root", object)]


def _inputs_first(graph: Any) -> None:
    """Move ``graph``'s placeholders, in their order, before its first call: fxshard's lowered programs
    place an input where it is first read, and the pass's merges insert a bucket after its first member,
    before later members' inputs ("used before it has been defined")."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    first_call = next(n for n in graph.nodes if n.op != "placeholder")
    for node in placeholders:
        first_call.prepend(node)


def _placeholders(node: Any) -> list[str]:
    """The graph inputs ``node`` is computed from."""
    seen, stack, found = set(), [node], []
    while stack:
        for source in stack.pop().all_input_nodes:
            if source not in seen:
                seen.add(source)
                if source.op == "placeholder":
                    found.append(source.name)
                else:
                    stack.append(source)
    return found


def _output_position(node: Any) -> int | None:
    """The output ``node``'s value reaches through single-input ops, or None."""
    value = node
    while len(value.users) == 1:
        user = next(iter(value.users))
        if user.op == "output":
            positions = [k for k, a in enumerate(user.args[0]) if a is value]
            return positions[0] if len(positions) == 1 else None
        if len(user.all_input_nodes) != 1:
            return None
        value = user
    return None


def _switch_on(variant: str, layers: int) -> tuple[dict[str, Any], Any]:
    """(fxshard's options, the manual plan or None) of ``variant``, with Inductor's config set for it."""
    from torch._inductor import config

    import torch.utils._runtime_estimation as runtime_estimation

    if variant == "fxshard":
        return {}, None
    # both of torch's passes estimate runtimes by roofline on construction (OverlapScheduler.__init__)
    runtime_estimation.get_gpu_dram_gbps = lambda: CPU_DRAM_GBPS
    if variant == "torch_auto":
        optimizations = config.aten_distributed_optimizations
        optimizations.enable_overlap_scheduling = True
        optimizations.collective_bucketing = True
        optimizations.compute_estimator = "analytical"
        return {"bucketing": False}, None
    if variant == "torch_manual":
        plan = _ModulePlan(layers)
        config.post_grad_custom_post_pass = plan
        return {"bucketing": False, "regional": False}, plan
    return {"bucketing": False}, None


def _collectives(step: Any) -> tuple[dict[str, int], int]:
    """(calls by kind, the largest all_gather's output elements) of ``step()`` (bench/train.py's count)."""
    from torch.profiler import ProfilerActivity, profile
    from train import _c10d_kind

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step()
    counts: dict[str, int] = {}
    largest = 0
    for event in prof.events():
        kind = _c10d_kind(event.name)
        if kind is None:
            continue
        counts[kind] = counts.get(kind, 0) + 1
        if kind == "all_gather":
            largest = max(largest, *map(_numel, _shapes(event.input_shapes)), 0)
    return counts, largest


def _shapes(value: Any) -> list[list[int]]:
    """The tensor shapes in a profiler event's ``input_shapes`` (a tensor list's nested)."""
    if isinstance(value, list) and all(isinstance(v, int) for v in value):
        return [value] if value else []
    return [s for v in value for s in _shapes(v)] if isinstance(value, list) else []


def _numel(shape: list[int]) -> int:
    numel = 1
    for size in shape:
        numel *= size
    return numel


def one(case: str, variant: str, layers: int) -> dict:
    """One variant of one case, in this process: counts, compile and step times."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import fxshard
    from models.llama import Llama, LlamaConfig
    from systems import adamw, build, case_mesh, cpu_seconds
    from train import LLAMA, _data

    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    buckets: list[str] = []  # torch_auto: what its FSDP pre-bucketing says it merged
    handler = logging.Handler()
    handler.emit = lambda record: buckets.append(record.getMessage()) if "pre_bucket" in record.getMessage() else None
    logging.getLogger("torch._inductor.fx_passes.fsdp").addHandler(handler)
    fallbacks: list[str] = []  # programs fxshard compiled with Inductor's Python wrapper, its C++ one failing
    fallback = logging.Handler()
    fallback.emit = lambda record: (fallbacks.append(record.getMessage()[:200])
                                    if "C++ wrapper" in record.getMessage() else None)
    logging.getLogger("fxshard").addHandler(fallback)
    try:
        options, plan = _switch_on(variant, layers)
        config = LlamaConfig(**{**LLAMA, "n_layers": layers})
        torch.manual_seed(0)
        model, step, _ = build(case, "fxshard", case_mesh(case, 4, "cpu"), Llama(config),
                               {"cost_model": fxshard.CostModel(), **options})
        optimizer = adamw(model)

        def training_step(k: int) -> None:
            step(*_data(config, k))
            optimizer.step()
            optimizer.zero_grad()

        start, cpu = time.perf_counter(), cpu_seconds()
        training_step(0)
        compile_s, compile_cpu_s = time.perf_counter() - start, cpu_seconds() - cpu
        times = []
        for k in range(1, STEPS + 1):
            start = time.process_time()
            training_step(k)
            times.append(time.process_time() - start)
        counts, largest = _collectives(lambda: training_step(STEPS + 1))
        return {"case": case, "variant": variant, "layers": layers, "counts": counts,
                "largest_gather_mib": largest * 4 / 2**20, "compile_s": compile_s, "compile_cpu_s": compile_cpu_s,
                "step_ms": statistics.median(times) * 1e3, "tagged": plan.tagged if plan else None,
                "pre_buckets": buckets, "python_wrapper": fallbacks}
    except Exception as e:  # noqa: BLE001 (a variant that cannot run a case is a row, not a failed table)
        return {"case": case, "variant": variant, "layers": layers,
                "error": f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"}
    finally:
        dist.destroy_process_group()


def measure(case: str, variant: str, layers: int) -> dict:
    """``one`` in a fresh process."""
    run = subprocess.run([sys.executable, __file__, "--one", case, variant, str(layers)], capture_output=True,
                         text=True, timeout=900)
    lines = run.stdout.strip().splitlines()
    if run.returncode or not lines:
        return {"case": case, "variant": variant, "layers": layers,
                "error": f"exit {run.returncode}: {run.stderr.strip().splitlines()[-1][:160] if run.stderr else ''}"}
    return json.loads(lines[-1])


def _calls(row: dict) -> str:
    return ", ".join(f"{n} {kind}" for kind, n in sorted(row["counts"].items()))


def table(rows: list[dict]) -> str:
    """Markdown: per case and depth, each variant's figures and its ratios to fxshard's."""
    lines = ["| case | layers | variant | collective calls / step | largest gather MiB | step CPU ms | "
             "compile s (CPU s) | calls / fxshard | step / fxshard | compile CPU / fxshard |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    base = {(r["case"], r["layers"]): r for r in rows if r["variant"] == "fxshard" and "error" not in r}
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | {r['layers']} | {r['variant']} | fails: {r['error']} | | | | | | |")
            continue
        a = base.get((r["case"], r["layers"]))

        def ratio(key: str) -> str:
            return f"{r[key] / a[key]:.2f}" if a and a[key] else "n/a"
        calls = sum(r["counts"].values())
        gathered = f"{r['largest_gather_mib']:.2f}" if r["largest_gather_mib"] else "n/a"
        call_ratio = f"{calls / sum(a['counts'].values()):.2f}" if a and a["counts"] else "n/a"
        lines.append(f"| {r['case']} | {r['layers']} | {r['variant']} | {calls} ({_calls(r)}) | "
                     f"{gathered} | {r['step_ms']:.1f} | {r['compile_s']:.1f} "
                     f"({r['compile_cpu_s']:.1f}) | {call_ratio} | "
                     f"{ratio('step_ms')} | {ratio('compile_cpu_s')} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=CASES, action="append")
    parser.add_argument("--variant", choices=VARIANTS, action="append")
    parser.add_argument("--layers", type=int, nargs="+", default=[2])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--from-log", metavar="PATH", help="the table of the rows a run wrote to stderr, one "
                        "JSON object a line (a run stopped before its table: rows are written as they finish)")
    parser.add_argument("--one", nargs=3, help=argparse.SUPPRESS)  # case variant layers, in this process
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one[0], args.one[1], int(args.one[2]))))
        return
    if args.from_log:
        lines = pathlib.Path(args.from_log).read_text().splitlines()
        print(table([json.loads(line) for line in lines if line.startswith("{")]))
        return
    rows = []
    for layers in args.layers:
        for case in args.case or CASES:
            for variant in args.variant or VARIANTS:
                rows.append(measure(case, variant, layers))
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(json.dumps(rows, indent=1) if args.json else table(rows))


if __name__ == "__main__":
    main()
