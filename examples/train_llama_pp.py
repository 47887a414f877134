"""Train the compact Llama with pipeline x tensor parallelism (2 stages x TP 2) on 4 gloo ranks.

    python examples/train_llama_pp.py                          # spawns 4 CPU ranks on 127.0.0.1
    torchrun --nproc-per-node 4 examples/train_llama_pp.py     # the same program, launched by torchrun

The model is split by module names as torchtitan splits it (stage 0: the embedding and layer 0;
stage 1: layer 1, the final norm, the output projection and the loss). ``explain_pipeline`` plans
each stage's training program with fxshard on its sub-mesh (``mesh["tp"]`` of its pp coordinate;
Megatron placements on tp): stage 0 hands on its output in the layout its plan leaves it, each rank
sends its local block of it to the same tp rank of stage 1, and the gradient comes back the same
way. ``torch.distributed.pipelining`` runs the stages (``ScheduleGPipe`` and ``Schedule1F1B``).
The first step runs both schedules and compares loss and every gradient with one device; then
AdamW trains a few steps under 1F1B, printing the losses next to the single-device run.
With ``--dp 2`` on 8 ranks the stage meshes are (dp, tp): pipeline x data x tensor parallelism.
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

import fxshard
from fxshard.backend.pipelining import PipelineRank, explain_pipeline
from models.llama import COLUMN_PARALLEL, ROW_PARALLEL, Llama, LlamaConfig

CONFIG = LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128)
STAGES = [["tok_embeddings", "layers.0"], ["layers.1", "norm", "output"]]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def mesh_axes(world_size: int, tp: int = 2, pp: int = 2) -> dict[str, int]:
    """(pp, dp, tp) with dp what the world leaves; a dp of 1 is left out."""
    dp = world_size // (pp * tp)
    return {"pp": pp, "dp": dp, "tp": tp} if dp > 1 else {"pp": pp, "tp": tp}


def placements(model: Llama, axes: dict[str, int]) -> tuple[dict, tuple]:
    """Megatron on tp, parameters replicated on dp (plain data parallelism; the plan all-reduces the
    gradients on dp); tokens and targets sharded on dp. Returns (parameter placements, input placements)."""
    on_dp = "dp" in axes
    params = {}
    for name, _ in model.named_parameters():
        tp = Shard(0) if any(k in name for k in COLUMN_PARALLEL) else \
            Shard(1) if any(k in name for k in ROW_PARALLEL) else Replicate()
        params[name] = (Replicate(), tp) if on_dp else (tp,)
    batch = (Shard(0), Replicate()) if on_dp else (Replicate(),)
    return params, (batch, batch)


def pin_boundary_to_sequence(model: Llama, axes: dict[str, int]) -> Llama:
    """A copy of ``model`` whose stage-0 output (layer 0's) is pinned to sequence shards on tp, as
    sequence parallelism keeps the residual stream: the boundary then carries 1/tp of each microbatch."""
    pinned = copy.deepcopy(model)
    sharded = ((Shard(0),) if "dp" in axes else ()) + (Shard(1),)
    pinned.layers[0].register_forward_hook(lambda module, args, out: fxshard.constrain(out, sharded))
    return pinned


def local_block(t: torch.Tensor, mesh, axes: dict[str, int]) -> torch.Tensor:
    """This rank's rows of a batch: its dp shard (the whole batch without dp)."""
    if "dp" not in axes:
        return t
    return t.chunk(axes["dp"])[mesh.get_local_rank("dp")]


def run(rank: int, world_size: int, device: str = "cpu", config: LlamaConfig = CONFIG, batch: int = 8,
        seq: int = 32, n_microbatches: int = 2, steps: int = 3, lr: float = 1e-2, tp: int = 2,
        inductor: bool = True, schedules: tuple[str, ...] = ("gpipe", "1f1b"), sequence_boundary: bool = False) -> dict:
    """Check the first step under each schedule against one device, then train ``steps`` AdamW steps."""
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    axes = mesh_axes(world_size, tp)
    mesh = init_device_mesh(device, tuple(axes.values()), mesh_dim_names=tuple(axes))
    torch.manual_seed(0)  # the same weights and data on every rank
    reference = Llama(config).to(device)
    data = [(torch.randint(0, config.vocab_size, (batch, seq), device=device),
             torch.randint(0, config.vocab_size, (batch, seq), device=device)) for _ in range(max(steps, 1))]
    params, inputs = placements(reference, axes)
    staged = pin_boundary_to_sequence(reference, axes) if sequence_boundary else reference
    start = time.perf_counter()
    # bytes decide: the default cost model's 10 us per collective favours fewer, larger collectives at this toy size
    plan = explain_pipeline(staged, STAGES, [data[0][0]], [data[0][1]], mesh=axes, placements=params,
                            input_placements=inputs, loss_fn=loss_fn, n_microbatches=n_microbatches,
                            cost_model=fxshard.CostModel(default_latency=0.0))
    if rank == 0:
        print(plan, flush=True)
    me = PipelineRank(plan, staged, mesh, inductor=inductor)
    make = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
    runs = {name: me.schedule(make[name]) for name in schedules}

    def step(schedule, tokens, targets) -> float | None:
        losses = me.step(schedule, [local_block(tokens, mesh, axes)], [local_block(targets, mesh, axes)])
        return float(torch.stack(losses).mean()) if losses else None

    checks = {}
    tokens, targets = data[0]
    ref_loss = reference.loss(tokens, targets)
    ref_loss.backward()
    for name, schedule in runs.items():  # the same step under each schedule, from the same weights
        loss = step(schedule, tokens, targets)
        checks[name] = {"loss": loss, "grad_error": grad_error(me.module, reference)}
        me.module.zero_grad()
    reference.zero_grad()
    first_s = time.perf_counter() - start
    sent_first = list(me.sent)

    optimizer = torch.optim.AdamW(me.module.parameters(), lr=lr, foreach=False)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=lr, foreach=False)
    losses, ref_losses = [], []
    train = runs[schedules[-1]]
    for tokens, targets in data[:steps]:
        losses.append(step(train, tokens, targets))
        optimizer.step()
        optimizer.zero_grad()
        ref = reference.loss(tokens, targets)
        ref.backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        ref_losses.append(ref.item())
    result = {"stage": me.index, "first_loss": ref_loss.item(), "checks": checks, "losses": losses,
              "ref_losses": ref_losses, "sent": sent_first, "planned_bytes": plan.boundary_bytes,
              "first_s": first_s}
    if me.is_last and mesh.get_coordinate()[-1] == 0 and all(c == 0 for c in mesh.get_coordinate()[1:]):
        report(result, axes, schedules)
    return result


def grad_error(module: torch.nn.Module, reference: torch.nn.Module) -> float:
    """The largest relative error of this stage's gradients against the single-device ones."""
    ref = dict(reference.named_parameters())
    worst = 0.0
    for name, p in module.named_parameters():
        full = p.grad.full_tensor()
        want = ref[name].grad
        worst = max(worst, ((full - want).abs().max() / want.abs().max().clamp_min(1e-12)).item())
    return worst


def report(result: dict, axes: dict[str, int], schedules: tuple[str, ...]) -> None:
    shape = " x ".join(f"{n} {s}" for n, s in axes.items())
    print(f"Llama 2 layers in 2 stages ({shape}); first step against one device (loss {result['first_loss']:.6f}):")
    for name, c in result["checks"].items():
        print(f"  {name}: loss {c['loss']:.6f}, worst relative gradient error on the last stage {c['grad_error']:.1e}")
    print(f"AdamW under {schedules[-1]}:\nstep  pipeline loss   single-device loss")
    for k, (a, b) in enumerate(zip(result["losses"], result["ref_losses"])):
        print(f"{k:4d}  {a:12.6f}   {b:12.6f}")


def spawn(world_size: int = 4, timeout: float = 900.0, **kwargs) -> dict[int, dict]:
    from ranks import launch

    return launch(run, world_size, timeout, "cpu", **kwargs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dp", type=int, default=1, help="data-parallel size: 2 x dp x 2 ranks")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--sequence-boundary", action="store_true",
                        help="pin the boundary activation to sequence shards on tp (each rank sends 1/tp)")
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE_FXSHARD", 4 * args.dp))  # under torchrun: this process is one rank
    results = spawn(world, steps=args.steps, sequence_boundary=args.sequence_boundary)
    worst = max(abs(a - b) / abs(b) for r in results.values() if r["losses"] and r["losses"][0] is not None
                for a, b in zip(r["losses"], r["ref_losses"]))
    worst_grad = max(c["grad_error"] for r in results.values() for c in r["checks"].values())
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"all ranks ok; worst relative loss difference {worst:.2e}, worst gradient error {worst_grad:.2e}")
    sys.exit(0 if worst <= 1e-4 and worst_grad <= 1e-4 else 1)


if __name__ == "__main__":
    main()
