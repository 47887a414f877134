"""torchtitan's models under its own ``Module.parallelize``: every rank's program matches one device.

The models, their sharding configs and ``ParallelDims`` are torchtitan's (tests/titan_programs.py says what
is shrunk or left out, and why). torchtitan's fused QKV projection builds a ``local_map`` from
``qkv.placements`` and ``qkv.device_mesh``; these tests run that code as it is written
(backend/capture/dtensor_reads.py). torchtitan 0.3.0 imports triton (its expert-parallel kernels), which torch
2.15's build brings and the 2.13 CPU wheel does not: there this file skips. CI installs torchtitan 0.3.0
with spmd_types 0.2.3 and tyro (.ci/run).
"""
from __future__ import annotations

import pathlib
import sys

import pytest
import torch

import fxshard

pytest.importorskip("triton", reason="torchtitan 0.3.0 imports triton; this torch build has none (2.13's CPU wheel)")
pytest.importorskip("torchtitan", reason="torchtitan 0.3.0 is not installed (.ci/run installs it)")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import titan_programs as titan  # noqa: E402

SEQ, BATCH = 16, 2


def tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, titan.VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def parallelized(kind: str, tp: int, dims, sequence_parallel: bool = False, n_layers: int = 1):
    """(single-device model, the same weights parallelized by torchtitan on ``dims``)."""
    cfg = titan.replicate_embedding(titan.CONFIGS[kind](n_layers, sequence_parallel))
    single = titan.build(cfg)
    sharded = titan.build(cfg)
    sharded.load_state_dict(single.state_dict())
    return single, titan.parallelize(sharded, dims, vocab_offsets=False)


# (model, tp, sequence parallel): llama3 at tp 4 with SP and qwen3 at tp 2 by default, the rest with --slow
CASES = [("llama3", 4, True), ("qwen3", 2, False), pytest.param("llama3", 2, False, marks=pytest.mark.slow),
         pytest.param("qwen3", 4, True, marks=pytest.mark.slow)]


@pytest.mark.parametrize("kind,tp,sp", CASES)
def test_forward_matches_one_device(kind, tp, sp):
    x = tokens()
    with titan.parallel_dims_on_cpu(tp) as dims:
        single, sharded = parallelized(kind, tp, dims, sp)
        with torch.no_grad():
            ref = single(x)
            out = fxshard.simulate(sharded, x)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_training_step_gradients_match_one_device():
    """simulate(grad=True): the loss and every parameter's gradient, torchtitan's Llama 3 at tp 2 + SP."""
    x = tokens()
    with titan.parallel_dims_on_cpu(2) as dims:
        single, sharded = parallelized("llama3", 2, dims, sequence_parallel=True, n_layers=1)
        loss = single(x).float().pow(2).mean()
        loss.backward()
        out, grads = fxshard.simulate(lambda t: sharded(t).float().pow(2).mean(), x, grad=True)
    torch.testing.assert_close(out, loss.detach(), rtol=1e-4, atol=1e-5)
    want = {n: p.grad for n, p in single.named_parameters()}
    assert set(grads) == set(want)
    for name, g in grads.items():
        torch.testing.assert_close(g, want[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.fixture(scope="module")
def vocab_parallel_ranks():
    """torchtitan's Llama 3 (one layer) at tp 2 with its vocab-parallel ``Embedding.forward`` as written, on two
    gloo ranks without Inductor (~50 s, one spawn for the tests below): each rank's forward, loss and gradients
    against one device (``titan.gloo_training_step``)."""
    return _spawn(titan.gloo_training_step, 2, timeout=600.0)


def test_vocab_parallel_embedding_as_torchtitan_writes_it_on_two_gloo_ranks(vocab_parallel_ranks):
    """torchtitan's vocab-parallel ``Embedding.forward`` as written: inside code on ``to_local()`` shards it shifts
    the ids by ``dist.get_rank(tp_group) * rows``, masks them and looks them up in the rank's table. Each real rank
    captures its own offset; fxshard runs that lookup as eager did, on the ids it computed (reading the region's
    lookup as its own masked lookup of the Shard(0) table shifted them again: max error 39.7 before)."""
    for rank, r in sorted(vocab_parallel_ranks.items()):
        assert r["forward"]["type"] == "DTensor" and r["forward"]["error"] <= 1e-4, f"rank {rank}: {r['forward']}"


def test_training_step_with_the_vocab_parallel_embedding_on_two_gloo_ranks(vocab_parallel_ranks):
    """The loss and every gradient but the embedding table's (the next test's) match one device on both ranks."""
    for rank, r in sorted(vocab_parallel_ranks.items()):
        assert r["loss"] <= 1e-4, (rank, r["loss"])
        grads = {name: g for name, g in r["grads"].items() if name != "tok_embeddings.weight"}
        assert all(g is not None for g in grads.values()) and len(grads) == 9, (rank, grads)
        for name, (error, largest) in grads.items():
            assert error <= 1e-5 + 1e-4 * largest, (rank, name, error, largest)


def test_vocab_parallel_embedding_gradient_on_two_gloo_ranks(vocab_parallel_ranks):
    """The table's gradient, each rank's Shard(0) block gathered, against one device's: the backward's accumulation
    into the table reads the forward's ids (computed on plain tensors) and is autograd's, outside the region, so it
    takes its lookup's mark (local_regions.mark_local_accumulations); unmarked, localize shifted the ids into the
    rank's block again and rank 1's rows got nothing (max error 0.27, the gradient's largest entry)."""
    for rank, r in sorted(vocab_parallel_ranks.items()):
        error, largest = r["grads"]["tok_embeddings.weight"]
        assert error <= 1e-5 + 1e-4 * largest, (rank, error, largest)


def test_simulate_warns_where_the_vocab_parallel_embedding_reads_its_rank():
    """Under simulate every rank runs the one capture, with this process's rank's offset baked in by Dynamo:
    simulate says so, naming the lookup, instead of returning other numbers than real ranks do in silence."""
    x = tokens()
    cfg = titan.llama3_config(n_layers=0)
    sharded = titan.build(cfg)
    with titan.parallel_dims_on_cpu(4) as dims:
        titan.parallelize(sharded, dims)
        with torch.no_grad(), pytest.warns(UserWarning, match=r"simulate: %embedding index their rank's own shard"):
            fxshard.simulate(sharded, x)


def _spawn(run, world_size: int, **kwargs):
    """examples/ranks.py's ``spawn`` (spawned ranks inherit sys.path and import by name)."""
    here = pathlib.Path(__file__).resolve().parent
    sys.path.insert(0, str(here.parent / "examples"))
    try:
        from ranks import spawn

        return spawn(run, world_size, **kwargs)
    finally:
        sys.path.remove(str(here.parent / "examples"))


@pytest.mark.slow  # ~90 s: two ranks, each compiling its program with Inductor
def test_compiled_on_two_gloo_ranks():
    """torch.compile(backend="fxshard") of torchtitan's Llama 3 (TP + SP) on two gloo ranks: each rank's output
    DTensor, gathered, is the single-device output."""
    results = _spawn(titan.gloo_forward, 2, timeout=600.0)
    for rank, r in sorted(results.items()):
        assert r["type"] == "DTensor" and r["error"] <= 1e-4, f"rank {rank}: {r}"


def moe_forward(kind: str, n_layers: int):
    """(one device's logits, the simulated run, its collectives by kind, fxshard's warnings): torchtitan's MoE
    model ``kind`` under its own parallelize at tp 2 (the embedding replicated), in eval mode (training counts
    tokens per expert into a buffer in place, which simulate cannot write back into a DTensor)."""
    from collections import Counter
    import warnings

    from fxshard.backend.explain import collectives_of
    from fxshard.backend.simulate import simulate_ranks

    x = tokens()
    with titan.parallel_dims_on_cpu(2) as dims:
        single, sharded = parallelized(kind, 2, dims, n_layers=n_layers)
        single.eval(), sharded.eval()
        with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ref = single(x)
            ran = simulate_ranks(sharded, x)
    ours = sorted({str(w.message) for w in caught if str(w.message).startswith("fxshard")})
    return ref, ran, Counter(c.kind for c in collectives_of(ran.graph)), ours


# torchtitan's MoE models at tp 2 (layers: Qwen3-MoE's every layer MoE; DeepSeek V3's first layer dense, the second
# MoE): two all_reduce of the residual stream [2, 16, 64] per layer, dense or MoE: after attention (wo's partial
# sums) and after the feed-forward (w2's; in a MoE layer the routed experts' partial output, which torchtitan's
# local_map region scatter-adds into zeros, summed with the shared experts' before the one all_reduce)
MOE_MODELS = [("qwen3_moe", 1, {"all_reduce": 2}), ("deepseek_v3", 2, {"all_reduce": 4})]


@pytest.mark.parametrize("kind,n_layers,collectives", MOE_MODELS)
def test_moe_forward_matches_one_device(kind, n_layers, collectives):
    """torchtitan's own MoE (router, grouped-mm experts in a local_map region, deterministic_scatter_add combine)
    under its own parallelize: exact against one device, every op with a rule (no replicated-op warning), and
    only the per-layer all_reduces of dense TP. (The combine's zeros used to stop the plan: the region's
    scatter_add wants them as partial sums, fxshard/factories.py now gives them that layout.)"""
    ref, ran, counts, ours = moe_forward(kind, n_layers)
    assert ours == [], ours
    assert dict(counts) == collectives
    out = ran.full()
    torch.testing.assert_close(out[0] if isinstance(out, (list, tuple)) else out, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.slow  # ~50 s: two gloo ranks
def test_flex_attention_on_two_gloo_ranks():
    """torchtitan's Llama 3 with its own FlexAttention (run unfused: its max-autotune compile wants Triton) and its
    packed-document block mask, under its own parallelize at tp 2, forward on two gloo ranks: each rank's output
    DTensor is one device's, with no fxshard warning. Real ranks, not simulate: torchtitan calls flex on the
    ``to_local()`` shards, which under simulate are LocalTensors, and torch 2.15 has no flex_attention rule for
    LocalTensor ('There was no rule registered for HOP flex_attention and subclass LocalTensor'; Dynamo breaks
    the graph there and eager then fails the same way)."""
    results = _spawn(titan.gloo_flex_forward, 2, timeout=600.0)
    for rank, r in sorted(results.items()):
        assert r["type"] == "DTensor" and r["warnings"] == [], (rank, r)
        assert r["error"] <= 1e-5 * r["largest"], (rank, r)


def test_auto_placements_within_torchtitans_memory_finds_its_tp_plan():
    """``fxshard.auto_placements`` on torchtitan's Llama 3 (plain, unparallelized) on tp=4, within the memory
    torchtitan's own tp plan needs: the same bytes and modeled step as that plan (the quick memory puts it 9%
    over; planned whole it fits, and the search checks the cheap tries near the budget so); exact."""
    import math

    from torch.distributed.tensor import DTensor, Replicate

    with titan.parallel_dims_on_cpu(4) as dims:
        single, sharded = parallelized("llama3", 4, dims, n_layers=2)
        hand = {n: tuple(p.placements) for n, p in sharded.named_parameters() if isinstance(p, DTensor)}
    single.eval()
    x = tokens()
    every = {n: hand.get(n, (Replicate(),)) for n, _ in single.named_parameters()}
    titans = fxshard.auto_placements(single, x, mesh={"tp": 4}, memory_budget=math.inf, placements=every).priced
    auto = fxshard.auto_placements(single, x, mesh={"tp": 4}, memory_budget=titans.memory)
    assert auto.priced.memory <= titans.memory and auto.priced.cost <= titans.cost * (1 + 1e-9)
    assert fxshard.explain(single, x, mesh={"tp": 4}, placements=dict(auto)).bytes_per_rank <= \
        fxshard.explain(single, x, mesh={"tp": 4}, placements=hand).bytes_per_rank
    x = tokens(seed=2)
    with torch.no_grad():
        torch.testing.assert_close(fxshard.simulate(single, x, mesh={"tp": 4}, placements=dict(auto)), single(x),
                                   rtol=1e-4, atol=1e-5)
