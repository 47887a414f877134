"""How stage 1 decomposes the composite ops the registry marks, and common-subexpression elimination.

An op is decomposed when its parts shard better than the whole (``registry.DECOMPOSED`` lists
them and why): softmax over a sharded dim becomes amax/sum with a small all_reduce each instead
of a gather of the tensor; cross-entropy becomes log_softmax + gather, so vocab-parallel logits
never gather [tokens, vocab]. Everything else stays whole, so Inductor still sees the ops it
knows how to fuse. Two decompositions are fxshard's own: random ``*_like`` ops drawn in global
shape, and nll_loss's backward as a comparison against a class arange.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch._decomp import get_decompositions

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
