"""Stage 2: give every node of a global ATen graph a Layout.

Each node's strategy is chosen by cost: the candidates come from its rule (a Signature or
the view algebra), and a candidate costs the planned redistributions of its inputs. The
chosen input layouts go to ``node.meta["arg_layouts"]``, the output to ``node.meta["layout"]``;
stage 3 inserts a redistribution wherever the two disagree.
"""
from __future__ import annotations

import itertools
import operator
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx as fx
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard
from torch.utils import _pytree as pytree

from .layout import Layout, LayoutError, Piece
from .mesh import MeshSpec
from .ops import CONSTRAIN
from .placements import layout_from_placements, user_layout
from .planner import CostModel, redistribute_cost
from .hints import at_hints
from .refine import REDUCE_SHARED, is_pinned
from .rules import LIKE_OPS, NEW_OPS, VIEW_OPS, Signature, signature_of
from .slicing import CONCAT_RULES, SLICE_RULES
from .views import view_layout

_warned_ops: set[str] = set()

PIN_PENALTY = 1e6  # the factor on moving a pinned input (refine.py): a last resort, never free


class UnsupportedOpError(NotImplementedError):
    """An op without a sharding rule under ``strict=True``."""


def tensor_inputs(node: fx.Node) -> list[fx.Node]:
    """The tensor-valued input nodes of ``node`` in argument order (duplicates kept)."""
    flat, _ = pytree.tree_flatten((node.args, node.kwargs))
    return [a for a in flat if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]


def _val(node: fx.Node) -> Any:
    return node.meta.get("val")


def _dtype(node: fx.Node) -> torch.dtype:
    v = _val(node)
    return v.dtype if isinstance(v, torch.Tensor) else torch.float32


@dataclass(frozen=True)
class Strategy:
    inputs: tuple[Layout, ...]
    output: Any  # a Layout, or a tuple of them for a multi-output op
    cost: float

    @property
    def key(self) -> tuple:
        """Lower is better: planned cost (inputs, plus what an output left Partial still owes), then
        a Partial output, then the output's local size (less memory and compute per rank)."""
        outs = self.output if isinstance(self.output, tuple) else (self.output,)
        first = outs[0]
        return (round(self.cost, 12), bool(first.partial), _numeric_size(first.max_local_shape()))


class _Requested:
    """Redistributions already asked for, per value: asking again costs nothing (stage 3 makes one)."""

    def __init__(self) -> None:
        self._seen: dict[fx.Node, set[Layout]] = {}

    def add(self, node: fx.Node, layouts: Sequence[Layout]) -> None:
        for a, want in zip(tensor_inputs(node), layouts):
            if isinstance(want, Layout) and a.meta.get("layout") != want:
                self._seen.setdefault(a, set()).add(want)

    def has(self, a: fx.Node, want: Layout) -> bool:
        return want in self._seen.get(a, ())


def propagate(gm: fx.GraphModule, mesh: MeshSpec, input_layouts: Mapping[str, Layout] | None = None,
              strict: bool = False, cost_model: CostModel | None = None,
              pinned: frozenset[str] = frozenset(),
              output_layouts: Sequence[Layout | None] | None = None) -> fx.GraphModule:
    """Annotate ``gm`` in place: ``meta["layout"]`` on tensor nodes, ``meta["arg_layouts"]`` on users.

    ``input_layouts`` maps placeholder names to layouts; other placeholders are replicated.
    Moving a ``pinned`` placeholder costs ``PIN_PENALTY`` times its price (see refine.py).
    ``output_layouts`` requires layouts of the outputs (None: the cheapest DTensor-expressible
    one), as a joint graph requires each gradient in its parameter's layout.
    """
    input_layouts = dict(input_layouts or {})
    requested = _Requested()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            val = _val(node)
            if isinstance(val, torch.Tensor):
                layout = input_layouts.get(node.name) or Layout.replicated(mesh, val.shape)
                if tuple(layout.shape) != tuple(val.shape):
                    raise LayoutError(f"input {node.name} has shape {list(val.shape)} but its layout {layout} is for "
                                      f"shape {list(layout.shape)}")
                node.meta["layout"] = layout
        elif node.op == "get_attr":
            val = _val(node)
            if isinstance(val, torch.Tensor):
                node.meta["layout"] = Layout.replicated(mesh, val.shape)
        elif node.op == "call_function":
            _propagate_call(node, mesh, strict, cost_model, requested, pinned)
            requested.add(node, node.meta.get("arg_layouts", ()))
        elif node.op == "output":
            outs = [a for a in pytree.tree_leaves(node.args) if isinstance(a, fx.Node) and "layout" in a.meta]
            wanted = list(output_layouts or ()) + [None] * len(outs)
            node.meta["arg_layouts"] = tuple(
                want if want is not None else dtensor_expressible(a.meta["layout"], _dtype(a), cost_model)
                for a, want in zip(outs, wanted))
    return gm


def dtensor_expressible(layout: Layout, dtype: torch.dtype = torch.float32,
                        cost_model: CostModel | None = None) -> Layout:
    """``layout`` itself if DTensor can express it, else the DTensor placements cheapest to reach.

    Candidates are every placement tuple (Replicate or Shard(d) per mesh axis; whole-axis
    partials kept); ties go to the one with the smaller local block.
    """
    if layout.to_placements() is not None:
        return layout
    mesh = layout.mesh
    partial = {a.name: op for a, op in layout.partial if a.is_whole}
    options = [[Partial(partial[n])] if n in partial else [Replicate()] + [Shard(d) for d in range(layout.ndim)]
               for n in mesh.names]
    best: tuple | None = None
    for placements in itertools.product(*options):
        try:
            target = layout_from_placements(mesh, layout.shape, placements)
            cost = redistribute_cost(layout, target, dtype, cost_model)
        except (LayoutError, AssertionError):
            continue
        key = (cost, _numeric_size(target.max_local_shape()))
        if best is None or key < best[0]:
            best = (key, target)
    return best[1] if best is not None else Layout.replicated(mesh, layout.shape)


def _numeric_size(shape: Sequence[Any]) -> float:
    n = 1.0
    for s in shape:
        n *= float(s) if isinstance(s, int) else float(at_hints(s))
    return n


def _propagate_call(node: fx.Node, mesh: MeshSpec, strict: bool, cost_model: CostModel | None,
                    requested: _Requested, pinned: frozenset[str] = frozenset()) -> None:
    ins = tensor_inputs(node)
    in_layouts = [a.meta["layout"] for a in ins]
    val = _val(node)
    if node.target is operator.getitem:
        src = node.args[0].meta.get("layout")
        if isinstance(src, tuple):
            node.meta["layout"] = src[node.args[1]]
        return
    if not isinstance(val, (torch.Tensor, tuple, list)):
        return  # symbolic sizes and other non-tensor values carry no layout
    if node.target is CONSTRAIN:
        target = user_layout(f"fxshard.constrain at {node.name}", node.args[1], mesh, val.shape)
        _set(node, (target,), target)
        return
    if node.target is torch.ops.aten.as_strided.default:
        _check_plain_view(node, in_layouts[0])
    offered = reduce_shared(ins, in_layouts) if REDUCE_SHARED in pinned else in_layouts
    if node.target in VIEW_OPS or node.target is torch.ops.aten.as_strided.default:
        required, out = view_layout(offered[0], tuple(val.shape))
        _set(node, (required,), out)
        return
    def cost(src: Layout, dst: Layout) -> float:
        return redistribute_cost(src, dst, _dtype(node), cost_model)

    if node.target in SLICE_RULES:
        _set(node, *SLICE_RULES[node.target](node, in_layouts, cost))
        return
    if node.target in CONCAT_RULES:
        _set(node, *CONCAT_RULES[node.target](node, in_layouts, cost))
        return
    if not ins and isinstance(val, torch.Tensor):  # a factory: the same value on every rank
        _set(node, (), Layout.replicated(mesh, val.shape))
        return
    if node.target in LIKE_OPS:
        _set(node, (in_layouts[0],), in_layouts[0].with_partial(()))
        return
    if node.target in NEW_OPS and isinstance(val, torch.Tensor):
        _set(node, (in_layouts[0],), Layout.replicated(mesh, val.shape))
        return
    sig = signature_of(node)
    if sig is not None:
        def cost_of(i: int, dst: Layout) -> float:
            if in_layouts[i] == dst or requested.has(ins[i], dst):
                return 0.0
            price = redistribute_cost(in_layouts[i], dst, _dtype(ins[i]), cost_model)
            return price * PIN_PENALTY if is_pinned(ins[i], pinned) else price

        strategy = _choose(sig, offered, _out_shapes(val), mesh, cost_of, cost)
        if strategy is not None:
            _set(node, strategy.inputs, strategy.output)
            return
    _fallback(node, in_layouts, mesh, strict)


def reduce_shared(ins: Sequence[fx.Node], layouts: Sequence[Layout]) -> list[Layout]:
    """The layouts a consumer may take its inputs in under ``REDUCE_SHARED``: a Partial value with
    several consumers is offered reduced only, so all of them share one reduction of it (kept
    Partial, each consumer's views of it would be reduced separately)."""
    return [l.with_partial(()) if l.partial and len(a.users) > 1 else l for a, l in zip(ins, layouts)]


def _check_plain_view(node: fx.Node, src: Layout) -> None:
    """as_strided is a view of the row-major layout only when its strides are contiguous ones."""
    size, stride = list(node.args[1]), list(node.args[2])
    offset = node.args[3] if len(node.args) > 3 else node.kwargs.get("storage_offset")
    contiguous, acc = [], 1
    for s in reversed(size):
        contiguous.insert(0, acc)
        acc *= int(s)
    plain = node.args[0].meta["val"].is_contiguous() and not offset and all(
        st == c for s, st, c in zip(size, stride, contiguous) if s != 1)
    if not plain:
        raise UnsupportedOpError(
            f"{node.format_node()}: as_strided(size={size}, stride={stride}, storage_offset={offset}) on a tensor "
            f"laid out as {src} is not a row-major view, and each rank's storage differs from the global one, so "
            "fxshard cannot shard it. Write it with view/reshape/permute/slice instead.")


def _set(node: fx.Node, arg_layouts: Sequence[Layout], out: Any) -> None:
    node.meta["arg_layouts"] = tuple(arg_layouts)
    node.meta["layout"] = out


def _fallback(node: fx.Node, in_layouts: Sequence[Layout], mesh: MeshSpec, strict: bool) -> None:
    required = tuple(Layout.replicated(mesh, l.shape) for l in in_layouts)
    val = _val(node)
    if isinstance(val, torch.Tensor):
        out: Any = Layout.replicated(mesh, val.shape)
    else:
        out = tuple(Layout.replicated(mesh, v.shape) if isinstance(v, torch.Tensor) else None for v in val)
    if tuple(in_layouts) == required:  # replicated already: replicating moves nothing, so nothing to say
        _set(node, required, out)
        return
    name = str(node.target)
    seen = ", ".join(str(l) for l in in_layouts) or "no tensor inputs"
    if strict:
        raise UnsupportedOpError(
            f"fxshard has no sharding rule for {name} (input layouts: {seen}). Add a rule to fxshard.rules.RULES, "
            "or pin a layout next to it with fxshard.constrain(x, placements) (x.redistribute for DTensors), or run "
            "without strict=True to replicate "
            "its inputs.")
    if name not in _warned_ops:
        _warned_ops.add(name)
        warnings.warn(f"fxshard: no sharding rule for {name} (input layouts: {seen}); its inputs are replicated",
                      stacklevel=2)
    _set(node, required, out)


# ---- strategies of declared signatures ------------------------------------------------------
def _factor_candidates(sig: Signature, in_layouts: Sequence[Layout]) -> dict[str, list[tuple[Piece, ...]]]:
    cands: dict[str, list[tuple[Piece, ...]]] = {}
    for dims, layout in zip(sig.inputs, in_layouts):
        for d, f in enumerate(dims):
            if f is None:
                continue
            options = cands.setdefault(f, [])
            pieces = layout.dims[d]
            if f not in sig.whole and any(p.axis is not None for p in pieces) and pieces not in options:
                options.append(pieces)
    for f in set(sig.output) - {None}:
        cands.setdefault(f, [])
    for options in cands.values():
        options.append(())  # local: always possible
    return cands


def _partial_candidates(sig: Signature, in_layouts: Sequence[Layout]) -> list[tuple[tuple[int, ...], tuple]]:
    """(group, partial axes) choices: the output stays Partial through one linear group."""
    out: list[tuple[tuple[int, ...], tuple]] = [((), ())]
    for group in sig.partial_groups:
        for i in group:
            p = in_layouts[i].partial if i < len(in_layouts) else ()
            if p and all(op in sig.partial_ops for _, op in p) and (group, p) not in out:
                out.insert(len(out) - 1, (group, p))
    return out


def _out_shapes(val: Any) -> tuple:
    if isinstance(val, torch.Tensor):
        return tuple(val.shape)
    return tuple(tuple(v.shape) if isinstance(v, torch.Tensor) else None for v in val)


def _choose(sig: Signature, in_layouts: Sequence[Layout], out_shapes: tuple, mesh: MeshSpec,
            cost_of: Callable[[int, Layout], float], price: "Price") -> Strategy | None:
    """The cheapest strategy of ``sig`` (see Strategy.key); ``cost_of(i, layout)`` prices input i,
    ``price(src, dst)`` a redistribution of the output."""
    if len(sig.inputs) != len(in_layouts):
        return None
    cands = _factor_candidates(sig, in_layouts)
    factors = sorted(cands)
    best: Strategy | None = None
    for choice in itertools.product(*(cands[f] for f in factors)):
        assign = dict(zip(factors, choice))
        for group, partial in _partial_candidates(sig, in_layouts):
            s = _strategy(sig, assign, group, partial, in_layouts, out_shapes, mesh, cost_of, price)
            if s is not None and (best is None or s.key < best.key):
                best = s
    return best


def _may_leave_a_rank_empty(pieces: Sequence[Piece]) -> bool:
    """Whether torch.chunk semantics give some rank no element of these pieces (nested chunks: maybe)."""
    chunked = [p for p in pieces if p.chunked]
    if len(chunked) != 1:
        return len(chunked) > 1
    size, n = int(chunked[0].size), int(chunked[0].axis.size)
    return size == 0 or -(-size // -(-size // n)) < n


def _strategy(sig: Signature, assign: Mapping[str, tuple[Piece, ...]], group: tuple[int, ...], partial: tuple,
              in_layouts: Sequence[Layout], out_shapes: tuple, mesh: MeshSpec,
              cost_of: Callable[[int, Layout], float], price: "Price") -> Strategy | None:
    try:
        contracted = tuple((p.axis, sig.reduce) for f in sorted(sig.contracted) for p in assign[f] if p.axis is not None)
        if sig.reduce == "avg" and any(p.chunked for f in sig.contracted for p in assign[f]):
            return None
        if sig.reduce in ("max", "min") and any(_may_leave_a_rank_empty(assign[f]) for f in sig.contracted):
            return None  # amax/amin of an empty block has no identity to return

        def partial_of(i: int) -> tuple:
            return (tuple(partial) if i in group else ()) + (contracted if i in sig.addends else ())

        required = tuple(
            Layout(mesh, layout.shape, [assign[f] if f is not None else () for f in dims], partial_of(i))
            for i, (dims, layout) in enumerate(zip(sig.inputs, in_layouts)))
        if sig.extra_outputs:
            output: Any = tuple(
                Layout(mesh, shape, [assign[f] if f is not None else () for f in dims], tuple(partial) + contracted)
                if shape is not None else None
                for dims, shape in zip((sig.output,) + sig.extra_outputs, out_shapes))
        else:
            output = Layout(mesh, out_shapes, [assign[f] if f is not None else () for f in sig.output],
                            tuple(partial) + contracted)
    except LayoutError:
        return None
    cost = sum(cost_of(i, dst) for i, dst in enumerate(required))
    first = output[0] if isinstance(output, tuple) else output
    debt = partial_debt(first.with_partial(contracted), price) if contracted else 0.0  # inherited: owed already
    return Strategy(required, output, cost + debt)


Price = Callable[[Layout, Layout], float]


def partial_debt(out: Layout, price: Price) -> float:
    """The least a Partial ``out`` will cost to resolve: reduce_scatter onto one dim, or all_reduce.

    Without it a greedy choice takes a free Partial output (gather the cheap indices of an
    embedding rather than its table) and pays the reduction of a large tensor one op later.
    """
    if not out.partial:
        return 0.0
    resolved = out.with_partial(())
    axes = [a for a, _ in out.partial]
    best = price(out, resolved)
    n = 1
    for a in axes:
        n *= a.size if isinstance(a.size, int) else 0
    for d, pieces in enumerate(out.dims):
        size = out.shape[d]
        if any(p.axis is not None for p in pieces) or not n or not isinstance(size, int) or size % n:
            continue
        try:
            target = resolved.with_dim(d, [Piece(a.size, a) for a in axes] + [Piece(size // n)])
        except LayoutError:
            continue
        best = min(best, price(out, target))
    return best
