"""Stage 5: each planned step -> functional collectives (+ local view/permute/slice).

A step carries the layouts before and after it. Cut into digits (``digits.py``), the local
block is a dense array of digits; a collective needs its group's digits at the front in
group order (one block per peer), so every step is: view as digits, permute, collective,
view as digits, permute, view. Uneven steps (one chunked piece) pad or slice; the exchange
packs and unpacks with index tables.
"""
from __future__ import annotations

import itertools
import math
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor

from fxshard.exchange import exchange_tables
from fxshard.layout import IDENTITY
from fxshard.graph import GROUP_AXES, LOWERED_MOVE, PLAN, copy_graph_module
from fxshard.mesh import Coordinate, MeshAxis
from fxshard.ops import REDISTRIBUTE
from fxshard.plans import Step

from .digits import coordinate_of, in_group, lead_labels, step_digits
from .localize import fake_values, propagate_local_shapes

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

GroupName = Callable[[tuple[MeshAxis, ...]], str]


class LoweringError(NotImplementedError):
    pass


class _Emit:
    """Appends nodes before ``anchor``; constants become attributes of ``module``."""

    def __init__(self, module: fx.GraphModule, anchor: fx.Node, device: torch.device | str = "cpu"):
        self.module, self.graph, self.anchor, self.device = module, module.graph, anchor, device

    def __call__(self, target: Any, *args: Any, **kwargs: Any) -> fx.Node:
        with self.graph.inserting_before(self.anchor):
            return self.graph.call_function(target, args, kwargs)

    def constant(self, value: torch.Tensor, hint: str) -> fx.Node:
        name = next(f"_{hint}_{i}" for i in itertools.count() if not hasattr(self.module, f"_{hint}_{i}"))
        self.module.register_buffer(name, value.to(self.device))
        with self.graph.inserting_before(self.anchor):
            return self.graph.get_attr(name)


def _contiguous(e: _Emit, x: fx.Node) -> fx.Node:
    return e(aten.clone.default, x, memory_format=torch.contiguous_format)


def _kept(size: int) -> bool:
    return size != 1 or isinstance(size, _Varying)


def _rearrange(e: _Emit, x: fx.Node, keys_in: Sequence, keys_out: Sequence, sizes: dict, out_shape: Sequence[int],
               in_shape: Sequence[int] | None = None) -> fx.Node:
    """View ``x`` (of ``in_shape``) as digits ``keys_in``, reorder them to ``keys_out``, view as ``out_shape``."""
    keys_in = [k for k in keys_in if _kept(sizes[k])]
    keys_out = [k for k in keys_out if _kept(sizes[k])]
    perm = [keys_in.index(k) for k in keys_out]
    varying = any(isinstance(v, _Varying) for v in sizes.values())
    if perm != sorted(perm):  # (reshape: the step's input may be any strided view)
        x = e(aten.reshape.default, x, [int(sizes[k]) for k in keys_in])
        x = _contiguous(e, e(aten.permute.default, x, perm))
    elif in_shape is not None and not varying and list(in_shape) == list(out_shape):
        return x
    return e(aten.reshape.default, x, list(out_shape))


def _sliced_digits(e: _Emit, x: fx.Node, keys: Sequence, sizes: dict, picks: dict, out_shape: Sequence[int]) -> fx.Node:
    """Select index ``picks[k]`` of each digit ``k`` of dense ``x`` (viewed as ``keys``); dense result."""
    keys = [k for k in keys if _kept(sizes[k])]
    x = e(aten.reshape.default, x, [int(sizes[k]) for k in keys])
    strided = False
    for i, k in enumerate(keys):
        if k in picks:
            x = e(aten.slice.Tensor, x, i, picks[k], picks[k] + 1)
            strided = strided or any(_kept(sizes[j]) and j not in picks for j in keys[:i])
    if strided:  # the slice is strided: make it dense for later views
        x = _contiguous(e, x)
    return e(aten.view.default, x, list(out_shape))


def _structured(e: _Emit, x: fx.Node, step: Step, coord: dict[str, int], group: str) -> fx.Node:
    """all_gather, all_to_all, reduce_scatter and local_shard of even layouts, over any group."""
    before_shape = [int(s) for s in step.before.local_shape(coord)]
    dims = step_digits(step.before, step.after, step.axes, before_shape)
    lead = lead_labels(dims, step.axes, step.before.mesh)
    # digits of size 1 are dropped from views, but only where that holds on every rank
    fixed = {(d, k) for d, digits in enumerate(dims) for k, dg in enumerate(digits)
             if len(digits) > 1 or step.before.dims[d] != step.after.dims[d] or not _uneven_dim(step.before, d)}
    n = math.prod(lab[2] for lab in lead)
    sizes: dict = {("lead", lab): lab[2] for lab in lead}
    before_keys, after_keys, scattered = [], [], []
    for d, digits in enumerate(dims):
        for k, dg in enumerate(digits):
            sizes[(d, k)] = dg.size
            gathered = in_group(dg.before, step.axes) and dg.after is None
            scatters = dg.before is None and in_group(dg.after, step.axes)
            if dg.before != dg.after and not (gathered or scatters):
                raise LoweringError(f"{step}: digit {dg} of dim {d} changes in a way no {step.kind} does")
            if dg.before is None:
                before_keys.append((d, k))
            if dg.after is None:
                after_keys.append(("lead", dg.before) if gathered else (d, k))
            if scatters:
                scattered.append(((d, k), dg.after))
    after_shape = [int(s) for s in step.after.local_shape(coord)]
    for key in list(sizes):
        if key[0] != "lead" and key not in fixed:
            sizes[key] = _Varying(sizes[key])
    kind = step.kind
    if kind == "local_shard":
        picks = {key: coordinate_of(lab, coord) for key, lab in scattered}
        return _sliced_digits(e, x, before_keys, sizes, picks, after_shape)
    if kind in ("all_gather", "local_partial"):
        index = 0
        for lab in lead:
            index = index * lab[2] + coordinate_of(lab, coord)
        y = _gathered(e, x, before_shape, step, n, index, group)
        gathered_shape = [n * before_shape[0]] + before_shape[1:]
        return _rearrange(e, y, [("lead", lab) for lab in lead] + before_keys, after_keys, sizes, after_shape,
                          gathered_shape)
    # all_to_all and reduce_scatter: the scattered digits go to the front, one block per peer
    by_label = {lab: key for key, lab in scattered}
    front = [by_label[lab] for lab in lead]
    rest = [k for k in before_keys if k not in front]
    rest_numel = math.prod(sizes[k] for k in rest)
    y = _rearrange(e, x, before_keys, front + rest, sizes, [n, rest_numel], before_shape)
    if kind == "reduce_scatter":
        y = e(c10d.wait_tensor.default, e(c10d.reduce_scatter_tensor.default, y, step.collective_op, n, group))
        return _divided(e, e(aten.view.default, y, after_shape), step)
    if kind == "all_to_all":
        y = e(c10d.wait_tensor.default, e(c10d.all_to_all_single.default, y, [1] * n, [1] * n, group))
        return _rearrange(e, y, [("lead", lab) for lab in lead] + rest, after_keys, sizes, after_shape)
    raise LoweringError(f"no structured lowering for step kind {kind!r}")


def _gathered(e: _Emit, x: fx.Node, shape: Sequence[int], step: Step, n: int, index: int, group: str) -> fx.Node:
    """The group's ``n`` blocks (of ``shape``) stacked along dim 0, this rank's at ``index``: an all_gather;
    for a shard made partial (local_partial), the op's identity in every other block: no peer sends."""
    if step.kind == "all_gather":
        return e(c10d.wait_tensor.default, e(c10d.all_gather_into_tensor.default, x, n, group))
    pad = [0, 0] * (len(shape) - 1) + [index * shape[0], (n - 1 - index) * shape[0]]
    return e(aten.constant_pad_nd.default, x, pad, IDENTITY[step.reduce_op])


def _exchange(e: _Emit, x: fx.Node, step: Step, coordinate: Coordinate, group: str) -> fx.Node:
    """Every rank sends each peer exactly the elements it lacks (per-peer sizes), then reorders."""
    tables = exchange_tables(step.before, step.after, step.axes, coordinate)
    flat = e(aten.reshape.default, x, [-1])
    send = e(aten.index_select.default, flat, 0, e.constant(tables.send_index, "exchange_send"))
    recv = e(c10d.wait_tensor.default, e(c10d.all_to_all_single.default, send, tables.recv_splits,
                                          tables.send_splits, group))
    both = e(aten.cat.default, [flat, recv])
    out = e(aten.index_select.default, both, 0, e.constant(tables.unpack_index, "exchange_unpack"))
    return e(aten.view.default, out, [int(s) for s in step.after.local_shape(coordinate)])


def _local_gather(e: _Emit, x: fx.Node, step: Step, coordinate: Coordinate) -> fx.Node:
    """A local_shard into or out of unequal blocks: every rank holds its target block already (an
    exchange that receives nothing), picked from its own block by an index table."""
    tables = exchange_tables(step.before, step.after, step.axes, coordinate)
    if sum(tables.recv_splits):
        raise LoweringError(f"{step}: a rank lacks elements of {step.after}; that is an exchange, not a local_shard")
    flat = e(aten.reshape.default, x, [-1])
    out = e(aten.index_select.default, flat, 0, e.constant(tables.unpack_index, "local_gather"))
    return e(aten.view.default, out, [int(s) for s in step.after.local_shape(coordinate)])


def _changes_unequal_blocks(step: Step) -> bool:
    """Whether a dim the step changes is one of unequal blocks (before or after)."""
    return any(any(p.uneven_blocks for p in step.before.dims[d] + step.after.dims[d])
               for d in range(step.before.ndim) if step.before.dims[d] != step.after.dims[d])


class _Varying(int):
    """A digit size that differs between ranks: never dropped from a view, even when 1."""


def _uneven_dim(layout, d: int) -> bool:
    return any(p.chunked for p in layout.dims[d])


def _is_uneven(step: Step) -> bool:
    """Whether a dim the step changes holds a chunked piece."""
    return any((_uneven_dim(step.before, d) or _uneven_dim(step.after, d)) and step.before.dims[d] != step.after.dims[d]
               for d in range(step.before.ndim))


def lower_step(e: _Emit, x: fx.Node, step: Step, coordinate: Coordinate, group_name: GroupName) -> fx.Node:
    mesh = step.before.mesh
    coord = mesh.coordinate_dict(coordinate)
    kind = step.kind
    n = int(step.group_size)
    group = group_name(step.axes) if not step.is_local else ""

    if kind == "all_reduce":
        y = e(c10d.wait_tensor.default, e(c10d.all_reduce.default, x, step.collective_op, group))
        return _divided(e, y, step)

    if kind == "local_partial" and step.before.dims == step.after.dims:
        holds = step.reduce_op not in IDENTITY or all(a.coordinate(coord[a.name]) == 0 for a in step.axes)
        return e(aten.clone.default, x) if holds else e(aten.full_like.default, x, IDENTITY[step.reduce_op])

    if kind == "exchange":
        return _exchange(e, x, step, coordinate, group)

    if kind == "local_shard" and _changes_unequal_blocks(step):
        return _local_gather(e, x, step, coordinate)

    if _is_uneven(step):
        return _uneven(e, x, step, coord, group)
    return _structured(e, x, step, coord, group)


def _uneven(e: _Emit, x: fx.Node, step: Step, coord: dict[str, int], group: str) -> fx.Node:
    """One axis, one chunked piece (torch.chunk layout): a padded all_gather or a local slice."""
    before = [int(s) for s in step.before.local_shape(coord)]
    after = [int(s) for s in step.after.local_shape(coord)]
    axis, d = step.axis, step.dim
    n, c = int(axis.size), axis.coordinate(coord[axis.name])
    if step.kind in ("all_gather", "local_partial") and len(step.before.dims[d]) == 1:
        return _gather_chunked(e, x, step, before, after, d, n, c, group)
    pieces = step.after.dims[d]
    i = next(k for k, p in enumerate(pieces) if p.axis == axis)
    if step.kind == "reduce_scatter" and i == len(pieces) - 1 and all(p.axis is not None for p in pieces[:i]):
        return _reduce_scatter_chunked(e, x, step, before, d, n, c, group)  # the local block, chunked
    if step.kind == "local_shard" and _chunks_whole_block(step, d, i):
        total = before[d]
        chunk = -(-total // n)
        start = min(c * chunk, total)
        length = max(0, min(chunk, total - start))
        return _sliced(e, x, d, start, start + length)
    if step.kind == "local_shard":  # e.g. an even piece before a chunked one ([5@a 3 ~2@c] -> [5@a 3@b ~2@c])
        return _local_gather(e, x, step, coord)
    raise LoweringError(f"{step}: uneven {step.kind} from {step.before} to {step.after} is not supported")


def _chunks_whole_block(step: Step, d: int, i: int) -> bool:
    """Whether piece ``i`` of dim ``d`` after the step cuts every rank's whole block of the dim with
    torch.chunk: it is appended after the dim's pieces, all sharded (a slice of the local block)."""
    pieces = step.after.dims[d]
    return (pieces[i].chunked and i == len(pieces) - 1 and step.before.dims[d] == pieces[:i]
            and all(p.axis is not None for p in pieces[:i]))


def _gather_chunked(e: _Emit, x: fx.Node, step: Step, before: list[int], after: list[int], d: int, n: int,
                    c: int, group: str) -> fx.Node:
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
    g = _gathered(e, padded, padded_shape, step, n, c, group)
    full = list(after)
    full[d] = n * chunk
    # g is [n * padded[0], ...]: the peer index leads; it becomes dim d's outermost digit
    keys = ["n"] + list(range(len(before)))
    sizes = {"n": n, **{k: _Varying(padded_shape[k]) if k != d and _uneven_dim(step.before, k) else padded_shape[k]
                        for k in range(len(before))}}
    order = list(range(d)) + ["n"] + list(range(d, len(before)))
    g = _rearrange(e, g, keys, order, sizes, full, [n * padded_shape[0]] + padded_shape[1:])
    return _sliced(e, g, d, 0, total)


def _reduce_scatter_chunked(e: _Emit, x: fx.Node, step: Step, before: list[int], d: int, n: int, c: int,
                            group: str) -> fx.Node:
    """Uneven reduce_scatter (torch.chunk layout): pad dim ``d`` to n equal chunks, reduce, cut the tail."""
    total = before[d]
    chunk = -(-total // n)
    pad = [0, 0] * (len(before) - 1 - d) + [0, n * chunk - total]
    padded = e(aten.constant_pad_nd.default, x, pad, 0.0)
    if d:
        padded = _contiguous(e, e(aten.movedim.int, padded, d, 0))
    y = e(c10d.wait_tensor.default, e(c10d.reduce_scatter_tensor.default, padded, step.collective_op, n, group))
    if d:
        y = _contiguous(e, e(aten.movedim.int, y, 0, d))
    start = min(c * chunk, total)
    return _divided(e, _sliced(e, y, d, 0, max(0, min(chunk, total - start))), step)


def _divided(e: _Emit, y: fx.Node, step: Step) -> fx.Node:
    """A reduced sum divided by the size of the avg axes the step reduced (sum and avg may be mixed)."""
    n = int(step.divisor)
    return e(aten.div.Tensor, y, n) if n != 1 else y


def _sliced(e: _Emit, x: fx.Node, d: int, start: int, end: int) -> fx.Node:
    """``x[start:end]`` along ``d``, contiguous: the graph's later views expect a dense tensor."""
    y = e(aten.slice.Tensor, x, d, start, end)
    return _contiguous(e, y) if d != 0 else y


def lower(gm: fx.GraphModule, coordinate: Coordinate, group_name: GroupName) -> fx.GraphModule:
    """A copy of the localized ``gm`` with every redistribution replaced by its lowered steps."""
    out = copy_graph_module(gm)
    graph = out.graph
    before = set(graph.nodes)
    replaced: list[tuple[fx.Node, Any]] = []  # (the lowered value, the redistribution's local value)
    for node in list(graph.nodes):
        if node.target is not REDISTRIBUTE:
            continue
        x = node.args[0]
        val = x.meta.get("val")
        e = _Emit(out, node, val.device if isinstance(val, torch.Tensor) else "cpu")
        is_bool = isinstance(val, torch.Tensor) and val.dtype == torch.bool
        if is_bool and node.meta[PLAN].collectives:  # masks travel as bytes (gloo and Inductor lack bool collectives)
            x = e(aten._to_copy.default, x, dtype=torch.uint8)
        for step in node.meta[PLAN].steps:
            x = lower_step(e, x, step, coordinate, group_name)
        if is_bool and node.meta[PLAN].collectives:
            x = e(aten._to_copy.default, x, dtype=torch.bool)
        replaced.append((x, node.meta.get("val")))
        node.replace_all_uses_with(x)
        graph.erase_node(node)
    for node in graph.nodes:  # ops that communicate themselves (routed experts) get their group's name
        if node.meta.get(GROUP_AXES):
            node.kwargs = {**node.kwargs, "group": group_name(node.meta[GROUP_AXES])}
    graph.lint()
    out.recompile()
    new = [n for n in graph.nodes if n not in before]
    for node in new:
        node.meta[LOWERED_MOVE] = True
    if not _propagate_lowered(out, new, replaced):
        propagate_local_shapes(out, coordinate, check=True)
    return out


def _propagate_lowered(gm: fx.GraphModule, new: Sequence[fx.Node], replaced: Sequence[tuple[fx.Node, Any]]) -> bool:
    """Fake values for the nodes lowering added, in the fake mode of the localized graph's values;
    True when each lowered redistribution's value has the metadata (shape, strides, dtype) its
    marker's had. Then every other value is what propagating the whole graph again would give, and
    localize checked those already; otherwise (False) the caller propagates and checks it all."""
    mode = next((v.fake_mode for n in gm.graph.nodes if isinstance(v := n.meta.get("val"), FakeTensor)), None)
    if mode is None:
        return False
    fake_values(gm, new, mode)
    return all(isinstance(v := x.meta.get("val"), torch.Tensor) and isinstance(old, torch.Tensor)
               and (v.shape, v.stride(), v.dtype) == (old.shape, old.stride(), old.dtype) for x, old in replaced)
