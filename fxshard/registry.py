"""The op registry: every ATen op fxshard knows, one entry each, as data.

An entry says how the op propagates layouts (its kind: a signature, a view, a range, a
factory, ...; fxshard/op_kinds.py), how stage 4 localizes its non-tensor arguments (a recipe of
fxshard/localization.py, or none), and what it is to the passes that reason about values
(whether its output relabels its input's elements, shares its storage, is cheap to recompute).
Stage 2 does one lookup per node (``lookup``), stage 3 copies the recipe into the graph, and
nothing else names an op. An op not in the table that torch tags pointwise propagates by
broadcasting; one without tensor inputs is a replicated factory; any other is replicated with a
warning, or refused under ``strict=True``.

Adding an op: one line for an einsum-like op (``aten.mm.default: einsum_op("m k, k n -> m n", ...)``),
one entry for a view-like or indexed one (docs/design.md, "Adding an op").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.fx as fx

from . import routing, rules, rules_attention, rules_moe
from .causal_rows import KERNEL_OF
from .flex_attention import FLEX_ATTENTION, FORWARD_INDICES, flex_attention
from .localization import (LocalArange, LocalShape, MaskedAccumulate, MaskedLookup, QueryRows, Recipe, SelectIndex,
                           SliceRange, SplitSizes)
from .op_kinds import FACTORY, LIKE, NEW, PIN, PLAIN_VIEW, VIEW, WRITE_INTO, Declared, Kind, Ranges
from .ops import CAST_FOR_COMPUTE, CONSTRAIN, REDISTRIBUTE, SUMMED
from .rules import LINEAR_OPS, einsum
from .slicing import concat_rule, select_rule, slice_rule, split_rule, stack_rule, unbind_rule

aten = torch.ops.aten


@dataclass(frozen=True)
class Op:
    """What fxshard knows of one op.

    ``relabels``: the output is the input's elements under other indices (views, permutes, expand,
    alias): a value that relabels an input is that input moved or kept (refine.py, the training
    split). ``aliases``: the output shares the input's storage (memory.py); every relabelling
    does, and select/slice too. ``recomputed_with_input``: the training split recomputes it in
    the backward whenever it recomputes its input (relabellings, casts, clones).
    """

    kind: Kind | None
    localize: Recipe | None = None
    relabels: bool = False
    aliases: bool = False
    recomputed_with_input: bool = False

    @property
    def shares_storage(self) -> bool:
        return self.relabels or self.aliases

    @property
    def cheap_follower(self) -> bool:
        return self.relabels or self.recomputed_with_input


def einsum_op(spec: str, reduce: str = "sum", partial_groups: Sequence[Sequence[int]] = (),
              partial_ops: Sequence[str] = LINEAR_OPS, **traits: Any) -> Op:
    """An op whose every call is the einsum ``spec`` (``"m k, k n -> m n"``; see rules.einsum)."""
    sig = einsum(spec, reduce, partial_groups, partial_ops)
    return Op(Declared(lambda node: sig), **traits)


def signature_op(rule: Any, localize: Recipe | None = None, **traits: Any) -> Op:
    """An op whose signature ``rule(node)`` computes from the node (its shapes, dims, flags)."""
    return Op(Declared(rule), localize, **traits)


def _query_rows(op: Any, backward: bool = False) -> QueryRows | None:
    """The recipe of an attention kernel whose causal calls stage 4 cuts into the rank's query rows."""
    return QueryRows(backward, KERNEL_OF[op.default]) if op in rules_attention.QUERY_ROWS_OPS else None


_view = Op(VIEW, LocalShape(1), relabels=True)
_squeeze = Op(VIEW, relabels=True)
_permute = signature_op(rules.permute, relabels=True)
_transpose = signature_op(rules.transpose, relabels=True)
_identity = signature_op(rules.identity)
_constant = Op(FACTORY, LocalShape(0))  # built at the local shape where its consumers want it sharded
_arange = Op(FACTORY, LocalArange())  # built as the rank's run where its consumers want it sharded

OPS: dict[Any, Op] = {
    # matmuls and contractions
    aten.mm.default: einsum_op("m k, k n -> m n", partial_groups=[(0,), (1,)]),
    aten.bmm.default: einsum_op("b m k, b k n -> b m n", partial_groups=[(0,), (1,)]),
    aten.addmm.default: signature_op(rules.addmm),
    aten.baddbmm.default: signature_op(rules.baddbmm),
    aten._scaled_mm.default: signature_op(rules.scaled_mm),  # float8 (torchao's Float8Linear)
    aten.convolution.default: signature_op(rules.convolution),
    # permutes
    aten.t.default: _transpose,
    aten.transpose.int: _transpose,
    aten.permute.default: _permute,
    # reductions
    aten.sum.dim_IntList: signature_op(rules.reduce_dims("sum")),
    aten.sum.default: signature_op(rules.reduce_all("sum")),
    aten.mean.dim: signature_op(rules.reduce_dims("avg")),
    aten.mean.default: signature_op(rules.reduce_all("avg")),
    aten.amax.default: signature_op(rules.reduce_dims("max")),
    aten.amin.default: signature_op(rules.reduce_dims("min")),
    aten.max.default: signature_op(rules.reduce_all("max")),  # float8 scales' amax (torchao: max(abs(x)))
    aten.min.default: signature_op(rules.reduce_all("min")),
    aten.var_mean.correction: signature_op(rules.var_mean),
    aten._softmax.default: signature_op(rules.softmax),
    aten._log_softmax.default: signature_op(rules.softmax),
    aten.cumsum.default: signature_op(rules.scan),
    aten.histc.default: signature_op(rules.histc),
    aten.all.default: signature_op(rules.reduce_whole),
    aten.all.dim: signature_op(rules.reduce_whole),
    aten.all.dims: signature_op(rules.reduce_whole),
    aten.any.default: signature_op(rules.reduce_whole),
    aten.any.dim: signature_op(rules.reduce_whole),
    aten.any.dims: signature_op(rules.reduce_whole),
    aten.argmax.default: signature_op(rules.reduce_whole),
    aten.argmin.default: signature_op(rules.reduce_whole),
    aten.max.dim: signature_op(rules.reduce_whole_indexed),
    aten.min.dim: signature_op(rules.reduce_whole_indexed),
    aten.cummax.default: signature_op(rules.moves_along(rules.scan_dim, outputs=2)),
    aten.cummin.default: signature_op(rules.moves_along(rules.scan_dim, outputs=2)),
    aten.logcumsumexp.default: signature_op(rules.moves_along(rules.scan_dim)),
    # elements moved along some dims (those stay whole), the others computed where they lie
    aten.flip.default: signature_op(rules.moves_along(rules.flip_dims, lambda node: rules.ALL_OPS)),
    aten.roll.default: signature_op(rules.moves_along(rules.roll_dims, lambda node: rules.ALL_OPS)),
    aten.constant_pad_nd.default: signature_op(rules.moves_along(rules.padded_dims, rules.pad_partial_ops)),
    aten.index_select.default: signature_op(rules.index_select),
    aten.topk.default: signature_op(rules.select_along),
    aten.sort.default: signature_op(rules.select_along),
    aten.sort.stable: signature_op(rules.select_along),
    aten.argsort.default: signature_op(rules_moe.argsort),
    aten.argsort.stable: signature_op(rules_moe.argsort),
    # pointwise ops whose partial sums need care (other pointwise ops: by their torch tag)
    aten.add.Tensor: signature_op(rules.add_like),
    aten.sub.Tensor: signature_op(rules.add_like),
    aten.mul.Tensor: signature_op(rules.mul_like),
    aten.div.Tensor: signature_op(rules.div_like),
    aten.neg.default: signature_op(rules.pointwise(lambda n: [(0,)])),
    aten.where.self: signature_op(rules.select),  # x and y Partial together: the loss's masked picks
    aten.floor_divide.default: signature_op(rules.pointwise()),  # pointwise, untagged
    aten._to_copy.default: signature_op(rules.to_copy, recomputed_with_input=True),
    aten.view_as_complex.default: signature_op(rules.view_as_complex),
    aten.view_as_real.default: signature_op(rules.view_as_real),
    aten._conj.default: signature_op(rules.pointwise(lambda n: [(0,)]), aliases=True),  # complex RoPE's backward
    aten.polar.default: signature_op(rules.pointwise()),  # a rotary table from (abs, angle)
    aten.triu.default: signature_op(rules.triangle),
    aten.tril.default: signature_op(rules.triangle),
    aten.clone.default: signature_op(rules.identity, recomputed_with_input=True),
    aten.lift_fresh_copy.default: signature_op(rules.identity, recomputed_with_input=True),
    aten.copy.default: signature_op(rules.pointwise()),  # src broadcast into self's shape, untagged
    aten.copy_.default: Op(WRITE_INTO),  # a mutated input written back (functionalization's epilogue)
    aten.alias.default: signature_op(rules.identity, relabels=True),
    aten.detach.default: signature_op(rules.identity, relabels=True),
    aten.contiguous.default: _identity,
    aten.expand.default: signature_op(rules.pointwise(lambda n: [(0,)], rules.ALL_OPS), LocalShape(1),
                                      relabels=True),
    # views: regroupings of pieces (fxshard/views.py)
    aten.view.default: Op(VIEW, LocalShape(1, becomes=aten.reshape.default), relabels=True),  # of a strided block
    aten._unsafe_view.default: _view,
    aten.reshape.default: _view,
    aten.unsqueeze.default: _squeeze,
    aten.squeeze.dim: _squeeze,
    aten.squeeze.default: _squeeze,
    aten.squeeze.dims: _squeeze,
    aten.flatten.using_ints: _squeeze,
    aten.as_strided.default: Op(PLAIN_VIEW, LocalShape(1, becomes=aten.view.default, only_input=True)),
    # ranges of a dim and stacks (fxshard/slicing.py)
    aten.slice.Tensor: Op(Ranges(slice_rule), SliceRange(), aliases=True),
    aten.select.int: Op(Ranges(select_rule), SelectIndex(), aliases=True),
    aten.split.Tensor: Op(Ranges(split_rule), SplitSizes()),
    aten.split_with_sizes.default: Op(Ranges(split_rule), SplitSizes()),
    aten.unbind.int: Op(Ranges(unbind_rule)),
    aten.cat.default: Op(Ranges(concat_rule)),
    aten.stack.default: Op(Ranges(stack_rule)),
    # lookups: a sharded table is looked up where it lies, a masked Partial(sum)
    aten.embedding.default: signature_op(rules.embedding, MaskedLookup(table=0, index=1, dim=0, mask_unsqueeze=-1)),
    aten.gather.default: signature_op(rules.gather, MaskedLookup(table=0, index=2, dim=None, dim_index=1)),
    aten.index.Tensor: signature_op(rules.index),
    # writes (backward graphs)
    aten.scatter.value: signature_op(rules.scatter),
    aten.scatter.src: signature_op(rules.scatter),
    aten.slice_scatter.default: signature_op(rules.slice_scatter),
    aten.select_scatter.default: signature_op(rules.slice_scatter),
    # accumulations by index (embedding's backward): into a target sharded on its rows, each rank
    # accumulates the indices it holds (the lookup above, run backwards); no full-size gradient
    aten.index_put.default: signature_op(rules.index_put_accumulate, MaskedAccumulate(target=0, indices=1, values=2)),
    aten.index_copy.default: signature_op(rules.index_copy),
    aten.index_add.default: signature_op(rules.index_add),
    aten.scatter_add.default: signature_op(rules.scatter_add),
    aten._unsafe_masked_index_put_accumulate.default: signature_op(
        rules.index_put_accumulate, MaskedAccumulate(target=0, indices=2, values=3, mask=1)),
    aten._grouped_mm.default: signature_op(rules_moe.grouped_mm),  # forward, and both forms of its backward
    # attention kernels: batch and heads independent
    **{op.default: signature_op(rules_attention.attention, _query_rows(op)) for op in rules_attention.ATTENTION_OPS},
    **{op.default: signature_op(rules_attention.attention_backward, _query_rows(op, backward=True))
       for op in rules_attention.ATTENTION_BACKWARD_OPS},
    FLEX_ATTENTION: signature_op(flex_attention, FORWARD_INDICES),  # a higher-order op: fxshard/flex_attention.py
    # factories (rand_like/randn_like are not *_like: drawn in global shape, fxshard/decompose.py says why)
    aten.ones_like.default: Op(LIKE),
    aten.zeros_like.default: Op(LIKE),
    aten.empty_like.default: Op(LIKE),
    aten.full_like.default: Op(LIKE),
    aten.new_ones.default: Op(NEW, LocalShape(1)),
    aten.new_zeros.default: Op(NEW, LocalShape(1)),
    aten.new_empty.default: Op(NEW, LocalShape(1)),
    aten.new_full.default: Op(NEW, LocalShape(1)),
    aten.new_empty_strided.default: Op(NEW),
    aten.zeros.default: _constant,
    aten.ones.default: _constant,
    aten.full.default: _constant,
    aten.empty.memory_format: _constant,
    aten.arange.default: _arange,
    aten.arange.start: _arange,
    aten.arange.start_step: _arange,
    # fxshard's own
    CONSTRAIN: Op(PIN),
    SUMMED: signature_op(rules.summed_here),  # a mixed-precision gradient summed in its reduce dtype
    # stage 1 traces it as the cast it is (fxshard/decompose.py); the rule is DTensor's, lent for Dynamo's capture
    CAST_FOR_COMPUTE: signature_op(rules.to_copy),
    REDISTRIBUTE: Op(None, LocalShape(3)),
    routing.ROUTED_OPS[0]: Op(routing.ROUTED, routing.RECIPE),  # a dropless MoE's routed rows, dispatched
    routing.ROUTED_OPS[1]: Op(routing.ROUTED, routing.RECIPE),
}

# ops of other libraries, by schema name: they exist only once that library is imported
NAMED_OPS: dict[str, Op] = {
    "transformers::grouped_mm_fallback": signature_op(rules_moe.grouped_mm),  # MoE experts of fp32 models
    "transformers::grouped_mm_fallback_backward": signature_op(rules_moe.grouped_mm_backward),
    "torchtitan::deterministic_scatter_add": signature_op(rules_moe.scatter_add_rows),  # MoE tokens combined
}


def entry_of(target: Any) -> Op | None:
    """The registry's entry for an op (ATen's by the op, other libraries' by schema name)."""
    entry = OPS.get(target)
    if entry is None and isinstance(target, torch._ops.OpOverload):
        entry = NAMED_OPS.get(target._schema.name)
    return entry


# ops stage 1 decomposes into ops with entries above, because their parts shard better than the
# whole (fxshard/decompose.py says how): FORWARD ones in every program, TRAINING ones (backward
# formulas) in joint graphs
FORWARD, TRAINING = "forward", "training"
DECOMPOSED: dict[Any, str] = {
    # softmax over a sharded dim: a max and a sum all-reduced instead of a gathered tensor
    aten._softmax: FORWARD,
    aten._log_softmax: FORWARD,
    aten._safe_softmax: FORWARD,
    # cross-entropy: log_softmax + gather, so vocab-parallel logits never gather [tokens, vocab]
    aten.nll_loss_forward: FORWARD,
    # norms: reductions over their last dim
    aten.native_layer_norm: FORWARD,
    aten._fused_rms_norm: FORWARD,
    aten.rms_norm: FORWARD,
    aten.native_dropout: FORWARD,
    # repeat (tiling): expand + clone + view, so each repeated dim is a regrouping of pieces (ALiBi's
    # per-head slopes tiled over the batch stay sharded by head)
    aten.repeat: FORWARD,
    # rot90: flips and a transpose, so the dims it does not turn stay sharded
    aten.rot90: FORWARD,
    # losses: pointwise ops and a mean, so a batch-sharded loss is a local sum and one all_reduce
    aten.mse_loss: FORWARD,
    aten.smooth_l1_loss: FORWARD,
    aten.huber_loss: FORWARD,
    aten.binary_cross_entropy: FORWARD,
    aten.binary_cross_entropy_with_logits: FORWARD,
    aten.soft_margin_loss: FORWARD,
    # backward formulas: pointwise ops, reductions and scatters (the attention backward kernels keep
    # an entry of their own and stay whole; nll_loss_backward has fxshard's own decomposition)
    aten._softmax_backward_data: TRAINING,
    aten._log_softmax_backward_data: TRAINING,
    aten.native_layer_norm_backward: TRAINING,
    aten._fused_rms_norm_backward: TRAINING,
    aten.embedding_dense_backward: TRAINING,
    aten.slice_backward: TRAINING,
    aten.select_backward: TRAINING,
    aten.silu_backward: TRAINING,
    aten.gelu_backward: TRAINING,
    aten.threshold_backward: TRAINING,
    aten.tanh_backward: TRAINING,
    aten.sigmoid_backward: TRAINING,
    aten.native_dropout_backward: TRAINING,
    aten.mse_loss_backward: TRAINING,
    aten.smooth_l1_loss_backward: TRAINING,
    aten.huber_loss_backward: TRAINING,
    aten.binary_cross_entropy_backward: TRAINING,
    aten.soft_margin_loss_backward: TRAINING,
}

_POINTWISE = signature_op(rules.pointwise())
_NO_TENSOR_INPUTS = Op(FACTORY)


def lookup(node: fx.Node, has_tensor_inputs: bool) -> Op | None:
    """The entry for ``node``'s op: its own, else a factory when it has no tensor inputs, else
    pointwise by torch's tag; None when fxshard knows nothing of it."""
    entry = entry_of(node.target)
    if entry is not None:
        return entry
    if not isinstance(node.meta.get("val"), torch.Tensor):
        return None
    if not has_tensor_inputs:
        return _NO_TENSOR_INPUTS
    target = node.target
    if isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags:
        return _POINTWISE
    return None


def recipe_of(node: fx.Node) -> Recipe | None:
    entry = entry_of(node.target) if node.op == "call_function" else None
    return entry.localize if entry is not None else None


def _ops_where(trait: str) -> frozenset:
    return frozenset(op for op, entry in OPS.items() if getattr(entry, trait))


RELABELS = _ops_where("relabels")  # the output relabels one input's elements (same storage)
SHARES_STORAGE = _ops_where("shares_storage")  # the output is a view of one input's storage
CHEAP_FOLLOWERS = _ops_where("cheap_follower")  # recomputed in the backward with their input
# replicated factories (zeros, new_zeros, ...): a consumer that wants one sharded gets its block built
# (fxshard/factories.py) or sliced locally, so moving one never moves data
FACTORIES = frozenset(op for op, entry in OPS.items() if entry.kind in (FACTORY, NEW))
