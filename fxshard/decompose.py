"""How stage 1 decomposes the composite ops the registry marks, and common-subexpression elimination.

An op is decomposed when its parts shard better than the whole (``registry.DECOMPOSED`` lists
them and why): softmax over a sharded dim becomes amax/sum with a small all_reduce each instead
of a gather of the tensor; cross-entropy becomes log_softmax + gather, so vocab-parallel logits
never gather [tokens, vocab]. Everything else stays whole, so Inductor still sees the ops it
knows how to fuse. Two decompositions are fxshard's own: random ``*_like`` ops drawn in global
shape, nll_loss's backward as a comparison against a class arange, and a float8 matmul into a narrow dtype as
one into float32 cast after (``_scaled_mm_in_float32``). One rewrite follows from the
last: the sum over the classes of such a one-hot comparison (log_softmax's backward sums its output
gradient over the classes) is the value at the target itself (``fold_one_hot_sums``).
"""
from __future__ import annotations

import contextlib
from typing import Any, Sequence

import torch
import torch.fx as fx
from torch._decomp import get_decompositions

from .ops import CAST_FOR_COMPUTE
from .registry import DECOMPOSED, FORWARD

aten = torch.ops.aten

def _draw_whole(factory: Any) -> Any:
    """rand_like(x) -> rand(x.shape): a random tensor is drawn in global shape on every rank.

    Every rank's generator is in the same state (the same seed, as DTensor requires), so each
    draws the same values: replicated values agree, and the block a sharded consumer slices out
    is exactly the single-device value. Drawn like x's shard instead, every rank would use the
    same numbers for different blocks (correlated dropout masks, and not the one-device result).
    """
    def draw(x: torch.Tensor, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None,
             generator=None) -> torch.Tensor:
        return factory(x.shape, dtype=dtype or x.dtype, device=device or x.device, generator=generator)
    return draw


def _scaled_mm_in_float32(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                          bias: Any = None, scale_result: Any = None, out_dtype: Any = None,
                          use_fast_accum: bool = False) -> torch.Tensor:
    """A float8 matmul into bf16/fp16 (torchao's rowwise recipe) as one into float32, then cast: the kernel
    accumulates in float32 and rounds once, so on one device the two are the same numbers (measured
    bit-identical on the CPU); where the ranks split k, each rank's partial stays float32 until it is summed,
    and the sum is rounded once, as one device rounds it (``rules.to_copy`` holds a partial sum in the wider
    dtype), instead of every rank's partial rounded to bf16 (3e-3 off one device at TP=4)."""
    narrow = out_dtype is not None and out_dtype.is_floating_point and out_dtype.itemsize < 4
    if not narrow or bias is not None or scale_result is not None:
        return NotImplemented
    out = aten._scaled_mm.default(a, b, scale_a, scale_b, None, None, torch.float32, use_fast_accum)
    return out.to(out_dtype)


def _nll_loss_backward(grad_output: torch.Tensor, self: torch.Tensor, target: torch.Tensor, weight: Any,
                       reduction: int, ignore_index: int, total_weight: torch.Tensor) -> torch.Tensor:
    """-grad * weight[c] where class c is the target, as a comparison of a class arange with the targets.

    PyTorch's own decomposition scatters into zeros along the class dim, which needs that dim
    whole; compared against an arange, the class dim shards like any pointwise op (vocab-parallel
    cross-entropy's backward never builds [tokens, vocab] on one rank).
    """
    channel_dim = 0 if self.dim() < 2 else 1
    classes = torch.arange(self.shape[channel_dim], device=self.device)
    if self.dim() >= 2:
        classes = classes.view([-1] + [1] * (self.dim() - 2))
    t = target.unsqueeze(channel_dim)
    hit = (classes == t) & (t != ignore_index)
    g = grad_output
    if reduction == 0 and self.dim() >= 2:  # none: one gradient per target
        g = g.unsqueeze(channel_dim)
    elif reduction == 1:  # mean
        g = g / total_weight
    scale = -g
    if weight is not None:
        scale = scale * (weight.view([-1] + [1] * (self.dim() - 2)) if self.dim() >= 2 else weight)
    return torch.where(hit, scale, torch.zeros((), dtype=self.dtype, device=self.device)).to(self.dtype)


def decomposition_table(training: bool = False) -> dict[Any, Any]:
    """torch's decompositions of the ops the registry marks decomposed (backward formulas: training)."""
    ops = [op for op, when in DECOMPOSED.items() if training or when == FORWARD]
    table = get_decompositions(ops)
    if training:
        table[aten.nll_loss_backward.default] = _nll_loss_backward
    table[aten._scaled_mm.default] = _scaled_mm_in_float32
    table[CAST_FOR_COMPUTE] = lambda x, dtype, summed_in: x.to(dtype)  # its backward is autograd's, above
    table[aten.rand_like.default] = _draw_whole(torch.rand)
    table[aten.randn_like.default] = _draw_whole(torch.randn)
    return table


def _is_pure(node: fx.Node) -> bool:
    target = node.target
    if node.op != "call_function":
        return False
    if isinstance(target, torch._ops.OpOverload):
        schema = target._schema
        if schema.is_mutable or torch.Tag.nondeterministic_seeded in target.tags:
            return False
    return True


def eliminate_common_subexpressions(gm: fx.GraphModule) -> fx.GraphModule:
    """Merge nodes that call the same pure op on the same arguments (in place).

    Tracing a module writes the same view once per use (``x.view(...)`` before each of
    three projections); merged, one value has several users, so a redistribution it needs
    is planned and paid once.
    """
    seen: dict[Any, fx.Node] = {}
    for node in list(gm.graph.nodes):
        if not _is_pure(node):
            continue
        try:
            key = (node.target, _hashable(node.args), _hashable(node.kwargs))
            hash(key)
        except TypeError:
            continue
        if key in seen:
            node.replace_all_uses_with(seen[key])
            gm.graph.erase_node(node)
        else:
            seen[key] = node
    gm.graph.lint()
    gm.recompile()
    return gm


def _hashable(a: Any) -> Any:
    if isinstance(a, (list, tuple)):
        return (type(a).__name__,) + tuple(_hashable(x) for x in a)
    if isinstance(a, dict):
        return ("dict",) + tuple((k, _hashable(v)) for k, v in sorted(a.items()))
    if isinstance(a, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return str(a)
    if isinstance(a, float):
        return ("float", a)  # 1 and 1.0 are different arguments
    return a


_VIEWS = (aten.view.default, aten.reshape.default, aten.unsqueeze.default, aten._unsafe_view.default)
_ANDS = (aten.bitwise_and.Tensor, aten.logical_and.default)


def fold_one_hot_sums(gm: fx.GraphModule) -> fx.GraphModule:
    """``sum(where(classes == t & m, a, 0), dim=d)`` -> ``where(0 <= t < C & m, a, 0)`` (in place).

    ``classes`` an arange of the ``C`` classes along ``d``; ``t`` (the targets), the other terms ``m``
    (the ignore mask) and ``a`` constant along ``d``. At most one class equals an integer target, exactly
    one when it is in range: the sum is that one value (plus zeros: bit for bit the same). Log-softmax's
    backward sums cross-entropy's one-hot gradient over the classes this way; summed as it is, a
    vocab-parallel plan reduces it across the ranks that hold the classes (a call each step) or gathers
    it, and every rank compares its tokens against every class. Folded, it is the targets' own values.
    """
    changed = False
    for node in list(gm.graph.nodes):
        found = _one_hot_sum(node)
        if found is not None and _fold(gm.graph, node, *found):
            changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()
    return gm


def _one_hot_sum(node: fx.Node) -> tuple | None:
    """(dim, targets, class count, the other terms, where's value and its zero) of a foldable sum; else None."""
    if node.op != "call_function" or node.target is not aten.sum.dim_IntList or node.kwargs.get("dtype") is not None:
        return None
    x, dims = node.args[0], node.args[1]
    if not isinstance(x, fx.Node) or x.target is not aten.where.self or not isinstance(dims, (list, tuple)) or len(dims) != 1:
        return None
    shape = _shape(x)
    if shape is None or not x.meta["val"].dtype.is_floating_point:
        return None
    d = dims[0] % len(shape)
    cond, value, zero = x.args
    if not (_constant_along(value, d, shape) and _is_zero(zero) and _constant_along(zero, d, shape)):
        return None
    terms = _conjunction(cond)
    for k, term in enumerate(terms):
        if term.target is not aten.eq.Tensor:
            continue
        for classes, t in (term.args, term.args[::-1]):
            if (isinstance(classes, fx.Node) and isinstance(t, fx.Node) and _arange_along(classes, d, shape)
                    and _constant_along(t, d, shape) and len(_shape(t) or ()) == len(shape)
                    and not t.meta["val"].dtype.is_floating_point
                    and all(_constant_along(m, d, shape) for m in terms[:k] + terms[k + 1:])):
                return d, t, shape[d], terms[:k] + terms[k + 1:], value, zero
    return None


def _fold(graph: fx.Graph, node: fx.Node, d: int, t: fx.Node, classes: int, others: Sequence[fx.Node],
          value: Any, zero: Any) -> bool:
    """The sum ``node`` replaced by its fold; False (the graph as it was) where the fold's shape differs."""
    meta = {k: v for k, v in node.meta.items() if k != "val"}
    made: list[fx.Node] = []

    def emit(target: Any, *args: Any) -> fx.Node:
        new = graph.call_function(target, args)
        new.meta.update(meta)
        vals = fx.node.map_arg(args, lambda a: a.meta["val"])
        with _fake_mode(node):
            new.meta["val"] = target(*vals)
        made.append(new)
        return new

    with graph.inserting_before(node):
        cond = emit(aten.bitwise_and.Tensor, emit(aten.ge.Scalar, t, 0), emit(aten.lt.Scalar, t, classes))
        for m in others:
            cond = emit(aten.bitwise_and.Tensor, cond, m)
        out = emit(aten.where.self, cond, value, zero)
        keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
        if not keepdim:
            out = emit(aten.squeeze.dim, out, d)
    if tuple(out.meta["val"].shape) != tuple(node.meta["val"].shape) or out.meta["val"].dtype != node.meta["val"].dtype:
        for new in reversed(made):  # another broadcast than the sum's: leave it as it is
            graph.erase_node(new)
        return False
    node.replace_all_uses_with(out)
    _erase_unused(graph, [node])
    return True


def _erase_unused(graph: fx.Graph, nodes: Sequence[fx.Node]) -> None:
    """``nodes``, and what they read, erased where nothing else reads them (pure ops only: a draw
    from a random generator stays, as eager would draw it)."""
    stack, erased = list(nodes), set()
    while stack:
        node = stack.pop()
        if node not in erased and not node.users and _is_pure(node):
            inputs = node.all_input_nodes
            graph.erase_node(node)
            erased.add(node)
            stack += inputs


def _fake_mode(node: fx.Node) -> Any:
    """The fake mode ``node``'s value was made in, to make the fold's values in.

    Its own, not ``torch._guards.detect_fake_mode``'s: that returns the active tracing context's mode
    first, and under ``torch.compile(backend="fxshard")`` the backend runs inside Dynamo's context, whose
    mode is not the one stage 1 traced in ("Mixing fake modes NYI")."""
    mode = getattr(node.meta["val"], "fake_mode", None)
    return mode if mode is not None else contextlib.nullcontext()


def _shape(a: Any) -> tuple[int, ...] | None:
    val = a.meta.get("val") if isinstance(a, fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return None
    try:
        return tuple(int(s) for s in val.shape)
    except (TypeError, ValueError):
        return None


def _constant_along(a: Any, d: int, shape: Sequence[int]) -> bool:
    """Whether ``a`` (a scalar or a tensor broadcast against ``shape``) has one value along dim ``d``."""
    if not isinstance(a, fx.Node):
        return isinstance(a, (int, float, bool))
    own = _shape(a)
    if own is None or len(own) > len(shape):
        return False
    at = d - (len(shape) - len(own))
    return at < 0 or own[at] == 1


def _is_zero(a: Any) -> bool:
    if not isinstance(a, fx.Node):
        return a == 0
    if a.target is aten.zeros.default:
        return True
    return a.target in (aten.scalar_tensor.default, aten.full.default) and a.args[-1] == 0


def _conjunction(cond: Any) -> list[fx.Node]:
    """The terms ``cond`` is the logical and of (itself if none)."""
    if not isinstance(cond, fx.Node):
        return []
    if cond.target in _ANDS and all(isinstance(a, fx.Node) for a in cond.args[:2]):
        return _conjunction(cond.args[0]) + _conjunction(cond.args[1])
    return [cond]


def _arange_along(node: fx.Node, d: int, shape: Sequence[int]) -> bool:
    """Whether ``node`` is ``arange(shape[d])`` laid along dim ``d`` of ``shape`` (size 1 elsewhere)."""
    own = _shape(node)
    if own is None or len(own) > len(shape):
        return False
    at = d - (len(shape) - len(own))
    if at < 0 or own[at] != shape[d] or any(s != 1 for k, s in enumerate(own) if k != at):
        return False
    while node.target in _VIEWS:
        node = node.args[0]
    if node.target is aten.arange.default:
        return node.args[0] == shape[d] and node.kwargs.get("dtype") in (None, torch.int64, torch.int32)
    if node.target in (aten.arange.start, aten.arange.start_step):
        step = node.args[2] if len(node.args) > 2 else 1
        return (node.args[0], node.args[1], step) == (0, shape[d], 1) and node.kwargs.get("dtype") in (None, torch.int64, torch.int32)
    return False
