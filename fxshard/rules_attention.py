"""Signatures of the ATen attention kernels (scaled dot product attention, forward and backward).

Every ATen attention kernel computes softmax(q k^T * scale + mask) v per (batch, head) block:
q [b, h, s, d], k [b, hk, t, d], v [b, hk, t, e]. With grouped-query heads (hk dividing h) q head i
reads kv head i // (h / hk), so one factor "h" shards both (each rank holds whole groups; a factor
may span dims of different sizes, fxshard/strategies.py). The kernels' arguments and outputs
differ (masks or biases, RNG state, sequence offsets, padded logsumexps); rules read arguments by
their schema names, which the kernels share. Which op uses which rule is the registry's.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from .causal_rows import KERNEL_OF
from .rules import Signature, _shape

aten = torch.ops.aten

ATTENTION_MASKS = ("attn_mask", "attn_bias", "dropout_mask")  # [b, h, s, t] or broadcast to it

_BACKWARD_FACTORS = {  # the backward kernels' per-head arguments (the rest: masks, logsumexp, replicated)
    "grad_out": ("b", "h", "s", "e"), "grad_out_": ("b", "h", "s", "e"), "out": ("b", "h", "s", "e"),
    "query": ("b", "h", "s", "d"), "key": ("b", "h", "t", "d"), "value": ("b", "h", "t", "e"),
}


def _named_tensors(node: Any) -> list[tuple[str, tuple[int, ...]]]:
    """(schema name, shape) of each tensor argument, in the order stage 2 lists them (positional,
    then keyword arguments)."""
    names = [a.name for a in node.target._schema.arguments]
    pairs = list(zip(names, node.args)) + list(node.kwargs.items())
    return [(name, _shape(a)) for name, a in pairs if _shape(a) is not None]


def _argument(node: Any, name: str) -> Any:
    """The value of argument ``name`` of an ATen call (its schema default when not given)."""
    for i, arg in enumerate(node.target._schema.arguments):
        if arg.name == name:
            if name in node.kwargs:
                return node.kwargs[name]
            if i < len(node.args):
                return node.args[i]
            return arg.default_value if arg.has_default_value() else None
    return None


def _grouped_heads(q: Sequence[int] | None, k: Sequence[int] | None, v: Sequence[int] | None) -> bool:
    """4-d q, k, v whose kv heads agree and divide q's heads (plain, grouped- or multi-query)."""
    return (q is not None and k is not None and v is not None and len(q) == len(k) == len(v) == 4
            and k[1] == v[1] and k[1] > 0 and q[1] % k[1] == 0)


def _mask_factors(shape: Sequence[int], reference: Sequence[int],
                  broadcast_named: bool = False) -> tuple[str | None, ...] | None:
    """A mask broadcast against [b, h, s, t] (right-aligned, as torch broadcasts): a size-1 dim
    where the reference is larger is None (``broadcast_named``: its factor, which the dim holds none
    of: a gradient there sums over it); a dim of any other size has no rule (None)."""
    if len(shape) > 4:
        return None
    n = len(shape)
    out: list[str | None] = []
    for size, factor, ref in zip(shape, ("b", "h", "s", "t")[4 - n:], tuple(reference)[4 - n:]):
        if size != ref and size != 1:
            return None
        out.append(factor if size == ref or broadcast_named else None)
    return tuple(out)


def _per_query_output(shape: Sequence[int] | None, q: Sequence[int], i: int) -> tuple[str | None, ...]:
    """An extra output's factors: one of shape [b, h, ...] (logsumexp, the math kernel's weights, a
    debug mask) follows batch and heads, and queries where its dim 2 is q's sequence; any other
    (RNG seed and offset, sequence offsets, an empty debug mask) gets names of its own (whole)."""
    if shape is None:
        return ()
    names = [f"x{i}_{d}" for d in range(len(shape))]
    if len(shape) >= 3 and tuple(shape[:2]) == tuple(q[:2]):
        names[:2] = ["b", "h"]
        if shape[2] == q[2]:
            names[2] = "s"
    return tuple(names)


def _queries_independent(node: Any, q: Sequence[int], k: Sequence[int]) -> bool:
    """Whether the call's query rows may be sharded (context parallelism: q, its mask rows and the
    outputs on the sequence, k and v whole): always without dropout, where one device's random
    mask cannot be cut; a causal call only on a kernel whose rank-local form stage 4 knows
    (``QUERY_ROWS_OPS``: keys before the rank's rows whole, its own block causal) and where queries
    and keys are one sequence (torch aligns a causal mask of unequal lengths top-left)."""
    if _argument(node, "dropout_p"):
        return False
    if not _argument(node, "is_causal"):
        return True
    return node.target.overloadpacket in QUERY_ROWS_OPS and q[2] == k[2] \
        and all(_argument(node, m) is None for m in ATTENTION_MASKS)


def attention(node: Any) -> Signature | None:
    """The ATen attention kernels: batch and heads are independent; key seq and head dims stay whole.

    Queries are independent too (context parallelism) where ``_queries_independent`` says so,
    unless an extra output's dim 2 is not the query length (the efficient kernel's logsumexp is
    padded to 32 queries). Fewer k/v heads than the pieces of q's heads keep their major part
    (strategies.fit): multi-query k/v (one head) are read whole by every rank's q heads.
    """
    tensors = _named_tensors(node)
    shapes = dict(tensors)
    q, k, v = shapes.get("query"), shapes.get("key"), shapes.get("value")
    if not _grouped_heads(q, k, v):
        return None
    factors = {"query": ("b", "h", "s", "d"), "key": ("b", "h", "t", "d"), "value": ("b", "h", "t", "e")}
    ins: list[tuple[str | None, ...]] = []
    for name, shape in tensors:
        f = factors.get(name) or (_mask_factors(shape, (q[0], q[1], q[2], k[2])) if name in ATTENTION_MASKS else None)
        if f is None:
            return None
        ins.append(f)
    whole = {"t", "d", "e"}
    if not _queries_independent(node, q, k):
        whole.add("s")
    outs = node.meta["val"]
    extra = tuple(_per_query_output(tuple(o.shape) if isinstance(o, torch.Tensor) else None, q, i)
                  for i, o in enumerate(outs[1:], 1))
    whole.update(f for dims in extra for f in dims if f and f.startswith("x"))
    if any(len(dims) >= 3 and dims[:2] == ("b", "h") and dims[2] != "s" for dims in extra):
        whole.add("s")
    return Signature(tuple(ins), ("b", "h", "s", "e"), whole=frozenset(whole), extra_outputs=extra)


def attention_backward(node: Any) -> Signature | None:
    """The ATen attention backward kernels: (batch, heads) blocks are independent, and query rows
    where the forward's are (``_queries_independent``); key rows and head dims whole.

    Sharded query rows give grad_key and grad_value each rank's rows' share: a Partial(sum) over
    the sequence's axes (``Signature.summed``). grad_query, grad_key, grad_value (and the efficient
    kernel's grad_bias) are laid out as their inputs: grouped-query k/v heads share q's heads factor
    and keep its major part (strategies.fit), so their gradients sum over the q heads the other ranks
    of their group hold (multi-query: all of them), a Partial(sum) there (``Signature.group_sums``);
    so does a broadcast bias's gradient over the batch or heads it was broadcast along.
    """
    tensors = _named_tensors(node)
    shapes = dict(tensors)
    q, k, v = shapes.get("query"), shapes.get("key"), shapes.get("value")
    if not _grouped_heads(q, k, v):
        return None
    ins: list[tuple[str | None, ...]] = []
    for i, (name, shape) in enumerate(tensors):
        own = tuple(f"w{i}_{d}" for d in range(len(shape)))
        if name in _BACKWARD_FACTORS:
            f = _BACKWARD_FACTORS[name]
        elif name in ATTENTION_MASKS:
            f = _mask_factors(shape, (q[0], q[1], q[2], k[2]), broadcast_named=True)
        elif name == "logsumexp":  # [b, h, s], [b, h, s, 1] (cuDNN) or [b, h, padded s] (efficient)
            f = ("b", "h") + own[2:] if len(shape) >= 3 and tuple(shape[:2]) == tuple(q[:2]) else None
            if f is not None and shape[2] == q[2]:
                f = ("b", "h", "s") + own[3:]
        else:  # RNG seed and offset, sequence offsets: replicated
            f = own
        if f is None:
            return None
        ins.append(f)
    by_name = dict(zip((n for n, _ in tensors), ins))
    grads_of = ("query", "key", "value", next((n for n in ATTENTION_MASKS if n in by_name), None))
    outs: list[tuple[str | None, ...]] = []
    for o, name in zip(node.meta["val"], grads_of):
        if o is None:
            outs.append(())
        elif not isinstance(o, torch.Tensor) or name is None or tuple(o.shape) != shapes[name]:
            return None
        else:
            outs.append(by_name[name])
    whole = {f for dims in ins for f in dims if f is not None and f not in ("b", "h", "s")}
    padded = any(f is not None and f.startswith("w") for f in by_name.get("logsumexp", ())[2:3])
    if padded or not _queries_independent(node, q, k):
        whole.add("s")
    grouped = ((1, 2) if k[1] < q[1] else ()) + ((3,) if len(outs) > 3 and outs[3] else ())
    return Signature(tuple(ins), outs[0], whole=frozenset(whole), partial_ops=(), extra_outputs=tuple(outs[1:]),
                     group_sums=grouped, summed=((), ("s",), ("s",)))


ATTENTION_OPS = tuple(op for op in (
    getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None),
    getattr(aten, "_scaled_dot_product_flash_attention", None),
    getattr(aten, "_scaled_dot_product_efficient_attention", None),
    getattr(aten, "_scaled_dot_product_cudnn_attention", None),
    getattr(aten, "_scaled_dot_product_fused_attention_overrideable", None),
    getattr(aten, "_scaled_dot_product_attention_math", None),
) if op is not None)

# kernels whose causal calls stage 4 rewrites for a rank's query rows (lowering/query_rows.py): those
# fxshard/causal_rows.py knows how to call on a block of keys (its ``KERNEL_OF``)
QUERY_ROWS_OPS = tuple(dict.fromkeys(op.overloadpacket for op in KERNEL_OF))

ATTENTION_BACKWARD_OPS = tuple(op for op in (
    getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None),
    getattr(aten, "_scaled_dot_product_flash_attention_backward", None),
    getattr(aten, "_scaled_dot_product_efficient_attention_backward", None),
    getattr(aten, "_scaled_dot_product_cudnn_attention_backward", None),
    getattr(aten, "_scaled_dot_product_fused_attention_overrideable_backward", None),
) if op is not None)
