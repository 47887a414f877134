"""Factories made at their local size where every consumer wants them sharded.

Propagation gives a factory (``zeros``, ``ones``, ``full``, ``empty``, ``arange``: no tensor
inputs; ``new_zeros`` and its kin, whose input gives only dtype and device) the replicated layout, and a consumer that needs it sharded slices its block out: no
communication, but every rank builds the whole tensor first. When all consumers want the same
layout, the factory takes that layout instead and stage 4 builds just the block: a constant's
block is the constant at the local shape, an ``arange``'s block is an ``arange`` over the rank's
contiguous index range (other arange layouts, and float ranges, stay replicated).

A zeros tensor read inside a local region (code on ``to_local()`` shards) whose consumers want partial sums
takes that layout: eager made zeros on every rank and accumulated the rank's partial sums into them
(torchtitan's MoE ``combine``: ``scatter_add`` of the experts' partial outputs into ``zeros_like(x)``), and
zeros on every rank are the partial sums of zeros, at the same local shape.
"""
from __future__ import annotations

import torch.fx as fx

from .graph import ARG_LAYOUTS, LAYOUT, LOCAL_REGION, requirements
from .layout import Layout
from .localization import LocalArange, LocalShape
from .op_kinds import FACTORY, NEW
from .registry import entry_of

_ZEROS = {"aten::zeros_like", "aten::new_zeros", "aten::zeros"}  # ops whose value is zeros, by schema name


def _wanted(node: fx.Node) -> set[Layout | None]:
    """The layouts the consumers of ``node`` require of it."""
    wanted: set[Layout | None] = set()
    for user in node.users:
        if user.meta.get(ARG_LAYOUTS) is None:
            return {None}  # a consumer without a layout (not propagated): leave the factory alone
        wanted.update(want for a, want in requirements(user) if a is node)
    return wanted


def contiguous_blocks(layout: Layout) -> bool:
    """Whether every rank holds one contiguous run of a 1-D layout's indices."""
    if layout.ndim != 1 or not layout.mesh.is_static or not isinstance(layout.shape[0], int):
        return False
    for coord in layout.mesh.coordinates():
        idx = layout.local_indices(0, coord)
        if idx.numel() > 1 and not bool((idx[1:] - idx[:-1] == 1).all()):
            return False
    return True


def _partial_zeros(node: fx.Node) -> bool:
    """Give a replicated zeros tensor the partial-sum layout all its consumers want (in place), where it or a
    consumer lies in a local region; whether it did. Only sums: zeros are not the partial products (or maxima)
    of a zeros tensor in general."""
    schema = getattr(node.target, "_schema", None)
    have = node.meta.get(LAYOUT)
    in_region = LOCAL_REGION in node.meta or any(LOCAL_REGION in user.meta for user in node.users)
    if schema is None or schema.name not in _ZEROS or not in_region or not isinstance(have, Layout) \
            or not have.is_replicated:
        return False
    wanted = _wanted(node)
    if len(wanted) != 1:
        return False
    (want,) = wanted
    if not isinstance(want, Layout) or want.dims != have.dims or want.shape != have.shape or not want.partial \
            or want.reduce_ops != {"sum"}:
        return False
    node.meta[LAYOUT] = want
    return True


def shard_factories(gm: fx.GraphModule) -> int:
    """Give replicated factories their consumers' common sharded layout (in place), and a local region's zeros
    the partial sums its consumers want; how many changed."""
    changed = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and _partial_zeros(node):
            changed += 1
            continue
        entry = entry_of(node.target) if node.op == "call_function" else None
        if entry is None or entry.kind not in (FACTORY, NEW) or not isinstance(entry.localize, (LocalShape, LocalArange)):
            continue
        have = node.meta.get(LAYOUT)
        if LOCAL_REGION in node.meta or not isinstance(have, Layout) or not have.is_replicated or not node.users:
            continue
        wanted = _wanted(node)
        if len(wanted) != 1:
            continue
        (want,) = wanted
        if not isinstance(want, Layout) or want == have or want.partial or want.shape != have.shape:
            continue
        if isinstance(entry.localize, LocalArange) and not (contiguous_blocks(want) and
                                                            all(type(a) is int for a in node.args)):
            continue  # float ranges: a local arange might round its length differently
        node.meta[LAYOUT] = want
        changed += 1
    return changed
