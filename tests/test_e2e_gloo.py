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
