"""Greedy ``generate()`` of a Hugging Face Llama under torch.compile(backend="fxshard") on gloo ranks.

    python examples/generate.py                         # 2 CPU ranks on 127.0.0.1, a static KV cache
    python examples/generate.py --cache dynamic         # transformers' default growing cache
    torchrun --nproc-per-node 2 examples/generate.py    # the same program, launched by torchrun

Needs the ``models`` extra (``pip install -e ".[models]"``: transformers). The model is built
from a small random config (seed 0, no download). Its tensor-parallel plan is the one
transformers ships with it (``config.base_model_tp_plan``: q/k/v and gate/up column-parallel,
o/down row-parallel; the output projection gathered) plus a vocabulary-parallel embedding, given
to ``parallelize_module`` with ``use_local_output=False`` so the model runs in global shapes,
which is what fxshard compiles. The KV cache holds DTensors sharded on the kv heads (each rank
its heads, never gathered); ``generate()`` itself runs unchanged and sees plain logits.

A static cache compiles two programs (prefill, then one decode step reused for every token). A
dynamic cache grows by one position per token, and fxshard plans for concrete sizes: the decode
steps of the first lengths get programs of their own, whose local code differs only in the
cache's length, which no layout shards; from then on one program compiled for symbolic lengths
serves every token (backend/programs/size_generic.py).

Prints the tokens of every rank against the single-device run, the collectives of one decode
step (Megatron's: an all_reduce per attention and per MLP, one for the vocab-parallel embedding,
an all_gather of the logits), and tokens/s.
"""
from __future__ import annotations

import os
import statistics
import sys
import time
import warnings

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.experimental import implicit_replication
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

CONFIG = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
              num_key_value_heads=4, max_position_embeddings=256)
STYLES = {  # transformers' names for its parallel styles -> DTensor's, the model kept in global shapes
    "colwise": lambda: ColwiseParallel(use_local_output=False),
    "rowwise": lambda: RowwiseParallel(use_local_output=False),
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),  # plain logits for generate()
}


def build_model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**CONFIG)).eval()


def tensor_parallel_plan(model: torch.nn.Module) -> dict:
    """The plan transformers ships with the model, as ``parallelize_module`` styles, and a
    vocabulary-parallel embedding (Megatron's)."""
    plan = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), use_local_output=False)}
    shipped = {"model." + k: v for k, v in model.config.base_model_tp_plan.items()}
    shipped.update(type(model)._tp_plan)
    for pattern, style in shipped.items():
        plan[pattern] = STYLES[style]()
    return plan


def sharded_cache(model: torch.nn.Module, mesh, kind: str, batch: int, max_len: int):
    """A KV cache whose tensors are DTensors sharded on the kv heads from the start.

    transformers creates a layer's tensors lazily from the first keys, as plain tensors (an empty
    one for the dynamic cache): DTensor can neither join a plain tensor with the sharded keys nor
    write them into it in place, so each layer starts with its sharded tensors.
    """
    from transformers import DynamicCache, StaticCache

    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    length = 0 if kind == "dynamic" else max_len
    cache = DynamicCache(config=config) if kind == "dynamic" else StaticCache(config=config, max_cache_len=max_len)
    for layer in cache.layers:
        def heads_sharded() -> torch.Tensor:
            return distribute_tensor(torch.zeros(batch, config.num_key_value_heads, length, head_dim), mesh, [Shard(1)])
        layer.keys, layer.values = heads_sharded(), heads_sharded()
        layer.dtype, layer.device = layer.keys.dtype, layer.keys.device
        layer.batch_size, layer.num_heads, layer.k_head_dim, layer.v_head_dim = \
            batch, config.num_key_value_heads, head_dim, head_dim
        layer.is_initialized = True
    return cache


def collectives_of(gm: torch.fx.GraphModule) -> dict[str, int]:
    counts: dict[str, int] = {}
    for n in gm.graph.nodes:
        name = getattr(n.target, "__name__", "")
        if getattr(n.target, "namespace", "") == "_c10d_functional" and not name.startswith("wait_tensor"):
            counts[name.split(".")[0]] = counts.get(name.split(".")[0], 0) + 1
    return counts


def run(rank: int, world_size: int, device: str = "cpu", cache: str = "static", batch: int = 2, prompt: int = 16,
        new_tokens: int = 16, repeats: int = 3, inductor: bool = True) -> dict:
    """Generate on this rank with the sharded model and on one device; returns the tokens and timings."""
    warnings.filterwarnings("ignore", message="Found a non-scalar tensor with numel=1")  # cache positions
    say = print if rank == 0 else (lambda *_, **__: None)
    mesh = init_device_mesh(device, (world_size,), mesh_dim_names=("tp",))
    model = build_model().to(device)
    torch.manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt), device=device)
    options = dict(attention_mask=torch.ones_like(ids), pad_token_id=model.config.eos_token_id,
                   max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)

    def timed(generate, fresh_cache) -> tuple[torch.Tensor, float]:
        times, out = [], None
        for _ in range(repeats):
            kv = fresh_cache()
            start = time.perf_counter()
            out = generate(ids, past_key_values=kv, **options)
            times.append(time.perf_counter() - start)
        return out, statistics.median(times)

    with torch.no_grad():
        expected, single_s = timed(model.generate, lambda: None)

    parallelize_module(model, mesh, tensor_parallel_plan(model))
    graphs: list[tuple[str, torch.fx.GraphModule]] = []
    model.forward = torch.compile(model.forward, backend="fxshard",
                                  options={"inductor": inductor, "on_graph": lambda s, gm: graphs.append((s, gm))})
    fresh = lambda: sharded_cache(model, mesh, cache, batch, prompt + new_tokens)  # noqa: E731
    # the rotary positions, masks and cache positions transformers builds are plain tensors: DTensor
    # reads them as replicated where they meet the sharded activations
    with torch.no_grad(), implicit_replication():
        say(f"compiling (the first generate): prefill, then decode ({cache} cache)", flush=True)
        start = time.perf_counter()
        first = model.generate(ids, past_key_values=fresh(), **options)
        compile_s = time.perf_counter() - start
        tokens, sharded_s = timed(model.generate, fresh)
    lowered = [gm for stage, gm in graphs if stage == "lower"]
    result = {"same_tokens": bool(torch.equal(tokens, expected) and torch.equal(first, expected)),
              "tokens": tokens.tolist(), "programs": len(lowered), "decode_collectives": collectives_of(lowered[-1]),
              "tokens_per_s": batch * new_tokens / sharded_s, "single_device_tokens_per_s": batch * new_tokens / single_s,
              "first_generate_s": compile_s}
    if rank == 0:
        config = model.config
        print(f"Llama {config.num_hidden_layers} layers, hidden {config.hidden_size}, {config.num_attention_heads} "
              f"heads ({config.num_key_value_heads} kv), vocab {config.vocab_size}; TP on {world_size} gloo ranks")
        print(f"greedy generate(): batch {batch}, prompt {prompt}, {new_tokens} new tokens, {cache} KV cache "
              "sharded on kv heads")
        for row, (got, want) in enumerate(zip(tokens.tolist(), expected.tolist())):
            print(f"  sequence {row}: {got[prompt:]} ({'same as one device' if got == want else f'one device: {want[prompt:]}'})")
        print(f"programs compiled: {len(lowered)} (first generate, compiling included: {compile_s:.1f} s)")
        print("collectives per decode step: " + ", ".join(f"{n} x {k}" for k, n in result["decode_collectives"].items()))
        print(f"tokens/s (median of {repeats} generate calls): {result['tokens_per_s']:.0f} sharded on {world_size} "
              f"ranks, {result['single_device_tokens_per_s']:.0f} on one device (eager)")
    return result


def spawn(world_size: int = 2, timeout: float = 900.0, **kwargs) -> dict[int, dict]:
    from ranks import launch

    return launch(run, world_size, timeout, "cpu", **kwargs)


def main() -> None:
    cache = sys.argv[sys.argv.index("--cache") + 1] if "--cache" in sys.argv else "static"
    if cache not in ("static", "dynamic"):
        sys.exit(f"--cache must be static or dynamic, not {cache!r}")
    results = spawn(int(os.environ.get("WORLD_SIZE_FXSHARD", "2")), cache=cache,
                    new_tokens=16)
    same = all(r["same_tokens"] for r in results.values())
    if int(os.environ.get("RANK", "0")) == 0:
        print("all ranks generated the single-device tokens" if same else "TOKENS DIFFER from the single-device run")
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
