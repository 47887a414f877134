"""How each kind of op propagates layouts: one interface, a handful of interpreters.

Every entry of the op registry (fxshard/registry.py) names one of these kinds. A kind is called
as ``kind(node, ctx)`` and returns the layouts the node requires of its tensor arguments and
the layout(s) of its output, or None when it has no strategy (stage 2 then replicates the
inputs, or refuses under ``strict``). The kinds:

- ``Declared(rule)``: ``rule(node)`` gives an einsum-like ``Signature`` (fxshard/rules.py); the
  cheapest of its strategies is taken (fxshard/strategies.py);
- ``VIEW`` / ``PLAIN_VIEW``: the factor algebra of views (fxshard/views.py); ``as_strided`` only
  when it is a row-major view;
- ``Ranges(fn)``: slices, selects, splits, concatenations (fxshard/slicing.py);
- ``LIKE``, ``NEW``, ``FACTORY``, ``PIN``: ``*_like`` factories take their input's sharding, ``new_*``
  ones and plain factories are replicated, ``fxshard.constrain`` pins the layout it names;
- ``WRITE_INTO``: ``copy_`` into a mutated input keeps that input's layout.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch.fx as fx

from .layout import Layout
from .mesh import MeshSpec
from .placements import user_layout
from .rules import Signature
from .strategies import Price, choose, output_shapes
from .views import view_layout

Decision = tuple[tuple[Layout, ...], Any]  # (required input layouts, output layout or tuple of them)


class UnsupportedOpError(NotImplementedError):
    """An op fxshard cannot shard: no registry entry under ``strict=True``, or arguments it cannot
    read globally."""


@dataclass(frozen=True)
class Context:
    """What a kind may know when it decides for one node."""

    mesh: MeshSpec
    layouts: Sequence[Layout]  # the tensor inputs' layouts, as they are
    offered: Sequence[Layout]  # as the node may take them (a shared Partial offered reduced: refine.py)
    move_cost: Callable[[int, Layout], float]  # what moving input i into a layout costs here
    price: Price  # what a redistribution of one of the node's values costs
    requested: Sequence[Sequence[Layout]] = ()  # per input, layouts other consumers already move it into
    wanted: Sequence[Layout] = ()  # layouts the program's output requires of this node's value (a gradient's)


class Kind:
    name = "kind"
    # whether the decision reads ``ctx.move_cost`` (where refinement's pins weigh); a kind that does takes
    # the first strategy of least cost (``strategies.choose``), which ``propagate.Decisions.with_fewer_pins``
    # relies on to reuse a decision made with fewer pins
    reads_move_costs = False

    def __call__(self, node: fx.Node, ctx: Context) -> Decision | None:
        raise NotImplementedError

    def __repr__(self) -> str:
        return self.name


@dataclass(frozen=True, repr=False)
class Declared(Kind):
    """An op described by a signature over named factors, computed from the node by ``rule``."""

    rule: Callable[[fx.Node], Signature | None]
    name = "signature"
    reads_move_costs = True

    def __call__(self, node: fx.Node, ctx: Context) -> Decision | None:
        sig = self.rule(node)
        if sig is None:
            return None
        strategy = choose(sig, ctx.offered, output_shapes(node.meta["val"]), ctx.mesh, ctx.move_cost, ctx.price,
                          ctx.requested, ctx.wanted)
        return None if strategy is None else (strategy.inputs, strategy.output)


class _View(Kind):
    name = "view"

    def __call__(self, node: fx.Node, ctx: Context) -> Decision:
        required, out = view_layout(ctx.offered[0], tuple(node.meta["val"].shape))
        return (required,), out


class _PlainView(_View):
    """``as_strided`` whose strides are the row-major ones of its size: a view; anything else is refused."""

    name = "as_strided"

    def __call__(self, node: fx.Node, ctx: Context) -> Decision:
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
                f"laid out as {ctx.layouts[0]} is not a row-major view, and each rank's storage differs from the "
                "global one, so fxshard cannot shard it. Write it with view/reshape/permute/slice instead.")
        return super().__call__(node, ctx)


@dataclass(frozen=True, repr=False)
class Ranges(Kind):
    """Ops that take ranges of a dim or stack tensors along one: ``fn(node, layouts, price)``."""

    fn: Callable[[fx.Node, Sequence[Layout], Price], Decision]
    name = "ranges"

    def __call__(self, node: fx.Node, ctx: Context) -> Decision:
        return self.fn(node, ctx.layouts, ctx.price)


class _Like(Kind):
    name = "like"

    def __call__(self, node: fx.Node, ctx: Context) -> Decision:
        return (ctx.layouts[0],), ctx.layouts[0].with_partial(())


class _New(Kind):
    name = "new"

    def __call__(self, node: fx.Node, ctx: Context) -> Decision:
        return (ctx.layouts[0],), Layout.replicated(ctx.mesh, node.meta["val"].shape)


class _Factory(Kind):
    name = "factory"

    def __call__(self, node: fx.Node, ctx: Context) -> Decision:
        return (), Layout.replicated(ctx.mesh, node.meta["val"].shape)


class _WriteInto(Kind):
    """``self.copy_(src)``, the write-back of a mutated input (a static KV cache): the write must land
    in ``self``'s own storage, so ``self`` keeps its layout and ``src`` comes in that layout."""

    name = "write_into"

    def __call__(self, node: fx.Node, ctx: Context) -> Decision | None:
        dst = ctx.layouts[0]
        if dst.partial or len(ctx.layouts) != 2 or ctx.layouts[1].shape != dst.shape:
            return None
        return (dst, dst), dst


class _Pin(Kind):
    name = "pin"

    def __call__(self, node: fx.Node, ctx: Context) -> Decision:
        target = user_layout(f"fxshard.constrain at {node.name}", node.args[1], ctx.mesh, node.meta["val"].shape)
        return (target,), target


VIEW: Kind = _View()
PLAIN_VIEW: Kind = _PlainView()
LIKE: Kind = _Like()
NEW: Kind = _New()
FACTORY: Kind = _Factory()
PIN: Kind = _Pin()
WRITE_INTO: Kind = _WriteInto()
