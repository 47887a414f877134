"""Choosing placements: the layouts of a program's parameters and arguments that make its step cheapest
within a memory budget per rank (``fxshard.auto_placements`` is the door: ``backend/auto_placements.py``).

The unknowns are *roles*, not tensors: a model's repeated layers hold the same parameter in every layer
(``layers.*.attention.wq.weight``), and a role is decided once for all of them, so the search costs the same
at 8 layers as at 32 (the door plans a folded program of four layers: ``backend/programs/fold.py``). A
candidate assignment is priced by planning the whole program with it (``plan``: stages 2-3, the planner's
own redistributions, refinement included), so the price is the one ``explain`` would show: the
cost model's time for every collective and local copy (``fxshard/costs.py``), plus the compute the busiest
rank does (each matmul's FLOPs times the ranks that repeat it, at ``CostModel.compute_rate``), with each of
the four planned layers' share weighted by the layers it stands for. Memory per rank is the parameters'
blocks (times gradients and optimizer state when training) plus the planned program's peak activations
(``fxshard/memory.py``).

The search is coordinate descent over roles, largest first: from every role replicated, each role in turn tries
every placement that differs from its own on one mesh axis, and its own with two axes' placements exchanged (a
tp-column FSDP layout to a tp-row one), and keeps the best; it ends when every role has been tried against the
final assignment without a change. Tied roles (a routed op's expert stacks) also try each move together. Where
either of two plans is over the budget, each is priced at its step plus a price on its memory over the limit
(``OVERFLOW_PRICE``: a move that takes a little memory off at a great cost loses to one that takes less off
cheaply); a descent that ends over the budget by more than a sliver (``MEMORY_SLIVER``) goes on with memory
first (a plan within the budget beats any over it; of two over it, the one with more than a sliver less memory).
The answer is planned whole; the cheapest tries the quick memory put a little over the limit are planned whole
too, and one that fits and costs less is descended from (``NEAR``: the quick memory errs by a few percent, and
near the budget that decides). The search runs again from every large tensor sharded along its first divisible
dim on each axis, and keeps the better answer: single moves cannot leave some local minima that one start or the
other falls into. The candidates are ``Replicate`` and ``Shard`` on each axis (uneven, in ``torch.chunk``'s
blocks, where one axis alone cuts a dim), and ``_StridedShard(d, k)`` for a weight whose matmul's output is
split into ``k`` equal parts (a fused q/k/v or gate/up projection: ``fused_projections.py``). A routed-experts
op's all_to_alls are priced at a uniform routing (``routing.uniform_dispatches``). Each role's last tries are
its explanation: which alternative cost more, or would not fit (``Decision.reason``).
"""
from __future__ import annotations

import itertools
import math
import warnings
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import torch
import torch.fx as fx
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from .costs import CostModel, DEFAULT_COST_MODEL, dtype_size, numel, numeric
from .graph import LAYOUT, PLAN, outputs
from .layer_names import layer_index
from .layout import Layout
from .memory import memory_report, propagated_peak
from .mesh import MeshSpec
from .planner import plan_redistribute
from .plans import Plan as Plan_
from .refine import requested_moves
from .routing import ROUTED_OPS, uniform_dispatches
from .placements import layout_from_placements, placements_from_layout, placements_to_str

__all__ = ["Role", "Priced", "Decision", "SearchResult", "search_placements", "layer_weights", "candidates"]

# a role whose tensors hold less than this share of all the searched bytes starts replicated (its sharding
# saves little memory and adds a collective); the search tries it sharded last
SMALL_SHARE = 0.01


# over the budget, of two plans the one with less memory is better, unless they differ by less than this share of
# the budget: then the cheaper (a row split padded by uneven blocks should not outweigh the step it makes)
MEMORY_SLIVER = 0.01
# over the budget, a step's price on memory over the limit: this many steps per whole limit over it
OVERFLOW_PRICE = 10.0
# a try the quick memory puts over the limit by less than this share is planned whole (the cheapest
# ``NEAR_CHECKS`` of them per descent), where it is cheaper than the answer: the quick memory errs by a few percent
NEAR = 0.15
NEAR_CHECKS = 2
# the second start is given up where, after one sweep over the roles, its step is still this much dearer than
# the first start's answer (coordinate descent rarely gains that much after its first sweep)
BEHIND = 1.25


@dataclass(frozen=True)
class Role:
    """Tensors decided together: one parameter in every repeated layer, or one tensor of its own."""

    name: str  # as the user reads it: ``layers.*.attention.wq.weight``, ``tok_embeddings.weight``, ``argument 0``
    inputs: tuple[str, ...]  # the planned program's placeholders it decides
    shape: tuple[int, ...]
    dtype: torch.dtype
    count: int  # the model's tensors it stands for (every layer's, where the program planned is folded)
    trainable: bool = False  # gradients and optimizer state are kept for it (training)
    pinned: Layout | None = None  # decided by the user (``placements=``, a DTensor): not searched
    fused: tuple[int, ...] = ()  # its matmul's output is split into this many equal parts (fused_projections.py)

    @property
    def nbytes(self) -> int:
        return int(numel(self.shape)) * dtype_size(self.dtype) * self.count


@dataclass(frozen=True)
class Priced:
    """One assignment's plan, priced."""

    cost: float  # modeled seconds per step: communication (collectives and copies) plus compute
    communication: float  # of which the collectives and local copies
    compute: float  # of which the busiest rank's matmuls
    bytes_per_rank: int  # received per rank per step (the folded layers weighted as the layers they stand for)
    collectives: int
    memory: int  # per rank: parameters (gradients, optimizer state) and peak activations
    parameter_memory: int
    activation_memory: int
    error: str | None = None  # the plan failed, or was not made (this assignment is never chosen)
    planned: bool = True  # False: its parameters alone are over the budget, so it was not planned

    def fits(self, budget: float) -> bool:
        return self.error is None and self.memory <= budget


@dataclass
class Decision:
    """What decided one role: its layout, and the alternatives tried against the final assignment."""

    role: Role
    layout: Layout
    why: str  # "pinned" or "searched"
    tried: dict[Layout, Priced] = field(default_factory=dict)

    def reason(self, chosen: Priced, budget: float) -> str:
        if self.why == "pinned":
            return "pinned (placements= or a DTensor)"
        cheaper = [(lay, p) for lay, p in self.tried.items() if p.error is None and p.cost < chosen.cost]
        over = [(lay, p) for lay, p in cheaper if not p.fits(budget)]
        parts = []
        if over:
            lay, p = min(over, key=lambda lp: lp[1].cost)
            parts.append(f"memory: {_text(lay)} would be {_percent(p.cost, chosen.cost)} cheaper but needs "
                         f"{p.memory} B/rank, over the budget of {int(budget)}")
        rest = [(lay, p) for lay, p in self.tried.items() if (lay, p) not in over]
        for lay, p in sorted(rest, key=lambda lp: lp[1].cost):
            if not p.planned:
                parts.append(f"{_text(lay)}: {p.error}, over the budget")
            elif p.error is not None:
                parts.append(f"{_text(lay)} cannot be planned ({p.error})")
            elif not p.fits(budget):
                parts.append(f"{_text(lay)} needs {p.memory} B/rank, over the budget")
            else:
                parts.append(f"{_text(lay)} costs {_percent(p.cost, chosen.cost)} more "
                             f"({p.bytes_per_rank - chosen.bytes_per_rank:+d} B/rank communicated, "
                             f"{p.memory - chosen.memory:+d} B/rank memory)")
        return "; ".join(parts) if parts else "the only placement"


@dataclass
class SearchResult:
    layouts: dict[str, Layout]  # role name -> layout
    decisions: dict[str, Decision]
    priced: Priced  # the answer's plan, refined as every door plans it
    quick: Priced  # the answer priced as the search priced every candidate (what the decisions' tries compare with)
    budget: float  # what the search held candidates to: the budget, less what quick pricing misses
    evaluations: int  # plans priced
    training: bool = False
    memory_budget: float = 0.0  # the budget asked for

    def reasons(self) -> dict[str, str]:
        return {name: d.reason(self.quick, self.budget) for name, d in self.decisions.items()}


def _text(layout: Layout) -> str:
    return placements_to_str(_placements(layout))


def _placements(layout: Layout) -> tuple[Placement, ...]:
    found = placements_from_layout(layout)
    assert found is not None, layout
    return found


def _percent(a: float, b: float) -> str:
    return f"{abs(a - b) / b:.1%}" if b > 0 else f"{abs(a - b):.3g} s"


def candidates(mesh: MeshSpec, shape: Sequence[int], fused: Sequence[int] = ()) -> list[tuple[Placement, ...]]:
    """Every placement of a tensor of ``shape``: on each axis Replicate or Shard(d), evenly divisible (several axes
    on one dim: by their product), or unevenly where one axis alone cuts the dim; with ``fused`` factors
    ``k``, also ``_StridedShard(d, k)`` (each of ``k`` equal parts of dim ``d`` split over the axis: a fused
    q/k/v or gate/up weight, each rank holding its share of every part), on one axis of a dim, each part
    divisible."""
    out: list[tuple[Placement, ...]] = [()]
    kinds: list[Placement] = [Replicate()] + [Shard(d) for d in range(len(shape))]
    kinds += [_StridedShard(d, split_factor=k) for k in fused for d in range(len(shape))]
    for axis in mesh.axes():
        out = [p + (q,) for p in out for q in kinds]
    return [p for p in out if _divides(mesh, shape, p)]


def _divides(mesh: MeshSpec, shape: Sequence[int], placements: Sequence[Placement]) -> bool:
    ways = [1] * len(shape)
    strided: dict[int, int] = {}
    for axis, p in zip(mesh.axes(), placements):
        if isinstance(p, (Shard, _StridedShard)):
            ways[p.dim] *= int(axis.size)
        if isinstance(p, _StridedShard):
            strided[p.dim] = int(p.split_factor)
    cuts = [sum(1 for q in placements if isinstance(q, (Shard, _StridedShard)) and q.dim == d)
            for d in range(len(shape))]
    # uneven (``torch.chunk``'s blocks, as DTensor cuts them) where one axis alone cuts a plain dim
    return all(s % (w * strided.get(d, 1)) == 0 or (cuts[d] == 1 and d not in strided and s >= w)
               for d, (s, w) in enumerate(zip(shape, ways))) and all(cuts[d] == 1 for d in strided)


def _neighbours(current: tuple[Placement, ...], options: Sequence[tuple[Placement, ...]]) -> list[tuple[Placement, ...]]:
    """The placements that differ from ``current`` on exactly one mesh axis, and ``current`` with its axes'
    placements exchanged (``S(1),S(0)`` -> ``S(0),S(1)``: from a tp-column FSDP layout to a tp-row one, which
    no single-axis step reaches without passing a worse layout)."""
    swapped = set(itertools.permutations(current)) - {current}
    return [p for p in options if sum(a != b for a, b in zip(p, current)) == 1 or p in swapped]


def _seed(mesh: MeshSpec, shape: Sequence[int], options: Sequence[tuple[Placement, ...]]) -> tuple[Placement, ...]:
    """Sharded as far as it goes: the innermost axis on the first divisible dim, each outer one on the next."""
    placements: list[Placement] = [Replicate()] * mesh.ndim
    taken: set[int] = set()
    for k in reversed(range(mesh.ndim)):
        for d in range(len(shape)):
            trial = list(placements)
            trial[k] = Shard(d)
            if d not in taken and tuple(trial) in options:
                placements, taken = trial, taken | {d}
                break
    return tuple(placements)


def layer_weights(gm: fx.GraphModule, layers: int, backward_roots: Sequence[str] = (),
                  output_names: Sequence[str | None] = ()) -> dict[fx.Node, float]:
    """How many of the model's layers each node of a folded program stands for (``layers``: the model's).

    A forward node is of the latest layer among the parameters it depends on; a node that depends on a
    ``backward_roots`` placeholder (a tangent) is of the latest layer among the gradients it flows into
    (``output_names``: per output, the input it is the gradient of), the layer whose backward it is. The
    first and last layers planned stand for themselves, the middle ones (the template and its successor) for
    all the layers between, in equal shares."""
    nodes = list(gm.graph.nodes)
    roots = set(backward_roots)
    layer_of: dict[fx.Node, int | None] = {}
    backward: set[fx.Node] = set()
    for node in nodes:
        if node.op == "placeholder":
            layer_of[node] = layer_index(node.name)
            if node.name in roots:
                backward.add(node)
            continue
        args = node.all_input_nodes
        if any(a in backward for a in args):
            backward.add(node)
            continue
        found = [k for a in args if (k := layer_of.get(a)) is not None]
        layer_of[node] = max(found) if found else None
    reach: dict[fx.Node, int] = {}
    for value, name in zip(outputs(gm), output_names):
        k = layer_index(name) if name is not None else None
        if isinstance(value, fx.Node) and k is not None:
            reach[value] = max(reach.get(value, k), k)
    for node in reversed(nodes):
        if node in reach:
            for a in node.all_input_nodes:
                if a in backward:
                    reach[a] = max(reach.get(a, reach[node]), reach[node])
    for node in backward:
        layer_of[node] = reach.get(node)
    # the layers planned: those of nodes computed from computed values (a dropped layer's parameters are
    # still inputs, and the joint program's zero gradients for them read nothing else)
    used = sorted({k for n, k in layer_of.items() if k is not None and n.op != "placeholder"
                   and any(a.op != "placeholder" for a in n.all_input_nodes)})
    if len(used) <= 2 or len(used) >= layers:
        return {}
    middle = (layers - 2) / (len(used) - 2)
    weight = {k: (1.0 if k in (used[0], used[-1]) else middle) for k in used}
    return {n: weight[k] for n, k in layer_of.items() if k in weight and weight[k] != 1.0}


# plans the program with these layouts of its placeholders; ``quick``: as the search prices candidates
# (``policies.QUICK_REFINEMENT``), else as the doors plan
Plan = Callable[[Mapping[str, Layout], bool], fx.GraphModule]


def search_placements(roles: Sequence[Role], mesh: MeshSpec, plan: Plan, budget: float, *,
                      flops: Mapping[str, int] | None = None, layers: int = 0, backward_roots: Sequence[str] = (),
                      output_names: Sequence[str | None] = (),
                      training: bool = False, optimizer_states: int = 2, activation_scale: float = 1.0,
                      cost_model: CostModel | None = None, tied: Sequence[Sequence[str]] = (),
                      max_evaluations: int = 400) -> SearchResult:
    """The layouts of ``roles`` that minimize the modeled step cost within ``budget`` bytes per rank.

    ``plan(layouts, quick)`` plans the program with these layouts of its placeholders (stages 2-3, a fresh
    copy) and returns the planned graph; ``flops``: each traced node's FLOPs on one device (by node name); ``layers``:
    the model's layers where the program planned is folded to four of them (0: not folded); ``activation_scale``:
    what the planned program's peak activations are multiplied by to stand for the model's (a folded training
    step keeps every layer's saved values). ``optimizer_states``: tensors the optimizer keeps per trainable
    parameter (Adam: two). ``tied``: groups of role names that also move together (a routed op's expert
    stacks: one sharded by expert alone asks the others for the same, a worse step than all of them at once)."""
    cost_model = cost_model or DEFAULT_COST_MODEL
    flops = flops or {}
    options = {r.name: candidates(mesh, r.shape, r.fused) for r in roles if r.pinned is None}
    cache: dict[tuple, Priced] = {}

    def layouts_of(assignment: Mapping[str, tuple[Placement, ...]]) -> dict[str, Layout]:
        out: dict[str, Layout] = {}
        for r in roles:
            layout = r.pinned if r.pinned is not None else layout_from_placements(mesh, r.shape, assignment[r.name])
            out.update({name: layout for name in r.inputs})
        return out

    def parameter_bytes(assignment: Mapping[str, tuple[Placement, ...]]) -> int:
        total = 0
        for r in roles:
            layout = r.pinned if r.pinned is not None else layout_from_placements(mesh, r.shape, assignment[r.name])
            local = int(numeric(numel(layout.max_local_shape()))) * dtype_size(r.dtype) * r.count
            total += local * ((2 + optimizer_states) if training and r.trainable else 1)
        return total

    planned_count = 0
    # the budget candidates are held to: the quick pricing misses the buffers stage 3's moves add, so where
    # the answer's plan is over the budget the search runs again within it less that gap
    limit = float(budget)

    def price(assignment: Mapping[str, tuple[Placement, ...]], quick: bool = True) -> Priced:
        nonlocal planned_count
        key = tuple(assignment[r.name] for r in roles if r.pinned is None)
        if quick and key in cache:
            return cache[key]
        params = parameter_bytes(assignment)
        if quick and params > limit:  # over the budget whatever its activations: not planned
            priced = Priced(math.inf, math.inf, math.inf, 0, 0, params, params, 0,
                            error=f"its parameters alone need {params} B/rank", planned=False)
        else:
            planned_count += 1
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    planned = plan(layouts_of(assignment), quick)
            except Exception as error:  # noqa: BLE001 (an assignment the planner refuses is never chosen)
                first = str(error).splitlines()[0][:200] if str(error) else ""
                priced = Priced(math.inf, math.inf, math.inf, 0, 0, params, params, 0,
                                error=f"{type(error).__name__}: {first}")
            else:
                priced = _priced(planned, params, flops, cost_model, layers, backward_roots, output_names,
                                 activation_scale, quick)
        if quick:
            cache[key] = priced
        return priced

    strict = False  # over the budget: less memory wins outright (else: the step plus a price on the overflow)

    def better(a: Priced, b: Priced) -> bool:
        if not strict and not (a.fits(limit) and b.fits(limit)) and a.error is None and b.error is None \
                and math.isfinite(a.cost) and math.isfinite(b.cost):
            return _overflowed(a, b.cost, limit) < _overflowed(b, b.cost, limit) * (1 - 1e-9)
        if a.fits(limit) != b.fits(limit):
            return a.fits(limit)
        if not a.fits(limit):
            if (a.error is None) != (b.error is None):
                return a.error is None
            if abs(a.memory - b.memory) > MEMORY_SLIVER * limit:  # more than a sliver (uneven blocks' padding)
                return a.memory < b.memory
        return a.cost < b.cost * (1 - 1e-9)

    total = sum(r.nbytes for r in roles if r.pinned is None) or 1
    searched = sorted((r for r in roles if r.pinned is None), key=lambda r: -r.nbytes)
    small = {r.name for r in searched if r.nbytes < SMALL_SHARE * total}
    replicated = {r.name: (Replicate(),) * mesh.ndim for r in searched}
    seeded = {r.name: (_seed(mesh, r.shape, options[r.name]) if r.name not in small else replicated[r.name])
              for r in searched}
    state, best = replicated, price(replicated)
    partners = {name: [m for m in group if m != name and m in options] for group in tied for name in group
                if name in options}
    decisions = {r.name: Decision(r, r.pinned, "pinned") for r in roles if r.pinned is not None}

    def descend(order: Sequence[Role], behind: Priced | None = None) -> bool:
        """Coordinate descent from ``state``; False where, after a sweep over every role, it is still more than
        ``BEHIND`` dearer than ``behind`` (another start's answer: this one is given up)."""
        nonlocal state, best
        unchanged = 0
        k = 0
        while unchanged < len(order) and planned_count < max_evaluations:
            if behind is not None and k == len(order) and best.fits(limit) and behind.fits(limit) \
                    and best.cost > BEHIND * behind.cost:
                return False
            role = order[k % len(order)]
            k += 1
            tried: dict[tuple[Placement, ...], Priced] = {}
            together: dict[tuple[Placement, ...], dict[str, tuple[Placement, ...]]] = {}
            for alternative in _neighbours(state[role.name], options[role.name]):
                tried[alternative] = price({**state, role.name: alternative})
                moved = {m: alternative for m in partners.get(role.name, ()) if alternative in options[m]}
                if moved and any(state[m] != alternative for m in moved):
                    together[alternative] = {**state, **moved, role.name: alternative}
            winner, step = None, None
            for alternative, p in tried.items():
                if better(p, best if winner is None else tried[winner]):
                    winner, step = alternative, {**state, role.name: alternative}
            for alternative, assignment in together.items():  # with its tied roles
                p = price(assignment)
                if better(p, best if step is None else price(step)):
                    winner, step = alternative, assignment
                    tried[alternative] = p
            if winner is not None:
                state = step
                best = price(state)
                unchanged = 0
            else:
                unchanged += 1
            decisions[role.name] = Decision(role, layout_from_placements(mesh, role.shape, state[role.name]),
                                            "searched",
                                            {layout_from_placements(mesh, role.shape, a): p for a, p in tried.items()
                                             if a != state[role.name]})
        if unchanged < len(order):  # the budget of plans ran out: the last tries may be against another state
            for role in order:
                decisions[role.name].layout = layout_from_placements(mesh, role.shape, state[role.name])
        return True

    def forget_unplanned() -> None:  # their parameters were over the old limit, maybe not over the new
        for key in [k for k, p in cache.items() if not p.planned]:
            del cache[key]

    def nearby(final: Priced) -> tuple[dict[str, tuple[Placement, ...]], float] | None:
        """The cheapest of the last tries that cost less than ``state`` but that the quick memory put over the
        limit by less than ``NEAR``, where its full plan fits the budget and costs less than ``final``: (its
        assignment, its full plan's memory less its quick one). The quick memory errs by a few percent; near
        the budget that decides."""
        tries = sorted(((p.cost, name, lay) for name, d in decisions.items() if d.why == "searched"
                        for lay, p in d.tried.items()
                        if p.error is None and p.cost < best.cost and limit < p.memory <= limit * (1 + NEAR)),
                       key=lambda t: t[0])
        for _, name, lay in tries[:NEAR_CHECKS]:
            trial = {**state, name: _placements(lay)}
            full = price(trial, quick=False)
            if full.fits(budget) and full.cost < final.cost:
                return trial, full.memory - price(trial).memory
        return None

    def calibrated(start: dict[str, tuple[Placement, ...]], behind: Priced | None = None) -> tuple | None:
        """Descent from ``start``, then the answer planned whole. The quick memory differs from the full plan's by
        the buffers stage 3's moves add or save: where the answer's plan is over the budget, search again within
        the budget less that gap; where it is under the budget and the quick price said more, search again with
        that room (the cheaper answer whose plan fits wins). None: given up behind ``behind``."""
        nonlocal state, best, limit, strict
        if limit != budget:
            limit = float(budget)
            forget_unplanned()
        state, best = start, price(start)
        answer = None
        for _ in range(4):
            if searched and not descend(searched, behind if answer is None else None):
                return None
            if searched and not best.fits(limit * (1 + MEMORY_SLIVER)):  # left over by the price: memory first
                strict = True
                descend(searched)
                strict = False
            final = price(state, quick=False)
            if answer is None or (final.fits(budget) and (not answer[1].fits(budget) or final.cost < answer[1].cost)):
                answer = (dict(decisions), final, best, limit)
            near = nearby(final)
            if near is not None:  # a cheaper neighbour the quick memory put over, within the budget planned whole
                state, gap = near
                best = price(state)
                if budget - gap > limit:
                    limit = budget - gap
                    forget_unplanned()
                continue
            gap = final.memory - best.memory
            if final.error is not None or gap == 0:
                break
            if not final.fits(budget) and best.fits(limit) and gap > 0 and limit - gap > 0:
                limit -= gap
            elif final.fits(budget) and gap < 0 and budget - gap > limit:
                limit = budget - gap
                forget_unplanned()
            else:
                break
            best = price(state)
        return answer

    # two starts, the better answer kept: single moves cannot leave some local minima (the residual stream
    # sharded on its hidden dim, which one start or the other can fall into)
    answer = calibrated(replicated)
    if seeded != replicated:
        other = calibrated(seeded, behind=answer[2])
        if other is not None and _preferred(other[1], answer[1], budget):
            answer = other
    decided, final, best, limit = answer
    layouts = {r.name: decided[r.name].layout for r in roles}
    return SearchResult(layouts, {r.name: decided[r.name] for r in roles}, final, best, limit, planned_count,
                        training, float(budget))


def _overflowed(p: Priced, scale: float, limit: float) -> float:
    """``p``'s step plus a price on its memory over ``limit``: ``OVERFLOW_PRICE`` times ``scale`` (a step) per
    share of the limit it is over by. Over the budget, a move that takes a little memory off at a great cost
    then loses to one that takes less off cheaply, and a plan the quick memory puts a sliver over is not left
    for one the step pays for."""
    return p.cost + OVERFLOW_PRICE * scale * max(0.0, p.memory - limit) / limit


def _preferred(a: Priced, b: Priced, budget: float) -> bool:
    """Whether answer ``a`` beats ``b``: within the budget first, then the cheaper step, then less memory."""
    if a.fits(budget) != b.fits(budget):
        return a.fits(budget)
    if a.fits(budget):
        return a.cost < b.cost * (1 - 1e-9) or (a.cost <= b.cost and a.memory < b.memory)
    return (a.error is None, -a.memory) > (b.error is None, -b.memory)


def _priced(planned: fx.GraphModule, parameters: int, flops: Mapping[str, int], cost_model: CostModel,
            layers: int, backward_roots: Sequence[str], output_names: Sequence[str | None], activation_scale: float,
            quick: bool) -> Priced:
    """A plan's price. ``quick``: ``planned`` is propagated only (stage 2: ``pipeline.propagate_graph``), each
    move its consumers ask for priced as the planner plans it; else planned (stage 3's PLAN on every move)."""
    weights = layer_weights(planned, layers, backward_roots, output_names) if layers else {}
    communication = compute = received = collectives = 0.0
    moves: list[tuple[fx.Node, Plan_]] = []
    if quick:
        for a, want in requested_moves(planned):
            moves.append((a, plan_redistribute(a.meta[LAYOUT], want, dtype=a.meta["val"].dtype,
                                               cost_model=cost_model)))
    for node in planned.graph.nodes:
        plan = node.meta.get(PLAN)
        if plan is not None and not quick:
            moves.append((node.args[0] if node.args and isinstance(node.args[0], fx.Node) else node, plan))
        count = flops.get(node.name)
        layout = node.meta.get(LAYOUT)
        if count and isinstance(layout, Layout):
            compute += weights.get(node, 1.0) * count * _share(layout) / cost_model.compute_rate
    for source, plan in moves:
        w = weights.get(source, 1.0)
        communication += w * plan.cost
        received += w * sum(numeric(s.bytes_per_rank) for s in plan.collectives)
        collectives += w * len(plan.collectives)
    for node in planned.graph.nodes:  # routed experts' all_to_alls, at a uniform routing
        if node.target in ROUTED_OPS:
            w = weights.get(node, 1.0)
            for dispatch, nbytes in uniform_dispatches(node):
                communication += w * cost_model.collective_cost(dispatch.axes, nbytes)
                received += w * nbytes
                collectives += w
    peak = propagated_peak(planned) if quick else memory_report(planned).peak_activations
    activations = int(numeric(peak) * activation_scale)
    return Priced(communication + compute, communication, compute, int(received), round(collectives),
                  parameters + activations, parameters, activations)


def _share(layout: Layout) -> float:
    """The share of an op's work one rank does, from its output's ``layout``: one over the sizes of the mesh
    axes (and sub-axes) it is sharded or a partial sum over; the other axes' ranks repeat the same work."""
    used = set(layout.sharded_axes()) | {axis for axis, _ in layout.partial}
    n = 1.0
    for axis in used:
        n *= numeric(axis.size)
    return 1.0 / n


def with_placements(result: SearchResult) -> dict[str, tuple[Placement, ...]]:
    """Each role's layout as DTensor placements."""
    return {name: _placements(layout) for name, layout in result.layouts.items()}

