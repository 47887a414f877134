"""Hugging Face architectures under the tp plans their authors wrote, as ``parallelize_module`` styles.

Each model's ``config.base_model_tp_plan`` becomes torch's styles (global shapes,
``use_local_output=False``, as fxshard compiles them): "colwise" / "rowwise" ``ColwiseParallel`` /
``RowwiseParallel``; "colwise_gather_output" a column-parallel projection whose output is gathered
(``output_layouts=Replicate()``) and "rowwise_split_input" a row-parallel one that splits a replicated
input (``input_layouts=Replicate()``), as transformers registers them; "replicated_with_grad_allreduce"
leaves the module replicated (its forward is the module's own); "moe_tp_experts" the experts' style of
tests/test_moe_styles.py. CLIP's vision tower and ModernBERT ship no plan: the Megatron plan written here
stands in (ModernBERT's fused projections each cut by heads, ``_StridedShard``). Exact against one device
on simulated ranks, no op run replicated, with the collectives of one forward counted.
"""
from __future__ import annotations

import fnmatch
import warnings
from collections import Counter
from typing import Any, Callable

import pytest
import torch
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.experimental import implicit_replication
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard

import fxshard
from fxshard.backend.explain import collectives_of
from fxshard.backend.simulate import fake_world, simulate_ranks

transformers = pytest.importorskip("transformers")

from test_moe_styles import ExpertsParallel, _sharded  # noqa: E402

VOCAB = 256
DECODER = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
               num_key_value_heads=4, max_position_embeddings=64, attn_implementation="sdpa")


class PackedColwiseParallel(ParallelStyle):
    """transformers' "packed_colwise" as a torch style: a projection fusing ``parts`` equal blocks (q, k
    and v; input and gate), each cut by rank (``_StridedShard``, as transformers shards it), its input
    replicated in; its output is what DTensor makes of the sharded weight."""

    def __init__(self, parts: int):
        self.parts = parts

    def _apply(self, module: torch.nn.Module, mesh) -> torch.nn.Module:
        def shard(_, mod, mesh):
            for name, p in list(mod.named_parameters(recurse=False)):
                dt = _sharded(p.data, _StridedShard(0, split_factor=self.parts), mesh)
                mod.register_parameter(name, torch.nn.Parameter(dt, requires_grad=p.requires_grad))

        def inputs(_, args, mesh):
            return tuple(a.redistribute(placements=[Replicate()]) if isinstance(a, DTensor) else
                         DTensor.from_local(a, mesh, [Replicate()], run_check=False) for a in args)

        return distribute_module(module, mesh, shard, inputs)


# transformers' styles, as torch's (the module entries of a plan)
STYLES: dict[str, Callable[[], Any]] = {
    "colwise": lambda: ColwiseParallel(use_local_output=False),
    "rowwise": lambda: RowwiseParallel(use_local_output=False),
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate(), use_local_output=False),
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate(), use_local_output=False),
    "packed_colwise": lambda: PackedColwiseParallel(2),
    "packed_colwise_qkv": lambda: PackedColwiseParallel(3),  # here only: ModernBERT's fused q, k and v
}
# transformers' parameter styles for [E, in, out] experts (Llama4): "packed_rowwise" cuts the last dim,
# gate and up each by rank; "colwise" the second-last (ColwiseParallel.shard_param's ``ndim - 2``)
EXPERT_PARAMETERS = {"packed_rowwise": _StridedShard(2, split_factor=2), "colwise": Shard(1)}
LEFT_REPLICATED = {"replicated_with_grad_allreduce"}


def torch_styles(plan: dict, prefix: str) -> dict:
    """The plan's module entries as torch's styles; its expert-parameter entries go to ExpertsParallel."""
    experts = {key.rsplit(".", 1)[1]: EXPERT_PARAMETERS[style] for key, style in plan.items()
               if ".experts." in key}
    out = {}
    for key, style in plan.items():
        if ".experts." in key or style in LEFT_REPLICATED:
            continue
        out[prefix + key] = ExpertsParallel(experts) if style == "moe_tp_experts" else STYLES[style]()
    return out


def _decoder(config: str, model: str, **cfg: Any) -> Callable[[], tuple]:
    def build():
        c = getattr(transformers, config)(**{**DECODER, **cfg})
        return getattr(transformers, model)(c), c.base_model_tp_plan, "model."
    return build


def _ids() -> tuple:
    return (torch.randint(0, VOCAB, (2, 8)),)


def _logits(model):
    def run(ids):
        return model(input_ids=ids, use_cache=False).logits
    return run


def _clip_vision():
    """CLIP's vision tower: transformers ships no tp plan for it; Megatron's stands in."""
    c = transformers.CLIPVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=8, image_size=16, patch_size=4, attn_implementation="sdpa")
    plan = {**{f"encoder.layers.*.self_attn.{p}_proj": "colwise" for p in "qkv"},
            "encoder.layers.*.self_attn.out_proj": "rowwise",
            "encoder.layers.*.mlp.fc1": "colwise", "encoder.layers.*.mlp.fc2": "rowwise"}
    return transformers.CLIPVisionModel(c), plan, ""


def _pixels() -> tuple:
    return (torch.randn(2, 3, 16, 16),)


def _vision_states(model):
    def run(pixels):
        return model(pixel_values=pixels).last_hidden_state
    return run


def _modern_bert():
    """ModernBERT: no tp plan in transformers; Megatron's, its fused q/k/v and input/gate packed as
    transformers' "packed_colwise" shards them."""
    c = transformers.ModernBertConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=8, local_attention=4, global_attn_every_n_layers=2,
                                      pad_token_id=0, eos_token_id=1, bos_token_id=2, cls_token_id=2,
                                      sep_token_id=1, attn_implementation="sdpa")
    plan = {"layers.*.attn.Wqkv": "packed_colwise_qkv", "layers.*.attn.Wo": "rowwise",
            "layers.*.mlp.Wi": "packed_colwise", "layers.*.mlp.Wo": "rowwise"}
    return transformers.ModernBertForMaskedLM(c), plan, "model."


MODELS: dict[str, tuple] = {
    "qwen3": (_decoder("Qwen3Config", "Qwen3ForCausalLM", head_dim=8), _logits, _ids),
    "olmo2": (_decoder("Olmo2Config", "Olmo2ForCausalLM"), _logits, _ids),
    "granite": (_decoder("GraniteConfig", "GraniteForCausalLM"), _logits, _ids),
    "smollm3": (_decoder("SmolLM3Config", "SmolLM3ForCausalLM", pad_token_id=0), _logits, _ids),
    "cohere2": (_decoder("Cohere2Config", "Cohere2ForCausalLM", sliding_window=4), _logits, _ids),
    "llama4": (_decoder("Llama4TextConfig", "Llama4ForCausalLM", num_local_experts=4, num_experts_per_tok=1,
                        intermediate_size_mlp=128, head_dim=8, interleave_moe_layer_step=1), _logits, _ids),
    "clip_vision": (_clip_vision, _vision_states, _pixels),
    "modern_bert": (_modern_bert, _logits, _ids),
}


def unmatched(model: torch.nn.Module, styles: dict) -> set:
    """The plan's entries that name no module of this model (parallelize_module only warns of them)."""
    names = [n for n, _ in model.named_modules()]
    return {key for key in styles if not any(fnmatch.fnmatchcase(n, key) for n in names)}


def run(name: str, world: int):
    """(one device's output, the simulated run, its collectives by kind, fxshard's warnings, the plan's
    entries naming no module)."""
    build, call, example = MODELS[name]
    torch.manual_seed(0)
    model, plan, prefix = build()
    model.eval()
    args = example()
    fn = call(model)
    with torch.no_grad():
        want = fn(*args)
    styles = torch_styles(plan, prefix)
    absent = unmatched(model, styles)
    with fake_world(fxshard.MeshSpec(tp=world)) as mesh:
        with LocalTensorMode(world), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the absent entries
            parallelize_module(model, mesh, styles)
        with warnings.catch_warnings(record=True) as caught, implicit_replication():
            warnings.simplefilter("always")
            ran = simulate_ranks(fn, *args)
    ours = sorted({str(w.message) for w in caught if str(w.message).startswith("fxshard")})
    return want, ran, dict(Counter(c.kind for c in collectives_of(ran.graph))), ours, absent


# collectives per forward (2 layers) at tp=2 and tp=4 alike, each the plan's own: an all_reduce after each
# row-parallel projection (attention and MLP: two a layer); Olmo2's plan gathers q, k and v whole
# ("colwise_gather_output": its q/k norms normalize the full width), three all_gathers a layer; Cohere2's
# parallel residual would need one reduce a layer, but its plan pins attention's and the MLP's outputs
# Replicate apart; Llama4's a third a layer, the routed experts' (moe_tp_experts) besides its shared expert's
COUNTS = {
    "qwen3": {"all_reduce": 4},
    "olmo2": {"all_gather": 6, "all_reduce": 4},
    "granite": {"all_reduce": 4},
    "smollm3": {"all_reduce": 4},
    "cohere2": {"all_reduce": 4},
    "llama4": {"all_reduce": 6},
    "clip_vision": {"all_reduce": 4},
    "modern_bert": {"all_reduce": 4},
}
# the plan's entries a tiny config has no module for (Llama4: every layer MoE, so no dense MLP)
ABSENT = {"llama4": {f"model.layers.*.feed_forward.{p}_proj" for p in ("gate", "up", "down")}}
# 8 heads and 4 kv heads everywhere: tp=2 and tp=4 both divide. By default every model at tp=2 but these,
# and at tp=4 the two with styles of their own (routed experts, fused projections); the rest with --slow
SLOW_AT_TWO = {"granite", "smollm3"}  # qwen3's plan and counts; their own: Granite's multipliers, SmolLM3's NoPE layers
AT_FOUR = {"llama4", "modern_bert"}
CASES = [(name, world) if (world == 2 and name not in SLOW_AT_TWO) or (world == 4 and name in AT_FOUR)
         else pytest.param(name, world, marks=pytest.mark.slow) for world in (2, 4) for name in MODELS]


@pytest.mark.parametrize("name, world", CASES)
def test_forward_is_one_devices(name, world):
    want, ran, moved, warned, absent = run(name, world)
    assert absent == ABSENT.get(name, set())
    torch.testing.assert_close(ran.full()[0], want, rtol=1e-4, atol=1e-4)
    assert warned == []
    assert moved == COUNTS[name]
