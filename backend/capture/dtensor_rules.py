"""fxshard's op rules lent to DTensor, for the ops DTensor has no sharding strategy for.

Dynamo computes a DTensor program's example values with DTensor's own sharding propagation, so
an op DTensor lacks (CPU flash attention, which every Hugging Face model calls through sdpa on
CPU; transformers' grouped matmul of MoE experts) fails while Dynamo traces, in front of
fxshard's backend, which has a rule for it. Importing the backend registers, through DTensor's
public ``register_sharding``, the strategies fxshard's signature for such an op implies: full
replication, and each factor that passes through to every output (not one that must stay whole)
sharded on all tensors carrying it. Ops DTensor already has are left alone; other libraries' ops
(the registry's ``NAMED_OPS``, keyed by schema name) are lent once that library has defined them, so
lending runs again at each capture (backend/capture/capture.py), cheap and idempotent. The strategies
only have to be right, not best: under the backend fxshard plans the program itself; in
DTensor eager they make the op run (sharded where the signature allows) instead of raising.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Callable, Iterator

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.utils._pytree import tree_flatten, tree_map

from fxshard.op_kinds import Declared
from fxshard.registry import NAMED_OPS, OPS, Op
from fxshard.rules import Signature

PlacementList = list  # one entry per output (then per tensor input): a placement, or None for a non-tensor
_LENT = "_fxshard_lent"  # the attribute that marks a sharding function fxshard lent

# DTensor's sharding propagator's tables, in the order it looks an op up (_sharding_prop.py,
# propagate_op_sharding_non_cached). torch 2.15 moved most of DTensor's rules from op_strategy_funcs
# to single-dim strategies (flash attention, mm, softmax, sum...). Each is read with a default: that an
# older torch (2.11) lacks the single-dim table is assumed, not checked.
_DTENSOR_TABLES = ("op_single_dim_strategy_funcs", "op_strategy_funcs", "op_to_rules")


def lend_rules_to_dtensor() -> list[Any]:
    """Register fxshard's signature rules with DTensor for the ops it has no strategy for; returns
    those ops. Idempotent: an op registered once has a strategy the next time."""
    from torch.distributed.tensor.experimental import register_sharding

    lent = []
    for op, entry in _known_ops():
        if isinstance(entry.kind, Declared) and isinstance(op, torch._ops.OpOverload) and not _decomposes(op) \
                and dtensor_rule(op) is None:
            register_sharding(op)(_strategies_from(op, entry.kind.rule))
            lent.append(op)
    return lent


def _known_ops() -> Iterator[tuple[Any, Op]]:
    """The registry's ATen ops, then each overload of its other libraries' ops that is defined now
    (transformers' grouped matmul exists once transformers' MoE code is imported)."""
    yield from OPS.items()
    for schema_name, entry in NAMED_OPS.items():
        namespace, _, name = schema_name.partition("::")
        packet = getattr(getattr(torch.ops, namespace), name, None)  # None until the library defines it
        for overload in packet.overloads() if packet is not None else ():
            yield getattr(packet, overload), entry


def dtensor_rule(op: Any) -> Any | None:
    """The rule DTensor's sharding propagation runs for ``op`` (its own, or one lent), or None: the one
    place that reads DTensor's rule tables, so each torch version's layout of them is handled here."""
    from torch.distributed.tensor import DTensor

    prop = DTensor._op_dispatcher.sharding_propagator
    for table in _DTENSOR_TABLES:
        rule = getattr(prop, table, {}).get(op)
        if rule is not None:
            return rule
    return None


def is_lent(op: Any) -> bool:
    """Whether the rule DTensor runs for ``op`` is one fxshard lent (``register_sharding`` wraps the
    sharding function in a partial; ours carry ``_LENT``)."""
    rule = dtensor_rule(op)
    return any(getattr(f, _LENT, False) for f in getattr(rule, "args", ()))


def _decomposes(op: Any) -> bool:
    """DTensor never sees an op that decomposes above autograd (the math attention): no rule needed."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd")


def _strategies_from(op: Any, rule: Callable[[Any], Signature | None]) -> Callable[..., list]:
    """DTensor's sharding function for ``op``: given the arguments (tensors as DTensorSpecs), the
    acceptable (output placements, input placements) pairs of one mesh dim."""
    def acceptable(*args: Any, **kwargs: Any) -> list[tuple[PlacementList, PlacementList]]:
        node = _node_of(op, args, kwargs)
        leaves = [x for x in tree_flatten((args, kwargs))[0] if _is_spec(x)]
        n_out = len(op._schema.returns)
        outs = node.meta["val"] if n_out > 1 else (node.meta["val"],)
        replicated = ([Replicate() if isinstance(o, torch.Tensor) else None for o in outs], [Replicate()] * len(leaves))
        sig = rule(node)
        if sig is None or len(sig.inputs) != len(leaves) or len(sig.extra_outputs) + 1 != sum(
                isinstance(o, torch.Tensor) for o in outs):
            return [replicated]
        out_dims = iter((sig.output,) + sig.extra_outputs)
        out_names = [next(out_dims) if isinstance(o, torch.Tensor) else None for o in outs]
        choices = [replicated]
        for factor in _passing_factors(sig, out_names):
            choices.append(([None if names is None else _on(factor, names) for names in out_names],
                            [_on(factor, names) for names in sig.inputs]))
        return choices
    setattr(acceptable, _LENT, True)
    return acceptable


def _passing_factors(sig: Signature, out_names: list[tuple | None]) -> list[str]:
    """Factors that every tensor output carries once, that need not stay whole, and that each
    input carries at most once."""
    tensors = [names for names in out_names if names is not None]
    factors = [f for f in tensors[0] if f is not None] if tensors else []
    return [f for f in factors if f not in sig.whole and all(list(names).count(f) == 1 for names in tensors)
            and all(list(names).count(f) <= 1 for names in sig.inputs)]


def _on(factor: str, names: tuple) -> Any:
    return Shard(list(names).index(factor)) if factor in names else Replicate()


def _is_spec(x: Any) -> bool:
    return hasattr(x, "tensor_meta") and hasattr(x, "placements")


def _node_of(op: Any, args: tuple, kwargs: dict) -> Any:
    """A stand-in for an fx node of ``op`` (what fxshard's rules read: args, kwargs, target and
    each tensor's ``meta["val"]``), its outputs computed on the meta device."""
    def meta_tensor(x: Any) -> Any:
        if not _is_spec(x):
            return x
        tm = x.tensor_meta
        return torch.empty_strided(tuple(tm.shape), tuple(tm.stride), dtype=tm.dtype, device="meta")

    meta_args, meta_kwargs = tree_map(meta_tensor, (args, kwargs))
    out = op(*meta_args, **meta_kwargs)
    hold = lambda v: SimpleNamespace(meta={"val": v}) if isinstance(v, torch.Tensor) else v  # noqa: E731
    return SimpleNamespace(target=op, args=tree_map(hold, meta_args), kwargs=tree_map(hold, meta_kwargs),
                           meta={"val": out})
