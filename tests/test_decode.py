"""KV-cache inference under Megatron TP: prefill, then decode one token at a time.

The step is what ``generate()`` runs: the model with a cache and the cache positions. Its cache
is explicit tensors here (rebuilt into a ``DynamicCache`` or written in place into a
``StaticCache``'s buffers with ``index_copy_``), sharded on the key/value heads like the k/v
projections that fill it, so a step moves nothing but Megatron's all-reduces: the cache is never
gathered. Every step's logits are the one-device logits.
"""
from __future__ import annotations

import warnings

import pytest
import torch
from torch.distributed.tensor import Shard

import fxshard

transformers = pytest.importorskip("transformers")

from zoo import ZOO  # noqa: E402

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


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_prefill_and_decode_never_gather_the_cache(name, cache):
    arch = ZOO[name]
    torch.manual_seed(0)
    model = arch.build()
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    step = (dynamic_step if cache == "dynamic" else static_step)(model)
    kv: tuple = () if cache == "dynamic" else tuple(
        torch.zeros(BATCH, config.num_key_value_heads, MAX_LEN, head_dim) for _ in range(2 * config.num_hidden_layers))
    ids, position = torch.randint(0, 256, (BATCH, PROMPT)), torch.arange(PROMPT)
    mesh = fxshard.MeshSpec(tp=4)
    for _ in range(1 + DECODE_STEPS):
        placements = {**arch.plan(model), **{2 + i: (Shard(1),) for i in range(len(kv))}}  # cache: by kv head
        written = [t.clone() for t in kv]
        with torch.no_grad():
            want = step(ids, position, *written)
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="fxshard")
            got = fxshard.simulate(step, ids, position, *[t.clone() for t in kv], mesh=mesh, placements=placements)
            explanation = fxshard.explain(step, ids, position, *kv, mesh=mesh, placements=placements)
        if cache == "dynamic":
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)  # logits and the grown cache
            logits, kv = want[0], want[1:]
        else:  # the step's logits read the entries it wrote (index_copy_ into the sharded buffers)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
            logits, kv = want, tuple(written)
        assert [c.kind for c in explanation.collectives] == ["all_reduce"] * arch.megatron_all_reduces
        ids, position = logits[:, -1].argmax(-1, keepdim=True), position[-1:] + 1
