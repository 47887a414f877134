"""Whether two layers' values are the same by how they are made, and two inputs alike: what folding compares.

Folding stamps out one layer's plan only where the layer after it is planned alike (``fold.py``): what the two
read is the same value, or made alike outside them (each layer's own view of the rotary tables, a constant lent
to each), and the dropped layers' parameters are the template's in layout, shape, stride and dtype.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from fxshard.graph import LAYOUT

__all__ = ["same_value", "alike_inputs"]


def same_value(a: Any, b: Any, depth: int = 0) -> bool:
    """Whether two values are equal by how they are made: the same node, or calls of one deterministic op in
    one layout on equal arguments (two layers' own views of a table both read)."""
    if a is b:
        return True
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same_value(x, y, depth) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k], depth) for k in a)
    if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
        return not isinstance(a, (fx.Node, torch.Tensor)) and not isinstance(b, (fx.Node, torch.Tensor)) and \
            type(a) is type(b) and a == b
    if a.op == b.op == "get_attr":  # a constant lent to each layer (block_joint.py): the same, or equal
        return a.meta.get(LAYOUT) == b.meta.get(LAYOUT) and _same_constant(_attr(a), _attr(b))
    if depth > 32 or a.op != "call_function" or b.op != "call_function" or a.target != b.target or \
            torch.Tag.nondeterministic_seeded in getattr(a.target, "tags", ()) or \
            a.meta.get(LAYOUT) != b.meta.get(LAYOUT):
        return False
    return same_value(a.args, b.args, depth + 1) and same_value(a.kwargs, b.kwargs, depth + 1)


def _attr(node: fx.Node) -> Any:
    value: Any = node.graph.owning_module
    for name in str(node.target).split("."):
        value = getattr(value, name, None)
    return value


def _same_constant(x: Any, y: Any) -> bool:
    if x is y:
        return x is not None
    if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)) or x.shape != y.shape or \
            x.dtype != y.dtype or x.device != y.device:
        return False
    try:
        return bool(torch.equal(x, y))
    except Exception:  # a fake or meta constant: no values to compare
        return False


def alike_inputs(a: fx.Node, b: fx.Node) -> bool:
    """Two inputs of one global layout, shape, stride and dtype."""
    x, y = a.meta.get("val"), b.meta.get("val")
    if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
        return False
    return a.meta.get(LAYOUT) == b.meta.get(LAYOUT) and x.shape == y.shape and x.stride() == y.stride() and \
        x.dtype == y.dtype
