"""Models no one here wrote: Hugging Face LlamaForCausalLM and GPT2LMHeadModel from small configs.

Random weights, no downloads. Plans are parameter placements (what ``distribute_tensor`` would
give); sequence parallelism pins the residual stream with ``fxshard.constrain`` in forward
hooks, so the model's code is untouched. Every plan's forward matches the single-device run.
Needs the ``models`` extra (transformers), which CI installs.
"""
from __future__ import annotations

import pathlib
import sys
import warnings

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import fxshard

transformers = pytest.importorskip("transformers")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from hint_programs import Logits  # noqa: E402  (``model(input_ids).logits`` without a KV cache)


def hf_llama() -> Logits:
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=64,
                                   attn_implementation="sdpa")
    return Logits(transformers.LlamaForCausalLM(cfg).eval())


def hf_gpt2() -> Logits:
    cfg = transformers.GPT2Config(vocab_size=256, n_embd=128, n_layer=2, n_head=16, n_positions=64,
                                  attn_implementation="sdpa", bos_token_id=0, eos_token_id=0)
    return Logits(transformers.GPT2LMHeadModel(cfg).eval())


# Megatron per model: (name suffix, placement of the tp axis); Conv1D weights are [in, out]
TP_RULES = {
    "llama": [(s, Shard(0)) for s in ("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight",
                                       "up_proj.weight", "embed_tokens.weight", "lm_head.weight")]
             + [(s, Shard(1)) for s in ("o_proj.weight", "down_proj.weight")],
    "gpt2": [("c_attn.weight", Shard(1)), ("c_fc.weight", Shard(1)), ("c_attn.bias", Shard(0)),
             ("c_fc.bias", Shard(0)), ("attn.c_proj.weight", Shard(0)), ("mlp.c_proj.weight", Shard(0)),
             ("wte.weight", Shard(0))],
}
MODELS = {"llama": hf_llama, "gpt2": hf_gpt2}
# the residual stream between blocks, for sequence parallelism: modules whose output is [batch, seq, hidden]
STREAM = {"llama": ("embed_tokens", "layers.0", "layers.1", "norm"), "gpt2": ("drop", "h.0", "h.1", "ln_f")}


def tp_placement(kind: str, name: str):
    return next((p for suffix, p in TP_RULES[kind] if name.endswith(suffix)), None)


def plan_tp(kind: str, model: Logits) -> dict:
    return {n: (p,) for n, _ in model.named_parameters() if (p := tp_placement(kind, n)) is not None}


def plan_fsdp(kind: str, model: Logits) -> dict:
    return {**{n: (Shard(0),) for n, _ in model.named_parameters()}, 0: (Shard(0),)}


def plan_2d(kind: str, model: Logits) -> dict:
    """tp as Megatron; dp shards each weight's other dim (1-D parameters on dim 0 unless tp has it)."""
    out: dict = {0: (Shard(0), Replicate())}
    for n, p in model.named_parameters():
        tp = tp_placement(kind, n)
        if tp is None:
            out[n] = (Shard(0), Replicate())
        elif p.dim() == 2:
            out[n] = (Shard(1 - tp.dim), tp)
        else:
            out[n] = (Replicate(), tp)
    return out


def pin_sequence(kind: str, model: Logits, placements) -> list:
    """Forward hooks that pin the residual stream sharded on the sequence: sequence parallelism."""
    modules = dict(model.named_modules())
    prefix = "model.model." if kind == "llama" else "model.transformer."

    def hook(module, args, output):
        if isinstance(output, tuple):
            return (fxshard.constrain(output[0], placements),) + output[1:]
        return fxshard.constrain(output, placements)

    return [modules[prefix + name].register_forward_hook(hook) for name in STREAM[kind]]


def check(kind: str, plan, mesh: fxshard.MeshSpec, sequence_parallel: bool = False, batch: int = 8, seq: int = 16):
    torch.manual_seed(0)
    model = MODELS[kind]()
    ids = torch.randint(0, 256, (batch, seq))
    with torch.no_grad():
        ref = model(ids)
    hooks = pin_sequence(kind, model, [Shard(1)]) if sequence_parallel else []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # every op of these models has a rule: no fallback warning
            placements = plan(kind, model)
            out = fxshard.simulate(model, ids, mesh=mesh, placements=placements)
            explanation = fxshard.explain(model, ids, mesh=mesh, placements=placements)
    finally:
        for h in hooks:
            h.remove()
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    counts: dict[str, int] = {}
    for c in explanation.collectives:
        counts[c.kind] = counts.get(c.kind, 0) + 1
    return counts


# By default GPT-2 at 4 ranks; Hugging Face's Llama at 4 with --slow (and both at 8): tests/test_zoo.py runs
# LlamaForCausalLM under Megatron TP at 2 and 4 ranks and under TP+SP (the same plan, counts and no-fallback
# check), tests/test_models.py's FSDP test the Llama FSDP plan, and the 2-D test below the HF Llama sharded on dp.
WORLD_KIND = [(4, "gpt2") if (world, kind) == (4, "gpt2") else pytest.param(world, kind, marks=pytest.mark.slow)
              for world in (4, 8) for kind in ("llama", "gpt2")]


@pytest.mark.parametrize("world, kind", WORLD_KIND)
def test_tensor_parallel(kind, world):
    counts = check(kind, plan_tp, fxshard.MeshSpec(tp=world))
    # two block outputs per layer and the vocab-parallel embedding are reduced; GPT-2's fused q|k|v
    # output is regrouped by head with an exchange of one block of q, k and v each (no gather)
    regroups = {"exchange": 2} if kind == "gpt2" else {}
    assert counts == {"all_reduce": 2 * 2 + 1, **regroups}, counts


@pytest.mark.parametrize("world, kind", WORLD_KIND)
def test_tensor_and_sequence_parallel(kind, world):
    """Few tokens (fewer than twice the hidden size): moving activations is cheaper than gathering
    weights, so each block gathers its input on the sequence and reduce-scatters its output."""
    counts = check(kind, plan_tp, fxshard.MeshSpec(tp=world), sequence_parallel=True, batch=2, seq=16)
    regroups = {"exchange": 2} if kind == "gpt2" else {}
    assert counts == {"all_gather": 2 * 2 + 1, "reduce_scatter": 2 * 2 + 1, **regroups}, counts


@pytest.mark.parametrize("world, kind", WORLD_KIND)
def test_fsdp_style(kind, world):
    check(kind, plan_fsdp, fxshard.MeshSpec(dp=world), batch=2 * world)


# gpt2 (~6 s) with --slow: the llama case runs the 2-D mesh, test_*[4-gpt2] GPT-2 on tp and on dp
@pytest.mark.parametrize("kind", ["llama", pytest.param("gpt2", marks=pytest.mark.slow)])
def test_2d_data_and_tensor_parallel(kind):
    check(kind, plan_2d, fxshard.MeshSpec(dp=2, tp=4))
