"""Dropless expert parallelism: a mixture-of-experts layer's routed rows as one op, dispatched by all-to-all.

A dropless MoE sorts its (token, choice) pairs by expert, runs each expert's rows through a grouped
matmul whose offsets come from the per-expert counts, and adds the results back into their tokens
(torchtitan's token reorderer, transformers' grouped_mm experts). Read globally, the sort is over
every rank's pairs; but the layer's result does not depend on the order of the rows between the sort
and the combine, only on which expert each row meets. So stage 1 (``backend/capture/routed_experts.py``)
replaces that region by ``fxshard::routed_experts(body, rows, keys, extras)``: the rows in pair order
(each pair's token row), the pairs' expert ids, and what the region reads besides (the expert weight
stacks first); its result is the region's outputs in pair order, so it is a row-wise op over the pairs.

Its sharding (``Routed``): with the expert stacks ``Shard(0)`` on an axis, the pairs are sharded on
that axis too, the stacks stay where they are, the outputs are sharded like the pairs. Each rank
then runs ``run_routed``: its own pairs sorted by expert, the counts exchanged (one all_to_all of
``experts`` integers), the rows sent to the ranks that own their experts (``all_to_all_single`` with
split sizes from the counts: data-dependent), regrouped by expert, the body run on the rank's experts,
and the results sent back the same way. The backward op recomputes the dispatch and runs the body's
vjp there, so the weights' gradients stay with their experts. Without sharded stacks the op is the
region as written, on each rank's own pairs (or replicated). Under fxshard's backend the ops' CPU and
CUDA kernels run ``run_routed`` and its backward compiled whole by Inductor
(``backend/capture/routed_kernels.py``): the split sizes are unbacked sizes there, so one program serves
every routing.

The body is an FX graph (Dynamo's ops), named in the op's arguments by a digest of its code
(``register_body``); the explicit cache of bodies is this module's ``_BODIES``.
"""
from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from .layout import Layout, Piece
from .localization import RoutedGroup
from .mesh import MeshAxis, is_static
from .op_kinds import Context, Decision, Kind

_BODIES: dict[str, fx.GraphModule] = {}  # explicit cache: a body's digest -> its graph (``register_body``)


class RoutingError(RuntimeError):
    """A routed-experts op that cannot run as asked (a body not registered in this process)."""


def register_body(gm: fx.GraphModule) -> str:
    """The name of ``gm`` (its code's digest) for ``routed_experts``' ``body`` argument."""
    key = "body_" + hashlib.sha256(gm.code.encode()).hexdigest()[:16]
    _BODIES.setdefault(key, gm)
    return key


def body_of(key: str) -> fx.GraphModule:
    if key not in _BODIES:
        raise RoutingError(f"routed experts: body {key} is not registered in this process; it is registered when "
                           "fxshard traces the program (backend/capture/routed_experts.py)")
    return _BODIES[key]


# ---- the local algorithm: dispatch, run the body, combine ----------------------------------------------
_c10d = torch.ops._c10d_functional


def _all_to_all(x: torch.Tensor, output_splits: list, input_splits: list, group: str) -> torch.Tensor:
    return _c10d.wait_tensor(_c10d.all_to_all_single(x.contiguous(), output_splits, input_splits, group))


@dataclass
class Routing:
    """How one rank's pairs travel: sorted by expert (``order``), sent to their experts' ranks (``send`` rows
    to each, ``recv`` from each, over ``group``) and regrouped there by expert (``perm``)."""

    order: torch.Tensor
    group: str | None = None
    send: list | None = None
    recv: list | None = None
    perm: torch.Tensor | None = None

    def dispatch(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Pair-space tensors of this rank -> the rows of the rank's experts, grouped by expert: one all_to_all
        carrying them all (``_packed``)."""
        tensors = [t[self.order] for t in tensors]
        if self.group is None or not tensors:
            return tensors
        moved = _all_to_all(_packed(tensors), self.recv, self.send, self.group)[self.perm]
        return _unpacked(moved, tensors)

    def combine(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The inverse of ``dispatch``: rows grouped by expert -> this rank's pairs in pair order."""
        tensors = list(tensors)
        if self.group is not None and tensors:
            packed = _packed(tensors)
            back = _all_to_all(packed.new_empty(packed.shape).index_copy(0, self.perm, packed), self.send, self.recv,
                               self.group)
            tensors = _unpacked(back, tensors)
        return [t.new_empty(t.shape).index_copy(0, self.order, t) for t in tensors]


def _packed(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Row tensors of one row count as one ``[rows, bytes]`` tensor (each row's bytes side by side, whatever
    their dtypes): one all_to_all moves them all, as many bytes as one each would, in one call."""
    if len(tensors) == 1:
        return tensors[0].contiguous()
    return torch.cat([t.contiguous().view(t.shape[0], torch.Size(t.shape[1:]).numel()).view(torch.uint8)
                      for t in tensors], dim=1)


def _unpacked(packed: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``_packed``'s inverse: ``packed``'s rows cut into tensors of ``like``'s dtypes and trailing shapes."""
    if len(like) == 1:
        return [packed]
    widths = [int(torch.Size(t.shape[1:]).numel()) * t.element_size() for t in like]
    parts = torch.split(packed, widths, dim=1)
    # a fresh row-major copy each (``contiguous`` keeps an empty part's strides: the grouped matmul refuses them)
    return [p.clone(memory_format=torch.contiguous_format).view(t.dtype).view(packed.shape[0], *t.shape[1:])
            for p, t in zip(parts, like)]


def route(keys: torch.Tensor, num_experts: int, group: str | None, group_size: int) -> tuple[Routing, torch.Tensor]:
    """(the routing of this rank's pairs, the counts of the rows its experts receive: ``[experts / group_size]``)."""
    order = torch.argsort(keys, stable=True)
    counts = torch.bincount(keys, minlength=num_experts)
    if group is None:
        return Routing(order), counts
    n, local = group_size, num_experts // group_size
    received = _all_to_all(counts, [local] * n, [local] * n, group)  # [n * local]: from each rank, per expert here
    send = counts.view(n, local).sum(1).tolist()
    recv = received.view(n, local).sum(1).tolist()
    segment = torch.repeat_interleave(torch.arange(n * local, device=keys.device), received)  # (source, expert)
    perm = torch.argsort((segment % local) * n + segment // local, stable=True)  # expert-major, sources in order
    return Routing(order, group, send, recv, perm), received.view(n, local).sum(0)


def _body_outputs(body: str, counts_dtype: torch.dtype, rows: Sequence[torch.Tensor], counts: torch.Tensor,
                  extras: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The body on the rows of a rank's experts (``counts`` rows each)."""
    out = body_of(body)(*rows, counts.to(counts_dtype), *extras)
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _body_gradients(body: str, counts_dtype: torch.dtype, rows: Sequence[torch.Tensor], counts: torch.Tensor,
                    extras: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The body's vjp: the gradients of its rows and extras (zeros for the integer ones).

    ``torch.func.vjp``, not ``torch.autograd.grad``: the op runs below autograd's dispatch key inside
    AOTAutograd's compiled backward, where ops record no graph even with grad mode on, so autograd.grad
    found nothing and every gradient came back zero (tests/test_e2e_gloo.py's update error caught it);
    functorch's transform records its own. torch.compile traces it too (``backend/capture/routed_kernels.py``)."""
    inputs = list(rows) + list(extras)
    floating = [k for k, t in enumerate(inputs) if t.is_floating_point()]

    def outputs(*differentiable: torch.Tensor) -> tuple:
        full = list(inputs)
        for k, t in zip(floating, differentiable):
            full[k] = t
        return tuple(_body_outputs(body, counts_dtype, full[:len(rows)], counts, full[len(rows):]))

    _, pull = torch.func.vjp(outputs, *(inputs[k] for k in floating))
    found = dict(zip(floating, pull(tuple(grads))))
    return [found[k] if k in found else torch.zeros_like(t) for k, t in enumerate(inputs)]


Each = Callable[..., list]  # each(fn, *args): fn(*args) on every rank's tensors (simulate: per rank)


def _directly(fn: Callable, *args: Any) -> list:
    return fn(*args)


def run_routed(body: str, rows: Sequence[torch.Tensor], keys: torch.Tensor, extras: Sequence[torch.Tensor],
               num_experts: int, num_stacks: int, counts_dtype: torch.dtype, group: str | None = None,
               group_size: int = 1, each: Each = _directly) -> list[torch.Tensor]:
    """``routed_experts`` on one rank's tensors; simulate runs it on LocalTensors, the body by ``each`` rank
    (sizes that differ per rank are the dispatch's, which LocalTensors carry; the body's Python indexing
    of them is not)."""
    routing, counts = route(keys, num_experts, group, group_size)
    outs = each(functools.partial(_body_outputs, body, counts_dtype), routing.dispatch(rows), counts, list(extras))
    return routing.combine(outs)


def run_routed_backward(body: str, rows: Sequence[torch.Tensor], keys: torch.Tensor, extras: Sequence[torch.Tensor],
                        grads: Sequence[torch.Tensor], num_experts: int, num_stacks: int, counts_dtype: torch.dtype,
                        group: str | None = None, group_size: int = 1, each: Each = _directly) -> list[torch.Tensor]:
    """The gradients of ``run_routed``'s rows and extras given its outputs': the dispatch again, the body's
    vjp on the rank's experts, the rows' gradients sent back (the extras' stay: a stack's are its experts')."""
    routing, counts = route(keys, num_experts, group, group_size)
    moved = routing.dispatch(list(rows) + list(grads))  # the rows and their outputs' gradients in one all_to_all
    found = each(functools.partial(_body_gradients, body, counts_dtype), moved[:len(rows)], counts, list(extras),
                 moved[len(rows):])
    # contiguous, as the op's fake says: a stack's gradient otherwise takes the layout of the vjp's last op (a
    # transposed stack's, transformers' ``weight.transpose(-2, -1)``), which the compiled caller's stride check refuses
    return routing.combine(found[:len(rows)]) + [g.contiguous() for g in found[len(rows):]]


# ---- the ops ------------------------------------------------------------------------------------------
@torch.library.custom_op("fxshard::routed_experts", mutates_args=())
def routed_experts(body: str, rows: list[torch.Tensor], keys: torch.Tensor, extras: list[torch.Tensor],
                   num_experts: int, num_stacks: int, counts_dtype: torch.dtype, *, group: str | None = None,
                   group_size: int = 1) -> list[torch.Tensor]:
    """A routed MoE region: ``body(rows sorted by key, per-expert counts, extras)`` back in pair order."""
    return run_routed(body, rows, keys, extras, num_experts, num_stacks, counts_dtype, group, group_size)


@routed_experts.register_fake
def _(body, rows, keys, extras, num_experts, num_stacks, counts_dtype, *, group=None, group_size=1):
    counts = keys.new_empty((num_experts // group_size,), dtype=counts_dtype)
    return [o.new_empty(o.shape) for o in _body_outputs(body, counts_dtype, rows, counts, extras)]


@torch.library.custom_op("fxshard::routed_experts_backward", mutates_args=())
def routed_experts_backward(body: str, rows: list[torch.Tensor], keys: torch.Tensor, extras: list[torch.Tensor],
                            grads: list[torch.Tensor], num_experts: int, num_stacks: int, counts_dtype: torch.dtype,
                            *, group: str | None = None, group_size: int = 1) -> list[torch.Tensor]:
    """The gradients of ``routed_experts``' rows, then of its extras."""
    return run_routed_backward(body, rows, keys, extras, grads, num_experts, num_stacks, counts_dtype, group,
                               group_size)


@routed_experts_backward.register_fake
def _(body, rows, keys, extras, grads, num_experts, num_stacks, counts_dtype, *, group=None, group_size=1):
    return [t.new_empty(t.shape) for t in list(rows) + list(extras)]


def _setup(ctx: Any, inputs: tuple, keyword_only_inputs: dict, output: Any) -> None:
    body, rows, keys, extras, num_experts, num_stacks, counts_dtype = inputs
    ctx.static = (body, num_experts, num_stacks, counts_dtype, keyword_only_inputs)
    ctx.counts = (len(rows), len(extras))
    ctx.outputs = [(o.shape, o.dtype, o.device) for o in output]
    ctx.save_for_backward(*rows, keys, *extras)


def _backward(ctx: Any, grads: Sequence[torch.Tensor | None]) -> tuple:
    body, num_experts, num_stacks, counts_dtype, kw = ctx.static
    saved = ctx.saved_tensors
    n_rows, n_extras = ctx.counts
    rows, keys, extras = list(saved[:n_rows]), saved[n_rows], list(saved[n_rows + 1:])
    filled = [g if g is not None else torch.zeros(shape, dtype=dtype, device=device)
              for g, (shape, dtype, device) in zip(grads, ctx.outputs)]
    found = routed_experts_backward(body, rows, keys, extras, filled, num_experts, num_stacks, counts_dtype, **kw)
    wanted = [t.is_floating_point() for t in rows + extras]
    found = [g if w else None for g, w in zip(found, wanted)]
    return None, found[:n_rows], None, found[n_rows:], None, None, None


routed_experts.register_autograd(_backward, setup_context=_setup)

ROUTED_OPS = (torch.ops.fxshard.routed_experts.default, torch.ops.fxshard.routed_experts_backward.default)
# what each routed op runs on a rank: simulate calls these on LocalTensors (every rank's tensors at once), where
# the op itself would run each rank's tensors alone and its all_to_alls could not meet
PYTHON_FORMS = {ROUTED_OPS[0]: run_routed, ROUTED_OPS[1]: run_routed_backward}


# ---- the sharding rule ---------------------------------------------------------------------------------
def _arguments(node: fx.Node) -> tuple[list, Any, list, list, int, int]:
    """(rows, keys, extras, grads, num_experts, num_stacks) of a routed op's node."""
    if node.target is ROUTED_OPS[0]:
        _, rows, keys, extras, num_experts, num_stacks = node.args[:6]
        return list(rows), keys, list(extras), [], num_experts, num_stacks
    _, rows, keys, extras, grads, num_experts, num_stacks = node.args[:7]
    return list(rows), keys, list(extras), list(grads), num_experts, num_stacks


def expert_axes(stacks: Sequence[Layout]) -> tuple[MeshAxis, ...]:
    """The mesh axes the expert weight stacks are sharded on by expert, major first (dim 0 cut into blocks on
    one axis, or on several: EP over a flattened (dp, tp) group); () where none is."""
    for layout in stacks:
        pieces = layout.dims[0] if layout.ndim else ()
        sharded = [p for p in pieces if p.axis is not None]
        if sharded and not any(p.chunked for p in pieces) and pieces[:len(sharded)] == tuple(sharded):
            return tuple(p.axis for p in sharded)
    return ()


def _size(axes: Sequence[MeshAxis]) -> int:
    return int(math.prod(int(a.size) for a in axes))


def _with_rows(layout: Layout, rows: Sequence[Piece], partial: Sequence[MeshAxis] = ()) -> Layout:
    """``layout``'s tensor with dim 0 in ``rows`` (pieces) and every other dim whole; Partial(sum) on ``partial``."""
    return Layout(layout.mesh, layout.shape, [tuple(rows)] + [(Piece(s),) for s in layout.shape[1:]],
                  partial={a: "sum" for a in partial})


def _blocks_on(axes: Sequence[MeshAxis], size: int) -> list[Piece]:
    """Dim 0 of ``size`` rows in contiguous blocks over ``axes`` (major first): the flattened group's order."""
    return [Piece(a.size, a) for a in axes] + [Piece(size // _size(axes))]


def _row_pieces(keys: Layout, axes: tuple[MeshAxis, ...]) -> list[Piece]:
    """How the pairs lie: as the keys do, where their dim 0 is cut on every expert axis (a dispatch group then
    holds distinct pairs: the rows may lie on further axes too, data parallel beside EP); else in blocks on
    the expert axes. The op is row-wise, so any such split of the pairs computes the same rows."""
    held = {p.axis for p in keys.dims[0] if p.axis is not None}
    if not keys.partial and set(axes) <= held:
        return list(keys.dims[0])
    return _blocks_on(axes, keys.shape[0])


class Routed(Kind):
    """``routed_experts`` and its backward: the stacks in blocks on their expert axes, the pairs cut on those
    axes (and any others the keys lie on), the outputs as the pairs; all replicated where the stacks are
    sharded but not by expert, or the expert axes divide neither the experts nor the pairs. Stacks replicated
    (data or context parallelism): the pairs as the keys lie, each rank's through every expert, no dispatch.

    Gradients (the backward op): a stack's is its experts', summed over the axes the pairs lie on besides
    the expert axes (each dispatch group ran its own pairs); another extra's (broadcast over the rows) is
    each rank's share, summed over every axis the pairs lie on."""

    name = "routed"

    def __call__(self, node: fx.Node, ctx: Context) -> Decision | None:
        rows, _, extras, grads, num_experts, num_stacks = _arguments(node)
        layouts = list(ctx.layouts)
        n_rows, n_extras = len(rows), len(extras)
        row_layouts, key_layout = layouts[:n_rows], layouts[n_rows]
        extra_layouts = layouts[n_rows + 1:n_rows + 1 + n_extras]
        grad_layouts = layouts[n_rows + 1 + n_extras:]
        axes = expert_axes(extra_layouts[:num_stacks])
        pairs = key_layout.shape[0]
        if axes and not (all(is_static(a.size) for a in axes) and num_experts % _size(axes) == 0
                         and pairs % _size(axes) == 0):
            axes = ()
        if not axes and not all(l.is_replicated for l in extra_layouts[:num_stacks]):
            required = tuple(Layout.replicated(ctx.mesh, l.shape) for l in layouts)
            outputs = tuple(Layout.replicated(ctx.mesh, v.shape) for v in node.meta["val"])
            return required, outputs
        pieces = _row_pieces(key_layout, axes)
        row_axes = [p.axis for p in pieces if p.axis is not None]
        stack_pieces = _blocks_on(axes, num_experts)
        required = ([_with_rows(l, pieces) for l in row_layouts] + [_with_rows(key_layout, pieces)]
                    + [_with_rows(l, stack_pieces) if k < num_stacks else Layout.replicated(ctx.mesh, l.shape)
                       for k, l in enumerate(extra_layouts)]
                    + [_with_rows(l, pieces) for l in grad_layouts])
        if node.target is ROUTED_OPS[0]:
            outputs = tuple(_with_rows(Layout.replicated(ctx.mesh, v.shape), pieces) for v in node.meta["val"])
        else:
            outputs = tuple(required[:n_rows]) + tuple(
                _with_rows(l, stack_pieces, [a for a in row_axes if a not in axes]) if k < num_stacks
                else Layout(ctx.mesh, l.shape, partial={a: "sum" for a in row_axes})
                for k, l in enumerate(extra_layouts))
        return tuple(required), outputs


ROUTED = Routed()


# ---- what a routed op sends ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Dispatch:
    """One all_to_all a routed op runs on every rank: its group's axes, its bytes received per rank as a function of the
    routing (``rows_in[keys]``: the rows the rank's experts get from its peers; ``rows_out[keys]``: the rank's
    own rows its peers ran, sent back), and what it carries."""

    axes: tuple[MeshAxis, ...]  # the dispatch group's axes (one, or several flattened)
    bytes_per_rank: Any  # a sympy expression in the two row counts (an int for the counts' exchange)
    what: str


def _row_bytes(values: Sequence[Any]) -> int:
    return sum(int(torch.Size(v.shape[1:]).numel()) * v.element_size() for v in values)


def dispatches(node: fx.Node) -> list[Dispatch]:
    """The all_to_alls of a planned routed op (none where its pairs are not sharded): the counts, the rows to
    their experts' ranks (each row's bytes: ``rows x features x dtype``), the results back."""
    import sympy

    from .graph import ARG_LAYOUTS

    required = node.meta.get(ARG_LAYOUTS)
    rows, keys, extras, grads, num_experts, num_stacks = _arguments(node)
    if required is None:
        return []
    axes = group_axes(node)
    if not axes:
        return []
    n = _size(axes)
    received = sympy.Symbol(f"rows_in[%{keys.name}]", integer=True, nonnegative=True)
    returned = sympy.Symbol(f"rows_out[%{keys.name}]", integer=True, nonnegative=True)
    sent = [a.meta["val"] for a in rows] + [g.meta["val"] for g in grads]
    back = list(node.meta["val"])[:len(rows)] if grads else list(node.meta["val"])
    direction = "gradients" if grads else "rows"
    return [Dispatch(axes, (n - 1) * (num_experts // n) * 8, "the per-expert counts, from every peer"),
            Dispatch(axes, received * _row_bytes(sent),
                     f"the {direction} of the peers' pairs routed to this rank's experts"),
            Dispatch(axes, returned * _row_bytes(back), "the results of this rank's pairs its peers' experts ran")]


def uniform_dispatches(node: fx.Node) -> list[tuple[Dispatch, float]]:
    """``dispatches(node)``, each with its bytes per rank where every pair is as likely to meet any expert (the
    routing a load-balanced router aims at): a rank sends ``(n - 1) / n`` of its pairs to its peers and gets as
    many back. What the placement search prices a dispatch at before the routing is known."""
    import sympy

    from .costs import numel, numeric
    from .graph import ARG_LAYOUTS

    found = dispatches(node)
    if not found:
        return []
    rows = _arguments(node)[0]
    pairs = numeric(numel(node.meta[ARG_LAYOUTS][len(rows)].max_local_shape()))  # the keys: a rank's pairs
    n = _size(found[0].axes)
    expected = pairs * (n - 1) / n
    out = []
    for d in found:
        value = sympy.sympify(d.bytes_per_rank)
        out.append((d, float(value.subs({s: expected for s in value.free_symbols}))))
    return out


def stack_sources(node: fx.Node) -> list[fx.Node]:
    """The placeholders a routed op's expert weight stacks come from (through casts and views): the tensors
    whose placements decide its dispatch together (one stack ``Shard(0)`` asks the same of the others)."""
    _, _, extras, _, _, num_stacks = _arguments(node)
    found = []
    for stack in extras[:num_stacks]:
        while isinstance(stack, fx.Node) and stack.op != "placeholder" and len(stack.all_input_nodes) == 1:
            stack = stack.all_input_nodes[0]
        if isinstance(stack, fx.Node) and stack.op == "placeholder":
            found.append(stack)
    return found


def group_axes(node: fx.Node) -> tuple[MeshAxis, ...]:
    """The mesh axes a planned routed op dispatches over: those its first stack is required in blocks on."""
    from .graph import ARG_LAYOUTS

    required = node.meta.get(ARG_LAYOUTS)
    rows, _, extras, _, _, num_stacks = _arguments(node)
    if required is None or not num_stacks:
        return ()
    return expert_axes([required[len(rows) + 1]])


RECIPE = RoutedGroup(group_axes)
