"""Signatures of the ops a mixture-of-experts layer routes and computes its tokens with.

A grouped matmul multiplies rows sorted by expert, ``offs [E]`` holding each group's end row, so
the rows (``s``) and the experts (``e``) stay whole wherever the offsets are global row numbers;
the feature dims (``k`` in, ``n`` out) shard as in mm: Megatron's column- and row-parallel experts.
Autograd writes the backward of ``aten._grouped_mm`` as two grouped matmuls, one of them the
2-D x 2-D form that sums each group's rows into its expert's weight; transformers' fallback op has
one backward op returning both gradients. The tokens come back through a scatter-add (torchtitan's
``deterministic_scatter_add``): linear in the destination and source together, so expert outputs
that are Partial(sum) stay so through it. Which op uses which rule is the registry's.
"""
from __future__ import annotations

from typing import Any

from .rules import Signature, _shape, scatter_add, select_along

_ROWS_AND_EXPERTS = frozenset({"s", "e"})


def _offsets(node: Any) -> Any:
    return node.args[2] if len(node.args) > 2 else node.kwargs.get("offs")


def _only_three_tensors(node: Any) -> bool:
    """No bias, scales or other tensor argument beside (a, b, offs): other forms have no rule."""
    rest = list(node.args[3:]) + [v for k, v in node.kwargs.items() if k != "offs"]
    return _shape(_offsets(node)) is not None and not any(_shape(a) for a in rest)


def grouped_mm(node: Any) -> Signature | None:
    """``_grouped_mm(x, w, offs)``: ``x [S, K] @ w[e] [E, K, N] -> [S, N]`` (the forward, and the input's
    gradient ``g @ w^T``), or ``x [K, S] @ g [S, N] -> [E, K, N]`` (the weight's gradient: each group's
    rows summed into its expert). Linear in either operand."""
    a, b = _shape(node.args[0]), _shape(node.args[1])
    if a is None or b is None or len(a) != 2 or not _only_three_tensors(node):
        return None
    if len(b) == 3:
        return Signature((("s", "k"), ("e", "k", "n"), ("e",)), ("s", "n"), partial_groups=((0,), (1,)),
                         whole=_ROWS_AND_EXPERTS)
    if len(b) == 2:
        return Signature((("k", "s"), ("s", "n"), ("e",)), ("e", "k", "n"), partial_groups=((0,), (1,)),
                         whole=_ROWS_AND_EXPERTS)
    return None


def grouped_mm_backward(node: Any) -> Signature | None:
    """transformers' ``grouped_mm_fallback_backward(x [S, K], w [E, K, N], offs, g [S, N])`` ->
    ``(grad_x [S, K], grad_w [E, K, N])``: ``k`` passes through both; a sharded ``n`` leaves grad_w
    sharded and grad_x a Partial(sum) (it sums over n), as Megatron's column-parallel backward."""
    shapes = [_shape(a) for a in node.args[:4]]
    if len(shapes) != 4 or any(s is None for s in shapes) or [len(s) for s in shapes] != [2, 3, 1, 2]:
        return None
    return Signature((("s", "k"), ("e", "k", "n"), ("e",), ("s", "n")), ("s", "k"),
                     partial_groups=((3,),), whole=_ROWS_AND_EXPERTS, extra_outputs=(("e", "k", "n"),),
                     summed=(("n",),))


def scatter_add_rows(node: Any) -> Signature | None:
    """torchtitan's ``deterministic_scatter_add(out, index, src)``: ``out.scatter_add(0, index, src)``."""
    out, index, src = node.args[:3]
    return scatter_add(_Call(node.target, (out, 0, index, src), node.meta))


def argsort(node: Any) -> Signature:
    """argsort along ``dim``: as sort, with the indices only."""
    sig = select_along(node)
    return Signature(sig.inputs, sig.output, partial_ops=(), whole=sig.whole)


class _Call:
    """A node's call restated with other arguments, for a rule that reads ``args`` (scatter_add's order)."""

    def __init__(self, target: Any, args: tuple, meta: dict) -> None:
        self.target, self.args, self.kwargs, self.meta = target, args, {}, meta
