"""Hugging Face Bloom under Megatron TP (the zoo's ``bloom``), called the default way
(``model(input_ids=ids).logits``: a KV cache is built): a GeLU written as a custom
autograd.Function, ALiBi attention scores from ``baddbmm`` over per-head slopes tiled over the
batch (``repeat``), and q, k, v fused per head. Every op has a rule, the result is the one-device
result, and the collectives are Megatron's: one all_reduce per attention and per MLP, one for
the vocab-parallel embedding; the ALiBi scores are sharded by head. Needs the ``models`` extra.
"""
from __future__ import annotations

import pathlib
import sys

import pytest
import torch

import fxshard
from fxshard.graph import LAYOUT

pytest.importorskip("transformers")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
try:
    from zoo import ZOO
finally:
    sys.path.pop(0)

BLOOM = ZOO["bloom"]


@pytest.fixture(scope="module")
def bloom():
    torch.manual_seed(0)
    model = BLOOM.build()
    return model, BLOOM.call(model), BLOOM.example(2, 8), BLOOM.plan(model)


@pytest.mark.parametrize("tp", [4])  # exactness at tp 2 and 4, without fallbacks: tests/test_zoo.py
def test_megatron_collectives_and_alibi_by_head(bloom, tp):
    model, fn, args, placements = bloom
    with torch.no_grad():
        explanation = fxshard.explain(fn, *args, mesh=fxshard.MeshSpec(tp=tp), placements=placements)
    kinds = [c.kind for c in explanation.collectives]
    assert kinds == ["all_reduce"] * BLOOM.megatron_all_reduces  # 2 per layer + 1: the alibi is never gathered
    scores = [n for n in explanation.graph.graph.nodes if n.target is torch.ops.aten.baddbmm.default]
    assert len(scores) == BLOOM.layers
    assert all(n.meta[LAYOUT].sharded_axes() for n in scores)  # [batch x heads, q, kv]: heads on tp
