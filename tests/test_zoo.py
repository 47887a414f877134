"""Hugging Face architectures no one here wrote, called as their users call them (tests/zoo.py).

Each is exact against one device on simulated ranks under its Megatron TP placements, with no
op falling back to replication (a missing rule warns even where the inputs are replicated), and
reduces exactly as often as a hand-written Megatron implementation. With the residual stream
pinned to the sequence (sequence parallelism), each of those reductions becomes a
reduce-scatter and its gather an all-gather, except where zoo.SP_GAPS records what fxshard does
instead and why.
"""
from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from zoo import ZOO, run  # noqa: E402

TOLERANCE = 1e-4  # float32 sums in another order; T5's unscaled attention logits are the largest


# at 4 ranks by default: grouped-query attention fused by kv group (falcon), kv heads = ranks (llama),
# q/k/v and gate/up fused as Megatron stores them (phi3), an encoder (bert); the others with --slow
AT_FOUR = {"llama", "falcon", "phi3", "bert"}
# at 2 ranks by default every architecture but these, whose paths a default test runs (with --slow all of them):
SLOW_AT_TWO = {
    "mistral",  # Llama's plan with a sliding window: llama-2, and gemma3-2 (sliding window); mistral under TP+SP
    "gemma",  # gemma3-2 (the same tied plan and head_dim); gemma under TP+SP (the same model and plan, exact)
    "qwen2_moe",  # ~5 s; mixtral-2 (routed experts); qwen2_moe under TP+SP (the same model and plan, exact)
    "bart",  # ~9 s; t5-2 (encoder-decoder, cross-attention), opt-2 (BART's q/k/v/fc1/fc2 plan, learned positions)
    *AT_FOUR - {"llama"},  # the same model, plan and counts at 4 ranks by default, and under TP+SP at 2
}
CASES = [(name, world) if (world == 2 and name not in SLOW_AT_TWO) or (world == 4 and name in AT_FOUR)
         else pytest.param(name, world, marks=pytest.mark.slow) for world in (2, 4) for name in ZOO]


@pytest.mark.parametrize("name, world", CASES)
def test_megatron_tensor_parallel(name, world):
    arch = ZOO[name]
    r = run(arch, world)
    assert r.warnings == []
    assert r.max_error < TOLERANCE
    assert r.collectives == {"all_reduce": arch.megatron_all_reduces}


# under TP+SP by default every architecture with a residual stream but these (with --slow all of them):
SP_SLOW = {
    "qwen2",  # llama's (the same plan, stream and Megatron-SP counts; qwen2-2 runs its q/k/v biases)
    "mixtral",  # ~4 s; qwen2_moe's (the routing on sequence shards, "as Mixtral" in SP_GAPS); mixtral-2 runs it
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SP_SLOW else n
                                  for n, a in ZOO.items() if a.stream])
def test_tensor_and_sequence_parallel(name):
    arch = ZOO[name]
    r = run(arch, 2, sequence_parallel=True)
    assert r.warnings == []
    assert r.max_error < TOLERANCE
    assert r.collectives == arch.sequence_parallel_collectives  # Megatron-SP's, or zoo.SP_GAPS says why not
