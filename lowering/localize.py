"""Stage 4: rewrite a planned global graph into this rank's local program (still with redistributes).

Each node whose op has non-tensor arguments that depend on the rank carries a recipe
(``graph.LOCALIZE``, set in stage 3 from the op registry; fxshard/localization.py): shapes
baked into arguments (view sizes, expand sizes, a redistribution's output, a factory's size)
become this rank's local sizes; ranges and indices move into the rank's block; a lookup into a
sharded table is masked, and so is an accumulation into one. This module carries out recipes and never asks which op a node calls.
A fake-tensor pass then checks every node's local shape against its layout, so an op whose
arguments fxshard does not know how to localize fails loudly here instead of computing the
wrong thing.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Sequence

import torch
import torch.fx as fx
from torch._prims_common import compute_required_storage_length, make_contiguous_strides_for
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, in_kernel_invocation_manager

from fxshard.graph import GROUP_AXES, LAYOUT, LOCAL_REGION, LOCALIZE, argument_leaves, copy_graph_module, metadata
from fxshard.layout import Layout
from fxshard.localization import (GlobalIndices, LocalArange, LocalShape, MaskedAccumulate, MaskedLookup, QueryRows,
                                  RoutedGroup, SelectIndex, SliceRange, SplitSizes)
from fxshard.mesh import Coordinate
from .query_rows import localize_query_rows

aten = torch.ops.aten  # the ops stage 4 writes into a local program (slices, pads, masks)


class LocalizeError(RuntimeError):
    pass


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
    src = node.args[0].meta[LAYOUT]
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


def _localize_slice(node: fx.Node, recipe: SliceRange, coordinate: Coordinate) -> None:
    src, out = node.args[0].meta[LAYOUT], node.meta[LAYOUT]
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


def _localize_select(node: fx.Node, recipe: SelectIndex, coordinate: Coordinate) -> None:
    src = node.args[0].meta[LAYOUT]
    d = _dim_arg(node, 1, src.ndim)
    if _is_masked(src, node.meta[LAYOUT]):
        i = int(node.args[2]) % int(src.shape[d])
        _localize_masked(node, coordinate, d, i, i + 1, drop_dim=True)
        return
    lo, _ = local_range(src, d, [int(node.args[2]) % int(src.shape[d])], coordinate)
    node.args = (node.args[0], d, lo)


def _localize_split(node: fx.Node, recipe: SplitSizes, coordinate: Coordinate) -> None:
    src, outs = node.args[0].meta[LAYOUT], node.meta[LAYOUT]
    d = _dim_arg(node, recipe.dim_index, src.ndim)
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


def _localize_lookup(node: fx.Node, recipe: MaskedLookup, coordinate: Coordinate) -> None:
    """A table sharded along the looked-up dim: look up the indices this rank holds, zeros elsewhere."""
    table, index = node.args[recipe.table], node.args[recipe.index]
    layout = table.meta[LAYOUT]
    d = recipe.dim if recipe.dim is not None else node.args[recipe.dim_index] % layout.ndim
    if not layout.dim_is_sharded(d):
        return  # every rank holds the whole looked-up dim: a plain lookup
    lo, hi = _held_run(layout, d, coordinate, node.format_node())
    graph = node.graph
    with graph.inserting_before(node):
        safe, valid = _masked_indices(graph, index, lo, hi)
        mask = valid if recipe.mask_unsqueeze is None else \
            graph.call_function(aten.unsqueeze.default, (valid, recipe.mask_unsqueeze))
    args = list(node.args)
    args[recipe.index] = safe
    node.args = tuple(args)
    _zero_where_not(node, mask)


def _localize_accumulate(node: fx.Node, recipe: MaskedAccumulate, coordinate: Coordinate) -> None:
    """A target sharded along its rows: accumulate the indices this rank holds, shifted into its block,
    the others masked out (the op becomes ``_unsafe_masked_index_put_accumulate``, whose mask also lets a
    rank that holds no rows run the same program: nothing lands in its empty block)."""
    layout = node.args[recipe.target].meta[LAYOUT]
    if not layout.dim_is_sharded(0):
        return  # every rank holds every row: a plain accumulation
    held = layout.local_indices(0, coordinate)
    lo, hi = _held_run(layout, 0, coordinate, node.format_node()) if held.numel() else (0, 0)
    (index,) = node.args[recipe.indices]
    values = node.args[recipe.values]
    graph = node.graph
    with graph.inserting_before(node):
        safe, valid = _masked_indices(graph, index, lo, hi)
        for _ in range(values.meta["val"].ndim - index.meta["val"].ndim):  # broadcast over each row's dims
            valid = graph.call_function(aten.unsqueeze.default, (valid, -1))
        if recipe.mask is not None:
            valid = graph.call_function(aten.logical_and.default, (node.args[recipe.mask], valid))
    node.target = aten._unsafe_masked_index_put_accumulate.default
    node.args, node.kwargs = (node.args[recipe.target], valid, [safe], values), {}


def _zero_of(node: fx.Node) -> float | int:
    """The zero of ``node``'s dtype as a scalar ``where`` keeps it in (an integer stays integer)."""
    val = node.meta.get("val")
    return 0.0 if not isinstance(val, torch.Tensor) or val.dtype.is_floating_point or val.dtype.is_complex else 0


def _zero_where_not(node: fx.Node, mask: fx.Node) -> None:
    graph = node.graph
    with graph.inserting_after(node):
        zeroed = graph.call_function(aten.where.ScalarOther, (mask, node, _zero_of(node)))  # keeps an integer lookup integer
    node.replace_all_uses_with(zeroed, delete_user_cb=lambda user: user is not zeroed)
    zeroed.meta.update(node.meta)


def _localize_arange(node: fx.Node, recipe: LocalArange, coordinate: Coordinate) -> None:
    """arange(start, end, step) sharded in contiguous blocks: this rank's run of it."""
    layout = node.meta[LAYOUT]
    if not isinstance(layout, Layout) or layout.is_replicated:
        return
    args = list(node.args)
    start, step = (0, 1) if node.target is aten.arange.default else (args[0], args[2] if len(args) > 2 else 1)
    idx = layout.local_indices(0, coordinate)
    lo = int(idx[0]) if idx.numel() else 0
    node.target = aten.arange.start_step
    node.args = (start + lo * step, start + (lo + idx.numel()) * step, step)


def _localize_shape(node: fx.Node, recipe: LocalShape, coordinate: Coordinate) -> None:
    layout = node.meta.get(LAYOUT)
    if not isinstance(layout, Layout):
        return
    shape = [int(s) for s in layout.local_shape(coordinate)]
    if recipe.only_input:
        node.args, node.kwargs = (node.args[0], shape), {}
    else:
        args = list(node.args)
        args[recipe.index] = shape
        node.args = tuple(args)
    if recipe.becomes is not None:
        node.target = recipe.becomes


def _first_index(layout: Layout, d: int, coordinate: Coordinate, what: str) -> int:
    """The global index of the rank's first row of dim ``d`` (0 where it holds none); its rows must be one
    contiguous run, else no shift makes a local index global."""
    held = layout.local_indices(d, coordinate).tolist()
    if held and held != list(range(held[0], held[0] + len(held))):
        raise LocalizeError(f"{what}: the rows of dim {d} held at {coordinate} under {layout} are not one contiguous "
                            "run, so its subgraphs (score_mod, mask_mod) cannot be given global indices; shard that "
                            "dim with a plain Shard")
    return held[0] if held else 0


def _localize_indices(node: fx.Node, recipe: GlobalIndices, coordinate: Coordinate) -> None:
    """Each subgraph the op calls becomes a copy (an attribute of its own) that adds the rank's first index of
    each sharded dim to the index it is given: the kernel counts heads from 0 on every rank."""
    layout = node.args[recipe.of].meta[LAYOUT]
    gm = node.graph.owning_module
    for path, d in recipe.blocks:
        block = _at(node.args, path)
        if layout.dim_is_sharded(d) and isinstance(block, int):
            first = _first_index(layout, d, coordinate, node.format_node())
            rows = int(layout.local_shape(coordinate)[d])
            if first % block or rows % block:
                raise LocalizeError(f"{node.format_node()}: the rank at {coordinate} holds rows {first}..{first + rows}"
                                    f" of dim {d} under {layout}, not whole blocks of {block}; shard it in multiples"
                                    " of the block mask's BLOCK_SIZE")
    for path, d in recipe.lengths:
        if layout.dim_is_sharded(d):
            node.args = _replaced(node.args, path, int(layout.local_shape(coordinate)[d]))
    for path, indices in recipe.subgraphs:
        offsets = {p: _first_index(layout, d, coordinate, node.format_node()) for p, d in indices
                   if layout.dim_is_sharded(d)}
        if not offsets:
            continue
        holder = _at(node.args, path[:-1])
        getter = holder[path[-1]]
        subgraph = copy_graph_module(attribute(gm, getter))
        placeholders = list(subgraph.graph.find_nodes(op="placeholder"))
        for p, offset in offsets.items():
            index = placeholders[p]
            with subgraph.graph.inserting_after(index):
                shifted = subgraph.graph.call_function(aten.add.Tensor, (index, offset))
            index.replace_all_uses_with(shifted, delete_user_cb=lambda user: user is not shifted)
            if "val" in index.meta:
                shifted.meta["val"] = index.meta["val"]
        subgraph.recompile()
        name = _free_attribute(gm, f"{getter.target}_global_indices")
        setattr(gm, name, subgraph)
        with node.graph.inserting_before(node):
            local_getter = node.graph.get_attr(name)
        node.args = _replaced(node.args, path, local_getter)


def _at(tree: Any, path: Sequence[int]) -> Any:
    for i in path:
        tree = tree[i]
    return tree


def _replaced(tree: Any, path: Sequence[int], new: Any) -> Any:
    """``tree`` (nested tuples and lists) with the leaf at ``path`` replaced by ``new``."""
    if not path:
        return new
    items = list(tree)
    items[path[0]] = _replaced(items[path[0]], path[1:], new)
    return type(tree)(items)


def _free_attribute(gm: fx.GraphModule, base: str) -> str:
    name, k = base, 0
    while hasattr(gm, name):
        k += 1
        name = f"{base}_{k}"
    return name


def _localize_routed(node: fx.Node, recipe: RoutedGroup, coordinate: Coordinate) -> None:
    """The axes the op's expert stacks lie on (``fxshard.routing.Routed``) size its group; stage 5 names their
    process group. Stacks held whole: no group, nothing to rewrite."""
    axes = recipe.axes(node)
    if axes:
        node.kwargs = {**node.kwargs, "group_size": int(math.prod(int(a.size) for a in axes))}
        node.meta[GROUP_AXES] = axes


_RECIPES = {
    LocalShape: _localize_shape,
    LocalArange: _localize_arange,
    SliceRange: _localize_slice,
    SelectIndex: _localize_select,
    SplitSizes: _localize_split,
    MaskedLookup: _localize_lookup,
    MaskedAccumulate: _localize_accumulate,
    GlobalIndices: _localize_indices,
    RoutedGroup: _localize_routed,
    QueryRows: localize_query_rows,
}


# Recipes that move an op's indices from the global index space into the rank's block (shift, mask, offset).
_INDEX_RECIPES = (LocalArange, SliceRange, SelectIndex, MaskedLookup, MaskedAccumulate, GlobalIndices)


def indexes_its_own_shard(node: fx.Node, recipe: Any) -> bool:
    """Whether ``node``'s indices already count in the rank's own block: the node, or the indices it reads,
    lie in a local region (code eager ran on ``to_local()`` shards, ``fxshard/local_regions.py``).

    There eager indexed each rank's shard with the numbers it computed per rank (Megatron's vocab-parallel
    embedding: ids shifted by ``dist.get_rank() * rows`` and masked by the user's code, then a plain lookup
    of the local table), and the region's shapes are checked to be eager's. Shifting them again into the
    rank's block would look up rank 0's rows everywhere; the op as written is eager's meaning. The backward
    of such a lookup accumulates at the same local indices (``MaskedAccumulate`` reading the region's ids)."""
    if type(recipe) not in _INDEX_RECIPES:
        return False
    if LOCAL_REGION in node.meta:
        return True
    if isinstance(recipe, MaskedLookup):
        indices = [node.args[recipe.index]]
    elif isinstance(recipe, MaskedAccumulate):
        indices = list(node.args[recipe.indices])
    else:
        return False
    return any(isinstance(i, fx.Node) and LOCAL_REGION in i.meta for i in indices)


def own_shard_indexing(gm: fx.GraphModule) -> list[fx.Node]:
    """The nodes of ``gm`` that index their rank's own shard as a local region computed it
    (``indexes_its_own_shard``): where eager per-rank numbers, a row offset from ``dist.get_rank()``, decide."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.meta.get(LAYOUT) is not None
            and indexes_its_own_shard(n, n.meta.get(LOCALIZE))]


def localize(gm: fx.GraphModule, coordinate: Coordinate) -> fx.GraphModule:
    """A copy of the planned global ``gm`` with this rank's local shapes."""
    local = copy_graph_module(gm)
    for node in list(local.graph.nodes):  # the nodes a recipe adds (masks, pads) need no recipe
        recipe = node.meta.pop(LOCALIZE, None)
        if node.op == "call_function" and recipe is not None and node.meta.get(LAYOUT) is not None \
                and not indexes_its_own_shard(node, recipe):
            _RECIPES[type(recipe)](node, recipe, coordinate)
    local.recompile()
    propagate_local_shapes(local, coordinate, check=True)
    return local


def local_fake_inputs(gm: fx.GraphModule, coordinate: Coordinate, mode: FakeTensorMode) -> list[torch.Tensor]:
    """A contiguous fake tensor of each input's local shape (``fresh_fake``: not dispatched, ~200 inputs a step)."""
    fakes = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        val, layout = node.meta["val"], node.meta[LAYOUT]
        shape = tuple(int(s) for s in layout.local_shape(coordinate))
        fakes.append(fresh_fake(mode, shape, make_contiguous_strides_for(shape), val.dtype, val.device))
    return fakes


def propagate_local_shapes(gm: fx.GraphModule, coordinate: Coordinate, check: bool) -> None:
    """Recompute ``meta["val"]`` with local fake tensors; with ``check``, compare against layouts."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    program_fake_values(gm, local_fake_inputs(gm, coordinate, mode), mode)
    if not check:
        return
    for node in gm.graph.nodes:
        layout, val = node.meta.get(LAYOUT), node.meta.get("val")
        if isinstance(layout, Layout) and isinstance(val, torch.Tensor):
            want = tuple(int(s) for s in layout.local_shape(coordinate))
            if tuple(val.shape) != want:
                raise LocalizeError(
                    f"{node.format_node()}: its local result has shape {list(val.shape)} but its layout {layout} "
                    f"gives {list(want)} at coordinate {coordinate}. fxshard does not know how to localize the "
                    f"arguments of {node.target}: give its entry in the op registry (fxshard.registry.OPS) a "
                    "localization recipe (fxshard/localization.py), or no entry, so that its inputs are replicated.")


def program_fake_values(gm: fx.GraphModule, inputs: Sequence[Any], mode: FakeTensorMode) -> None:
    """Every value's ``meta["val"]``: the placeholders' are ``inputs``, the others computed (``fake_values``)."""
    for placeholder, x in zip(gm.graph.find_nodes(op="placeholder"), inputs):
        placeholder.meta["val"] = x
    fake_values(gm, [n for n in gm.graph.nodes if n.op != "placeholder"], mode)


def complete_fake_values(gm: fx.GraphModule, inputs: Sequence[Any]) -> None:
    """``meta["val"]`` of every value of ``gm`` where one lacks it (a region a second run loaded without them,
    ``backend/programs/lowered_cache.py``), for inputs of ``inputs``' metadata (real or fake tensors)."""
    if all("val" in n.meta for n in gm.graph.nodes if n.op != "output"):
        return
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes = [fresh_fake(mode, tuple(x.shape), tuple(x.stride()), x.dtype, x.device) if isinstance(x, torch.Tensor)
             else x for x in inputs]
    program_fake_values(gm, fakes, mode)


def fake_values(gm: fx.GraphModule, nodes: Sequence[fx.Node], mode: FakeTensorMode) -> None:
    """``meta["val"]`` of each of ``nodes`` (in program order, their arguments' values known) computed
    in ``mode``. What ``FakeTensorProp`` does for the functional aten graphs stages 4 and 5 write, for
    much less: no interpreter; a value is copied (``detach``) only where a later op could change it in
    place (a mutating op's result); and a call repeating an earlier one, of this program or another (the
    same op on arguments of the same metadata: every layer's matmul) gets a fresh value of the earlier
    result's metadata (``_Repeats``) without dispatching (an 8-layer FSDP step's two local programs: 617 ->
    142-233 ms)."""
    repeats = _Repeats(mode)
    with mode:
        for node in nodes:
            if node.op == "get_attr":  # a constant, perhaps of a submodule ("sub.name")
                attr = attribute(gm, node)
                if isinstance(attr, torch.Tensor):
                    node.meta["val"] = mode.from_tensor(attr)
                continue  # a subgraph (flex attention's score_mod): its callers are given the module itself
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: _value_of(gm, a))
            if node.op == "output":
                node.meta["val"] = args[0]
                continue
            if node.op != "call_function":
                raise LocalizeError(f"{node.format_node()}: a local program holds only calls of functions")
            leaves = argument_leaves((args, kwargs))
            key = repeats.key(node.target, args, kwargs, leaves)
            result = repeats.get(key, leaves)
            if result is None:
                result = node.target(*args, **kwargs)
                repeats.put(key, leaves, result)
            schema = getattr(node.target, "_schema", None)
            node.meta["val"] = (_snapshot(result) if schema is not None and schema.is_mutable else result)


def attribute(gm: fx.GraphModule, node: fx.Node) -> Any:
    """What a ``get_attr`` node of ``gm`` names: a constant tensor or a subgraph (a GraphModule a
    higher-order op calls), perhaps of a submodule (``"sub.name"``)."""
    return functools.reduce(getattr, node.target.split("."), gm)


def _value_of(gm: fx.GraphModule, node: fx.Node) -> Any:
    """``node``'s value as an argument of a call: its ``meta["val"]``, or the subgraph a ``get_attr`` names
    (it has no fake value: a higher-order op calls it, as eager calls it)."""
    if node.op == "get_attr" and "val" not in node.meta:
        return attribute(gm, node)
    return node.meta["val"]


class ResultSpecs:
    """An explicit cache for the process: the metadata of each output of a call, by op and argument metadata
    (``_Repeats``). A non-mutating op's fake result depends on nothing else, whichever program and fake mode
    asked: a backward repeats its forward's calls (norms, activations), the programs Inductor is given (the
    regions) repeat the lowered ones' (8 layers: ~160 of the ~400 calls dispatched in a step's compile).
    Emptied when it holds ``limit`` entries."""

    def __init__(self, limit: int = 1 << 16) -> None:
        self.limit = limit
        self._specs: dict[Any, Any] = {}

    def get(self, key: Any) -> Any:
        return self._specs.get(key)

    def put(self, key: Any, entry: Any) -> None:
        if len(self._specs) >= self.limit:
            self._specs.clear()
        self._specs[key] = entry

    def clear(self) -> None:
        self._specs.clear()


RESULT_SPECS = ResultSpecs()


class _Repeats:
    """The results of calls by op and argument metadata (``graph.metadata``), as the metadata of each output
    (``RESULT_SPECS``): a non-mutating operator's fake result depends on nothing else. An output that shares
    an argument's storage (a view; ``_unsafe_view``) shares the same argument's storage when made again.
    Ops whose results are not plain fake tensors of static shapes (a scalar, a constant) are dispatched
    each time, as are mutating ops."""

    def __init__(self, mode: FakeTensorMode) -> None:
        self.mode = mode

    def key(self, target: Any, args: tuple, kwargs: dict, leaves: list[Any]) -> Any:
        """``leaves``: ``args`` and ``kwargs``'s (``graph.argument_leaves``)."""
        if not isinstance(target, torch._ops.OpOverload) or target._schema.is_mutable:
            return None
        if any(isinstance(a, torch.Tensor) and (not isinstance(a, FakeTensor) or a.constant is not None
                                                 or a.requires_grad)
               for a in leaves):
            return None
        key = (target, metadata(args), metadata(kwargs))
        try:
            hash(key)
        except TypeError:
            return None
        return key

    def put(self, key: Any, leaves: list[Any], result: Any) -> None:
        if key is None:
            return
        storages = [a.untyped_storage()._cdata if isinstance(a, torch.Tensor) else None for a in leaves]
        specs, fresh = [], set()
        for out in result if isinstance(result, (tuple, list)) else (result,):
            if not isinstance(out, FakeTensor) or out.constant is not None or out.requires_grad \
                    or out.is_conj() or out.is_neg() or out.layout != torch.strided \
                    or any(isinstance(s, torch.SymInt) for s in (*out.shape, *out.stride())):
                return
            storage = out.untyped_storage()._cdata
            base = storages.index(storage) if storage in storages else None
            if base is None and (storage in fresh or out.storage_offset() != 0 or out.untyped_storage().nbytes()
                                 != compute_required_storage_length(out.shape, out.stride(), 0) * out.itemsize):
                return  # a result inside a larger buffer, or sharing another's: not a fresh tensor of its metadata
            fresh.add(storage)
            specs.append((tuple(out.shape), tuple(out.stride()), out.storage_offset(), out.dtype, out.device, base))
        RESULT_SPECS.put(key, (type(result) if isinstance(result, (tuple, list)) else None, tuple(specs)))

    def get(self, key: Any, leaves: list[Any]) -> Any:
        entry = RESULT_SPECS.get(key) if key is not None else None
        if entry is None:
            return None
        container, specs = entry
        outputs = [self._fresh(leaves, *spec) for spec in specs]
        return container(outputs) if container is not None else outputs[0]

    def _fresh(self, leaves: list[Any], shape: tuple, stride: tuple, offset: int, dtype: torch.dtype,
               device: torch.device, base: int | None) -> FakeTensor:
        """A fake tensor of this metadata, as the fake mode's own cache makes one."""
        return fresh_fake(self.mode, shape, stride, dtype, device,
                          (leaves[base].untyped_storage(), offset) if base is not None else None)


def fresh_fake(mode: FakeTensorMode, shape: Sequence[int], stride: Sequence[int], dtype: torch.dtype,
               device: torch.device, storage: tuple[Any, int] | None = None) -> FakeTensor:
    """A fake tensor of ``mode`` with this metadata, made without dispatching (no fake-mode cache lookup);
    ``storage``: (a fake storage, an offset) it views, else a fresh one."""
    with in_kernel_invocation_manager(mode):
        empty = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
        if storage is not None:
            empty.set_(storage[0], storage[1], shape, stride)
    return FakeTensor(mode, empty, device)


def _snapshot(value: Any) -> Any:
    if isinstance(value, FakeTensor):
        return value.detach()
    if isinstance(value, (tuple, list)):
        return type(value)(_snapshot(v) for v in value)
    return value
