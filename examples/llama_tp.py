"""A compact Llama 3 with tensor + sequence parallelism, compiled with backend="fxshard" on gloo ranks.

    python examples/llama_tp.py                                  # spawns 4 CPU ranks on 127.0.0.1 (TP+SP)
    python examples/llama_tp.py --tp-only                        # tensor parallel without sequence parallelism
    torchrun --nproc-per-node 4 examples/llama_tp.py             # the same program, launched by torchrun

The model (examples/models/llama.py) is written in global shapes; ``parallelize_module`` with
torchtitan's plan says how its weights and activations are sharded. A single-device run writes
the checkpoint; each rank builds the model on the meta device and reads only its shards of it
(``fxshard.load_sharded``). fxshard plans the communication and Inductor compiles each rank's program. Prints the collectives per layer
(TP+SP: 2 all_gather + 2 reduce_scatter), tokens/s, and the error against one device.
"""
from __future__ import annotations

import os
import statistics
import sys
import time

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from models.llama import Llama, LlamaConfig, tensor_parallel_plan

CONFIG = LlamaConfig(vocab_size=1024, dim=256, n_layers=2, n_heads=8, n_kv_heads=4, ffn_dim=768)


def collectives_of(gm: torch.fx.GraphModule) -> list[str]:
    return [n.target.__name__.split(".")[0] for n in gm.graph.nodes
            if n.op == "call_function" and getattr(n.target, "namespace", "") == "_c10d_functional"
            and not n.target.__name__.startswith("wait_tensor")]


def write_checkpoint(path: str, config: LlamaConfig = CONFIG) -> None:
    """The single-device model's weights (seed 0), as one torch.save state dict."""
    torch.manual_seed(0)
    torch.save(Llama(config).state_dict(), path)


def run(rank: int, world_size: int, device: str = "cpu", sequence_parallel: bool = True,
        config: LlamaConfig = CONFIG, batch: int = 2, seq: int = 64, steps: int = 5,
        checkpoint: str | None = None, workdir: str | None = None) -> dict:
    """Compile and run the sharded Llama on this rank; returns what it measured.

    With ``checkpoint`` (or a ``workdir`` holding ``llama.pt``: ``ranks.launch`` with ``setup=``) the
    sharded model is built on the meta device and each rank reads only its shard of every weight
    from it (``fxshard.load_sharded``); the single-device reference loads it whole.
    """
    if checkpoint is None and workdir is not None:
        checkpoint = os.path.join(workdir, "llama.pt")
    say = print if rank == 0 else (lambda *_, **__: None)
    mesh = init_device_mesh(device, (world_size,), mesh_dim_names=("tp",))
    torch.manual_seed(0)  # same weights and tokens on every rank
    model = Llama(config).eval().to(device)
    tokens = torch.randint(0, config.vocab_size, (batch, seq), device=device)
    if checkpoint is not None:
        model.load_state_dict(torch.load(checkpoint, weights_only=True))
    with torch.no_grad():
        expected = model(tokens)

    if checkpoint is not None:
        import fxshard

        say("each rank reads its shards of the checkpoint (fxshard.load_sharded)", flush=True)
        with torch.device("meta"):
            model = Llama(config).eval()
        parallelize_module(model, mesh, tensor_parallel_plan(model, sequence_parallel=sequence_parallel))
        fxshard.load_sharded(model, checkpoint, mesh)  # the placements parallelize_module gave
    else:
        parallelize_module(model, mesh, tensor_parallel_plan(model, sequence_parallel=sequence_parallel))
    graphs: dict = {}
    compiled = torch.compile(model, backend="fxshard",
                             options={"on_graph": lambda stage, gm: graphs.__setitem__(stage, gm)})
    say("compiling (the first call): Dynamo, then fxshard's stages and Inductor", flush=True)
    with torch.no_grad():
        out = compiled(tokens)  # compiles
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            compiled(tokens)
            times.append(time.perf_counter() - start)
    assert isinstance(out, DTensor), type(out)
    error = (out.full_tensor() - expected).abs().max().item()
    collectives = collectives_of(graphs["lower"])
    tokens_per_s = batch * seq / statistics.median(times)
    if rank == 0:
        per_layer: dict[str, int] = {}
        for c in collectives:
            per_layer[c] = per_layer.get(c, 0) + 1
        mode = "TP+SP" if sequence_parallel else "TP"
        print(f"Llama {config.n_layers} layers, dim {config.dim}, {config.n_heads} heads "
              f"({config.n_kv_heads} kv), vocab {config.vocab_size}; {mode} on {world_size} gloo ranks")
        print("collectives per forward: " + ", ".join(f"{n} x {k}" for k, n in per_layer.items()))
        extra = ("plus a reduce_scatter out of the vocab-parallel embedding and an all_gather into the output "
                 "projection") if sequence_parallel else "plus an all_reduce out of the vocab-parallel embedding"
        print(f"  = per layer {', '.join(f'{n // config.n_layers} x {k}' for k, n in per_layer.items())}, {extra}")
        print(f"tokens/s (median of {steps}): {tokens_per_s:.0f}")
        print(f"logits: DTensor {tuple(out.shape)} placements={out.placements}")
        print(f"max abs error vs single device: {error:.2e}")
    return {"error": error, "collectives": collectives, "tokens_per_s": tokens_per_s}


def spawn(world_size: int = 4, timeout: float = 900.0, **kwargs) -> dict[int, dict]:
    from ranks import launch

    return launch(run, world_size, timeout, "cpu", **kwargs)


def main() -> None:
    """Self-spawned or under torchrun, the same path: the checkpoint is written once per node
    (``setup``), then every rank reads its shards of it."""
    sequence_parallel = "--tp-only" not in sys.argv
    results = spawn(int(os.environ.get("WORLD_SIZE_FXSHARD", "4")), sequence_parallel=sequence_parallel,
                    setup=lambda workdir: write_checkpoint(os.path.join(workdir, "llama.pt")))
    worst = max(r["error"] for r in results.values())
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"all ranks ok; worst error {worst:.2e}")
    sys.exit(0 if worst <= 1e-4 else 1)


if __name__ == "__main__":
    main()
