"""Real transformer models: every parallelism matches the single-device forward, with the
communication a Megatron expert would write.

Plans come from ``parallelize_module`` (made under LocalTensorMode so every rank's shard is
known) or from parameter placements; ``simulate`` runs all ranks in one process.
"""
from __future__ import annotations

import pathlib
import sys
import warnings
from collections import Counter

import pytest
import torch
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import parallelize_module

import fxshard
from fxshard.backend.explain import collectives_of
from fxshard.backend.simulate import fake_world, simulate_ranks
from fxshard.propagate import UnsupportedOpError

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
from models.llama import (  # noqa: E402
    COLUMN_PARALLEL, ROW_PARALLEL, Llama, LlamaConfig, fsdp_placements, fsdp_tp_placements, megatron_placements,
    tensor_parallel_plan)

CFG = LlamaConfig(vocab_size=256, dim=128, n_layers=2, n_heads=16, n_kv_heads=8, ffn_dim=256)
COLUMN, ROW = COLUMN_PARALLEL, ROW_PARALLEL


def fresh_model(cfg: LlamaConfig = CFG) -> Llama:
    return Llama(cfg).eval()


def tokens(batch: int, seq: int, cfg: LlamaConfig = CFG) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (batch, seq))


def simulated(fn, *args, **options):
    """(the simulated run, the collectives of the plan its ranks ran): one capture and one plan, where
    ``simulate`` then ``explain`` would make each twice. ``options``: ``simulate_ranks``'s."""
    run = simulate_ranks(fn, *args, **options)
    return run, collectives_of(run.graph)


def run_plan(cfg: LlamaConfig, world: int, sequence_parallel: bool, x: torch.Tensor, fn: str = "forward"):
    """(single-device output, simulated output, the collectives of the plan the ranks ran) of the TP / TP+SP
    plan: planned once for both (``simulate`` and ``explain`` would each capture and plan it)."""
    model = fresh_model(cfg)
    with torch.no_grad():
        ref = getattr(model, fn)(*x)
    with fake_world(fxshard.MeshSpec(tp=world)) as mesh:
        with LocalTensorMode(world):
            parallelize_module(model, mesh, tensor_parallel_plan(model, sequence_parallel=sequence_parallel))
        call = getattr(model, fn) if fn != "forward" else model
        run, collectives = simulated(call, *x)
    out, = run.full()
    return ref, out, collectives


def counts(collectives) -> dict[str, int]:
    """Collectives by kind (an explanation's ``collectives``, or ``run_plan``'s)."""
    return dict(Counter(c.kind for c in collectives))


# ~8 s: by default test_llama_variants_under_tensor_parallel runs this parallelize_module TP plan (exact, only
# all_reduces), and tests/test_explain_report.py's test_llama_tensor_parallel_reasons_totals_and_memory counts its
# 2 reduces per layer + 1 (megatron_placements, the same placements)
@pytest.mark.slow
@pytest.mark.parametrize("world", [4, pytest.param(8, marks=pytest.mark.slow)])
def test_llama_tensor_parallel_two_all_reduces_per_layer(world):
    ref, out, planned = run_plan(CFG, world, False, (tokens(2, 16),))
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    # per layer: after attention and after the FFN; one more for the vocab-parallel embedding
    assert counts(planned) == {"all_reduce": 2 * CFG.n_layers + 1}


# ~8 s: by default tests/test_training.py's test_tensor_and_sequence_parallel_with_parallelize_module runs this
# plan forward and backward (exact, its forward collectives counted), and test_golden_llama_layer_... reads it
@pytest.mark.slow
@pytest.mark.parametrize("world", [4, pytest.param(8, marks=pytest.mark.slow)])
def test_llama_tensor_and_sequence_parallel(world):
    ref, out, planned = run_plan(CFG, world, True, (tokens(2, 16),))
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    # per layer 2 all_gather (into attention, into the FFN) + 2 reduce_scatter (out of them);
    # the embedding reduce-scatters onto the sequence, the output projection gathers it back
    assert counts(planned) == {"all_gather": 2 * CFG.n_layers + 1, "reduce_scatter": 2 * CFG.n_layers + 1}


@pytest.mark.parametrize("world", [4, pytest.param(8, marks=pytest.mark.slow)])
def test_vocab_parallel_loss_moves_no_tokens_by_vocab_tensor(world):
    """Embedding and output vocab-sharded: masked lookups and a sharded log-softmax, never the logits."""
    model = fresh_model()
    x, y = tokens(2, 16), tokens(2, 16)
    mesh = fxshard.MeshSpec(tp=world)
    run, collectives = simulated(model.loss, x, y, mesh=mesh, placements=megatron_placements(model))
    out, = run.full()
    with torch.no_grad():
        torch.testing.assert_close(out, model.loss(x, y), rtol=1e-4, atol=1e-5)
    logits_sized = [c for c in collectives if c.node.meta["val"].numel() >= x.numel() * CFG.vocab_size]
    assert not logits_sized, [str(c) for c in logits_sized]


@pytest.mark.parametrize("variant", [dict(rope="complex"), dict(tie_embeddings=True)])
def test_llama_variants_under_tensor_parallel(variant):
    cfg = LlamaConfig(vocab_size=256, dim=64, n_layers=1, n_heads=8, n_kv_heads=4, ffn_dim=128, **variant)
    ref, out, planned = run_plan(cfg, 4, False, (tokens(2, 8, cfg),))
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    assert set(counts(planned)) == {"all_reduce"}


# Bytes, not latency, decide the FSDP-style plans below: at these toy sizes the default 10 us per
# collective would favour fewer, larger collectives (moving activations instead of weights).
BANDWIDTH_BOUND = fxshard.CostModel(default_latency=0.0)


placements_fsdp = fsdp_placements  # every parameter Shard(0) on dp; propagation gathers each where used
placements_2d = fsdp_tp_placements  # dp x tp: Megatron on tp, every weight's other dim on dp


@pytest.mark.parametrize("dp", [4, pytest.param(8, marks=pytest.mark.slow)])
def test_llama_fsdp_gathers_parameters_only(dp):
    """Activations larger than weights (8 sequences of 64 per rank): gathering each weight where it
    is used is the cheapest plan, and nothing else moves."""
    model = fresh_model()
    x = tokens(8 * dp, 64)
    pl = {**placements_fsdp(model), 0: (Shard(0),)}
    mesh = fxshard.MeshSpec(dp=dp)
    run, collectives = simulated(model, x, mesh=mesh, placements=pl, cost_model=BANDWIDTH_BOUND)
    out, = run.full()
    with torch.no_grad():
        torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-4)
    n_params = len(list(model.parameters()))
    assert counts(collectives) == {"all_gather": n_params}  # each parameter once, activations never move
    sources = [c.node.args[0] for c in collectives]
    sources = [a.args[0] if a.target is torch.ops.aten.t.default else a for a in sources]  # weight.t()
    assert {a.op for a in sources} == {"placeholder"}


@pytest.mark.parametrize("batch, seq", [(8, 32), (16, 8)])
def test_fsdp_plan_never_moves_more_than_gathering_every_weight(batch, seq):
    """Few tokens per rank: moving some activations instead of their (larger) weights beats FSDP's
    plan, which refine.py always has as a candidate, so the plan found is never worse than it."""
    dp = 4
    model = fresh_model()
    x = tokens(batch, seq)
    pl = {**placements_fsdp(model), 0: (Shard(0),)}
    mesh = fxshard.MeshSpec(dp=dp)
    run, collectives = simulated(model, x, mesh=mesh, placements=pl, cost_model=BANDWIDTH_BOUND)
    out, = run.full()
    every_weight = sum(p.numel() * 4 * (dp - 1) // dp for p in model.parameters())
    assert sum(c.bytes_per_rank for c in collectives) < every_weight
    with torch.no_grad():
        torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-4)


def test_llama_2d_data_and_tensor_parallel():
    """Megatron on tp, FSDP on dp: every dp collective gathers a weight, every tp one reduces a block output."""
    model = fresh_model()
    x = tokens(8, 32)
    pl = {**placements_2d(model), 0: (Shard(0), Replicate())}
    mesh = fxshard.MeshSpec(dp=2, tp=4)
    run, collectives = simulated(model, x, mesh=mesh, placements=pl, cost_model=BANDWIDTH_BOUND)
    out, = run.full()
    with torch.no_grad():
        torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-4)
    by_axes = {}
    for c in collectives:
        by_axes.setdefault((c.kind, ",".join(map(str, c.axes))), []).append(c)
    assert sorted(by_axes) == [("all_gather", "dp"), ("all_reduce", "tp")], sorted(by_axes)
    assert len(by_axes[("all_reduce", "tp")]) == 2 * CFG.n_layers + 1  # + the vocab-parallel embedding
    gathered = [c.node.args[0] for c in by_axes[("all_gather", "dp")]]
    gathered = [a.args[0] if a.target is torch.ops.aten.t.default else a for a in gathered]  # weight.t()
    assert {a.op for a in gathered} == {"placeholder"} and "arg0" not in {a.name for a in gathered}


def test_constrain_pins_a_layout():
    def f(x, w):
        return torch.relu(fxshard.constrain(x @ w, [Shard(0)]))

    x, w = torch.randn(8, 16), torch.randn(16, 12)
    mesh, pl = fxshard.MeshSpec(tp=4), {1: (Shard(1),)}
    e = fxshard.explain(f, x, w, mesh=mesh, placements=pl)
    assert str(e.output_layouts[0]) == "[4@tp 2] [12]"
    torch.testing.assert_close(fxshard.simulate(f, x, w, mesh=mesh, placements=pl), f(x, w))
    torch.testing.assert_close(fxshard.constrain(x, [Shard(0)]), x)  # eagerly: the value itself


def rule_less_model(x, w):
    return torch.cumprod(x @ w, 1)  # cumprod has no sharding rule


def test_strict_mode_names_the_op_its_layouts_and_the_fixes():
    x, w = torch.randn(8, 16), torch.randn(16, 12)
    with pytest.raises(UnsupportedOpError) as err:
        fxshard.explain(rule_less_model, x, w, mesh=fxshard.MeshSpec(tp=4), placements={1: (Shard(1),)}, strict=True)
    text = str(err.value)
    assert "aten.cumprod.default" in text and "[16] [4@tp 3]" not in text and "[8] [4@tp 3]" in text
    assert "fxshard.registry.OPS" in text and "fxshard.constrain" in text and "strict=True" in text


def test_fallback_replicates_warns_once_per_program_and_stays_correct():
    x, w = torch.randn(8, 16), torch.randn(16, 12)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fxshard.simulate(rule_less_model, x, w, mesh=fxshard.MeshSpec(tp=4), placements={1: (Shard(1),)})
        fxshard.explain(rule_less_model, x, w, mesh=fxshard.MeshSpec(tp=4), placements={1: (Shard(1),)})
    torch.testing.assert_close(out, rule_less_model(x, w), rtol=1e-4, atol=1e-4)  # x @ w rounds per shard
    ours = [w for w in caught if "no sharding rule for aten.cumprod.default" in str(w.message)]
    # one warning per compiled program (simulate, explain), however often refinement re-propagates
    assert len(ours) == 2 and all("[8] [4@tp 3]" in str(w.message) for w in ours)


def test_local_region_that_reads_differently_globally_is_an_error():
    """Eager code on to_local() shards that uses a local size: an error, never a different program."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    class Heads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(16, 32, bias=False)

        def forward(self, x):
            y = self.proj(x)  # local shard [4, 8] on each of 4 ranks
            return y.view(y.shape[0], 2, -1)  # 2 "heads" of the local block: not a view of the global one

    with fake_world(fxshard.MeshSpec(tp=4)) as mesh:
        model = Heads()
        with LocalTensorMode(4):
            parallelize_module(model, mesh, {"proj": ColwiseParallel()})
        with pytest.raises(Exception, match="local shard|eager"):
            fxshard.explain(model, torch.randn(4, 16), mesh=mesh)


def test_golden_llama_layer_tensor_and_sequence_parallel():
    """A one-layer Llama under TP+SP at world size 4 (embedding, layer, norm, output): read this when it
    changes. Between the layers the residual stream is sharded on the sequence ([4@tp 2])."""
    from expecttest import assert_expected_inline

    cfg = LlamaConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=4, ffn_dim=64)
    model = fresh_model(cfg)
    with fake_world(fxshard.MeshSpec(tp=4)) as mesh:
        with LocalTensorMode(4):
            parallelize_module(model, mesh, tensor_parallel_plan(model, sequence_parallel=True))
        e = fxshard.explain(model, tokens(1, 8, cfg), mesh=mesh)
    assert_expected_inline(str(e), """\
%arg0: i64[1, 8] [1] [8] = input
%tok_embeddings_weight: f32[64, 32] [4@tp 16] [32] = input
%layers_0_attention_norm_weight: f32[32] [32] = input
%layers_0_attention_wq_weight: f32[32, 32] [4@tp 8] [32] = input
%layers_0_attention_wk_weight: f32[32, 32] [4@tp 8] [32] = input
%layers_0_attention_wv_weight: f32[32, 32] [4@tp 8] [32] = input
%layers_0_attention_wo_weight: f32[32, 32] [32] [4@tp 8] = input
%layers_0_ffn_norm_weight: f32[32] [32] = input
%layers_0_feed_forward_w1_weight: f32[64, 32] [4@tp 16] [32] = input
%layers_0_feed_forward_w3_weight: f32[64, 32] [4@tp 16] [32] = input
%layers_0_feed_forward_w2_weight: f32[32, 64] [32] [4@tp 16] = input
%norm_weight: f32[32] [32] = input
%output_weight: f32[64, 32] [4@tp 16] [32] = input
%arange: f32[4] [4] = aten.arange.start_step(0, 8, 2, dtype=float32, device=device, pin_memory=False)
%div: f32[4] [4] = aten.div.Tensor(%arange, 8)
%pow_1: f32[4] [4] = aten.pow.Scalar(500000.0, %div)
%reciprocal: f32[4] [4] = aten.reciprocal(%pow_1)
%mul: f32[4] [4] = aten.mul.Tensor(%reciprocal, 1.0)
%arange_1: f32[8] [8] = aten.arange(8, dtype=float32, device=device, pin_memory=False)
%view: f32[8, 1] [8] [1] = aten.view(%arange_1, [8, 1])
%mul_1: f32[8, 4] [8] [4] = aten.mul.Tensor(%view, %mul)
%embedding: f32[1, 8, 32] [1] [8] [32] P(sum@tp) = aten.embedding(%tok_embeddings_weight, %arg0)
%redistribute_default: f32[1, 8, 32] [1] [4@tp 2] [32] = redistribute(%embedding) from [1] [8] [32] P(sum@tp): reduce_scatter(tp dim 1 sum)
%pow_2: f32[1, 8, 32] [1] [4@tp 2] [32] = aten.pow.Tensor_Scalar(%redistribute_default, 2)
%mean: f32[1, 8, 1] [1] [4@tp 2] [1] = aten.mean.dim(%pow_2, [-1], True)
%add: f32[1, 8, 1] [1] [4@tp 2] [1] = aten.add.Tensor(%mean, 1e-05)
%rsqrt: f32[1, 8, 1] [1] [4@tp 2] [1] = aten.rsqrt(%add)
%mul_2: f32[1, 8, 32] [1] [4@tp 2] [32] = aten.mul.Tensor(%redistribute_default, %rsqrt)
%mul_3: f32[1, 8, 32] [1] [4@tp 2] [32] = aten.mul.Tensor(%mul_2, %layers_0_attention_norm_weight)
%redistribute_default_1: f32[1, 8, 32] [1] [8] [32] = redistribute(%mul_3) from [1] [4@tp 2] [32]: all_gather(tp dim 1)
%t: f32[32, 32] [32] [4@tp 8] = aten.t(%layers_0_attention_wq_weight)
%view_1: f32[8, 32] [8] [32] = aten.view(%redistribute_default_1, [8, 32])
%mm: f32[8, 32] [8] [4@tp 8] = aten.mm(%view_1, %t)
%_unsafe_view: f32[1, 8, 32] [1] [8] [4@tp 8] = aten._unsafe_view(%mm, [1, 8, 32])
%view_2: f32[1, 8, 4, 8] [1] [8] [4@tp] [8] = aten.view(%_unsafe_view, [1, 8, -1, 8])
%t_1: f32[32, 32] [32] [4@tp 8] = aten.t(%layers_0_attention_wk_weight)
%mm_1: f32[8, 32] [8] [4@tp 8] = aten.mm(%view_1, %t_1)
%_unsafe_view_1: f32[1, 8, 32] [1] [8] [4@tp 8] = aten._unsafe_view(%mm_1, [1, 8, 32])
%view_4: f32[1, 8, 4, 8] [1] [8] [4@tp] [8] = aten.view(%_unsafe_view_1, [1, 8, -1, 8])
%t_2: f32[32, 32] [32] [4@tp 8] = aten.t(%layers_0_attention_wv_weight)
%mm_2: f32[8, 32] [8] [4@tp 8] = aten.mm(%view_1, %t_2)
%_unsafe_view_2: f32[1, 8, 32] [1] [8] [4@tp 8] = aten._unsafe_view(%mm_2, [1, 8, 32])
%view_6: f32[1, 8, 4, 8] [1] [8] [4@tp] [8] = aten.view(%_unsafe_view_2, [1, 8, -1, 8])
%cat: f32[8, 8] [8] [8] = aten.cat([%mul_1, %mul_1], -1)
%cos: f32[8, 8] [8] [8] = aten.cos(%cat)
%unsqueeze: f32[1, 8, 8] [1] [8] [8] = aten.unsqueeze(%cos, 0)
%unsqueeze_1: f32[1, 8, 1, 8] [1] [8] [1] [8] = aten.unsqueeze(%unsqueeze, 2)
%sin: f32[8, 8] [8] [8] = aten.sin(%cat)
%unsqueeze_2: f32[1, 8, 8] [1] [8] [8] = aten.unsqueeze(%sin, 0)
%unsqueeze_3: f32[1, 8, 1, 8] [1] [8] [1] [8] = aten.unsqueeze(%unsqueeze_2, 2)
%mul_4: f32[1, 8, 4, 8] [1] [8] [4@tp] [8] = aten.mul.Tensor(%view_2, %unsqueeze_1)
%slice_1: f32[1, 8, 4, 4] [1] [8] [4@tp] [4] = aten.slice.Tensor(%view_2, 3, 4, 9223372036854775807)
%neg: f32[1, 8, 4, 4] [1] [8] [4@tp] [4] = aten.neg(%slice_1)
%slice_2: f32[1, 8, 4, 4] [1] [8] [4@tp] [4] = aten.slice.Tensor(%view_2, 3, 0, 4)
%cat_1: f32[1, 8, 4, 8] [1] [8] [4@tp] [8] = aten.cat([%neg, %slice_2], -1)
%mul_5: f32[1, 8, 4, 8] [1] [8] [4@tp] [8] = aten.mul.Tensor(%cat_1, %unsqueeze_3)
%add_1: f32[1, 8, 4, 8] [1] [8] [4@tp] [8] = aten.add.Tensor(%mul_4, %mul_5)
%mul_6: f32[1, 8, 4, 8] [1] [8] [4@tp] [8] = aten.mul.Tensor(%view_4, %unsqueeze_1)
%slice_3: f32[1, 8, 4, 4] [1] [8] [4@tp] [4] = aten.slice.Tensor(%view_4, 3, 4, 9223372036854775807)
%neg_1: f32[1, 8, 4, 4] [1] [8] [4@tp] [4] = aten.neg(%slice_3)
%slice_4: f32[1, 8, 4, 4] [1] [8] [4@tp] [4] = aten.slice.Tensor(%view_4, 3, 0, 4)
%cat_3: f32[1, 8, 4, 8] [1] [8] [4@tp] [8] = aten.cat([%neg_1, %slice_4], -1)
%mul_7: f32[1, 8, 4, 8] [1] [8] [4@tp] [8] = aten.mul.Tensor(%cat_3, %unsqueeze_3)
%add_2: f32[1, 8, 4, 8] [1] [8] [4@tp] [8] = aten.add.Tensor(%mul_6, %mul_7)
%transpose: f32[1, 4, 8, 8] [1] [4@tp] [8] [8] = aten.transpose.int(%add_1, 1, 2)
%transpose_1: f32[1, 4, 8, 8] [1] [4@tp] [8] [8] = aten.transpose.int(%add_2, 1, 2)
%transpose_2: f32[1, 4, 8, 8] [1] [4@tp] [8] [8] = aten.transpose.int(%view_6, 1, 2)
%_scaled_dot_product_flash_attention_for_cpu = aten._scaled_dot_product_flash_attention_for_cpu(%transpose, %transpose_1, %transpose_2, 0.0, True)
%getitem: f32[1, 4, 8, 8] [1] [4@tp] [8] [8] = getitem(%_scaled_dot_product_flash_attention_for_cpu, 0)
%getitem_1: f32[1, 4, 8] [1] [4@tp] [8] = getitem(%_scaled_dot_product_flash_attention_for_cpu, 1)
%transpose_3: f32[1, 8, 4, 8] [1] [8] [4@tp] [8] = aten.transpose.int(%getitem, 1, 2)
%view_7: f32[1, 8, 32] [1] [8] [4@tp 8] = aten.view(%transpose_3, [1, 8, -1])
%t_3: f32[32, 32] [4@tp 8] [32] = aten.t(%layers_0_attention_wo_weight)
%view_8: f32[8, 32] [8] [4@tp 8] = aten.view(%view_7, [8, 32])
%mm_3: f32[8, 32] [8] [32] P(sum@tp) = aten.mm(%view_8, %t_3)
%_unsafe_view_3: f32[1, 8, 32] [1] [8] [32] P(sum@tp) = aten._unsafe_view(%mm_3, [1, 8, 32])
%redistribute_default_2: f32[1, 8, 32] [1] [4@tp 2] [32] = redistribute(%_unsafe_view_3) from [1] [8] [32] P(sum@tp): reduce_scatter(tp dim 1 sum)
%add_3: f32[1, 8, 32] [1] [4@tp 2] [32] = aten.add.Tensor(%redistribute_default, %redistribute_default_2)
%pow_3: f32[1, 8, 32] [1] [4@tp 2] [32] = aten.pow.Tensor_Scalar(%add_3, 2)
%mean_1: f32[1, 8, 1] [1] [4@tp 2] [1] = aten.mean.dim(%pow_3, [-1], True)
%add_4: f32[1, 8, 1] [1] [4@tp 2] [1] = aten.add.Tensor(%mean_1, 1e-05)
%rsqrt_1: f32[1, 8, 1] [1] [4@tp 2] [1] = aten.rsqrt(%add_4)
%mul_8: f32[1, 8, 32] [1] [4@tp 2] [32] = aten.mul.Tensor(%add_3, %rsqrt_1)
%mul_9: f32[1, 8, 32] [1] [4@tp 2] [32] = aten.mul.Tensor(%mul_8, %layers_0_ffn_norm_weight)
%redistribute_default_3: f32[1, 8, 32] [1] [8] [32] = redistribute(%mul_9) from [1] [4@tp 2] [32]: all_gather(tp dim 1)
%t_4: f32[32, 64] [32] [4@tp 16] = aten.t(%layers_0_feed_forward_w1_weight)
%view_9: f32[8, 32] [8] [32] = aten.view(%redistribute_default_3, [8, 32])
%mm_4: f32[8, 64] [8] [4@tp 16] = aten.mm(%view_9, %t_4)
%_unsafe_view_4: f32[1, 8, 64] [1] [8] [4@tp 16] = aten._unsafe_view(%mm_4, [1, 8, 64])
%silu: f32[1, 8, 64] [1] [8] [4@tp 16] = aten.silu(%_unsafe_view_4)
%t_5: f32[32, 64] [32] [4@tp 16] = aten.t(%layers_0_feed_forward_w3_weight)
%mm_5: f32[8, 64] [8] [4@tp 16] = aten.mm(%view_9, %t_5)
%_unsafe_view_5: f32[1, 8, 64] [1] [8] [4@tp 16] = aten._unsafe_view(%mm_5, [1, 8, 64])
%mul_10: f32[1, 8, 64] [1] [8] [4@tp 16] = aten.mul.Tensor(%silu, %_unsafe_view_5)
%t_6: f32[64, 32] [4@tp 16] [32] = aten.t(%layers_0_feed_forward_w2_weight)
%view_11: f32[8, 64] [8] [4@tp 16] = aten.view(%mul_10, [8, 64])
%mm_6: f32[8, 32] [8] [32] P(sum@tp) = aten.mm(%view_11, %t_6)
%_unsafe_view_6: f32[1, 8, 32] [1] [8] [32] P(sum@tp) = aten._unsafe_view(%mm_6, [1, 8, 32])
%redistribute_default_4: f32[1, 8, 32] [1] [4@tp 2] [32] = redistribute(%_unsafe_view_6) from [1] [8] [32] P(sum@tp): reduce_scatter(tp dim 1 sum)
%add_5: f32[1, 8, 32] [1] [4@tp 2] [32] = aten.add.Tensor(%add_3, %redistribute_default_4)
%pow_4: f32[1, 8, 32] [1] [4@tp 2] [32] = aten.pow.Tensor_Scalar(%add_5, 2)
%mean_2: f32[1, 8, 1] [1] [4@tp 2] [1] = aten.mean.dim(%pow_4, [-1], True)
%add_6: f32[1, 8, 1] [1] [4@tp 2] [1] = aten.add.Tensor(%mean_2, 1e-05)
%rsqrt_2: f32[1, 8, 1] [1] [4@tp 2] [1] = aten.rsqrt(%add_6)
%mul_11: f32[1, 8, 32] [1] [4@tp 2] [32] = aten.mul.Tensor(%add_5, %rsqrt_2)
%mul_12: f32[1, 8, 32] [1] [4@tp 2] [32] = aten.mul.Tensor(%mul_11, %norm_weight)
%redistribute_default_5: f32[1, 8, 32] [1] [8] [32] = redistribute(%mul_12) from [1] [4@tp 2] [32]: all_gather(tp dim 1)
%t_7: f32[32, 64] [32] [4@tp 16] = aten.t(%output_weight)
%view_12: f32[8, 32] [8] [32] = aten.view(%redistribute_default_5, [8, 32])
%mm_7: f32[8, 64] [8] [4@tp 16] = aten.mm(%view_12, %t_7)
%_unsafe_view_7: f32[1, 8, 64] [1] [8] [4@tp 16] = aten._unsafe_view(%mm_7, [1, 8, 64])
return [%_unsafe_view_7]
communication: 3 x reduce_scatter(tp), 3 x all_gather(tp); 4608 bytes received per rank""")


@pytest.mark.parametrize("dim", [0, 1])
def test_cumsum_scans_locally_along_unsharded_dims(dim):
    x = torch.randn(8, 12)
    mesh, pl = fxshard.MeshSpec(tp=4), {0: (Shard(0),)}
    torch.testing.assert_close(fxshard.simulate(lambda t: torch.cumsum(t, dim), x, mesh=mesh, placements=pl),
                               torch.cumsum(x, dim))
    e = fxshard.explain(lambda t: torch.cumsum(t, dim), x, mesh=mesh, placements=pl)
    assert [c.kind for c in e.collectives] == (["all_gather"] if dim == 0 else [])


@pytest.mark.parametrize("world", [4, pytest.param(8, marks=pytest.mark.slow)])
@pytest.mark.parametrize("tokens_sharded", [False, True])
def test_moe_expert_parallel(world, tokens_sharded):
    """Top-k routed experts (GShard-style dispatch, static shapes): experts sharded on ep. Expert
    weights never move; with the batch sharded on ep too, dispatch is a reduce-scatter onto the
    experts and combine gathers their outputs (GShard's two all-to-alls)."""
    from models.moe import MoE, reference_moe

    torch.manual_seed(0)
    moe = MoE(dim=32, ffn_dim=64, n_experts=8, top_k=2).eval()
    x = torch.randn(2 * world, 8, 32)
    placements = {"w1": (Shard(0),), "w3": (Shard(0),), "w2": (Shard(0),)}
    if tokens_sharded:
        placements[0] = (Shard(0),)
    mesh = fxshard.MeshSpec(ep=world)
    run, collectives = simulated(moe, x, mesh=mesh, placements=placements, strict=True)
    out, = run.full()
    with torch.no_grad():
        torch.testing.assert_close(out, moe(x), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(moe(x), reference_moe(moe, x), rtol=1e-4, atol=1e-5)
    moved = {c.node.args[0].name for c in collectives}
    assert not moved & {"w1", "w2", "w3"}, moved
    if not tokens_sharded:
        assert collectives == [] and str(run.output_layouts[0]).endswith("P(sum@ep)")
    else:
        assert str(run.output_layouts[0]).startswith(f"[{world}@ep 2]")


def dropout(x, w):
    return torch.nn.functional.dropout(x @ w, p=0.5, training=True)


def rand_like_mask(x, w):
    y = x @ w
    return (torch.rand_like(y) > 0.5) * y * 2


@pytest.mark.parametrize("f", [dropout, rand_like_mask])
@pytest.mark.parametrize("placements", [{1: (Shard(1),)}, {0: (Shard(0),)}])
def test_random_ops_draw_the_single_device_values(f, placements):
    """Random ops draw in global shape with the caller's generator (same seed on every rank): each
    shard's mask is its block of the one-device mask, not one local mask repeated on every rank."""
    x, w = torch.randn(8, 16), torch.randn(16, 32)
    torch.manual_seed(1)
    ref = f(x, w)
    torch.manual_seed(1)
    out = fxshard.simulate(f, x, w, mesh=fxshard.MeshSpec(tp=4), placements=placements)
    torch.testing.assert_close(out, ref)
    blocks = (ref == 0).reshape(8, 4, 8).unbind(1) if 1 in placements else (ref == 0).reshape(4, 2, 32).unbind(0)
    assert not all(torch.equal(blocks[0], b) for b in blocks[1:])  # the ranks' masks differ


INDEX_CASES = {  # name: (function, x's shape, (indexed dim, index shape) each, placements, collectives)
    "rows of a column-sharded matrix": (lambda x, i: x[i], (8, 12), [(0, (6,))], {0: (Shard(1),)}, 0),
    "columns, batch sharded": (lambda x, i: x[:, i], (8, 12), [(1, (4, 5))], {0: (Shard(0),)}, 0),
    "columns, index sharded": (lambda x, i: x[:, i], (8, 12), [(1, (8, 5))], {1: (Shard(0),)}, 0),
    "two apart: index block in front": (lambda x, i, j: x[i, :, j], (8, 4, 12), [(0, (8, 1)), (2, (1, 5))],
                                        {0: (Shard(1),)}, 0),
    "the indexed dim sharded: gathered": (lambda x, i: x[i], (8, 12), [(0, (6,))], {0: (Shard(0),)}, 1),
}


@pytest.mark.parametrize("name", sorted(INDEX_CASES))
def test_advanced_indexing_is_local_where_the_indexed_dims_are(name):
    f, shape, index_specs, placements, n_collectives = INDEX_CASES[name]
    x = torch.randn(shape)
    indices = [torch.randint(0, shape[d], s) for d, s in index_specs]
    mesh = fxshard.MeshSpec(tp=4)
    torch.testing.assert_close(fxshard.simulate(f, x, *indices, mesh=mesh, placements=placements), f(x, *indices))
    e = fxshard.explain(f, x, *indices, mesh=mesh, placements=placements, strict=True)
    assert len(e.collectives) == n_collectives, [str(c) for c in e.collectives]


def _factories_case_constant(x):
    return x * torch.full((8, 12), 3.0) + torch.zeros(8, 12)


def _factories_case_arange(x):
    return x + torch.arange(10, dtype=torch.float32) + torch.arange(2, 22, 2)


@pytest.mark.parametrize("f, shape, placements", [
    (_factories_case_constant, (8, 12), {0: (Shard(1),)}),
    (_factories_case_constant, (8, 12), {0: (Shard(0),)}),
    (_factories_case_arange, (3, 10), {0: (Shard(1),)}),  # uneven: 3, 3, 3, 1 per rank
])
def test_factories_are_built_at_their_local_size(f, shape, placements):
    """A factory whose consumers all want it sharded is built as this rank's block: the local program
    has no slice of a whole factory, and every rank's block is right."""
    from fxshard.backend.simulate import fake_world, lowered_graphs

    x = torch.randn(shape)
    mesh = fxshard.MeshSpec(tp=4)
    torch.testing.assert_close(fxshard.simulate(f, x, mesh=mesh, placements=placements), f(x))
    e = fxshard.explain(f, x, mesh=mesh, placements=placements)
    factories = [n for n in e.graph.graph.nodes if n.op == "call_function" and n.target in (
        torch.ops.aten.full.default, torch.ops.aten.zeros.default, torch.ops.aten.arange.default,
        torch.ops.aten.arange.start_step)]
    x_layout = e.input_layouts["arg0"]
    assert factories and all(n.meta["layout"] == x_layout if n.meta["val"].dim() == 2
                             else not n.meta["layout"].is_replicated for n in factories)
    assert not [n for n in e.graph.graph.nodes if n.target is fxshard.ops.REDISTRIBUTE]
    with fake_world(mesh) as device_mesh:
        local = lowered_graphs(f, x, device_mesh=device_mesh, placements=placements)[(3,)]
    sizes = [n.meta["val"].numel() for n in local.graph.nodes if n.op == "call_function"]
    assert max(sizes) < x.numel()  # nothing whole is built on rank 3
