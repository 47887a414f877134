"""FlexAttention (``torch.ops.higher_order.flex_attention``): heads and batch shard as SDPA's do.

The op is ``flex_attention(q, k, v, score_mod, block_mask, scale, kernel_options, score_buffers,
mask_buffers)``: ``score_mod`` and the block mask's ``mask_mod`` are subgraphs (``get_attr`` of a
GraphModule), called with ``(b, h, q_idx, kv_idx)`` of each score. The signature:

- q ``b h s d``, k ``b h t d``, v ``b h t e``; the outputs (attention, logsumexp, max) ``b h s e``,
  ``b h s``, ``b h s``: batch and heads pass through (grouped-query k/v with fewer heads keep their
  major part, as SDPA's); the sequence dims and head dims stay whole (the block mask is built per
  query block over every key block, and a mask_mod reads ``q_idx`` and ``kv_idx``);
- the block mask's tensors lead with its own batch and head dims (size 1 where it broadcasts):
  those shard with q's batch and heads, the block dims stay whole;
- tensors the subgraphs capture (``score_buffers``, ``mask_buffers``: an ALiBi slope table) stay whole,
  since the subgraphs may index them anywhere.

Query rows shard too (context parallelism, the sequence dim of q on a ``cp`` axis, k and v whole):
the block mask's per-query-block tensors (``kv_num_blocks``, ``kv_indices`` and their ``full_``
pair: which key blocks each query block reads, [B, H, query blocks, ...]) follow q's rows, one
block of ``Q_BLOCK_SIZE`` rows per entry, and its per-key-block tensors (``q_num_blocks``, ...:
the backward's) stay whole. A rank's rows must be one contiguous run of whole blocks (``Signature.exact``:
a strategy that would give a rank part of a block is none, so the queries stay whole there).

What a subgraph sees of a sharded dim: the local program calls the kernel on the rank's heads, so
the kernel hands the subgraphs local indices ``h`` in ``[0, heads / n)``. A score_mod that reads the
head (ALiBi's slope of head ``h``) must see the global head, as on one device: stage 4 gives each
rank a copy of both subgraphs whose batch, head and query indices are shifted by the rank's first
batch row, head and query row (``localization.GlobalIndices``; a causal mask_mod compares the global
``q_idx`` with ``kv_idx``), and refuses where the rank's heads are not one contiguous run (then there
is no shift that makes them global). The block mask's query length becomes the rank's.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.fx as fx

from .graph import argument_leaves
from .localization import GlobalIndices
from .rules import Signature

FLEX_ATTENTION = torch.ops.higher_order.flex_attention

# the subgraphs flex_attention calls, as (path in its arguments, (placeholder, dim of q it indexes)):
# score_mod(score, b, h, q_idx, kv_idx, *buffers) is argument 3; mask_mod(b, h, q_idx, kv_idx, *buffers)
# is the block mask's (argument 4) last element
# (score_mod's q_idx: placeholder 3; mask_mod's: 2). The block mask (argument 4) is BlockMask.as_tuple():
# Q_LEN, KV_LEN, the per-query-block tensors (2-5), the per-key-block ones (6-9), the backward's write
# orders (10-13), Q_BLOCK_SIZE, KV_BLOCK_SIZE, mask_mod
FORWARD_INDICES = GlobalIndices(of=0, subgraphs=(((3,), ((1, 0), (2, 1), (3, 2))), ((4, -1), ((0, 0), (1, 1), (2, 2)))),
                                lengths=(((4, 0), 2),), blocks=(((4, 14), 2),))

_Q, _K, _V, _BLOCK_MASK, _SCORE_BUFFERS, _MASK_BUFFERS = 0, 1, 2, 4, 7, 8
_Q_LEN, _KV_LEN, _PER_QUERY_BLOCK = 0, 1, range(2, 6)


def _shape(a: Any) -> tuple[int, ...] | None:
    val = a.meta.get("val") if isinstance(a, fx.Node) else None
    return tuple(int(s) for s in val.shape) if isinstance(val, torch.Tensor) else None


def _tensor_arguments(node: fx.Node) -> list[tuple[int, tuple[int, ...]]]:
    """(argument position, shape) of each tensor leaf of the arguments, in ``graph.tensor_inputs``' order."""
    return [(i, shape) for i, arg in enumerate(node.args) for leaf in argument_leaves(arg)
            if (shape := _shape(leaf)) is not None]


def _heads_agree(q: Sequence[int], k: Sequence[int], v: Sequence[int]) -> bool:
    """4-d q, k, v of one batch whose k/v heads agree and divide q's (plain or grouped-query)."""
    return (len(q) == len(k) == len(v) == 4 and q[0] == k[0] == v[0] and k[1] == v[1] and k[1] > 0
            and q[1] % k[1] == 0 and k[2] == v[2])


def _block_mask_factors(shape: Sequence[int], q: Sequence[int], i: int, element: int) -> tuple[str | None, ...] | None:
    """A block-mask tensor ``[B|1, H|1, blocks...]``: its batch and heads are q's (or broadcast); a per-query-block
    one's query blocks (dim 2) are q's rows in blocks, the rest whole."""
    if len(shape) < 2:
        return None
    lead: list[str | None] = []
    for size, factor, full in zip(shape[:2], ("b", "h"), q[:2]):
        if size == 1 and full != 1:
            lead.append(None)
        elif size == full:
            lead.append(factor)
        else:
            return None
    rest = [f"m{i}_{d}" for d in range(2, len(shape))]
    if element in _PER_QUERY_BLOCK and rest:
        rest[0] = "s"
    return tuple(lead) + tuple(rest)


def flex_attention(node: fx.Node) -> Signature | None:
    """The signature of a ``flex_attention`` call (the module docstring says which dims shard)."""
    if node.kwargs or len(node.args) < 9:
        return None
    tensors = _tensor_arguments(node)
    q, k, v = (_shape(node.args[i]) for i in (_Q, _K, _V))
    if q is None or k is None or v is None or not _heads_agree(q, k, v):
        return None
    factors = {_Q: ("b", "h", "s", "d"), _K: ("b", "h", "t", "d"), _V: ("b", "h", "t", "e")}
    block_mask = node.args[_BLOCK_MASK]
    elements = iter([e for e, a in enumerate(block_mask) if _shape(a) is not None])
    ins: list[tuple[str | None, ...]] = []
    per_query_block: list[int] = []
    for j, (position, shape) in enumerate(tensors):
        if position in factors:
            f = factors[position]
        elif position == _BLOCK_MASK:
            element = next(elements)
            f = _block_mask_factors(shape, q, j, element)
            per_query_block += [j] if element in _PER_QUERY_BLOCK else []
        elif position in (_SCORE_BUFFERS, _MASK_BUFFERS):
            f = tuple(f"w{j}_{d}" for d in range(len(shape)))
        else:
            f = None
        if f is None:
            return None
        ins.append(f)
    outs = node.meta.get("val")
    if not isinstance(outs, (tuple, list)) or not outs or not all(isinstance(o, torch.Tensor) for o in outs):
        return None
    shapes = [tuple(o.shape) for o in outs]
    if shapes[0] != (q[0], q[1], q[2], v[3]) or any(s != tuple(q[:3]) for s in shapes[1:]):
        return None
    whole = {f for dims in ins for f in dims if f is not None and f not in ("b", "h", "s")}
    if (block_mask[_Q_LEN], block_mask[_KV_LEN]) != (q[2], k[2]):
        whole.add("s")  # a block mask of other lengths: its blocks are not q's rows
    return Signature(tuple(ins), ("b", "h", "s", "e"), whole=frozenset(whole),
                     extra_outputs=tuple(("b", "h", "s") for _ in shapes[1:]), exact=tuple(per_query_block))
