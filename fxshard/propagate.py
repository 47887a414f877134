"""Stage 2: give every node of a global ATen graph a Layout.

Each node is one lookup in the op registry (fxshard/registry.py): its kind proposes the
layouts the node requires of its inputs and the layout of its output, choosing by cost among
its candidates, where a candidate costs the planned redistributions of its inputs. The chosen
input layouts go to ``node.meta["arg_layouts"]``, the output to ``node.meta["layout"]``
(fxshard/graph.py); stage 3 inserts a redistribution wherever the two disagree.
"""
from __future__ import annotations

import itertools
import operator
from typing import Any, Callable, Hashable, Iterable, Mapping, Sequence

import torch
import torch.fx as fx
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from .costs import CostModel
from .graph import ARG_LAYOUTS, LAYOUT, dtype_of, metadata, required_layouts, set_strategy, tensor_inputs, value
from .layout import Layout, LayoutError
from .mesh import MeshSpec
from .op_kinds import Context, UnsupportedOpError
from .ops import SUMMED
from .placements import dtensor_spec_of, layout_from_placements
from .planner import redistribute_cost
from .policies import Pin
from .rebuild import Rebuilds
from .refine import is_pinned, pin_of
from .registry import lookup
from .sources import relabel_chain, served_by_source
from .strategies import numeric_size

__all__ = ["UnsupportedOpError", "dtensor_expressible", "propagate", "reduce_shared"]

PIN_PENALTY = 1e6  # the factor on moving a pinned input (refine.py): a last resort, never free
MAX_PINS_UNSET = 3  # a node with more pinned inputs looks for no decision made with fewer (Decisions.with_fewer_pins)


class _Requested:
    """Redistributions already asked for, per value: asking again costs nothing (stage 3 makes one)."""

    def __init__(self, rebuilds: Rebuilds, foreseen: Mapping[fx.Node, Iterable[Layout]] | None = None) -> None:
        self._seen: dict[fx.Node, set[Layout]] = {a: set(wants) for a, wants in (foreseen or {}).items()}
        self._sorted: dict[fx.Node, tuple[Layout, ...]] = {}  # ``of``, until ``a`` is asked for in another layout
        self._through_sources = foreseen is not None
        self.rebuilds = rebuilds  # what serving a value in a layout costs, rebuilt or moved

    def add(self, ins: Sequence[fx.Node], layouts: Sequence[Layout]) -> None:
        """``ins``: a node's tensor inputs; ``layouts``: what it requires of them."""
        for a, want in zip(ins, layouts):
            if isinstance(want, Layout) and a.meta.get(LAYOUT) != want:
                seen = self._seen.setdefault(a, set())
                if want not in seen:
                    seen.add(want)
                    self._sorted.pop(a, None)

    def has(self, a: fx.Node, want: Layout) -> bool:
        """Asked for already; with ``foreseen`` requests, also through a source of ``a``'s relabellings."""
        if want in self._seen.get(a, ()):
            return True
        return self._through_sources and served_by_source(a, want, lambda n, layout: layout in self._seen.get(n, ()))

    def of(self, a: fx.Node) -> tuple[Layout, ...]:
        """The layouts ``a`` is moved into already, in a fixed order."""
        known = self._sorted.get(a)
        if known is None:
            known = self._sorted[a] = tuple(sorted(self._seen.get(a, ()), key=str))
        return known

    def key(self, a: fx.Node, memo: "Decisions") -> Hashable:
        """All ``has(a, ...)`` reads: ``of(a)``; with ``foreseen`` requests, also each relabelling on the way
        to ``a``'s sources (its structure), its input's layout and what that is moved into already. Where no
        such source is moved into anything, ``has`` reads what it reads without ``foreseen``: the key is
        ``of(a)`` then too, so the foreseen propagation meets the decisions the others made (it is not a
        tuple of layouts otherwise: the keys cannot meet where the reads differ)."""
        if not self._through_sources:
            return self.of(a)
        sources = tuple((memo.structure_of(n), n.args[0].meta[LAYOUT], self.of(n.args[0]))
                        for n in relabel_chain(a))
        if not any(moved for _, _, moved in sources):
            return self.of(a)
        return self.of(a), sources


class Decisions:
    """The strategies one program's propagations chose, keyed by all a decision reads: the node's
    structure (``structure``), its inputs' layouts, which of them are asked for already, which are
    pinned, and the layouts it is offered them in where ``Pin.REDUCE_SHARED`` offers them otherwise.

    Refinement propagates the same graph up to ~18 times with other pins, and a model repeats its
    layers: most nodes meet a decision made before (the costly part: every strategy priced). A pin
    changes few decisions: ``with_fewer_pins`` finds the decision made without it where that one still holds.
    """

    def __init__(self) -> None:
        self.made: dict[tuple, Any] = {}
        self._structures: dict[fx.Node, int] = {}
        self._numbers: dict[Hashable, int] = {}  # each distinct structure's number
        self._inputs: dict[fx.Node, list[fx.Node]] = {}
        self._pins: dict[fx.Node, str | None] = {}

    def another_copy(self) -> "Decisions":
        """These decisions for another copy of the same program (``fxshard.auto_placements`` plans one trace
        with many input layouts): what was read of the old copy's nodes is dropped, the decisions (keyed by
        structure and layouts alone) are kept."""
        self._structures, self._inputs, self._pins = {}, {}, {}
        return self

    def inputs(self, node: fx.Node) -> list[fx.Node]:
        """``graph.tensor_inputs(node)``, read once per program (the graph does not change between runs)."""
        ins = self._inputs.get(node)
        if ins is None:
            ins = self._inputs[node] = tensor_inputs(node)
        return ins

    def structure_of(self, node: fx.Node) -> int:
        """``structure(node, ...)``, read once per program, as a number (equal structures, equal numbers): a
        decision's key hashes a number rather than the nested tuple, at every node of every propagation."""
        number = self._structures.get(node)
        if number is None:
            number = self._structures[node] = self._numbers.setdefault(structure(node, self.inputs(node)),
                                                                       len(self._numbers))
        return number

    def pinned(self, node: fx.Node, pinned: frozenset[str]) -> bool:
        """``refine.is_pinned``, with what it reads of the graph read once per program."""
        if not pinned:
            return False
        try:
            pin = self._pins[node]
        except KeyError:
            pin = self._pins[node] = pin_of(node)
        return pin in pinned

    def key(self, node: fx.Node, ins: Sequence[fx.Node], layouts: Sequence[Layout], offered: Sequence[Layout],
            requested: _Requested, pinned: frozenset[str]) -> tuple:
        """(structure, layouts, requests, pins, offered), which ``with_fewer_pins`` reads by position; ``offered``:
        ``reduce_shared``'s layouts, or ``layouts`` itself (the key then says nothing more)."""
        return (self.structure_of(node), tuple(layouts), tuple(requested.key(a, self) for a in ins),
                tuple(self.pinned(a, pinned) for a in ins), None if offered is layouts else tuple(offered))

    def with_fewer_pins(self, key: tuple, kind: Any, free: Callable[[int, Layout], bool]) -> Any:
        """A decision made at ``key`` (``(self.key(...), wanted)``) with fewer of the node's inputs pinned
        that is the one these pins make too, else None. Pins weigh only in ``ctx.move_cost``, which most
        kinds never read (``Kind.reads_move_costs``); one that reads it takes the first strategy of least
        cost (``strategies.choose``), and a pin multiplies the cost of moving its input: a strategy chosen
        with fewer pins stays the least (and the first such) where it moves none of the other pinned inputs
        at a cost (``free(i, layout)``: moving input ``i`` into ``layout`` costs nothing). Refinement's
        rounds pin inputs that most decisions never move (misses at 1 / 8 layers: 1068 / 1335 -> ~750 / ~1000)."""
        own, wanted = key
        pinned = [i for i, pin in enumerate(own[3]) if pin]
        if not pinned or len(pinned) > MAX_PINS_UNSET:
            return None
        for unset in range(1, len(pinned) + 1):
            for dropped in itertools.combinations(pinned, unset):
                pins = tuple(pin and i not in dropped for i, pin in enumerate(own[3]))
                decision = self.made.get(((*own[:3], pins, own[4]), wanted))
                if decision is not None and (not kind.reads_move_costs
                                             or all(free(i, decision[0][i]) for i in dropped)):
                    return decision
        return None


def structure(node: fx.Node, ins: Sequence[fx.Node]) -> Hashable:
    """What an op kind reads of ``node`` besides its inputs' layouts: its op, its arguments (constants
    by type and value, inputs by first position and value's metadata), its value's metadata, and
    which inputs have several consumers (``reduce_shared``). Two layers' matmuls share it; a node
    with an unhashable argument keys by itself."""
    first: dict[fx.Node, int] = {}

    def leaf(a: Any) -> Any:
        if isinstance(a, fx.Node):
            return ("input", first.setdefault(a, len(first)), metadata(a))
        if isinstance(a, (tuple, list)):
            return (type(a), tuple(leaf(x) for x in a))
        if isinstance(a, dict):
            return (type(a), tuple((k, leaf(x)) for k, x in a.items()))
        return (type(a), a)

    key = (node.target, leaf(node.args), leaf(node.kwargs), metadata(node), tuple(len(a.users) > 1 for a in ins))
    try:
        hash(key)
    except TypeError:
        return node
    return key


def propagate(gm: fx.GraphModule, mesh: MeshSpec, input_layouts: Mapping[str, Layout] | None = None,
              strict: bool = False, cost_model: CostModel | None = None,
              pinned: frozenset[str] = frozenset(),
              output_layouts: Sequence[Layout | None] | None = None,
              fallbacks: dict[str, str] | None = None, memo: Decisions | None = None,
              foreseen: Mapping[fx.Node, Iterable[Layout]] | None = None) -> fx.GraphModule:
    """Annotate ``gm`` in place: ``meta["layout"]`` on tensor nodes, ``meta["arg_layouts"]`` on users.

    ``input_layouts`` maps placeholder names to layouts; other placeholders are replicated.
    Moving a ``pinned`` placeholder costs ``PIN_PENALTY`` times its price (see refine.py).
    ``output_layouts`` requires layouts of the outputs (None: the cheapest DTensor-expressible
    one), as a joint graph requires each gradient in its parameter's layout. Ops replicated for
    want of a strategy are recorded in ``fallbacks`` (op -> input layouts), for one warning each.
    ``memo`` carries decisions from one propagation of ``gm`` to the next (refinement: see ``Decisions``).
    ``foreseen``: redistributions taken as asked for from the start (value -> layouts: what the consumers
    of an earlier plan asked for, refine.py), so that an op before the consumer asking for one may read
    it for free, also through relabellings of it; its decisions share ``memo`` with the others' (where it
    reads more of the requests than they do, its keys say so: ``_Requested.key``).
    """
    input_layouts = dict(input_layouts or {})
    requested = _Requested(Rebuilds(cost_model), foreseen)
    wanted = wanted_at_output(gm, output_layouts or ())
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            val = value(node)
            if isinstance(val, torch.Tensor):
                layout = input_layouts.get(node.name) or Layout.replicated(mesh, val.shape)
                if tuple(layout.shape) != tuple(val.shape):
                    raise LayoutError(f"input {node.name} has shape {list(val.shape)} but its layout {layout} is for "
                                      f"shape {list(layout.shape)}")
                node.meta[LAYOUT] = layout
        elif node.op == "get_attr":
            val = value(node)
            if isinstance(val, torch.Tensor):
                node.meta[LAYOUT] = Layout.replicated(mesh, val.shape)
        elif node.op == "call_function":
            ins = memo.inputs(node) if memo is not None else tensor_inputs(node)
            _propagate_call(node, ins, mesh, strict, cost_model, requested, pinned, fallbacks, memo,
                            wanted.get(node, ()))
            requested.add(ins, required_layouts(node) or ())
        elif node.op == "output":
            outs = [a for a in torch.utils._pytree.tree_leaves(node.args) if isinstance(a, fx.Node) and LAYOUT in a.meta]
            wanted = list(output_layouts or ()) + [None] * len(outs)
            node.meta[ARG_LAYOUTS] = tuple(
                want if want is not None else dtensor_expressible(a.meta[LAYOUT], dtype_of(a), cost_model)
                for a, want in zip(outs, wanted))
    return gm


def wanted_at_output(gm: fx.GraphModule, output_layouts: Sequence[Layout | None]) -> dict[fx.Node, tuple[Layout, ...]]:
    """The layouts the program's output requires of the values it returns (a joint graph's gradients:
    their parameters' layouts), so the op making one may make it in that layout directly; so too the value a
    returned one is a dtype cast of, or summed from (a mixed-precision gradient summed in bf16, then cast to its
    fp32 parameter's dtype: the reduce_scatter into the shard is made before the cast)."""
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    returned = [a for a in torch.utils._pytree.tree_leaves(out.args)
                if isinstance(a, fx.Node) and isinstance(value(a), torch.Tensor)]
    wanted: dict[fx.Node, tuple[Layout, ...]] = {}
    for a, want in zip(returned, output_layouts):
        while want is not None and tuple(want.shape) == tuple(value(a).shape) and want not in wanted.get(a, ()):
            wanted[a] = wanted.get(a, ()) + (want,)
            cast = a.target is SUMMED or (a.target is torch.ops.aten._to_copy.default and set(a.kwargs) <= {"dtype"})
            if not (cast and len(a.users) == 1 and isinstance(a.args[0], fx.Node)
                    and isinstance(value(a.args[0]), torch.Tensor)):
                break
            a = a.args[0]
    return wanted


def dtensor_expressible(layout: Layout, dtype: torch.dtype = torch.float32,
                        cost_model: CostModel | None = None) -> Layout:
    """``layout`` itself if DTensor can express it, else the DTensor placements cheapest to reach.

    Candidates are every placement tuple (Replicate or Shard(d) per mesh axis; whole-axis
    partials kept); ties go to the one with the smaller local block.
    """
    if dtensor_spec_of(layout) is not None:  # placements, with a shard order where DTensor needs one
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
        key = (cost, numeric_size(target.max_local_shape()))
        if best is None or key < best[0]:
            best = (key, target)
    return best[1] if best is not None else Layout.replicated(mesh, layout.shape)


def _propagate_call(node: fx.Node, ins: list[fx.Node], mesh: MeshSpec, strict: bool, cost_model: CostModel | None,
                    requested: _Requested, pinned: frozenset[str], fallbacks: dict[str, str] | None,
                    memo: Decisions | None, wanted: tuple[Layout, ...] = ()) -> None:
    in_layouts = [a.meta[LAYOUT] for a in ins]
    val = value(node)
    if node.target is operator.getitem:
        src = node.args[0].meta.get(LAYOUT)
        if isinstance(src, tuple):
            node.meta[LAYOUT] = src[node.args[1]]
        return
    if not isinstance(val, (torch.Tensor, tuple, list)):
        return  # symbolic sizes and other non-tensor values carry no layout
    offered = reduce_shared(ins, in_layouts) if Pin.REDUCE_SHARED in pinned else in_layouts
    if offered is not in_layouts and offered == in_layouts:
        offered = in_layouts  # no shared Partial input: the pin offers nothing else here
    key = (memo.key(node, ins, in_layouts, offered, requested, pinned), wanted) if memo is not None else None
    if key is not None and key in memo.made:
        set_strategy(node, *memo.made[key])
        return
    entry = lookup(node, has_tensor_inputs=bool(ins))
    if entry is not None and entry.kind is not None:
        moves_pinned = memo.pinned if memo is not None else is_pinned  # the memo reads each node's pin once

        def unpinned_cost(i: int, dst: Layout) -> float:
            if in_layouts[i] == dst or requested.has(ins[i], dst):
                return 0.0
            return requested.rebuilds.serving_cost(ins[i], dst)

        def move_cost(i: int, dst: Layout) -> float:
            price = unpinned_cost(i, dst)
            return price * PIN_PENALTY if price and moves_pinned(ins[i], pinned) else price

        if key is not None:
            decision = memo.with_fewer_pins(key, entry.kind, lambda i, dst: unpinned_cost(i, dst) == 0.0)
            if decision is not None:
                set_strategy(node, *decision)
                memo.made[key] = decision
                return
        ctx = Context(mesh, in_layouts, offered, move_cost,
                      lambda src, dst: redistribute_cost(src, dst, dtype_of(node), cost_model),
                      [requested.of(a) for a in ins], wanted)
        decision = entry.kind(node, ctx)
        if decision is not None:
            set_strategy(node, *decision)
            if key is not None:
                memo.made[key] = decision
            return
    _fallback(node, in_layouts, mesh, strict, fallbacks)


def reduce_shared(ins: Sequence[fx.Node], layouts: Sequence[Layout]) -> list[Layout]:
    """The layouts a consumer may take its inputs in under ``Pin.REDUCE_SHARED``: a Partial value with
    several consumers is offered reduced only, so all of them share one reduction of it (kept
    Partial, each consumer's views of it would be reduced separately)."""
    return [l.with_partial(()) if l.partial and len(a.users) > 1 else l for a, l in zip(ins, layouts)]


def _fallback(node: fx.Node, in_layouts: Sequence[Layout], mesh: MeshSpec, strict: bool,
              fallbacks: dict[str, str] | None) -> None:
    required = tuple(Layout.replicated(mesh, l.shape) for l in in_layouts)
    val = value(node)
    if isinstance(val, torch.Tensor):
        out: Any = Layout.replicated(mesh, val.shape)
    else:
        out = tuple(Layout.replicated(mesh, v.shape) if isinstance(v, torch.Tensor) else None for v in val)
    name = str(node.target)
    seen = ", ".join(str(l) for l in in_layouts) or "no tensor inputs"
    if fallbacks is not None:  # replicated already or not: without a rule it would replicate whatever it gets
        fallbacks.setdefault(name, seen)
    if tuple(in_layouts) == required:  # replicated already: nothing moves, so strict has nothing to refuse
        set_strategy(node, required, out)
        return
    if strict:
        raise UnsupportedOpError(
            f"fxshard has no sharding rule for {name} (input layouts: {seen}). Add an entry for it to the op registry "
            "(fxshard.registry.OPS; docs/design.md says how), or pin a layout next to it with "
            "fxshard.constrain(x, placements) (x.redistribute for DTensors), or run without strict=True to "
            "replicate its inputs.")
    set_strategy(node, required, out)
