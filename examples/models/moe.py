"""A Mixture-of-Experts feed-forward block with top-k routing, GShard-style: static shapes.

Each token picks its ``top_k`` experts; a token's slot in an expert's buffer is its rank among
the tokens routed there (a cumsum over the one-hot routing), and tokens past an expert's
``capacity`` are dropped (their residual passes through, as in GShard and Switch). Dispatch and
combine are einsums with a one-hot ``[tokens, experts, capacity]`` tensor, so every shape is
known at trace time and the experts' dim can be sharded like any other: expert parallelism is a
placement of the expert weights (``Shard(0)``), and the combine's contraction over experts is a
partial sum that one all-reduce (or reduce-scatter) finishes.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MoE(nn.Module):
    def __init__(self, dim: int, ffn_dim: int, n_experts: int, top_k: int = 2, capacity_factor: float = 2.0):
        super().__init__()
        self.n_experts, self.top_k, self.capacity_factor = n_experts, top_k, capacity_factor
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(n_experts, dim, ffn_dim) * dim ** -0.5)
        self.w3 = nn.Parameter(torch.randn(n_experts, dim, ffn_dim) * dim ** -0.5)
        self.w2 = nn.Parameter(torch.randn(n_experts, ffn_dim, dim) * ffn_dim ** -0.5)

    def capacity(self, tokens: int) -> int:
        return max(1, int(self.capacity_factor * tokens * self.top_k / self.n_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [batch, seq, dim] -> [batch, seq, dim]."""
        b, s, d = x.shape
        tokens = x.reshape(b * s, d)
        probs = F.softmax(self.router(tokens), dim=-1)  # [t, e]
        gate, expert = probs.topk(self.top_k, dim=-1)  # [t, k]
        gate = gate / gate.sum(dim=-1, keepdim=True)
        routed = F.one_hot(expert, self.n_experts).to(x.dtype)  # [t, k, e]
        # a token's slot in each expert: how many (token, choice) pairs before it went there
        position = (torch.cumsum(routed.reshape(-1, self.n_experts), dim=0).reshape(routed.shape) - 1) * routed
        capacity = self.capacity(b * s)
        kept = routed * (position < capacity).to(x.dtype)
        slot = F.one_hot(position.sum(dim=1).long().clamp(max=capacity - 1), capacity).to(x.dtype)  # [t, e, c]
        dispatch = kept.sum(dim=1).unsqueeze(-1) * slot  # [t, e, c]
        combine = (gate.unsqueeze(-1) * kept).sum(dim=1).unsqueeze(-1) * slot  # [t, e, c]
        expert_in = torch.einsum("tec,td->ecd", dispatch, tokens)
        hidden = F.silu(torch.einsum("ecd,edf->ecf", expert_in, self.w1)) * torch.einsum("ecd,edf->ecf", expert_in, self.w3)
        expert_out = torch.einsum("ecf,efd->ecd", hidden, self.w2)
        return torch.einsum("tec,ecd->td", combine, expert_out).reshape(b, s, d)


def reference_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """The same block token by token with python loops: what the einsums must compute."""
    b, s, d = x.shape
    tokens = x.reshape(b * s, d)
    probs = F.softmax(moe.router(tokens), dim=-1)
    gate, expert = probs.topk(moe.top_k, dim=-1)
    gate = gate / gate.sum(dim=-1, keepdim=True)
    capacity, used = moe.capacity(b * s), [0] * moe.n_experts
    out = torch.zeros_like(tokens)
    for t in range(b * s):
        for j in range(moe.top_k):
            e = int(expert[t, j])
            if used[e] < capacity:
                h = F.silu(tokens[t] @ moe.w1[e]) * (tokens[t] @ moe.w3[e])
                out[t] += gate[t, j] * (h @ moe.w2[e])
            used[e] += 1
    return out.reshape(b, s, d)
