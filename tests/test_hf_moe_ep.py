"""Dropless expert parallelism on Hugging Face MoE models: Qwen3-MoE, Mixtral, DeepSeek-V3 and GPT-OSS with
transformers' grouped_mm experts (``experts_implementation="grouped_mm"``), from tiny random configs.

Their experts' stacked weights (and GPT-OSS's expert biases: dim 0 the experts) are ``Shard(0)`` on ``ep`` and
the batch ``Shard(0)`` on it, all else replicated. Stage 1 makes each layer's routed region one routed-experts op
(backend/capture/routed_experts.py: transformers sorts without ``stable``, counts ``histc(sort(ids)[0], max=E-1)``,
multiplies by ``transformers::grouped_mm_fallback`` for float32 weights or ``torch._grouped_mm`` for bf16 ones,
adds GPT-OSS's biases in place, and puts the rows back by the sort's inverse); no expert weight is gathered.
Each case is checked against one device on fresh data, on simulated ranks. Needs transformers.
"""
from __future__ import annotations

import warnings

import pytest
import torch
from torch.distributed.tensor import Shard

import fxshard
from fxshard.backend.explain import collectives_of
from fxshard.backend.simulate import simulate_ranks
from fxshard.routing import ROUTED_OPS

transformers = pytest.importorskip("transformers")

VOCAB, BATCH, SEQ = 256, 8, 4
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, attn_implementation="sdpa", experts_implementation="grouped_mm")
CONFIGS = {  # 8 experts, 2 a token
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, intermediate_size=64, head_dim=8,
                       norm_topk_prob=True)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=16, head_dim=8)),
    # group-limited routing (2 groups, 1 kept), a shared expert beside the routed ones
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
                         first_k_dense_replace=0, moe_intermediate_size=16, intermediate_size=64, q_lora_rank=None,
                         kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, num_key_value_heads=4)),
    # biases on the experts, gate and up interleaved ([..., ::2]), a clamped SwiGLU; no SDPA path in transformers
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=16, head_dim=8, sliding_window=4,
                     layer_types=["full_attention"], rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                     attn_implementation="eager")),
}


def _model(name: str, seed: int, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    config_name, model_name, cfg = CONFIGS[name]
    torch.manual_seed(seed)
    config = getattr(transformers, config_name)(**{**COMMON, **cfg})
    return getattr(transformers, model_name)(config).to(dtype).eval()


def _experts_sharded(model: torch.nn.Module) -> dict:
    """Every expert stack (``...experts.<name>``: dim 0 the experts) ``Shard(0)`` on ep; the rest replicated."""
    plan = {n: [Shard(0)] for n, _ in model.named_parameters() if ".experts." in n}
    assert plan and all(p.shape[0] == 8 for n, p in model.named_parameters() if n in plan)
    return plan


def _simulate(fn, ids, model, ep: int, grad: bool):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = simulate_ranks(fn, ids, mesh=fxshard.MeshSpec(ep=ep), grad=grad,
                             placements={0: [Shard(0)], **_experts_sharded(model)})
    warned = sorted({str(w.message) for w in caught if str(w.message).startswith("fxshard")})
    assert warned == []
    assert any(n.target in ROUTED_OPS for n in run.graph.graph.nodes)
    return run


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("ep", [2, 4, 8])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_are_one_devices_and_no_expert_moves(name, ep):
    """Inference: the logits as one device's; nothing planned moves (the experts stay on their ranks, the rows
    travel by the routed op's all_to_alls)."""
    model, ids = _model(name, seed=ep), _ids(100 + ep)

    def logits(ids):
        return model(input_ids=ids, use_cache=False).logits

    with torch.no_grad():
        want = logits(ids)
        run = _simulate(logits, ids, model, ep, grad=False)
    torch.testing.assert_close(run.full()[0], want)
    assert collectives_of(run.graph) == []


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_training_steps_gradients_are_one_devices(name):
    """One training step's loss and every parameter's gradient as one device's at ep 2: the experts' stay with
    their experts (no all_gather of any weight), the replicated parameters' are all-reduced."""
    model, ids = _model(name, seed=7), _ids(8)

    def loss(ids):
        return model(input_ids=ids, use_cache=False).logits.float().pow(2).mean()

    want = loss(ids)
    want.backward()
    run = _simulate(loss, ids, model, 2, grad=True)
    torch.testing.assert_close(run.full()[0], want.detach())
    grads = run.full_grads()
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, msg=lambda m: f"{n}: {m}")
    assert not [c for c in collectives_of(run.graph) if c.kind == "all_gather"]


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss"])
def test_bf16_models_run_torch_grouped_mm(name):
    """Weights in bf16: transformers multiplies by ``torch._grouped_mm`` itself (not its fallback op); the logits
    at ep 4 as one device's."""
    model, ids = _model(name, seed=11, dtype=torch.bfloat16), _ids(12)

    def logits(ids):
        return model(input_ids=ids, use_cache=False).logits

    with torch.no_grad():
        want = logits(ids)
        run = _simulate(logits, ids, model, 4, grad=False)
    torch.testing.assert_close(run.full()[0], want)
    assert collectives_of(run.graph) == []


def _unsorting_layer(x, router, w1, w2, leak: str = ""):
    """A dropless layer that puts its rows back as transformers does, by the sort's inverse (``inv[perm] =
    arange``, then ``rows[inv]``); ``leak`` also returns the inverse or the rows in expert order, which show the
    sort's order: the region must then stay as written."""
    top, chosen = torch.topk(torch.softmax(x @ router, dim=-1), 2, dim=1)
    ids, perm = torch.sort(chosen.reshape(-1))
    offsets = torch.cumsum(torch.histc(ids.float(), bins=w1.shape[0], min=0, max=w1.shape[0] - 1), 0).to(torch.int32)
    rows = (x[perm // 2] * top.reshape(-1)[perm][:, None]).bfloat16()
    out = torch._grouped_mm(torch.relu(torch._grouped_mm(rows, w1, offs=offsets)), w2, offs=offsets).float()
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.shape[0])
    y = out[inv].view(x.shape[0], 2, -1).sum(1)
    return (y, {"inverse": inv, "rows": out}[leak]) if leak else y


@pytest.mark.parametrize("leak", ["", "inverse", "rows"])
def test_an_unsorting_region_whose_order_escapes_is_left_as_written(leak):
    torch.manual_seed(61)
    x, router = torch.randn(32, 16), torch.randn(16, 4)
    w1, w2 = torch.randn(4, 16, 32).bfloat16(), torch.randn(4, 32, 16).bfloat16()
    with torch.no_grad():
        want = _unsorting_layer(x, router, w1, w2, leak)
        run = simulate_ranks(lambda *a: _unsorting_layer(*a, leak), x, router, w1, w2, mesh=fxshard.MeshSpec(ep=2),
                             placements={0: [Shard(0)], 2: [Shard(0)], 3: [Shard(0)]})
    for got, expected in zip(run.full(), want if leak else (want,)):
        torch.testing.assert_close(got, expected)
    assert any(n.target in ROUTED_OPS for n in run.graph.graph.nodes) is not bool(leak)


def _gloo_training(rank: int, world_size: int, device: str = "cpu", name: str = "qwen3_moe") -> dict:
    """Two steps' loss and accumulated gradients through torch.compile(backend="fxshard") on this gloo rank (the
    experts DTensors ``Shard(0)`` on ep, the rest plain: replicated), against one device's."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torch.distributed.tensor.experimental import implicit_replication

    from fxshard.backend.capture.dtensor_rules import lend_rules_to_dtensor

    mesh = init_device_mesh(device, (world_size,), mesh_dim_names=("ep",))
    reference = _model(name, seed=3)
    # Dynamo traces DTensors by DTensor's propagation, which needs fxshard's rule for transformers' grouped matmul;
    # the backend lends it at import and at each capture, but this module imported it before the model's code
    # defined that op, and Dynamo's trace comes before the capture (backend/capture/dtensor_rules.py)
    lend_rules_to_dtensor()
    model = copy.deepcopy(reference)
    for module_name, module in model.named_modules():
        for p_name, p in list(module.named_parameters(recurse=False)) if module_name.endswith(".experts") else ():
            setattr(module, p_name, torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)])))
    stages: list[str] = []
    compiled = torch.compile(lambda ids: model(input_ids=ids, use_cache=False).logits.float().pow(2).mean(),
                             backend="fxshard", options={"on_graph": lambda stage, gm: stages.append(stage) if any(
                                 n.target in ROUTED_OPS for n in gm.graph.nodes) else None})
    loss_error = 0.0
    for step in range(2):
        ids = _ids(20 + step)
        with implicit_replication():  # the positions and masks transformers builds are plain tensors
            loss = compiled(distribute_tensor(ids, mesh, [Shard(0)]))
        loss.backward()
        want = reference(input_ids=ids, use_cache=False).logits.float().pow(2).mean()
        want.backward()
        got = loss.full_tensor() if isinstance(loss, DTensor) else loss
        loss_error = max(loss_error, abs(got.item() - want.item()) / abs(want.item()))
    errors = {}
    for (n, p), q in zip(model.named_parameters(), reference.parameters()):
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        errors[n] = ((g - q.grad).abs().max() / q.grad.abs().max()).item()
    return {"loss_error": loss_error, "grad_error": max(errors.values()), "routed": sorted(set(stages))}


@pytest.mark.slow
def test_qwen3_moe_trains_on_two_gloo_ranks():
    """The compiled routed ops on real ranks (their kernels Inductor programs, transformers' fallback op inside):
    two steps' loss and gradients as one device's. A transposed stack's gradient came back in the transposed
    layout, which the backward op's caller refused (its fake says contiguous). ~30 s."""
    import pathlib
    import sys

    here = pathlib.Path(__file__).resolve().parent
    sys.path[:0] = [str(here.parent / "examples"), str(here)]
    try:
        from ranks import spawn

        import test_hf_moe_ep

        results = spawn(test_hf_moe_ep._gloo_training, 2, timeout=600.0)
    finally:
        sys.path.remove(str(here.parent / "examples"))
        sys.path.remove(str(here))
    for rank, r in results.items():
        assert r["loss_error"] < 1e-5 and r["grad_error"] < 1e-5, (rank, r)
        assert {"plan_forward", "plan_backward"} <= set(r["routed"]), (rank, r)
