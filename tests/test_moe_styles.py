"""Hugging Face MoE models under ``parallelize_module`` styles, from the tp plans their authors wrote.

Each model's ``config.base_model_tp_plan`` (GptOss has none beyond its embedding: the zoo's Megatron
plan stands in) becomes torch's styles: "colwise" / "rowwise" modules ``ColwiseParallel`` /
``RowwiseParallel`` (global shapes, ``use_local_output=False``, as fxshard compiles them), and
"moe_tp_experts" a style that shards the experts' parameters as the plan says ("packed_colwise":
gate and up each cut by rank, ``_StridedShard``; "rowwise": the input features) and replicates
their inputs and output, as transformers' own style does. The experts' grouped matmul is
transformers' custom op (fp32 under torch.compile), which DTensor has no rule for: fxshard lends
its own (backend/capture/dtensor_rules.py). Exact against one device on simulated ranks, no op run
replicated, with the collectives counted.
"""
from __future__ import annotations

import contextlib
import warnings
from collections import Counter

import pytest
import torch
from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.experimental import implicit_replication
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module
from torch.distributed.tensor.debug import _clear_sharding_prop_cache
from torch.distributed.tensor.placement_types import _StridedShard

import fxshard
from fxshard.backend.explain import collectives_of
from fxshard.backend.simulate import fake_world, simulate_ranks

transformers = pytest.importorskip("transformers")

WORLD, VOCAB = 2, 256
DECODER = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
               num_key_value_heads=4, max_position_embeddings=64)
PARAMETER_STYLES = {"packed_colwise": _StridedShard(1, split_factor=2), "rowwise": Shard(-1)}  # HF's, for [E, out, in]


def _qwen3_moe():
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=8, **DECODER)), {}


def _deepseek_v3():
    config = transformers.DeepseekV3Config(
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_group=1, topk_group=1,
        first_k_dense_replace=0, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=8, **{**DECODER, "num_key_value_heads": 8})
    return transformers.DeepseekV3ForCausalLM(config), {}


def _gpt_oss():
    """GptOss stores gate_up as [E, in, out] with gate and up interleaved: a plain Shard of out keeps
    each rank's gate and up together."""
    config = transformers.GptOssConfig(num_local_experts=4, num_experts_per_tok=2, head_dim=8, sliding_window=4,
                                       **DECODER)
    plan = {**{f"layers.*.self_attn.{p}_proj": "colwise" for p in "qkv"}, "layers.*.self_attn.o_proj": "rowwise",
            "layers.*.mlp.experts": "moe_tp_experts"}
    placements = {"gate_up_proj": Shard(2), "gate_up_proj_bias": Shard(1), "down_proj": Shard(1)}
    return transformers.GptOssForCausalLM(config), {"plan": plan, "experts": placements}


# forward collectives at tp=2, 2 layers: an all_reduce after attention and after the experts per layer
# (DeepseekV3's plan leaves its MLA attention replicated: its two are the shared experts' row-parallel
# output and the routed experts', each pinned Replicate by its style); GptOss slices gate and up apart with a step ([..., ::2]), which
# fxshard gathers the sharded projection for (one all_gather a layer)
MODELS = {
    "qwen3_moe": (_qwen3_moe, {"all_reduce": 4}),
    "deepseek_v3": (_deepseek_v3, {"all_reduce": 4}),
    "gpt_oss": (_gpt_oss, {"all_reduce": 4, "all_gather": 2}),
}


def _sharded(p: torch.Tensor, placement, mesh) -> DTensor:
    """A parameter's DTensor under LocalTensorMode. distribute_tensor gives every rank rank 0's block for
    a _StridedShard there (torch 2.13 and 2.15): each rank's block is cut here, as DTensor defines it."""
    if not isinstance(placement, _StridedShard):
        return distribute_tensor(p, mesh, [placement])
    d, n = placement.dim, mesh.size()
    blocks = {r: torch.cat([c.chunk(n, d)[r] for c in p.chunk(placement.split_factor, d)], d) for r in range(n)}
    return DTensor.from_local(LocalTensor(blocks), mesh, [placement], run_check=False, shape=p.shape, stride=p.stride())


class ExpertsParallel(ParallelStyle):
    """transformers' "moe_tp_experts" as a torch style: parameters sharded by ``placements``, the
    router's outputs and the tokens replicated in, the experts' output replicated out."""

    def __init__(self, placements: dict):
        self.placements = placements

    def _apply(self, module: torch.nn.Module, mesh) -> torch.nn.Module:
        def shard(_, mod, mesh):
            for name, p in list(mod.named_parameters(recurse=False)):
                dt = _sharded(p.data, self.placements.get(name, Replicate()), mesh)
                mod.register_parameter(name, torch.nn.Parameter(dt, requires_grad=p.requires_grad))

        def inputs(_, args, mesh):
            return tuple(a.redistribute(placements=[Replicate()]) if isinstance(a, DTensor) else
                         DTensor.from_local(a, mesh, [Replicate()], run_check=False) if isinstance(a, torch.Tensor)
                         else a for a in args)

        def output(_, out, mesh):
            return out.redistribute(placements=[Replicate()])

        return distribute_module(module, mesh, shard, inputs, output)


def torch_styles(model: torch.nn.Module, plan: dict, experts: dict) -> dict:
    """The tp plan's module entries as torch's styles; its expert-parameter entries go to ExpertsParallel."""
    styles = {"colwise": lambda: ColwiseParallel(use_local_output=False),
              "rowwise": lambda: RowwiseParallel(use_local_output=False),
              "moe_tp_experts": lambda: ExpertsParallel(experts)}
    return {f"model.{key}": styles[style]() for key, style in plan.items()
            if style in styles and ".experts." not in key}


def _experts_placements(plan: dict) -> dict:
    return {key.rsplit(".", 1)[1]: PARAMETER_STYLES[style] for key, style in plan.items()
            if ".experts." in key and style in PARAMETER_STYLES}


@contextlib.contextmanager
def fresh_world():
    """A fake world of WORLD ranks whose DTensors hold its own mesh.

    DTensor's sharding-propagation caches (Python's and the C++ fast path's) are keyed by specs whose
    DeviceMesh compares by value (ranks, layout, device, names), not by process group; their output
    specs keep the mesh of the call that filled them. Without clearing them, ``nn.Parameter(dt)``
    (``detach``) in a second world gets the first world's mesh back, and its destroyed group
    ("Group ... is not registered") surfaces where DTensor redistributes (GptOss' grouped matmul
    after its forward test). torch's design, so the fixture clears them, as
    ``torch.distributed.tensor.debug`` offers."""
    _clear_sharding_prop_cache()
    try:
        with fake_world(fxshard.MeshSpec(tp=WORLD)) as mesh:
            yield mesh
    finally:
        _clear_sharding_prop_cache()


def run(name: str, grad: bool):
    """(one device's logits and gradients, the simulated run, its collectives by kind, fxshard's warnings)."""
    build, _ = MODELS[name]
    torch.manual_seed(0)
    model, own = build()
    plan = own.get("plan", model.config.base_model_tp_plan)
    experts = own.get("experts", _experts_placements(plan))
    model.train(grad)
    ids = torch.randint(0, VOCAB, (2, 8))

    def logits(ids):
        return model(input_ids=ids, use_cache=False).logits

    want = logits(ids)
    grads = {}
    if grad:
        want.backward(torch.ones_like(want))
        grads = {n: p.grad for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
    with fresh_world() as mesh:
        with LocalTensorMode(WORLD), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # plan entries for modules a config leaves out (dense MLPs)
            parallelize_module(model, mesh, torch_styles(model, plan, experts))
        # transformers builds index tensors (torch.arange) that meet DTensor activations
        with warnings.catch_warnings(record=True) as caught, implicit_replication():
            warnings.simplefilter("always")
            ran = simulate_ranks(logits, ids, grad=grad)
    ours = sorted({str(w.message) for w in caught if str(w.message).startswith("fxshard")})
    return (want.detach(), grads), ran, Counter(c.kind for c in collectives_of(ran.graph)), ours


@pytest.mark.parametrize("name", list(MODELS))
def test_forward_is_one_devices(name):
    (want, _), ran, moved, warned = run(name, grad=False)
    torch.testing.assert_close(ran.full()[0], want, rtol=1e-4, atol=1e-4)
    assert warned == []
    assert moved == MODELS[name][1]


# training through transformers' fallback op and its backward op (transformers::grouped_mm_fallback_backward):
# before its rule it ran replicated, gathering the experts' weights, their activations and the gradient
# (4 all_gathers, 54 KiB/rank, per Qwen3-MoE layer at tp=2); now each layer all-reduces twice forward and
# twice backward (the norms' weight gradients: 4 more of 32 B). GptOss: 4 all_reduce, 8 all_gather (its ::2
# slices; after its forward test in one process too, each world fresh_world's). DeepseekV3 writes its keys
# into slices of a new_empty (copy_), which trains through backend/capture/functional_copy.py; its 8: the 4 forward
# ones and as many backward
TRAINING = {"qwen3_moe": {"all_reduce": 12}, "deepseek_v3": {"all_reduce": 8},
            "gpt_oss": {"all_reduce": 4, "all_gather": 8}}


@pytest.mark.parametrize("name", list(TRAINING))
def test_a_training_step_is_one_devices(name):
    (want, grads), ran, moved, warned = run(name, grad=True)
    torch.testing.assert_close(ran.full()[0], want, rtol=1e-4, atol=1e-4)
    got = ran.full_grads()
    assert sorted(got) == sorted(grads)
    for key, g in got.items():
        torch.testing.assert_close(g, grads[key], rtol=1e-4, atol=2e-4, msg=lambda m: f"{key}: {m}")
    assert warned == []
    assert moved == TRAINING[name]


class SliceWrites(torch.nn.Module):
    """DeepseekV3's expand_kv in small: a new tensor filled by copy_ into two slices, one from a
    broadcast source of another dtype."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8, bias=False)
        self.b = torch.nn.Linear(8, 4, bias=False)

    def forward(self, x):
        a, b = self.a(x), self.b(x)[:, :1].double()
        out = a.new_empty(*a.shape[:-1], 12)
        out[..., :8].copy_(a)
        out[..., 8:].copy_(b)  # [n, 1] -> [n, 4], float64 -> float32
        return (out * out).sum()


def test_a_copy_into_a_slice_trains():
    """autograd has no derivative of functionalization's aten.copy; the joint trace gives it copy_'s."""
    torch.manual_seed(0)
    model, x = SliceWrites(), torch.randn(6, 8)
    want = model(x)
    want.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    with fresh_world() as mesh:
        with LocalTensorMode(WORLD):
            parallelize_module(model, mesh, {"a": ColwiseParallel(use_local_output=False)})
        with implicit_replication():
            ran = simulate_ranks(model, x, grad=True)
    torch.testing.assert_close(ran.full()[0], want)
    got = ran.full_grads()
    assert sorted(got) == sorted(grads)
    for key, g in got.items():
        torch.testing.assert_close(g, grads[key], msg=lambda m: f"{key}: {m}")
