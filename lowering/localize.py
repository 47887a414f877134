"""Stage 4: rewrite a planned global graph into this rank's local program (still with redistributes).

Shapes baked into op arguments (view sizes, expand sizes, a redistribution's output) become
this rank's local sizes. A fake-tensor pass then checks every node's local shape against its
layout, so an op whose arguments fxshard does not know how to localize fails loudly here
instead of computing the wrong thing.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from fxshard.layout import Layout
from fxshard.mesh import Coordinate
from fxshard.factories import ARANGES
from fxshard.ops import REDISTRIBUTE

aten = torch.ops.aten

# op -> index of the argument that holds the op's output shape
SHAPE_ARGS: dict[Any, int] = {
    aten.view.default: 1,
    aten._unsafe_view.default: 1,
    aten.reshape.default: 1,
    aten.expand.default: 1,
    REDISTRIBUTE: 3,
    # constant factories given a sharded layout (fxshard/factories.py): the constant at the local shape
    aten.zeros.default: 0,
    aten.ones.default: 0,
    aten.full.default: 0,
    aten.empty.memory_format: 0,
}


class LocalizeError(RuntimeError):
    pass


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    return fx.GraphModule(gm, graph)


def local_range(src: Layout, d: int, global_indices: list[int], coordinate: Coordinate) -> tuple[int, int]:
    """Where ``global_indices`` (of dim ``d`` of a tensor laid out as ``src``) sit in this rank's block.

    They must be a contiguous run in local order; anything else means the layouts disagree.
    """
    if not global_indices:
        return 0, 0
    position = {g: i for i, g in enumerate(src.local_indices(d, coordinate).tolist())}
    local = [position.get(g) for g in global_indices]
    if None in local or local != list(range(local[0], local[0] + len(local))):
        raise LocalizeError(f"indices {global_indices} of dim {d} are not one contiguous run of this rank's block "
                            f"of {src} at {coordinate}")
    return local[0], local[0] + len(local)


def _dim_arg(node: fx.Node, i: int, ndim: int) -> int:
    d = node.args[i] if len(node.args) > i else node.kwargs.get("dim", 0)
    return d % ndim


def _is_masked(src: Layout, out: Layout) -> bool:
    """Stage 2 took the range where it lies: the output is partial over axes the input shards."""
    return set(out.partial) != set(src.partial)


def _localize_masked(node: fx.Node, coordinate: Coordinate, d: int, start: int, end: int, drop_dim: bool) -> None:
    """This rank's rows of [start, end) where they lie in the range, zeros elsewhere (slice + pad)."""
    src = node.args[0].meta["layout"]
    held = src.local_indices(d, coordinate).tolist()
    g0 = held[0] if held else 0
    lo, hi = max(start, g0), min(end, g0 + len(held))
    if hi <= lo:
        lo = hi = start
    ndim = src.ndim
    pad = [0, 0] * (ndim - 1 - d) + [lo - start, end - hi]
    graph = node.graph
    with graph.inserting_after(node):
        padded = graph.call_function(aten.constant_pad_nd.default, (node, pad, 0.0))
    last = padded
    if drop_dim:
        with graph.inserting_after(padded):
            last = graph.call_function(aten.squeeze.dim, (padded, d))
    node.replace_all_uses_with(last, delete_user_cb=lambda user: user is not padded)
    last.meta.update(node.meta)
    node.meta = {}
    node.target = aten.slice.Tensor
    node.args, node.kwargs = (node.args[0], d, lo - g0, hi - g0), {}


def _localize_slice(node: fx.Node, coordinate: Coordinate) -> None:
    src, out = node.args[0].meta["layout"], node.meta["layout"]
    d = _dim_arg(node, 1, src.ndim)
    step = node.args[4] if len(node.args) > 4 else node.kwargs.get("step", 1)
    if step != 1:  # stage 2 made the sliced dim local: the global arguments are the local ones
        return
    start = _global_start(node, src, d)
    if _is_masked(src, out):
        _localize_masked(node, coordinate, d, start, start + int(out.shape[d]), drop_dim=False)
        return
    wanted = [start + int(i) for i in out.local_indices(d, coordinate)]
    lo, hi = local_range(src, d, wanted, coordinate)
    node.args = (node.args[0], d, lo, hi) + tuple(node.args[4:])
    node.kwargs = {}


def _global_start(node: fx.Node, src: Layout, d: int) -> int:
    size = int(src.shape[d])
    start = node.args[2] if len(node.args) > 2 else node.kwargs.get("start", None)
    if start is None:
        return 0
    start = int(start) + (size if int(start) < 0 else 0)
    return min(max(start, 0), size)


def _localize_select(node: fx.Node, coordinate: Coordinate) -> None:
    src = node.args[0].meta["layout"]
    d = _dim_arg(node, 1, src.ndim)
    if _is_masked(src, node.meta["layout"]):
        i = int(node.args[2]) % int(src.shape[d])
        _localize_masked(node, coordinate, d, i, i + 1, drop_dim=True)
        return
    lo, _ = local_range(src, d, [int(node.args[2]) % int(src.shape[d])], coordinate)
    node.args = (node.args[0], d, lo)


def _localize_split(node: fx.Node, coordinate: Coordinate) -> None:
    src, outs = node.args[0].meta["layout"], node.meta["layout"]
    d = _dim_arg(node, 2, src.ndim)
    sizes, offset, end = [], 0, 0
    for out in outs:
        lo, hi = local_range(src, d, [offset + int(i) for i in out.local_indices(d, coordinate)], coordinate)
        if hi > lo and lo != end:
            raise LocalizeError(f"{node.format_node()}: split pieces are not consecutive on this rank")
        end = max(end, hi)
        sizes.append(hi - lo)
        offset += int(out.shape[d])
    node.target = aten.split_with_sizes.default
    node.args, node.kwargs = (node.args[0], sizes, d), {}


def _held_run(src: Layout, d: int, coordinate: Coordinate, what: str) -> tuple[int, int]:
    """The global rows [lo, hi) of dim ``d`` this rank holds; they must be one contiguous run."""
    held = src.local_indices(d, coordinate).tolist()
    if not held:
        raise LocalizeError(f"{what}: the rank at {coordinate} holds no rows of dim {d} of {src}; shard that dim "
                            "over fewer ranks (or make its size at least the number of ranks)")
    lo, hi = held[0], held[0] + len(held)
    if held != list(range(lo, hi)):
        raise LocalizeError(f"{what}: the rows of dim {d} held at {coordinate} under {src} are not one contiguous "
                            "run; a masked lookup needs a plain Shard of that dim")
    return lo, hi


def _masked_indices(graph: fx.Graph, index: fx.Node, lo: int, hi: int) -> tuple[fx.Node, fx.Node]:
    """(index - lo where lo <= index < hi else 0, the mask of those positions), inserted before use."""
    ge = graph.call_function(aten.ge.Scalar, (index, lo))
    lt = graph.call_function(aten.lt.Scalar, (index, hi))
    valid = graph.call_function(aten.logical_and.default, (ge, lt))
    shifted = graph.call_function(aten.sub.Tensor, (index, lo))
    safe = graph.call_function(aten.where.ScalarOther, (valid, shifted, 0))
    return safe, valid


def _localize_embedding(node: fx.Node, coordinate: Coordinate) -> None:
    """A vocab-sharded table: look up the indices this rank holds, zeros elsewhere (Partial(sum))."""
    weight, index = node.args[0], node.args[1]
    table = weight.meta["layout"]
    if not table.dims[0]:
        return
    lo, hi = _held_run(table, 0, coordinate, node.format_node())
    graph = node.graph
    with graph.inserting_before(node):
        safe, valid = _masked_indices(graph, index, lo, hi)
        mask = graph.call_function(aten.unsqueeze.default, (valid, -1))
    node.args = (weight, safe) + tuple(node.args[2:])
    _zero_where_not(node, mask)


def _localize_gather(node: fx.Node, coordinate: Coordinate) -> None:
    """gather along a sharded dim: the same masked lookup as a vocab-sharded embedding."""
    src, index = node.args[0], node.args[2]
    layout = src.meta["layout"]
    d = node.args[1] % layout.ndim
    if not layout.dims[d]:
        return
    lo, hi = _held_run(layout, d, coordinate, node.format_node())
    graph = node.graph
    with graph.inserting_before(node):
        safe, valid = _masked_indices(graph, index, lo, hi)
    node.args = (src, node.args[1], safe) + tuple(node.args[3:])
    _zero_where_not(node, valid)


def _zero_where_not(node: fx.Node, mask: fx.Node) -> None:
    graph = node.graph
    with graph.inserting_after(node):
        zeroed = graph.call_function(aten.where.ScalarOther, (mask, node, 0.0))
    node.replace_all_uses_with(zeroed, delete_user_cb=lambda user: user is not zeroed)
    zeroed.meta.update(node.meta)


def _localize_arange(node: fx.Node, layout: Layout, coordinate: Coordinate) -> None:
    """arange(start, end, step) sharded in contiguous blocks: this rank's run of it."""
    args = list(node.args)
    start, step = (0, 1) if node.target is aten.arange.default else (args[0], args[2] if len(args) > 2 else 1)
    idx = layout.local_indices(0, coordinate)
    lo = int(idx[0]) if idx.numel() else 0
    node.target = aten.arange.start_step
    node.args = (start + lo * step, start + (lo + idx.numel()) * step, step)


# ops whose index arguments depend on where this rank's block sits
LOCAL_INDEX_ARGS = {
    aten.embedding.default: _localize_embedding,
    aten.gather.default: _localize_gather,
    aten.slice.Tensor: _localize_slice,
    aten.select.int: _localize_select,
    aten.split.Tensor: _localize_split,
    aten.split_with_sizes.default: _localize_split,
}


def localize(gm: fx.GraphModule, coordinate: Coordinate) -> fx.GraphModule:
    """A copy of the planned global ``gm`` with this rank's local shapes."""
    local = copy_graph_module(gm)
    for node in local.graph.nodes:
        layout = node.meta.get("layout")
        if node.op != "call_function":
            continue
        if node.target in SHAPE_ARGS and isinstance(layout, Layout):
            args = list(node.args)
            args[SHAPE_ARGS[node.target]] = [int(s) for s in layout.local_shape(coordinate)]
            node.args = tuple(args)
            if node.target is aten.view.default:  # a collective's output may be a permuted (strided) block
                node.target = aten.reshape.default
        elif node.target is aten.as_strided.default and isinstance(layout, Layout):  # a plain view (stage 2)
            node.target = aten.view.default
            node.args, node.kwargs = (node.args[0], [int(s) for s in layout.local_shape(coordinate)]), {}
        elif node.target in ARANGES and isinstance(layout, Layout) and not layout.is_replicated:
            _localize_arange(node, layout, coordinate)
        elif node.target in LOCAL_INDEX_ARGS and layout is not None:
            LOCAL_INDEX_ARGS[node.target](node, coordinate)
    local.recompile()
    propagate_local_shapes(local, coordinate, check=True)
    return local


def local_fake_inputs(gm: fx.GraphModule, coordinate: Coordinate, mode: FakeTensorMode) -> list[torch.Tensor]:
    fakes = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        val, layout = node.meta["val"], node.meta["layout"]
        with mode:
            fakes.append(torch.empty([int(s) for s in layout.local_shape(coordinate)], dtype=val.dtype,
                                     device=val.device))
    return fakes


def propagate_local_shapes(gm: fx.GraphModule, coordinate: Coordinate, check: bool) -> None:
    """Recompute ``meta["val"]`` with local fake tensors; with ``check``, compare against layouts."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    FakeTensorProp(gm, mode).propagate(*local_fake_inputs(gm, coordinate, mode))
    if not check:
        return
    for node in gm.graph.nodes:
        layout, val = node.meta.get("layout"), node.meta.get("val")
        if isinstance(layout, Layout) and isinstance(val, torch.Tensor):
            want = tuple(int(s) for s in layout.local_shape(coordinate))
            if tuple(val.shape) != want:
                raise LocalizeError(
                    f"{node.format_node()}: its local result has shape {list(val.shape)} but its layout {layout} "
                    f"gives {list(want)} at coordinate {coordinate}. fxshard does not know how to localize the "
                    f"arguments of {node.target}; add it to fxshard.lowering.localize.SHAPE_ARGS or give it a rule "
                    "that replicates its inputs.")
