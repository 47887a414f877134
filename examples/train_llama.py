"""Train the compact Llama with FSDP x tensor parallelism (2 x 2) on 4 gloo ranks, compiled with fxshard.

    python examples/train_llama.py                          # spawns 4 CPU ranks on 127.0.0.1
    torchrun --nproc-per-node 4 examples/train_llama.py     # the same program, launched by torchrun

Every parameter is a DTensor on a (dp, tp) mesh: Megatron's column/row split on tp, the other
dim sharded on dp (FSDP). Token batches are sharded on dp. ``torch.compile(model.loss,
backend="fxshard")`` would need DTensor to run the unchanged model eagerly, which it cannot (CPU
attention, a rotary table built in ``forward``), so ``fxshard.compile(model.loss)`` traces it on
global stand-ins and compiles the joint forward+backward program: the plan all-gathers each weight
on dp where it is used (again in the backward, so no rank keeps a gathered weight between the
passes), all-reduces each block's output on tp, and reduce-scatters every gradient into its
parameter's placements. ``torch.optim.AdamW`` steps on those DTensor gradients. Prints the loss of
each step next to a single-device run of the same model, tokens/s and peak memory per rank.
"""
from __future__ import annotations

import copy
import os
import resource
import statistics
import sys
import time

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import fxshard
from models.llama import Llama, LlamaConfig, fsdp_tp_placements

CONFIG = LlamaConfig(vocab_size=512, dim=128, n_layers=2, n_heads=8, n_kv_heads=4, ffn_dim=384)


def collectives_of(gm: torch.fx.GraphModule) -> dict[str, int]:
    counts: dict[str, int] = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and getattr(n.target, "namespace", "") == "_c10d_functional" \
                and not n.target.__name__.startswith("wait_tensor"):
            kind = n.target.__name__.split(".")[0]
            counts[kind] = counts.get(kind, 0) + 1
    return counts


def distribute_parameters(model: nn.Module, mesh, placements: dict) -> None:
    """Replace each parameter by a DTensor parameter with its placements (the module's code is unchanged)."""
    for name, param in list(model.named_parameters()):
        owner = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        leaf = name.rpartition(".")[2]
        owner.register_parameter(leaf, nn.Parameter(distribute_tensor(param.detach(), mesh, placements[name])))


def run(rank: int, world_size: int, device: str = "cpu", config: LlamaConfig = CONFIG, batch: int = 16,
        seq: int = 128, steps: int = 5, lr: float = 1e-2, foreach: bool = True, check_grads: bool = False) -> dict:
    """Train ``steps`` steps on this rank and on one device; returns the losses and what it measured."""
    mesh = init_device_mesh(device, (2, world_size // 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)  # same weights and data on every rank
    reference = Llama(config).to(device)
    model = copy.deepcopy(reference)
    distribute_parameters(model, mesh, fsdp_tp_placements(model))
    data = [(torch.randint(0, config.vocab_size, (batch, seq), device=device),
             torch.randint(0, config.vocab_size, (batch, seq), device=device)) for _ in range(steps)]

    # bytes decide: the default cost model's 10 us per collective favours fewer, larger collectives
    # at this toy size (moving activations on dp instead of gathering weights)
    compiled = fxshard.compile(model.loss, cost_model=fxshard.CostModel(default_latency=0.0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, foreach=foreach)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=lr, foreach=foreach)
    batch_placements = (Shard(0), Replicate())  # sequences split over dp, the same on every tp rank

    losses, ref_losses, times, grad_error = [], [], [], 0.0
    compile_s = 0.0
    if rank == 0:
        print("step 0 compiles: Dynamo traces model.loss, then fxshard's stages and Inductor", flush=True)
    for step, (tokens, targets) in enumerate(data):
        start = time.perf_counter()
        loss = compiled(distribute_tensor(tokens, mesh, batch_placements),
                        distribute_tensor(targets, mesh, batch_placements))
        loss.backward()
        if step == 0 and check_grads:
            ref_loss = reference.loss(tokens, targets)
            ref_loss.backward()
            for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
                assert isinstance(p.grad, DTensor) and p.grad.placements == p.placements, (name, p.grad)
                grad_error = max(grad_error, ((p.grad.full_tensor() - q.grad).abs().max() /
                                              q.grad.abs().max().clamp_min(1e-12)).item())
            reference.zero_grad()
        optimizer.step()
        optimizer.zero_grad()
        elapsed = time.perf_counter() - start
        if step == 0:
            compile_s = elapsed
        else:
            times.append(elapsed)
        losses.append(loss.full_tensor().item())

        ref_loss = reference.loss(tokens, targets)
        ref_loss.backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        ref_losses.append(ref_loss.item())

    tokens_per_s = batch * seq / statistics.median(times) if times else float("nan")
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result = {"losses": losses, "ref_losses": ref_losses, "tokens_per_s": tokens_per_s, "peak_mb": peak_mb,
              "compile_s": compile_s, "grad_error": grad_error, "stages": sorted(compiled.last.reporter.times),
              "forward": collectives_of(compiled.last.forward_graph),
              "backward": collectives_of(compiled.last.backward_graph)}
    if rank == 0:
        print(f"Llama {config.n_layers} layers, dim {config.dim}, vocab {config.vocab_size}; FSDP x TP "
              f"(dp 2 x tp {world_size // 2}) on {world_size} gloo ranks, batch {batch} x {seq} tokens, AdamW")
        print(f"collectives per step: forward {result['forward']}, backward {result['backward']}")
        print("step  fxshard loss   single-device loss")
        for k, (a, b) in enumerate(zip(losses, ref_losses)):
            print(f"{k:4d}  {a:12.6f}   {b:12.6f}")
        print(f"first step (compiles): {compile_s:.1f} s; tokens/s (median of {len(times)} steps): {tokens_per_s:.0f}")
    return result


def spawn(world_size: int = 4, timeout: float = 900.0, **kwargs) -> dict[int, dict]:
    from ranks import launch

    return launch(run, world_size, timeout, "cpu", **kwargs)


def main() -> None:
    results = spawn(int(os.environ.get("WORLD_SIZE_FXSHARD", "4")))  # under torchrun: this process is one rank
    worst = max(abs(a - b) / abs(b) for r in results.values() for a, b in zip(r["losses"], r["ref_losses"]))
    if int(os.environ.get("RANK", "0")) == 0:
        for rank, r in sorted(results.items()):
            print(f"rank {rank}: peak memory {r['peak_mb']:.0f} MB, {r['tokens_per_s']:.0f} tokens/s")
        print(f"all ranks ok; worst relative loss difference {worst:.2e}")
    sys.exit(0 if worst <= 1e-4 else 1)


if __name__ == "__main__":
    main()
