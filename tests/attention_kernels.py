"""CPU stand-ins for the attention kernels CPU lacks (CUDA flash, memory-efficient, cuDNN, overrideable).

Tracing calls these ops on fake tensors (their meta kernels), so a graph using them can be
planned on a CPU-only machine; running it needs a CPU kernel, which these give: the math
formula, with the outputs the real kernels return (shapes as torch/_meta_registrations.py
gives them). Where the real kernels differ: no dropout (``dropout_p`` must be 0, so the RNG
outputs are empty placeholders), the efficient kernel's padded logsumexp is zero past the
sequence, bool masks are accepted wherever float ones are, and masks broadcast as in
``F.scaled_dot_product_attention``. ``register_cuda_kernels_on_cpu`` registers them for a
``with`` block only (a ``torch.library.Library`` destroyed at its end).
"""
from __future__ import annotations

import contextlib
import math
from typing import Iterator

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


def _scores(q: Tensor, k: Tensor, mask: Tensor | None, is_causal: bool, scale: float | None) -> Tensor:
    """q @ k^T * scale with the causal (top-left) and explicit masks applied; k already has q's heads."""
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
    s = (q.float() @ k.float().transpose(-2, -1)) * scale
    if is_causal:
        keep = torch.ones(s.shape[-2:], dtype=torch.bool).tril()
        s = s.masked_fill(~keep, float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.float()
    return s


def _expand_heads(q: Tensor, kv: Tensor) -> Tensor:
    """k or v with q's heads: each kv head serves a contiguous group of q heads (GQA)."""
    return kv.repeat_interleave(q.size(1) // kv.size(1), dim=1) if kv.size(1) != q.size(1) else kv


def _fold_heads(grad: Tensor, kv: Tensor) -> Tensor:
    """The gradient for q's heads summed back onto kv's heads (the inverse of ``_expand_heads``)."""
    b, h, t, d = grad.shape
    return grad.view(b, kv.size(1), h // kv.size(1), t, d).sum(2) if kv.size(1) != h else grad


def attention_forward(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool,
                      scale: float | None) -> tuple[Tensor, Tensor]:
    """(output, logsumexp [b, h, s]) by the math formula."""
    s = _scores(q, _expand_heads(q, k), mask, is_causal, scale)
    lse = s.logsumexp(-1)
    out = torch.exp(s - lse.unsqueeze(-1)) @ _expand_heads(q, v).float()
    return out.to(q.dtype), lse


def attention_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                       mask: Tensor | None, is_causal: bool, scale: float | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(grad_q, grad_k, grad_v, grad of the scores) from the saved output and logsumexp [b, h, s]."""
    scale_ = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
    k_, v_ = _expand_heads(q, k).float(), _expand_heads(q, v).float()
    p = torch.exp(_scores(q, k_, mask, is_causal, scale) - lse.unsqueeze(-1))
    g = grad_out.float()
    dp = g @ v_.transpose(-2, -1)
    ds = p * (dp - (g * out.float()).sum(-1, keepdim=True))
    dq = (ds @ k_) * scale_
    dk = _fold_heads((ds.transpose(-2, -1) @ q.float()) * scale_, k)
    dv = _fold_heads(p.transpose(-2, -1) @ g, v)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), ds


def _sum_to(grad: Tensor, shape: torch.Size) -> Tensor:
    """A broadcast operand's gradient: summed over the dims it was stretched along."""
    lead = grad.dim() - len(shape)
    dims = [d for d in range(grad.dim()) if d < lead or (shape[d - lead] == 1 and grad.size(d) != 1)]
    return grad.sum(dims, keepdim=True).reshape(shape) if dims else grad


def _check_no_dropout(dropout_p: float) -> None:
    if dropout_p:
        raise NotImplementedError("the CPU stand-ins of the CUDA attention kernels have no dropout: pass dropout_p=0")


def _seed_offset() -> tuple[Tensor, Tensor]:
    return torch.empty((), dtype=torch.long), torch.empty((), dtype=torch.long)


# ---- forwards ------------------------------------------------------------------------------

def flash(q, k, v, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    """aten._scaled_dot_product_flash_attention: GQA native; no mask argument."""
    _check_no_dropout(dropout_p)
    out, lse = attention_forward(q, k, v, None, is_causal, scale)
    rng_state = torch.zeros(2, dtype=torch.uint64)
    unused = torch.zeros((), dtype=torch.uint64)
    debug = torch.empty(0, dtype=q.dtype)
    return out, lse, None, None, q.size(2), k.size(2), rng_state, unused, debug


def efficient(q, k, v, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *, scale=None):
    """aten._scaled_dot_product_efficient_attention: logsumexp padded to a multiple of 32 queries."""
    _check_no_dropout(dropout_p)
    out, lse = attention_forward(q, k, v, attn_bias, is_causal, scale)
    m = q.size(2)
    padded = torch.zeros(q.size(0), q.size(1), -(-m // 32) * 32 if compute_log_sumexp else 0)
    if compute_log_sumexp:
        padded[..., :m] = lse
    return (out, padded) + _seed_offset()


def cudnn(q, k, v, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, return_debug_mask=False, *,
          scale=None):
    """aten._scaled_dot_product_cudnn_attention: logsumexp [b, h, s, 1]."""
    _check_no_dropout(dropout_p)
    out, lse = attention_forward(q, k, v, attn_bias, is_causal, scale)
    return (out, lse.unsqueeze(-1), None, None, q.size(2), k.size(2)) + _seed_offset() + (None,)


def overrideable(q, k, v, attn_bias=None, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    """aten._scaled_dot_product_fused_attention_overrideable (other devices' fused kernel): cuDNN's outputs,
    logsumexp [b, h, s]."""
    _check_no_dropout(dropout_p)
    out, lse = attention_forward(q, k, v, attn_bias, is_causal, scale)
    return (out, lse, None, None, q.size(2), k.size(2)) + _seed_offset() + (None,)


# ---- backwards -----------------------------------------------------------------------------

def flash_backward(grad_out, q, k, v, out, lse, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                   philox_seed, philox_offset, *, scale=None):
    _check_no_dropout(dropout_p)
    return attention_backward(grad_out, q, k, v, out, lse, None, is_causal, scale)[:3]


def efficient_backward(grad_out, q, k, v, attn_bias, out, lse, philox_seed, philox_offset, dropout_p,
                       grad_input_mask, is_causal=False, *, scale=None):
    _check_no_dropout(dropout_p)
    lse = lse[..., :q.size(2)]
    dq, dk, dv, ds = attention_backward(grad_out, q, k, v, out, lse, attn_bias, is_causal, scale)
    grad_bias = None
    if attn_bias is not None and grad_input_mask[3]:
        grad_bias = _sum_to(ds, attn_bias.shape).to(attn_bias.dtype)
    return dq, dk, dv, grad_bias


def cudnn_backward(grad_out, q, k, v, out, lse, philox_seed, philox_offset, attn_bias, cum_seq_q, cum_seq_k,
                   max_q, max_k, dropout_p, is_causal, *, scale=None):
    _check_no_dropout(dropout_p)
    return attention_backward(grad_out, q, k, v, out, lse.squeeze(-1), attn_bias, is_causal, scale)[:3]


def overrideable_backward(grad_out, q, k, v, attn_bias, grad_input_mask, out, lse, cum_seq_q, cum_seq_k, max_q,
                          max_k, dropout_p, is_causal, philox_seed, philox_offset, *, scale=None):
    return efficient_backward(grad_out, q, k, v, attn_bias, out, lse, philox_seed, philox_offset, dropout_p,
                              grad_input_mask, is_causal, scale=scale)


STAND_INS = {
    "_scaled_dot_product_flash_attention": flash,
    "_scaled_dot_product_efficient_attention": efficient,
    "_scaled_dot_product_cudnn_attention": cudnn,
    "_scaled_dot_product_flash_attention_backward": flash_backward,
    "_scaled_dot_product_efficient_attention_backward": efficient_backward,
    "_scaled_dot_product_cudnn_attention_backward": cudnn_backward,
    "_scaled_dot_product_fused_attention_overrideable": overrideable,
    "_scaled_dot_product_fused_attention_overrideable_backward": overrideable_backward,
}


@contextlib.contextmanager
def register_cuda_kernels_on_cpu() -> Iterator[None]:
    """The stand-ins as the CPU kernels of their aten ops, for the ``with`` block only."""
    lib = torch.library.Library("aten", "IMPL")
    try:
        for name, fn in STAND_INS.items():
            lib.impl(name, fn, "CPU")
        yield
    finally:
        lib._destroy()


def reference(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, is_causal: bool = False,
              scale: float | None = None) -> Tensor:
    """What every kernel computes, by torch's own math path (the oracle for the stand-ins); a mask
    with ``is_causal`` (which F.scaled_dot_product_attention refuses) is folded into the mask."""
    if is_causal and mask is not None:
        keep = torch.ones(q.size(2), k.size(2), dtype=torch.bool).tril()
        mask = mask & keep if mask.dtype == torch.bool else mask.masked_fill(~keep, float("-inf"))
        is_causal = False
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                          enable_gqa=k.size(1) != q.size(1))
