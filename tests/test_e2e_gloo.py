"""End to end: torch.compile(backend="fxshard") with Inductor on real gloo ranks (127.0.0.1).

Few and bounded: each run has a timeout, so a hung collective fails the test, not CI.
"""
from __future__ import annotations

import pathlib
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture(scope="module")
def mlp_tp():
    sys.path.insert(0, str(EXAMPLES))  # spawned ranks inherit sys.path and import the module by name
    try:
        import mlp_tp

        yield mlp_tp
    finally:
        sys.path.remove(str(EXAMPLES))


def test_mlp_tensor_parallel_on_two_gloo_ranks(mlp_tp):
    results = mlp_tp.spawn(world_size=2, timeout=240.0)
    for rank, r in sorted(results.items()):
        assert r["error"] <= 1e-5, f"rank {rank}: max abs error {r['error']:.2e} vs the single-device MLP"
        # the Megatron optimum: the row-parallel output is summed once, nothing else moves
        assert r["collectives"] == ["all_reduce.default"], f"rank {rank}: {r['collectives']}"


@pytest.fixture(scope="module")
def llama_tp():
    sys.path.insert(0, str(EXAMPLES))
    try:
        import llama_tp
        from models.llama import LlamaConfig

        yield llama_tp, LlamaConfig(vocab_size=256, dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=128)
    finally:
        sys.path.remove(str(EXAMPLES))


@pytest.mark.parametrize("sequence_parallel, expected", [
    (False, ["all_reduce"] * 3),  # after attention, after the FFN, and the vocab-parallel embedding
    (True, ["reduce_scatter_tensor", "all_gather_into_tensor"] * 3),
], ids=["tp", "tp+sp"])
def test_llama_on_two_gloo_ranks(llama_tp, sequence_parallel, expected, tmp_path):
    """TP+SP loads its weights with fxshard.load_sharded from the single-device run's checkpoint
    (each rank reads its shards; the model was built on the meta device)."""
    module, config = llama_tp
    checkpoint = None
    if sequence_parallel:
        checkpoint = str(tmp_path / "llama.pt")
        module.write_checkpoint(checkpoint, config)
    results = module.spawn(world_size=2, timeout=300.0, sequence_parallel=sequence_parallel, config=config,
                           batch=2, seq=16, steps=1, checkpoint=checkpoint)
    for rank, r in sorted(results.items()):
        assert r["error"] <= 1e-4, f"rank {rank}: max abs error {r['error']:.2e} vs the single-device Llama"
        assert sorted(r["collectives"]) == sorted(expected), f"rank {rank}: {r['collectives']}"
