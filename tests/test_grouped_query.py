"""Grouped-query attention with fewer key/value heads than tensor-parallel ranks (issue 18).

8 q heads, 2 (or 1: multi-query) kv heads at tp=4, Megatron placements (q projection column-parallel,
o projection row-parallel). Rank r holds q heads 2r, 2r+1, which read kv head r // 2: as vLLM does,
each rank holds the kv head of its q heads, replicated over the ranks of its group. In layouts:
q's heads are ``[4@tp 2]`` and k/v's heads ``[2@tp/2]`` (the major sub-axis of tp; replicated on
tp%2), so q is never gathered. The kv projections may be given ``Replicate()`` (vLLM's
annotation: a local slice, no collective) or ``Shard(0)`` (each kv head split over two ranks: the
halves are gathered within each pair, tp%2).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

import fxshard
from fxshard.layout import Piece
from fxshard.strategies import fit

B, S, HQ, D, HIDDEN = 2, 6, 8, 16, 64
MESH = fxshard.MeshSpec(tp=4)
TP = MESH.axis("tp")
TP_HI, TP_LO = TP.split(2)  # tp/2 (which pair of ranks), tp%2 (which rank of the pair)


def attention_block(kv_heads: int):
    """q/k/v projections, causal SDPA with grouped-query heads, o projection."""
    def block(x, wq, wk, wv, wo):
        q = (x @ wq.t()).view(B, S, HQ, D).transpose(1, 2)
        k = (x @ wk.t()).view(B, S, kv_heads, D).transpose(1, 2)
        v = (x @ wv.t()).view(B, S, kv_heads, D).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return o.transpose(1, 2).reshape(B, S, HQ * D) @ wo.t()
    return block


def arguments(kv_heads: int, requires_grad: bool = False) -> list[torch.Tensor]:
    shapes = [(B, S, HIDDEN), (HQ * D, HIDDEN), (kv_heads * D, HIDDEN), (kv_heads * D, HIDDEN), (HIDDEN, HQ * D)]
    return [(torch.randn(s) * (1 if i == 0 else 0.1)).requires_grad_(requires_grad) for i, s in enumerate(shapes)]


def placements(kv_projection) -> dict:
    return {1: (Shard(0),), 2: (kv_projection,), 3: (kv_projection,), 4: (Shard(1),)}


# (a factor's pieces, the size of a smaller dim sharing it) -> (the pieces that dim keeps, the axes it leaves out)
FITS = {
    "q heads [4@tp] over 2 kv heads: the major sub-axis": ((Piece(4, TP),), 2, ((Piece(2, TP_HI),), (TP_LO,))),
    "over 1 kv head: nothing kept": ((Piece(4, TP),), 1, ((), (TP,))),
    "over 4 kv heads: all kept": ((Piece(4, TP),), 4, ((Piece(4, TP),), ())),
    "strided q heads [2 4@tp] over 2: the local block": ((Piece(2), Piece(4, TP)), 2, ((Piece(2),), (TP,))),
}


@pytest.mark.parametrize("case", list(FITS))
def test_a_smaller_dim_keeps_the_major_pieces(case):
    pieces, size, want = FITS[case]
    assert fit(pieces, size) == want


# (kv heads, kv projections' placement) -> the collectives of the forward; q is never moved
PLANS = {
    "2 kv heads, Replicate kv projections: a local slice": (2, Replicate(), []),
    "2 kv heads, Shard(0) kv projections: k and v halves gathered in pairs": (2, Shard(0), [("all_gather", "tp%2")] * 2),
    "1 kv head (MQA), Replicate": (1, Replicate(), []),
    "1 kv head (MQA), Shard(0): k and v gathered": (1, Shard(0), [("all_gather", "tp")] * 2),
}


@pytest.mark.parametrize("case", list(PLANS))
def test_kv_heads_are_replicated_per_group_not_q_gathered(case):
    kv_heads, kv_projection, want = PLANS[case]
    e = fxshard.explain(attention_block(kv_heads), *arguments(kv_heads), mesh=MESH, placements=placements(kv_projection))
    assert [(c.kind, ",".join(map(str, c.axes))) for c in e.collectives] == want


def test_half_heads_move_at_the_lower_bound():
    """From Shard(0) kv projections (each kv head split over a pair of ranks) the least a rank can
    receive is the other half of its kv head's k and v for every token: what the pair gathers."""
    e = fxshard.explain(attention_block(2), *arguments(2), mesh=MESH, placements=placements(Shard(0)))
    plans = [c.node.meta["plan"] for c in e.collectives]
    assert [p.bytes_per_rank for p in plans] == [fxshard.lower_bound_bytes(p.src, p.dst) for p in plans] == \
        [B * S * (D // 2) * 4] * 2


@pytest.mark.parametrize("case", list(PLANS))
def test_gradients_sum_each_kv_head_over_its_group(case):
    """grad_key/grad_value of a kv head sum over its q heads, which lie on several ranks: Partial(sum)."""
    kv_heads, kv_projection, _ = PLANS[case]
    torch.manual_seed(0)
    args = arguments(kv_heads, requires_grad=True)
    loss = lambda *a: attention_block(kv_heads)(*a).square().mean()  # noqa: E731
    got, grads = fxshard.simulate(loss, *args, mesh=MESH, placements=placements(kv_projection), grad=True)
    loss(*args).backward()
    torch.testing.assert_close([grads[i] for i in range(len(args))], [a.grad for a in args], rtol=1e-4, atol=1e-6)
