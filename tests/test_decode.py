"""KV-cache inference under Megatron TP: prefill, then decode one token at a time.

The step is what ``generate()`` runs: the model with a cache and the cache positions. Its cache
is explicit tensors here (rebuilt into a ``DynamicCache`` or written in place into a
``StaticCache``'s buffers with ``index_copy_``), sharded on the key/value heads like the k/v
projections that fill it, so a step moves nothing but Megatron's all-reduces: the cache is never
gathered. Every step's logits are the one-device logits.
"""
from __future__ import annotations

import re
import warnings
from typing import Any

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import fxshard
from fxshard.backend.explain import collectives_of
from fxshard.backend.simulate import simulate_ranks
from fxshard.graph import LAYOUT

transformers = pytest.importorskip("transformers")

from zoo import DECODER, ZOO, _hf  # noqa: E402

BATCH, PROMPT, MAX_LEN, DECODE_STEPS = 2, 6, 16, 3


def dynamic_step(model: torch.nn.Module):
    layers = model.config.num_hidden_layers

    def step(ids: torch.Tensor, position: torch.Tensor, *kv: torch.Tensor):
        cache = transformers.DynamicCache([(kv[2 * i], kv[2 * i + 1]) for i in range(layers)]) if kv else \
            transformers.DynamicCache(config=model.config)
        logits = model(input_ids=ids, past_key_values=cache, cache_position=position).logits
        return (logits,) + tuple(t for layer in cache.layers for t in (layer.keys, layer.values))
    return step


def static_step(model: torch.nn.Module):
    def step(ids: torch.Tensor, position: torch.Tensor, *kv: torch.Tensor):
        cache = transformers.StaticCache(config=model.config, max_cache_len=MAX_LEN)
        for i, layer in enumerate(cache.layers):  # the cache's buffers are the step's inputs, written in place
            layer.lazy_initialization(kv[2 * i], kv[2 * i + 1])
            layer.keys, layer.values = kv[2 * i], kv[2 * i + 1]
            layer.cumulative_length = position[0].clone()
        return model(input_ids=ids, past_key_values=cache, cache_position=position).logits
    return step


def decode(model: torch.nn.Module, cache: str, mesh: fxshard.MeshSpec, plan: dict, cache_layout: Any,
           steps: int = DECODE_STEPS) -> list[tuple[list[str], list[str]]]:
    """Prefill, then ``steps`` decode steps, each exact against one device; per step its collectives and
    the layouts of the cache it returns (a dynamic cache: the next step's inputs, as returned)."""
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    step = (dynamic_step if cache == "dynamic" else static_step)(model)
    kv: tuple = () if cache == "dynamic" else tuple(
        torch.zeros(BATCH, config.num_key_value_heads, MAX_LEN, head_dim) for _ in range(2 * config.num_hidden_layers))
    layouts = [cache_layout] * len(kv)
    ids, position = torch.randint(0, 256, (BATCH, PROMPT)), torch.arange(PROMPT)
    out = []
    for _ in range(1 + steps):
        placements = {**plan, **{2 + i: layout for i, layout in enumerate(layouts)}}
        written = [t.clone() for t in kv]
        with torch.no_grad():
            want = step(ids, position, *written)
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="fxshard")
            # one capture and one plan: what the ranks compute, and the plan's collectives and layouts
            ranks = simulate_ranks(step, ids, position, *[t.clone() for t in kv], mesh=mesh, placements=placements)
        outs = ranks.full()
        got = outs[0] if len(outs) == 1 else tuple(outs)
        # dynamic: the logits and the grown cache; static: the logits, which read the entries the step
        # wrote (index_copy_ into the sharded buffers)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        logits, kv = (want[0], want[1:]) if cache == "dynamic" else (want, tuple(written))
        placeholders = {n.name: n for n in ranks.graph.graph.find_nodes(op="placeholder")}
        held = list(ranks.output_layouts[1:]) if cache == "dynamic" else \
            [placeholders[f"arg{2 + i}"].meta[LAYOUT] for i in range(len(kv))]  # written in place
        layouts = held if cache == "dynamic" else layouts
        out.append(([c.kind for c in collectives_of(ranks.graph)], [str(layout) for layout in held]))
        ids, position = logits[:, -1].argmax(-1, keepdim=True), position[-1:] + 1
    return out


# by default qwen2 with a dynamic cache; the others (~15 s each) with --slow: qwen2-dynamic runs the dynamic step
# sharded on kv heads, a static cache written in place runs in test_fewer_kv_heads_...[llama static, ...; 1 layer,
# 1 decode step] (this decode(), exact, only Megatron's all_reduces) and, sharded on kv heads as here, in
# tests/test_e2e_gloo.py's static generate() on 2 ranks (the same tokens, Megatron's collectives per step)
@pytest.mark.parametrize("name, cache", [
    pytest.param("llama", "dynamic", marks=pytest.mark.slow),
    pytest.param("llama", "static", marks=pytest.mark.slow),
    ("qwen2", "dynamic"),
    pytest.param("qwen2", "static", marks=pytest.mark.slow),
])
def test_prefill_and_decode_never_gather_the_cache(name, cache):
    arch = ZOO[name]
    torch.manual_seed(0)
    model = arch.build()
    steps = decode(model, cache, fxshard.MeshSpec(tp=4), arch.plan(model), (Shard(1),))  # the cache: by kv head
    assert [kinds for kinds, _ in steps] == [["all_reduce"] * arch.megatron_all_reduces] * (1 + DECODE_STEPS)


TP4 = fxshard.MeshSpec(tp=4)
PAIRS = fxshard.MeshSpec(kv=2, group=2)  # tp=4 written as (kv head, rank in its group)


def kv_heads_on_pairs(shape: tuple) -> fxshard.Layout:
    """A kv head per pair of ranks of tp=4 (its major sub-axis, tp/2), replicated in the pair: vLLM's
    cache with 2 kv heads at tp=4, a layout DTensor cannot express on a one-axis mesh."""
    return fxshard.Layout(TP4, shape, [(), (fxshard.Piece(2, TP4.axis("tp").split(2)[0]),), (), ()])


def _with_kv_heads(name: str, kv_heads: int, layers: int) -> torch.nn.Module:
    config, model = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}[name]
    return _hf(config, model, **{**DECODER, "num_key_value_heads": kv_heads, "num_hidden_layers": layers})()


def _replicated_kv(plan: dict) -> dict:
    """Megatron's plan with the k/v projections replicated (vLLM's annotation for fewer kv heads than ranks)."""
    return {n: ((Replicate(),) if re.search(r"\.(k|v)_proj\.", n) else p) for n, p in plan.items()}


def _pairs(plan: dict) -> dict:
    """Megatron's plan on (kv, group): every sharded parameter on both axes, k/v projections on kv only."""
    return {n: (p[0], Replicate() if re.search(r"\.(k|v)_proj\.", n) else p[0]) for n, p in plan.items()}


# 8 q heads, fewer kv heads than the 4 ranks: (architecture, cache, kv heads, mesh, the plan, the cache's
# layout). Static caches are inputs written in place, so they keep the layout given; a dynamic cache is
# returned, as a DTensor: on tp=4 a kv head per pair is not one (it would be moved to one every step),
# on the mesh written as (kv, group) it is (Shard(1), Replicate()). With one kv head every rank holds it.
FEWER_KV_HEADS = {
    "llama static, 2 kv heads, tp=4": ("llama", "static", 2, TP4, _replicated_kv, kv_heads_on_pairs),
    "qwen2 static, 1 kv head, tp=4": ("qwen2", "static", 1, TP4, _replicated_kv, lambda shape: (Replicate(),)),
    "llama dynamic, 2 kv heads, kv=2 x group=2": ("llama", "dynamic", 2, PAIRS, _pairs, None),
    "qwen2 dynamic, 1 kv head, tp=4": ("qwen2", "dynamic", 1, TP4, _replicated_kv, None),
}
KV_LAYOUTS = {2: {TP4: "[2] [2@tp/2] [{}] [8]", PAIRS: "[2] [2@kv] [{}] [8]"}, 1: {TP4: "[2] [1] [{}] [8]"}}


# by default the 2-kv-head cases, 1 layer and 1 decode step (multi-query's plan is tests/test_grouped_query.py's);
# with --slow every case, 2 layers and 3 decode steps
DEPTHS = [pytest.param(case, (1, 1), id=f"{case}; 1 layer, 1 decode step") for case in FEWER_KV_HEADS
          if FEWER_KV_HEADS[case][2] == 2] + \
         [pytest.param(case, (2, DECODE_STEPS), id=f"{case}; 2 layers, 3 decode steps", marks=pytest.mark.slow)
          for case in FEWER_KV_HEADS]


@pytest.mark.parametrize("case, depth", DEPTHS)
def test_fewer_kv_heads_than_ranks_keep_one_kv_head_per_group(case, depth):
    """Each rank holds the kv head its q heads read (vLLM), the cache never moves: only Megatron's
    all-reduces, in prefill as in decode."""
    name, cache, kv_heads, mesh, plan, cache_layout = FEWER_KV_HEADS[case]
    layers, decode_steps = depth
    arch = ZOO[name]
    torch.manual_seed(0)
    model = _with_kv_heads(name, kv_heads, layers)
    shape = (BATCH, kv_heads, MAX_LEN, model.config.hidden_size // model.config.num_attention_heads)
    steps = decode(model, cache, mesh, plan(arch.plan(model)), cache_layout(shape) if cache_layout else None,
                   decode_steps)
    lengths = [MAX_LEN] * (1 + decode_steps) if cache == "static" else range(PROMPT, PROMPT + 1 + decode_steps)
    layout, reduces = KV_LAYOUTS[kv_heads][mesh], arch.per_layer * layers + arch.extra
    assert steps == [(["all_reduce"] * reduces, [layout.format(n)] * 2 * layers) for n in lengths]


@pytest.mark.slow  # ~15 s; by default tests/test_e2e_gloo.py's static generate() checks 2 programs for 3 tokens
def test_generate_with_a_static_cache_compiles_no_program_per_token(fake_mesh_4):
    """Hugging Face ``generate()`` through the backend (examples/generate.py's plan and static cache, sharded
    on kv heads): the prefill and one decode step are compiled, and every later token reuses the decode
    step (cache positions are tensors, the cache is written in place): 10 new tokens, 2 programs."""
    import pathlib
    import sys

    from torch.distributed.tensor.experimental import implicit_replication
    from torch.distributed.tensor.parallel import parallelize_module

    sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "examples"))
    try:
        import generate
    finally:
        sys.path.pop(0)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**generate.CONFIG, "num_hidden_layers": 1}))
    parallelize_module(model.eval(), fake_mesh_4, generate.tensor_parallel_plan(model))
    lowered: list[str] = []
    model.forward = torch.compile(model.forward, backend="fxshard", options={
        "inductor": False, "on_graph": lambda stage, gm: lowered.append(stage) if stage == "lower" else None})
    ids = torch.randint(0, model.config.vocab_size, (BATCH, PROMPT))
    with torch.no_grad(), implicit_replication(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Found a non-scalar tensor with numel=1")
        model.generate(ids, past_key_values=generate.sharded_cache(model, fake_mesh_4, "static", BATCH, MAX_LEN),
                       attention_mask=torch.ones_like(ids), pad_token_id=model.config.eos_token_id,
                       max_new_tokens=MAX_LEN - PROMPT, min_new_tokens=MAX_LEN - PROMPT, do_sample=False)
    assert len(lowered) == 2
