"""Automatic placements against the hand plans: ``fxshard.auto_placements`` vs Megatron / FSDP x TP.

For each model and mesh below, one row:

    case | mesh | budget | hand B/rank | auto B/rank | auto/hand | hand us | auto us | auto mem | solve s | explain s | ratio | plans

* hand: the plan its authors use (Megatron on tp: column q/k/v/gate/up, row o/down, vocab-parallel embedding and
  head; on (dp, tp): FSDP x TP with the batch on dp), as ``explain`` plans it.
* auto: ``fxshard.auto_placements`` with the same pinned inputs (the batch on dp), within a budget of the memory
  per rank the hand plan needs (``budget``: parameters and peak activations, as fxshard's memory report
  counts them), or 0.4x the parameters on tp=4 for the acceptance row; its answer given back to ``explain``.
* B/rank: bytes the busiest rank receives per step (``explain``'s total); us: the modeled step (the cost model's
  collectives and copies plus compute at ``CostModel.compute_rate``), both plans priced alike.
* solve s / explain s: the search against one ``explain`` of the hand plan, warm, in the same process (medians of
  three); ratio = solve / explain; plans: the candidates the search planned.
* MoE training rows (tests/moe_programs.py's dropless MoE, the tokens on an ep axis): the hand plan is expert
  parallelism (every stack ``Shard(0)``); a training step's bytes are priced by the search's own model for both
  plans (the step's collectives plus the routed all_to_alls at a uniform routing); explain s is one plan of the
  hand plan's training step (``plan_function(..., training=True)``).

The 8- and 32-layer rows are the depth check: the search plans four layers either way (folded), so its
time grows with the capture alone. Fake meshes, no process group, no communication. Run from the
repository root::

    python bench/auto_placements.py            # about two minutes on this project's machine
"""
from __future__ import annotations

import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch.distributed.tensor import Replicate, Shard

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "tests"))

import fxshard  # noqa: E402
from models.llama import Llama, LlamaConfig, fsdp_tp_placements, megatron_placements  # noqa: E402


@dataclass
class Case:
    name: str
    build: Callable[[], tuple[Callable, tuple, torch.nn.Module]]  # -> (fn, args, module)
    hand: Callable[[torch.nn.Module], dict]  # the module -> its hand placements (parameters)
    mesh: dict
    pinned: dict  # what auto keeps (the batch on dp), part of the hand plan too
    budget_of_params: float | None = None  # the budget as a share of the parameters (None: the hand plan's memory)
    training: bool = False  # a training step (fn returns the loss): both plans priced by the search's own model


def _examples_llama(layers: int = 4, kv_heads: int = 4, ffn_dim: int = 768) -> Callable[[], tuple]:
    def build() -> tuple:
        torch.manual_seed(0)
        vocab = 1024 if ffn_dim == 768 else 1000
        model = Llama(LlamaConfig(vocab_size=vocab, dim=256, n_layers=layers, n_heads=8, n_kv_heads=kv_heads,
                                  ffn_dim=ffn_dim)).eval()
        return model, (torch.randint(0, vocab, (4, 64)),), model
    return build


def _examples_llama_loss() -> Callable[[], tuple]:
    """A small Llama's training step (its loss), tests/test_auto_placements.py's size."""
    def build() -> tuple:
        torch.manual_seed(0)
        model = Llama(LlamaConfig(vocab_size=256, dim=64, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=192))
        return model.loss, (torch.randint(0, 256, (2, 32)), torch.randint(0, 256, (2, 32))), model
    return build


def _zoo(name: str) -> Callable[[], tuple]:
    def build() -> tuple:
        from zoo import ZOO

        torch.manual_seed(0)
        arch = ZOO[name]
        model = arch.build()
        return arch.call(model), arch.example(4, 32), model
    return build


def _zoo_plan(name: str) -> Callable[[torch.nn.Module], dict]:
    def plan(model: torch.nn.Module) -> dict:
        from zoo import ZOO

        return ZOO[name].plan(model)
    return plan


def _moe(dim: int, hidden: int, tokens: int) -> Callable[[], tuple]:
    """tests/moe_programs.py's dropless MoE (torchtitan's form, 8 experts, top-2), its loss for a training step."""
    def build() -> tuple:
        from moe_programs import DroplessMoE

        torch.manual_seed(0)
        model = DroplessMoE(dim=dim, hidden=hidden, experts=8)

        def loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return ((model(x) - y) ** 2).mean()
        return loss, (torch.randn(tokens, dim), torch.randn(tokens, dim)), model
    return build


def _expert_parallel(model: torch.nn.Module) -> dict:
    return {name: (Shard(0),) for name in ("w1", "w2", "w3")}


def _fsdp_tp(model: torch.nn.Module) -> dict:
    return fsdp_tp_placements(model)


DP_BATCH = {0: (Shard(0), Replicate())}
CASES = [
    Case("examples' Llama, 4 layers (acceptance)", _examples_llama(), megatron_placements, {"tp": 4}, {}, 0.4),
    Case("examples' Llama, 4 layers", _examples_llama(), megatron_placements, {"tp": 4}, {}),
    Case("examples' Llama, 8 layers", _examples_llama(8), megatron_placements, {"tp": 4}, {}),
    Case("examples' Llama, 32 layers", _examples_llama(32), megatron_placements, {"tp": 4}, {}),
    Case("examples' Llama MQA (1 kv head)", _examples_llama(kv_heads=1), megatron_placements, {"tp": 4}, {}),
    Case("examples' Llama, FSDP x TP", _examples_llama(), _fsdp_tp, {"dp": 2, "tp": 4}, DP_BATCH),
    Case("HF Llama", _zoo("llama"), _zoo_plan("llama"), {"tp": 4}, {}),
    Case("HF Qwen2", _zoo("qwen2"), _zoo_plan("qwen2"), {"tp": 4}, {}),
    Case("HF Mixtral (MoE)", _zoo("mixtral"), _zoo_plan("mixtral"), {"tp": 4}, {}),
    Case("HF GPT-NeoX (parallel residual)", _zoo("gpt_neox"), _zoo_plan("gpt_neox"), {"tp": 4}, {}),
    Case("examples' Llama, odd sizes (vocab 1000, ffn 690)", _examples_llama(ffn_dim=690), megatron_placements,
         {"tp": 4}, {}),
    Case("HF Phi-3 (fused q/k/v, gate/up)", _zoo("phi3"), _zoo_plan("phi3"), {"tp": 4}, {}),
    Case("examples' Llama training (small), Megatron", _examples_llama_loss(), megatron_placements, {"tp": 4}, {},
         training=True),
    Case("MoE training, experts 8x128x256, 64 tokens", _moe(128, 256, 64), _expert_parallel, {"ep": 4},
         {0: (Shard(0),), 1: (Shard(0),)}, training=True),
    Case("MoE training, experts 8x32x48, 2048 tokens", _moe(32, 48, 2048), _expert_parallel, {"ep": 4},
         {0: (Shard(0),), 1: (Shard(0),)}, training=True),
]


def _median_time(run: Callable[[], Any], repeats: int = 3) -> tuple[float, Any]:
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = run()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def row(case: Case) -> list[str]:
    fn, args, module = case.build()
    params = sum(p.numel() * p.element_size() for p in module.parameters())
    hand = {**case.hand(module), **case.pinned}
    every = {name: hand.get(name, (Replicate(),) * len(case.mesh)) for name, _ in module.named_parameters()}
    priced_hand = fxshard.auto_placements(fn, *args, mesh=case.mesh, memory_budget=math.inf, training=case.training,
                                          placements={**every, **case.pinned}).priced
    budget = case.budget_of_params * params if case.budget_of_params else priced_hand.memory
    fxshard.explain(fn, *args, mesh=case.mesh, placements=hand)  # warm
    explain_s, hand_plan = _median_time(lambda: fxshard.explain(fn, *args, mesh=case.mesh, placements=hand))
    if case.training:  # one plan of the hand plan's training step, as ``explain`` plans the forward
        from fxshard.backend.driver import plan_function

        explain_s, _ = _median_time(lambda: plan_function(fn, args, mesh=case.mesh, placements=hand, training=True))
    solve_s, auto = _median_time(lambda: fxshard.auto_placements(fn, *args, mesh=case.mesh, memory_budget=budget,
                                                                 training=case.training, placements=case.pinned))
    if case.training:  # the step's collectives and the routed all_to_alls, as the search prices them
        hand_bytes, auto_bytes = priced_hand.bytes_per_rank, auto.priced.bytes_per_rank
    else:
        chosen = fxshard.explain(fn, *args, mesh=case.mesh, placements=dict(auto))
        hand_bytes, auto_bytes = hand_plan.bytes_per_rank, chosen.bytes_per_rank
    mesh = "x".join(f"{k}={v}" for k, v in case.mesh.items())
    return [case.name, mesh, f"{budget / 1e6:.2f} MB", f"{hand_bytes}", f"{auto_bytes}",
            f"{auto_bytes / hand_bytes:.2f}" if hand_bytes else "-", f"{priced_hand.cost * 1e6:.1f}",
            f"{auto.priced.cost * 1e6:.1f}", f"{auto.priced.memory / 1e6:.2f} MB", f"{solve_s:.2f}",
            f"{explain_s:.2f}", f"{solve_s / explain_s:.1f}", f"{auto.evaluations}"]


HEADER = ["case", "mesh", "budget", "hand B/rank", "auto B/rank", "auto/hand", "hand us", "auto us", "auto mem",
          "solve s", "explain s", "ratio", "plans"]


def main() -> None:
    rows = []
    for case in CASES:
        try:
            rows.append(row(case))
        except Exception as error:  # noqa: BLE001 (a row that fails says so; the others still print)
            rows.append([case.name, "x".join(f"{k}={v}" for k, v in case.mesh.items()),
                         f"FAILED: {type(error).__name__}: {str(error).splitlines()[0][:120]}"] + [""] * 10)
        print(" | ".join(rows[-1]), flush=True)
    print()
    print("| " + " | ".join(HEADER) + " |")
    print("|" + "---|" * len(HEADER))
    for r in rows:
        print("| " + " | ".join(r) + " |")


if __name__ == "__main__":
    main()
