"""torchtitan's own models, as its authors build and parallelize them, shrunk to run in seconds.

The builders are torchtitan's (``_build_llama3_layers``, ``_build_qwen3_layers``) at dim 64, and the sharding
is torchtitan's (``set_llama3_sharding_config``, ``set_qwen3_sharding_config``, then ``Module.parallelize``
with ``ParallelDims`` on its ``partial_dtensor`` backend). Two departures, each for a stated reason:

- attention is torchtitan's ``ScaledDotProductAttention`` (causal), not its language models' default
  ``FlexAttention``: flex compiles its kernel with Triton on a GPU, and fxshard has no rule for the
  ``flex_attention`` higher-order op;
- the token embedding's table is replicated (``replicate_embedding``): torchtitan's vocab-parallel
  ``Embedding.forward`` computes its row offset from ``dist.get_rank(tp_group)`` inside a local region, a
  Python int Dynamo bakes into each rank's graph (``simulate`` traces rank 0's for every rank), and fxshard
  reads that local lookup globally as its own masked lookup, so it is left out here
  (tests/test_torchtitan.py's ``test_vocab_parallel_embedding`` records what fxshard does with it).

torchtitan builds its meshes on ``torchtitan.tools.utils.device_type`` (CUDA when no accelerator is found);
``parallel_dims_on_cpu`` builds them on the CPU, on the fake process group ``fxshard``'s ``fake_world`` made.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

DIM, HEADS, KV_HEADS, HIDDEN, VOCAB = 64, 8, 4, 128, 128


def _sdpa(layers: list) -> list:
    from torchtitan.models.common.attention import ScaledDotProductAttention

    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return layers


def _ends(rope_dim: int) -> dict:
    """The embedding, final norm and output head of a decoder at ``DIM``."""
    from torchtitan.models.common import Embedding, Linear, RMSNorm

    return dict(
        dim=DIM, vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM,
                                        param_init={"weight": torch.nn.init.normal_}),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init={"weight": torch.nn.init.ones_}),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB,
                              param_init={"weight": torch.nn.init.normal_, "bias": torch.nn.init.zeros_}))


def llama3_config(n_layers: int = 2, sequence_parallel: bool = False, flex: bool = False) -> Any:
    """torchtitan's Llama 3 (fused QKV, GQA, complex RoPE, SwiGLU) with its TP (+ SP) sharding config; ``flex``:
    its own FlexAttention (the caller passes the block mask and runs flex eagerly, ``eager_flex``)."""
    from torchtitan.models.common import ComplexRoPE
    from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    head_dim = DIM // HEADS
    layers = _build_llama3_layers(n_layers=n_layers, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS, hidden_dim=HIDDEN,
                                  rope=ComplexRoPE.Config(dim=head_dim, max_seq_len=64, theta=500000, scaling="none"),
                                  attn_backend="flex", fuse_qkv=True)
    cfg = Llama3Model.Config(**_ends(head_dim), layers=layers if flex else _sdpa(layers))
    set_llama3_sharding_config(cfg, enable_sp=sequence_parallel)
    return cfg


def qwen3_config(n_layers: int = 2, sequence_parallel: bool = False) -> Any:
    """torchtitan's dense Qwen3 (fused QKV, q/k RMSNorm, cos-sin RoPE) with its TP (+ SP) sharding config;
    untied output head (the debug model ties it to the embedding, which is replicated here)."""
    from torchtitan.models.common import CosSinRoPE
    from torchtitan.models.qwen3 import Qwen3Model
    from torchtitan.models.qwen3 import _build_qwen3_layers
    from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

    head_dim = 16
    layers = _build_qwen3_layers(n_layers=n_layers, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS, head_dim=head_dim,
                                 hidden_dim=HIDDEN, attn_backend="flex", fuse_qkv=True,
                                 rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=64, theta=1000000.0))
    cfg = Qwen3Model.Config(**_ends(head_dim), layers=_sdpa(layers), enable_weight_tying=False)
    set_qwen3_sharding_config(cfg, enable_sp=sequence_parallel, enable_ep=False)
    return cfg


EXPERTS, TOP_K, MOE_HIDDEN = 4, 2, 32


def qwen3_moe_config(n_layers: int = 1, sequence_parallel: bool = False) -> Any:
    """torchtitan's Qwen3-MoE (its registry's ``debugmodel_moe`` shape: every layer MoE, softmax router with
    route_norm, grouped-mm experts) at ``DIM`` with ``EXPERTS`` experts, top ``TOP_K``; its TP sharding config
    without EP. Untied head, as ``qwen3_config``."""
    from torchtitan.models.common import CosSinRoPE
    from torchtitan.models.qwen3 import Qwen3Model, _build_qwen3_moe_layers
    from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

    head_dim = 16
    layers = _build_qwen3_moe_layers(n_layers=n_layers, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS,
                                     head_dim=head_dim, moe_hidden_dim=MOE_HIDDEN, num_experts=EXPERTS,
                                     top_k=TOP_K, attn_backend="flex", moe_comm_backend="standard",
                                     rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=64, theta=1000000.0))
    cfg = Qwen3Model.Config(**_ends(head_dim), layers=_sdpa(layers), enable_weight_tying=False)
    set_qwen3_sharding_config(cfg, enable_sp=sequence_parallel, enable_ep=False)
    return cfg


def deepseek_v3_config(n_layers: int = 2, sequence_parallel: bool = False) -> Any:
    """torchtitan's DeepSeek V3 (its registry's ``debugmodel`` shape: MLA without q LoRA, YaRN complex RoPE, the
    first layer dense, then MoE layers with shared experts and a softmax top-k router) at ``DIM``, heads of 8 +
    8 rope dims, ``EXPERTS`` routed experts; its TP sharding config without EP."""
    from torchtitan.models.common import ComplexRoPE
    from torchtitan.models.deepseek_v3 import DeepSeekV3Model, _build_dsv3_layers
    from torchtitan.models.deepseek_v3.sharding import set_deepseek_v3_sharding_config

    rope_dim = 8
    layers = _build_dsv3_layers(n_layers=n_layers, n_dense_layers=1, dim=DIM, n_heads=HEADS, q_lora_rank=0,
                                kv_lora_rank=32, qk_nope_head_dim=8, qk_rope_head_dim=rope_dim, v_head_dim=8,
                                mscale=0.70, dense_hidden_dim=HIDDEN, moe_hidden_dim=MOE_HIDDEN,
                                num_experts=EXPERTS, num_shared_experts=2, router_top_k=TOP_K,
                                router_score_func="softmax", attn_backend="flex", moe_comm_backend="standard",
                                non_blocking_capacity_factor=None,
                                rope=ComplexRoPE.Config(dim=rope_dim, max_seq_len=64 * 4, theta=10000.0,
                                                        scaling="yarn", rope_factor=40.0, beta_fast=32.0,
                                                        beta_slow=1.0, original_seq_len=64))
    cfg = DeepSeekV3Model.Config(**_ends(rope_dim), layers=_sdpa(layers))
    set_deepseek_v3_sharding_config(cfg, enable_sp=sequence_parallel, enable_ep=False)
    return cfg


CONFIGS = {"llama3": llama3_config, "qwen3": qwen3_config, "qwen3_moe": qwen3_moe_config,
           "deepseek_v3": deepseek_v3_config}


def replicate_embedding(cfg: Any) -> Any:
    """The token embedding's table replicated on tp and its output declared replicated (the rest of the config
    as torchtitan wrote it); its module then looks rows up globally (``parallelize(..., vocab_offsets=False)``)."""
    import spmd_types as spmd
    from torchtitan.models.common.decoder_sharding import dense_activation_placement, dense_param_placement

    sharding = cfg.tok_embeddings.sharding_config
    sharding.state_shardings["weight"] = dense_param_placement(tp=spmd.R)
    sharding.out_src_shardings = dense_activation_placement(tp=spmd.R)
    return cfg


def build(cfg: Any, seed: int = 0) -> torch.nn.Module:
    """The model of ``cfg`` with torchtitan's own initialization, on the CPU."""
    torch.manual_seed(seed)
    model = cfg.build()
    model.init_states()
    return model


@contextlib.contextmanager
def parallel_dims_on_cpu(tp: int) -> Iterator[Any]:
    """``ParallelDims(tp=tp)`` on the ``partial_dtensor`` backend, its meshes built on the CPU over a fake process
    group of ``tp`` ranks (``fake_world``), for the duration of the block."""
    import torchtitan.distributed.parallel_dims as parallel_dims
    from torchtitan.distributed import ParallelDims

    import fxshard
    from fxshard.backend.simulate import fake_world

    device_type = parallel_dims.device_type
    parallel_dims.device_type = "cpu"
    try:
        with fake_world(fxshard.MeshSpec(tp=tp)):
            yield ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=tp, pp=1, ep=1, world_size=tp,
                               spmd_backend="partial_dtensor")
    finally:
        parallel_dims.device_type = device_type


def parallelize(model: torch.nn.Module, dims: Any, vocab_offsets: bool = True) -> torch.nn.Module:
    """torchtitan's ``model.parallelize(dims)``, its DTensors made under ``LocalTensorMode`` (every rank's shard
    held, what ``simulate`` runs). ``vocab_offsets=False``: the embedding module looks rows up globally (no
    tp group; with ``replicate_embedding`` its table is whole on every rank)."""
    from torch.distributed._local_tensor import LocalTensorMode

    with LocalTensorMode(dims.tp):
        model.parallelize(dims)
    if not vocab_offsets:
        model.tok_embeddings.tp_group = None
    return model


def gloo_forward(rank: int, world_size: int, device: str, kind: str = "llama3", vocab_offsets: bool = False,
                 sequence_parallel: bool = True, inductor: bool = True) -> dict:
    """One rank of a real process group (examples/ranks.py ``spawn``): torchtitan parallelizes ``kind`` on tp =
    the world, ``torch.compile(backend="fxshard")`` runs it; the max abs error of the output against one device.
    ``vocab_offsets``: torchtitan's vocab-parallel embedding as it is written (each rank's offset its own)."""
    import torchtitan.distributed.parallel_dims as parallel_dims
    from torchtitan.distributed import ParallelDims

    parallel_dims.device_type = "cpu"  # this spawned process's own module: torchtitan's meshes on the CPU
    cfg = CONFIGS[kind](2, sequence_parallel)
    if not vocab_offsets:
        replicate_embedding(cfg)
    single, sharded = build(cfg), build(cfg)
    sharded.load_state_dict(single.state_dict())
    x = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = single(x)
    sharded.parallelize(ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=world_size, pp=1, ep=1,
                                     world_size=world_size, spmd_backend="partial_dtensor"))
    if not vocab_offsets:
        sharded.tok_embeddings.tp_group = None
    with torch.no_grad():
        out = torch.compile(sharded, backend="fxshard", options={"inductor": inductor})(x)
    full = out.full_tensor() if hasattr(out, "full_tensor") else out
    return {"error": float((full - ref).abs().max()), "type": type(out).__name__}


def full(t: Any) -> torch.Tensor:
    """A DTensor gathered whole; a plain tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def gloo_training_step(rank: int, world_size: int, device: str, kind: str = "llama3", vocab_offsets: bool = True,
                       sequence_parallel: bool = False, n_layers: int = 1, inductor: bool = False,
                       debug_dir: str | None = None) -> dict:
    """One rank of a real process group: torchtitan parallelizes ``kind`` on tp = the world (its vocab-parallel
    embedding as written unless ``vocab_offsets=False``), ``torch.compile(backend="fxshard")`` runs the loss
    ``mean(out**2)``, backward fills every parameter's ``.grad``. Returns numbers only (a tensor a spawned rank
    returns lives in memory shared with a process that exits), each against one device: the no-grad forward's
    max abs error (and the output's type), the loss's error, and each parameter's gradient's max abs error
    beside that gradient's largest magnitude (None: no gradient)."""
    import torchtitan.distributed.parallel_dims as parallel_dims
    from torchtitan.distributed import ParallelDims

    parallel_dims.device_type = "cpu"
    cfg = CONFIGS[kind](n_layers, sequence_parallel)
    if not vocab_offsets:
        replicate_embedding(cfg)
    single, sharded = build(cfg), build(cfg)
    sharded.load_state_dict(single.state_dict())
    x = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    loss = single(x).float().pow(2).mean()
    loss.backward()
    sharded.parallelize(ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=world_size, pp=1, ep=1,
                                     world_size=world_size, spmd_backend="partial_dtensor"))
    if not vocab_offsets:
        sharded.tok_embeddings.tp_group = None
    options = {"inductor": inductor, **({"debug_dir": debug_dir} if debug_dir else {})}
    with torch.no_grad():  # the forward alone first (its own capture): the output against one device's
        ref = single(x)
        out = torch.compile(sharded, backend="fxshard", options=options)(x)
    forward = {"error": float((full(out) - ref).abs().max()), "type": type(out).__name__}
    value = torch.compile(lambda t: sharded(t).float().pow(2).mean(), backend="fxshard", options=options)(x)
    value.backward()
    want = dict(single.named_parameters())
    grads = {name: (float((full(p.grad) - want[name].grad).abs().max()), float(want[name].grad.abs().max()))
             if p.grad is not None else None for name, p in sharded.named_parameters()}
    return {"forward": forward, "loss": float((full(value.detach()) - loss.detach()).abs()), "grads": grads}


def eager_flex() -> None:
    """torchtitan's FlexAttention calls ``flex_attention`` compiled with Inductor's max-autotune (Triton kernels);
    on the CPU the plain function runs instead (the one device's reference unfused, the same higher-order op
    under torch.compile). Call in the process that runs the model (a spawned rank's own)."""
    from torch.nn.attention.flex_attention import flex_attention
    from torchtitan.models.common.attention import FlexAttention

    FlexAttention._compiled_flex_attn = flex_attention


def document_positions() -> torch.Tensor:
    """Positions of two packed documents per row (10 and 6 tokens), torchtitan's block-causal masking input."""
    return torch.cat([torch.arange(10), torch.arange(6)]).repeat(2, 1)


def gloo_flex_forward(rank: int, world_size: int, device: str) -> dict:
    """One rank: torchtitan's Llama 3 (one layer) with its FlexAttention and a packed-document block mask
    (``get_attention_masks``), parallelized by torchtitan on tp = the world (embedding replicated), run by
    ``torch.compile(backend="fxshard")`` without Inductor; the output's max abs error against one device, and
    fxshard's warnings (a replicated op, a graph break it reports)."""
    import torchtitan.distributed.parallel_dims as parallel_dims
    from torchtitan.distributed import ParallelDims

    parallel_dims.device_type = "cpu"
    eager_flex()
    cfg = replicate_embedding(llama3_config(1, flex=True))
    single, sharded = build(cfg), build(cfg)
    sharded.load_state_dict(single.state_dict())
    x = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    positions = document_positions()
    masks = single.get_attention_masks(positions)
    with torch.no_grad():
        ref = single(x, positions=positions, attention_masks=masks)
    sharded.parallelize(ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=world_size, pp=1, ep=1,
                                     world_size=world_size, spmd_backend="partial_dtensor"))
    sharded.tok_embeddings.tp_group = None
    import warnings

    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.compile(lambda t, p: sharded(t, positions=p, attention_masks=masks), backend="fxshard",
                            options={"inductor": False})(x, positions)
    return {"error": float((full(out) - ref).abs().max()), "largest": float(ref.abs().max()),
            "type": type(out).__name__,
            "warnings": sorted({str(w.message) for w in caught if str(w.message).startswith("fxshard")})}
