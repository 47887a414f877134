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
CASES = [(name, world) if world == 2 or name in AT_FOUR else pytest.param(name, world, marks=pytest.mark.slow)
         for world in (2, 4) for name in ZOO]


@pytest.mark.parametrize("name, world", CASES)
def test_megatron_tensor_parallel(name, world):
    arch = ZOO[name]
    r = run(arch, world)
    assert r.warnings == []
    assert r.max_error < TOLERANCE
    assert r.collectives == {"all_reduce": arch.megatron_all_reduces}


@pytest.mark.parametrize("name", [n for n, a in ZOO.items() if a.stream])
def test_tensor_and_sequence_parallel(name):
    arch = ZOO[name]
    r = run(arch, 2, sequence_parallel=True)
    assert r.warnings == []
    assert r.max_error < TOLERANCE
    assert r.collectives == arch.sequence_parallel_collectives  # Megatron-SP's, or zoo.SP_GAPS says why not
