"""A compact Llama 3 in global shapes: RMSNorm, rotary embeddings, grouped-query attention with
scaled_dot_product_attention, SwiGLU, tied or untied output projection.

Nothing here knows about sharding: fxshard shards it from the placements of its parameters
and inputs (``tensor_parallel_plan`` below gives the usual Megatron ones).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 512
    dim: int = 128
    n_layers: int = 2
    n_heads: int = 16
    n_kv_heads: int = 8
    ffn_dim: int = 256
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope: str = "real"  # "real" (cos/sin, rotate-half) or "complex" (freqs_cis, view_as_complex)
    tie_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rope_angles(seq_len: int, head_dim: int, theta: float, device: torch.device | None = None) -> torch.Tensor:
    """[seq_len, head_dim // 2] rotation angles (position x frequency)."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    positions = torch.arange(seq_len, device=device, dtype=torch.float32)
    return torch.outer(positions, freqs)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope_real(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """x: [batch, seq, heads, head_dim]; the Hugging Face (rotate-half) form."""
    emb = torch.cat((angles, angles), dim=-1)
    # in x's dtype, as Hugging Face's form casts them: bf16 q and k stay bf16 beside v (SDPA wants one dtype)
    cos, sin = emb.cos()[None, :, None, :].to(x.dtype), emb.sin()[None, :, None, :].to(x.dtype)
    return x * cos + rotate_half(x) * sin


def apply_rope_complex(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """x: [batch, seq, heads, head_dim]; the Meta (interleaved pairs as complex numbers) form."""
    xc = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    out = torch.view_as_real(xc * freqs_cis[None, :, None, :]).flatten(3)
    return out.type_as(x)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[batch, seq, kv_heads, head_dim] -> [batch, seq, kv_heads * n_rep, head_dim]."""
    if n_rep == 1:
        return x
    b, s, _, d = x.shape  # -1 for the heads: the same code runs on tensor-parallel local shards
    return x[:, :, :, None, :].expand(-1, -1, -1, n_rep, -1).reshape(b, s, -1, d)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        hd = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * hd, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=False)
        self.wo = nn.Linear(cfg.n_heads * hd, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        b, s, _ = x.shape
        # -1 for the head counts: the same code runs on tensor-parallel local shards (fewer heads)
        q = self.wq(x).view(b, s, -1, cfg.head_dim)
        k = self.wk(x).view(b, s, -1, cfg.head_dim)
        v = self.wv(x).view(b, s, -1, cfg.head_dim)
        apply = apply_rope_complex if cfg.rope == "complex" else apply_rope_real
        q, k = apply(q, rope), apply(k, rope)
        n_rep = cfg.n_heads // cfg.n_kv_heads
        k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig, max_seq_len: int = 256):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        if cfg.rope == "complex":
            angles = rope_angles(max_seq_len, cfg.head_dim, cfg.rope_theta)
            self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [batch, seq] -> logits [batch, seq, vocab]."""
        seq = tokens.shape[1]
        if self.cfg.rope == "complex":
            rope = self.freqs_cis[:seq]
        else:
            rope = rope_angles(seq, self.cfg.head_dim, self.cfg.rope_theta, tokens.device)
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, rope)
        return self.output(self.norm(h))

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self(tokens)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


COLUMN_PARALLEL = ("wq", "wk", "wv", "w1", "w3", "tok_embeddings", "output")
ROW_PARALLEL = ("wo", "w2")


def megatron_placements(model: Llama) -> dict:
    """Megatron as parameter placements on a 1-D mesh (for ``explain``/``simulate``'s ``placements=``):
    column-parallel weights Shard(0), row-parallel Shard(1), norms replicated."""
    from torch.distributed.tensor import Shard

    out = {}
    for name, _ in model.named_parameters():
        if any(k in name for k in COLUMN_PARALLEL):
            out[name] = (Shard(0),)
        elif any(k in name for k in ROW_PARALLEL):
            out[name] = (Shard(1),)
    return out


def fsdp_placements(model: Llama) -> dict:
    """FSDP (ZeRO-3) as parameter placements on a 1-D data-parallel mesh: every parameter Shard(0).

    Nothing else is said: the plan all-gathers each weight where it is used and reduce-scatters
    its gradient into Shard(0), because that is the cheapest way to run the global program."""
    from torch.distributed.tensor import Shard

    return {name: (Shard(0),) for name, _ in model.named_parameters()}


def fsdp_tp_placements(model: Llama) -> dict:
    """FSDP x TP on a (dp, tp) mesh: Megatron on tp, each weight's other dim sharded on dp."""
    from torch.distributed.tensor import Replicate, Shard

    out = {}
    for name, _ in model.named_parameters():
        if any(k in name for k in COLUMN_PARALLEL):
            out[name] = (Shard(1), Shard(0))
        elif any(k in name for k in ROW_PARALLEL):
            out[name] = (Shard(0), Shard(1))
        else:
            out[name] = (Shard(0), Replicate())
    return out


def tensor_parallel_plan(model: Llama, sequence_parallel: bool = False, loss_parallel: bool = True) -> dict:
    """The Megatron plan for ``parallelize_module(model, tp_mesh, plan)`` (torchtitan's, in global shapes).

    Column-parallel q/k/v and w1/w3, row-parallel wo and w2 (heads and FFN columns sharded),
    a vocab-parallel embedding and output. With ``sequence_parallel`` the norms and the
    residual stream are sharded on the sequence dim between the blocks. Attention outputs
    stay DTensors (``use_local_output=False``): the model reshapes them in global shapes;
    the rotary table becomes a replicated DTensor beside them.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel)

    seq = Shard(1) if sequence_parallel else Replicate()
    local_stream = not sequence_parallel  # a replicated residual stream stays plain tensors (plain norms)
    plan: dict = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq, use_local_output=local_stream),
        "output": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                  use_local_output=False),
    }
    if sequence_parallel:
        plan["norm"] = SequenceParallel()
    for i in range(len(model.layers)):
        p = f"layers.{i}."
        plan.update({
            p + "attention": PrepareModuleInput(input_layouts=(seq, None), desired_input_layouts=(Replicate(), None),
                                                use_local_output=False),
            p + "attention.wq": ColwiseParallel(),
            p + "attention.wk": ColwiseParallel(),
            p + "attention.wv": ColwiseParallel(),
            p + "attention.wo": RowwiseParallel(output_layouts=seq, use_local_output=local_stream),
            p + "feed_forward": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),),
                                                   use_local_output=False),
            p + "feed_forward.w1": ColwiseParallel(),
            p + "feed_forward.w3": ColwiseParallel(),
            p + "feed_forward.w2": RowwiseParallel(output_layouts=seq, use_local_output=local_stream),
        })
        if sequence_parallel:
            plan[p + "attention_norm"] = SequenceParallel()
            plan[p + "ffn_norm"] = SequenceParallel()
    return plan
