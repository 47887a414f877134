"""Real transformer models: every parallelism matches the single-device forward, with the
communication a Megatron expert would write.

Plans come from ``parallelize_module`` (made under LocalTensorMode so every rank's shard is
known) or from parameter placements; ``simulate`` runs all ranks in one process.
"""
from __future__ import annotations

import pathlib
import sys
import warnings

import pytest
import torch
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import parallelize_module

import fxshard
from fxshard.backend.simulate import fake_world
from fxshard.propagate import UnsupportedOpError

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
from models.llama import Llama, LlamaConfig, tensor_parallel_plan  # noqa: E402

CFG = LlamaConfig(vocab_size=256, dim=128, n_layers=2, n_heads=16, n_kv_heads=8, ffn_dim=256)
COLUMN = ("wq", "wk", "wv", "w1", "w3", "tok_embeddings", "output")
ROW = ("wo", "w2")


def fresh_model(cfg: LlamaConfig = CFG) -> Llama:
    return Llama(cfg).eval()


def tokens(batch: int, seq: int, cfg: LlamaConfig = CFG) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (batch, seq))


def run_plan(cfg: LlamaConfig, world: int, sequence_parallel: bool, x: torch.Tensor, fn: str = "forward"):
    """(single-device output, simulated output, explanation) of the TP / TP+SP plan."""
    model = fresh_model(cfg)
    with torch.no_grad():
        ref = getattr(model, fn)(*x)
    with fake_world(fxshard.MeshSpec(tp=world)) as mesh:
        with LocalTensorMode(world):
            parallelize_module(model, mesh, tensor_parallel_plan(model, sequence_parallel=sequence_parallel))
        call = getattr(model, fn) if fn != "forward" else model
        explanation = fxshard.explain(call, *x, mesh=mesh)
        out = fxshard.simulate(call, *x)
    return ref, out, explanation


def counts(explanation) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in explanation.collectives:
        out[c.kind] = out.get(c.kind, 0) + 1
    return out


@pytest.mark.parametrize("world", [4, 8])
def test_llama_tensor_parallel_two_all_reduces_per_layer(world):
    ref, out, e = run_plan(CFG, world, False, (tokens(2, 16),))
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    # per layer: after attention and after the FFN; one more for the vocab-parallel embedding
    assert counts(e) == {"all_reduce": 2 * CFG.n_layers + 1}


@pytest.mark.parametrize("world", [4, 8])
def test_llama_tensor_and_sequence_parallel(world):
    ref, out, e = run_plan(CFG, world, True, (tokens(2, 16),))
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    # per layer 2 all_gather (into attention, into the FFN) + 2 reduce_scatter (out of them);
    # the embedding reduce-scatters onto the sequence, the output projection gathers it back
    assert counts(e) == {"all_gather": 2 * CFG.n_layers + 1, "reduce_scatter": 2 * CFG.n_layers + 1}


def placements_tp(model: Llama) -> dict:
    out = {}
    for name, _ in model.named_parameters():
        if any(k in name for k in COLUMN):
            out[name] = (Shard(0),)
        elif any(k in name for k in ROW):
            out[name] = (Shard(1),)
    return out


@pytest.mark.parametrize("world", [4, 8])
def test_vocab_parallel_loss_moves_no_tokens_by_vocab_tensor(world):
    """Embedding and output vocab-sharded: masked lookups and a sharded log-softmax, never the logits."""
    model = fresh_model()
    x, y = tokens(2, 16), tokens(2, 16)
    mesh = fxshard.MeshSpec(tp=world)
    out = fxshard.simulate(model.loss, x, y, mesh=mesh, placements=placements_tp(model))
    with torch.no_grad():
        torch.testing.assert_close(out, model.loss(x, y), rtol=1e-4, atol=1e-5)
    e = fxshard.explain(model.loss, x, y, mesh=mesh, placements=placements_tp(model))
    logits_sized = [c for c in e.collectives if c.node.meta["val"].numel() >= x.numel() * CFG.vocab_size]
    assert not logits_sized, [str(c) for c in logits_sized]


@pytest.mark.parametrize("variant", [dict(rope="complex"), dict(tie_embeddings=True)])
def test_llama_variants_under_tensor_parallel(variant):
    cfg = LlamaConfig(vocab_size=256, dim=64, n_layers=1, n_heads=8, n_kv_heads=4, ffn_dim=128, **variant)
    ref, out, e = run_plan(cfg, 4, False, (tokens(2, 8, cfg),))
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    assert set(counts(e)) == {"all_reduce"}


def placements_fsdp(model: Llama) -> dict:
    """FSDP-style: every parameter Shard(0) on dp; propagation all-gathers each where it is used."""
    return {name: (Shard(0),) for name, _ in model.named_parameters()}


def placements_2d(model: Llama) -> dict:
    """dp x tp: Megatron on tp, every weight's other dim sharded on dp (FSDP-style)."""
    out = {}
    for name, p in model.named_parameters():
        if any(k in name for k in COLUMN):
            out[name] = (Shard(1), Shard(0))
        elif any(k in name for k in ROW):
            out[name] = (Shard(0), Shard(1))
        else:
            out[name] = (Shard(0), Replicate())
    return out


@pytest.mark.parametrize("dp", [4, 8])
def test_llama_fsdp_gathers_parameters_only(dp):
    model = fresh_model()
    x = tokens(2 * dp, 32)
    pl = {**placements_fsdp(model), 0: (Shard(0),)}
    mesh = fxshard.MeshSpec(dp=dp)
    out = fxshard.simulate(model, x, mesh=mesh, placements=pl)
    with torch.no_grad():
        torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-4)
    e = fxshard.explain(model, x, mesh=mesh, placements=pl)
    n_params = len(list(model.parameters()))
    assert counts(e) == {"all_gather": n_params}  # each parameter once, activations never move
    sources = [c.node.args[0] for c in e.collectives]
    sources = [a.args[0] if a.target is torch.ops.aten.t.default else a for a in sources]  # weight.t()
    assert {a.op for a in sources} == {"placeholder"}


def test_llama_2d_data_and_tensor_parallel():
    model = fresh_model()
    x = tokens(8, 32)
    pl = {**placements_2d(model), 0: (Shard(0), Replicate())}
    mesh = fxshard.MeshSpec(dp=2, tp=4)
    out = fxshard.simulate(model, x, mesh=mesh, placements=pl)
    with torch.no_grad():
        torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-4)
    e = fxshard.explain(model, x, mesh=mesh, placements=pl)
    tp_reductions = [c for c in e.collectives if c.kind == "all_reduce"]
    assert all(tuple(map(str, c.axes)) == ("tp",) for c in tp_reductions)
    assert len(tp_reductions) == 2 * CFG.n_layers


def test_constrain_pins_a_layout():
    def f(x, w):
        return torch.relu(fxshard.constrain(x @ w, [Shard(0)]))

    x, w = torch.randn(8, 16), torch.randn(16, 12)
    mesh, pl = fxshard.MeshSpec(tp=4), {1: (Shard(1),)}
    e = fxshard.explain(f, x, w, mesh=mesh, placements=pl)
    assert str(e.output_layouts[0]) == "[4@tp 2] [12]"
    torch.testing.assert_close(fxshard.simulate(f, x, w, mesh=mesh, placements=pl), f(x, w))
    torch.testing.assert_close(fxshard.constrain(x, [Shard(0)]), x)  # eagerly: the value itself


def cumsum_model(x, w):
    return torch.cumsum(x @ w, 1)  # cumsum has no sharding rule


def test_strict_mode_names_the_op_its_layouts_and_the_fixes():
    x, w = torch.randn(8, 16), torch.randn(16, 12)
    with pytest.raises(UnsupportedOpError) as err:
        fxshard.explain(cumsum_model, x, w, mesh=fxshard.MeshSpec(tp=4), placements={1: (Shard(1),)}, strict=True)
    text = str(err.value)
    assert "aten.cumsum.default" in text and "[16] [4@tp 3]" not in text and "[8] [4@tp 3]" in text
    assert "fxshard.rules.RULES" in text and "fxshard.constrain" in text and "strict=True" in text


def test_fallback_replicates_warns_once_and_stays_correct():
    from fxshard import propagate

    propagate._warned_ops.discard("aten.cumsum.default")
    x, w = torch.randn(8, 16), torch.randn(16, 12)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fxshard.simulate(cumsum_model, x, w, mesh=fxshard.MeshSpec(tp=4), placements={1: (Shard(1),)})
        fxshard.explain(cumsum_model, x, w, mesh=fxshard.MeshSpec(tp=4), placements={1: (Shard(1),)})
    torch.testing.assert_close(out, cumsum_model(x, w))
    ours = [w for w in caught if "no sharding rule for aten.cumsum.default" in str(w.message)]
    assert len(ours) == 1 and "[8] [4@tp 3]" in str(ours[0].message)


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
