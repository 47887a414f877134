"""Fused projections: weights that hold several projections side by side (q/k/v in one ``qkv_proj``, gate and
up in one ``gate_up_proj``, Mixtral's grouped gate/up experts), found by what the program does with their
matmul's output: splits it into equal parts along its last dim. Such a weight wants ``_StridedShard(d, k)``:
each rank a share of every part, so the split stays local (``fxshard/placement_search.py`` offers it).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .mesh import is_static

__all__ = ["fused_factors"]

# what a weight reaches its matmul through, and the matmul's output its split through, without moving data
# across its last dim: rules as data for ``fused_factors``
_PASSING = frozenset({"t", "transpose", "permute", "view", "_unsafe_view", "reshape", "_to_copy", "alias", "detach",
                      "clone", "contiguous", "expand", "unsqueeze", "add"})
_MATMULS = frozenset({"mm", "addmm", "bmm", "matmul", "linear", "_grouped_mm", "grouped_mm", "grouped_mm_fallback"})


def _op(node: fx.Node) -> str:
    return getattr(node.target, "_opname", "") if node.op == "call_function" else ""


def fused_factors(gm: fx.GraphModule, name: str) -> tuple[int, ...]:
    """Into how many equal parts the outputs of the matmuls reading placeholder ``name`` are split along their last
    dim (``split``, ``split_with_sizes``, or slices tiling it): a fused projection (q/k/v: 3, gate/up: 2), whose
    weight a rank should hold a share of every part of (``_StridedShard``). Empty where none is."""
    start = next((n for n in gm.graph.nodes if n.op == "placeholder" and n.name == name), None)
    if start is None:
        return ()
    found: set[int] = set()
    seen: set[tuple[fx.Node, int | None]] = set()
    frontier: list[tuple[fx.Node, int | None]] = [(start, None)]  # (node, the matmul output's last size once past it)
    while frontier:
        node, width = frontier.pop()
        for user in node.users:
            op = _op(user)
            if (user, width) in seen:
                continue
            seen.add((user, width))
            if op in _PASSING and (width is None or _last_size(user) == width):  # past it: the same last dim
                frontier.append((user, width))
            elif op in _MATMULS and width is None and _right_operand(user) is node:
                frontier.append((user, _last_size(user)))
        if width is not None and (k := _parts(node)) > 1:
            found.add(k)
    return tuple(sorted(found))


def _last_size(node: fx.Node) -> int | None:
    value = node.meta.get("val")
    return int(value.shape[-1]) if isinstance(value, torch.Tensor) and value.dim() and is_static(value.shape[-1]) \
        else None


def _right_operand(matmul: fx.Node) -> object:
    """The operand whose dim becomes the matmul's last: the weight of ``x @ w`` (``addmm``: its third argument)."""
    index = 2 if _op(matmul) == "addmm" else 1
    return matmul.args[index] if len(matmul.args) > index else None


def _parts(node: fx.Node) -> int:
    """The equal parts ``node``'s users cut its last dim into (1: none)."""
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return 1
    last, size = value.dim() - 1, value.shape[-1]
    slices: list[tuple[int, int]] = []
    for user in node.users:
        op, args = _op(user), user.args
        at = 1 if op == "slice" else 2  # slice(x, dim, start, end, step); split(x, size, dim)
        dim = args[at] if len(args) > at else user.kwargs.get("dim", 0)
        if op not in ("split", "split_with_sizes", "slice") or not isinstance(dim, int) or dim % value.dim() != last:
            continue
        if op == "split" and isinstance(args[1], int) and size % args[1] == 0 and size // args[1] > 1:
            return int(size // args[1])
        if op == "split_with_sizes" and len(set(args[1])) == 1 and len(args[1]) > 1:
            return len(args[1])
        if op == "slice" and (len(args) < 5 or args[4] == 1):
            begin = args[2] if len(args) > 2 else 0
            end = min(args[3] if len(args) > 3 else size, size)
            slices.append((int(begin or 0), int(end)))
    slices.sort()
    lengths = {b - a for a, b in slices}
    tiled = slices and slices[0][0] == 0 and slices[-1][1] == size and all(
        slices[i][1] == slices[i + 1][0] for i in range(len(slices) - 1))
    return len(slices) if tiled and len(slices) > 1 and len(lengths) == 1 else 1
