"""Stage 5: each planned step -> functional collectives (+ local view/permute/slice).

A step carries the layouts before and after it; the local structure of a dim at this
rank's coordinate (its local pieces, major to minor) says where the moving mesh index sits
inside the local block, so one view + permute places it, whatever the strides. Collectives
work on dim 0, so the moving index is permuted to the front or from it.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from fxshard.layout import Piece
from fxshard.mesh import Coordinate, MeshAxis
from fxshard.ops import REDISTRIBUTE
from fxshard.planner import Step

from .localize import copy_graph_module, propagate_local_shapes

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

GroupName = Callable[[MeshAxis], str]


class LoweringError(NotImplementedError):
    pass


class _Emit:
    """Appends nodes before ``anchor``; keeps the local shape of the value being built."""

    def __init__(self, graph: fx.Graph, anchor: fx.Node):
        self.graph, self.anchor = graph, anchor

    def __call__(self, target: Any, *args: Any, **kwargs: Any) -> fx.Node:
        with self.graph.inserting_before(self.anchor):
            return self.graph.call_function(target, args, kwargs)


def _local_pieces(pieces: Sequence[Piece]) -> list[int]:
    return [int(p.size) for p in pieces if p.axis is None]


def _position(pieces: Sequence[Piece], axis: MeshAxis) -> tuple[int, int, int]:
    """(index of ``axis``'s piece, product of local pieces before it, after it)."""
    i = next(k for k, p in enumerate(pieces) if p.axis == axis)
    before = math.prod(_local_pieces(pieces[:i]))
    after = math.prod(_local_pieces(pieces[i + 1:]))
    return i, before, after


def _split_shape(shape: Sequence[int], d: int, parts: Sequence[int]) -> list[int]:
    return list(shape[:d]) + list(parts) + list(shape[d + 1:])


def _move(e: _Emit, x: fx.Node, ndim: int, src: int, dst: int) -> fx.Node:
    if src == dst:
        return x
    perm = [k for k in range(ndim) if k != src]
    perm.insert(dst, src)
    return e(aten.permute.default, x, perm)


def _contiguous(e: _Emit, x: fx.Node) -> fx.Node:
    return e(aten.clone.default, x, memory_format=torch.contiguous_format)


def _to_front(e: _Emit, x: fx.Node, shape: Sequence[int], d: int, pre: int, n: int, post: int) -> fx.Node:
    """View dim ``d`` as [pre, n, post] and bring ``n`` to the front: [n, ...] contiguous."""
    if d == 0 and pre == 1:
        return x
    split = _split_shape(shape, d, [pre, n, post])
    y = e(aten.view.default, x, split)
    y = _move(e, y, len(split), d + 1, 0)
    return _contiguous(e, y)


def _from_front(e: _Emit, x: fx.Node, shape_after: Sequence[int], d: int, pre: int, n: int, post: int) -> fx.Node:
    """Inverse: ``x`` is [n, ...rest] where rest has dim ``d`` = pre*post; put n between pre and post."""
    if d == 0 and pre == 1:
        return e(aten.view.default, x, list(shape_after))
    rest = list(shape_after)
    rest[d] = pre * post
    split = [n] + _split_shape(rest, d, [pre, post])
    y = e(aten.view.default, x, split)
    y = _move(e, y, len(split), 0, d + 1)
    if math.prod(shape_after[:d]) * pre != 1:  # n moved behind larger dims: dense again for later views
        y = _contiguous(e, y)
    return e(aten.view.default, y, list(shape_after))


def lower_step(e: _Emit, x: fx.Node, step: Step, coordinate: Coordinate, group_name: GroupName) -> fx.Node:
    mesh = step.before.mesh
    coord = mesh.coordinate_dict(coordinate)
    before = [int(s) for s in step.before.local_shape(coordinate)]
    after = [int(s) for s in step.after.local_shape(coordinate)]
    axis, n = step.axis, int(step.axis.size)
    c = axis.coordinate(coord[axis.name])
    kind = step.kind

    if kind == "all_reduce":
        op = "sum" if step.reduce_op == "avg" else step.reduce_op
        y = e(c10d.wait_tensor.default, e(c10d.all_reduce.default, x, op, group_name(axis)))
        return e(aten.div.Tensor, y, n) if step.reduce_op == "avg" else y

    if kind == "local_partial":
        holds = step.reduce_op != "sum" or c == 0
        return e(aten.clone.default, x) if holds else e(aten.zeros_like.default, x)

    d = step.dim
    if kind == "all_gather":
        pieces = step.before.dims[d]
        i, pre, post = _position(pieces, axis)
        if pieces[i].chunked:
            return _gather_chunked(e, x, step, before, after, d, n, group_name(axis))
        g = e(c10d.wait_tensor.default, e(c10d.all_gather_into_tensor.default, x, n, group_name(axis)))
        if d == 0 and pre == 1:  # gathered along the outermost piece of dim 0: already the target block
            return g
        return _from_front(e, g, after, d, pre, n, post)

    if kind == "reduce_scatter":
        i, pre, post = _position(step.after.dims[d], axis)
        op = "sum" if step.reduce_op == "avg" else step.reduce_op
        front = _to_front(e, x, before, d, pre, n, post)
        y = e(c10d.wait_tensor.default, e(c10d.reduce_scatter_tensor.default, front, op, n, group_name(axis)))
        y = e(aten.view.default, y, _front_shape(before, d, pre, n, post)[1:]) if not (d == 0 and pre == 1) else y
        y = e(aten.reshape.default, y, after)
        return e(aten.div.Tensor, y, n) if step.reduce_op == "avg" else y

    if kind == "all_to_all":
        to = step.to_dim
        _, pre_t, post_t = _position(step.after.dims[to], axis)
        _, pre_g, post_g = _position(step.before.dims[d], axis)
        front = _to_front(e, x, before, to, pre_t, n, post_t)
        mid = list(before)
        mid[to] = pre_t * post_t
        # the op takes explicit split sizes: front's dim 0 holds n equal blocks, one per peer
        rows = post_t if (to == 0 and pre_t == 1) else 1
        splits = [rows] * n
        y = e(c10d.wait_tensor.default, e(c10d.all_to_all_single.default, front, splits, splits, group_name(axis)))
        y = e(aten.view.default, y, [n] + mid)
        # y is [n, ...mid]: n is the index along dim d that this rank now gathers
        return _from_front(e, y, after, d, pre_g, n, post_g)

    if kind == "local_shard":
        i, pre, post = _position(step.after.dims[d], axis)
        if step.after.dims[d][i].chunked:
            if pre != 1:
                raise LoweringError(f"uneven shard of a strided block ({step.after}) is not supported yet")
            total = before[d]
            chunk = -(-total // n)
            start = min(c * chunk, total)
            length = max(0, min(chunk, total - start))
            return _sliced(e, x, d, start, start + length)
        split = _split_shape(before, d, [pre, n, post])
        y = e(aten.view.default, x, split)
        y = e(aten.slice.Tensor, y, d + 1, c, c + 1)
        if math.prod(before[:d]) * pre != 1:  # the slice is strided: make it dense for later views
            y = _contiguous(e, y)
        return e(aten.view.default, y, after)

    raise LoweringError(f"no lowering for step kind {kind!r}")


def _front_shape(shape: Sequence[int], d: int, pre: int, n: int, post: int) -> list[int]:
    rest = list(shape)
    rest[d] = pre * post
    return [n] + _split_shape(rest, d, [pre, post])


def _gather_chunked(e: _Emit, x: fx.Node, step: Step, before: list[int], after: list[int], d: int, n: int,
                    group: str) -> fx.Node:
    """Uneven all-gather (torch.chunk layout): pad every rank to the chunk size, gather, cut the tail."""
    pieces = step.before.dims[d]
    if len(pieces) != 1:
        raise LoweringError(f"uneven gather of {step.before} with other pieces in dim {d} is not supported yet")
    total = int(step.before.shape[d])
    chunk = -(-total // n)
    pad = [0, 0] * (len(before) - 1 - d) + [0, chunk - before[d]]
    padded = e(aten.constant_pad_nd.default, x, pad, 0.0)
    padded_shape = list(before)
    padded_shape[d] = chunk
    g = e(c10d.wait_tensor.default, e(c10d.all_gather_into_tensor.default, padded, n, group))
    full = list(after)
    full[d] = n * chunk
    g = _from_front(e, g, full, d, 1, n, chunk)
    return _sliced(e, g, d, 0, total)


def _sliced(e: _Emit, x: fx.Node, d: int, start: int, end: int) -> fx.Node:
    """``x[start:end]`` along ``d``, contiguous: the graph's later views expect a dense tensor."""
    y = e(aten.slice.Tensor, x, d, start, end)
    return _contiguous(e, y) if d != 0 else y


def lower(gm: fx.GraphModule, coordinate: Coordinate, group_name: GroupName) -> fx.GraphModule:
    """A copy of the localized ``gm`` with every redistribution replaced by its lowered steps."""
    out = copy_graph_module(gm)
    graph = out.graph
    for node in list(graph.nodes):
        if node.target is not REDISTRIBUTE:
            continue
        e = _Emit(graph, node)
        x = node.args[0]
        for step in node.meta["plan"].steps:
            x = lower_step(e, x, step, coordinate, group_name)
        node.replace_all_uses_with(x)
        graph.erase_node(node)
    graph.lint()
    out.recompile()
    propagate_local_shapes(out, coordinate, check=True)
    return out
