"""Head-tail (zigzag) load balance for context parallelism, by reordering the tokens.

With the sequence cut into ``cp`` contiguous shards, rank r's queries see the keys of r + 1 shards under a
causal mask: the last rank does about twice the mean's attention. The head-tail order gives rank r the
chunks r and 2 cp - 1 - r of 2 cp equal chunks, so every rank's rows see the same number of keys.
fxshard's layouts cut a dim into a product of pieces, which this assignment is not, so it is the
tokens that move, once, before the program: the user permutes every per-token input (ids, labels,
position ids) by ``head_tail_order`` and shards the result plainly (``Shard(1)``); rank r's contiguous
shard is then its two chunks. The program sees the permuted sequence, so what depends on a token's
position must read the permuted positions: the rotary angles from ``position_ids`` (Hugging Face models
take them), and the causal mask from them, ``causal_mask(positions)`` (a key is visible where its
position is at most the query's), passed as the attention mask. A mean loss over the tokens is the
same in any order; per-token outputs come back permuted (``outputs[..., order.argsort(), :]`` undoes it).

The attention is then a masked, non-causal one, its rows independent: each rank's rows with the keys
gathered, as for ``Shard`` (fxshard/rules_attention.py), with equal work on every rank (dense masked
kernels compute every score; FlexAttention with a block mask of these positions skips the empty blocks).
"""
from __future__ import annotations

import torch


def head_tail_order(seq_len: int, cp: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The positions in head-tail order: ``x[:, order]`` puts chunks r and 2 cp - 1 - r of 2 cp equal chunks in
    rank r's contiguous shard of ``seq_len / cp`` tokens."""
    if cp < 1 or seq_len % (2 * cp):
        raise ValueError(f"head_tail_order: a sequence of {seq_len} tokens does not cut into 2 x {cp} equal chunks; "
                         f"pad it to a multiple of {2 * cp}")
    chunks = torch.arange(seq_len, device=device).view(2 * cp, seq_len // (2 * cp))
    ranks = [torch.cat([chunks[r], chunks[2 * cp - 1 - r]]) for r in range(cp)]
    return torch.cat(ranks)


def causal_mask(positions: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The causal attention mask [1, 1, s, s] of tokens at ``positions`` (any order): 0 where the key's position is
    at most the query's, the dtype's lowest value elsewhere (an additive mask, as Hugging Face models take it)."""
    visible = positions[:, None] >= positions[None, :]
    mask = torch.zeros(visible.shape, dtype=dtype, device=positions.device)
    return mask.masked_fill(~visible, torch.finfo(dtype).min)[None, None]
