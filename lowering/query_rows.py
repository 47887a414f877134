"""Stage 4 for a causal attention kernel whose query rows are sharded (``fxshard.localization.QueryRows``).

The call becomes fxshard's op of the same arguments (``fxshard/causal_rows.py``) given the global
positions of the rank's rows, in runs, and the kernel the recipe names: the rank computes its rows over
the keys before them and its own causal block, not one device's top-left causal mask on its local rows.
Arguments are read by their schema names, never by which op the node calls.
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from fxshard.causal_rows import CAUSAL_ROWS_OPS, runs_of
from fxshard.graph import LAYOUT
from fxshard.layout import Layout
from fxshard.localization import QueryRows
from fxshard.mesh import Coordinate

aten = torch.ops.aten
SEQUENCE = 2
_FORWARD = ("query", "key", "value")
_BACKWARD = ("grad_out", "query", "key", "value", "out", "logsumexp")


class QueryRowsError(RuntimeError):
    pass


def localize_query_rows(node: fx.Node, recipe: QueryRows, coordinate: Coordinate) -> None:
    """Rewrite a causal call on this rank's query rows (no-op: a non-causal call, or every row held)."""
    values = _bound(node)
    if not values.get("is_causal"):
        return
    q, k = values["query"], values["key"]
    q_layout, k_layout = q.meta.get(LAYOUT), k.meta.get(LAYOUT)
    if not isinstance(q_layout, Layout) or not q_layout.dim_is_sharded(SEQUENCE):
        return
    if not isinstance(k_layout, Layout) or k_layout.dim_is_sharded(SEQUENCE):
        raise QueryRowsError(f"{node.format_node()}: causal attention on sharded query rows needs its keys whole, "
                             f"they are {k_layout}")
    rows = q_layout.local_indices(SEQUENCE, coordinate).tolist()
    if not rows:
        raise QueryRowsError(f"{node.format_node()}: the rank at {coordinate} holds no query rows of {q_layout}; "
                             "shard the sequence evenly over its axes")
    names = _BACKWARD if recipe.backward else _FORWARD
    op = CAUSAL_ROWS_OPS[1 if recipe.backward else 0]
    node.target = op
    node.args = tuple(values[n] for n in names) + (runs_of(rows), recipe.kernel, values.get("scale"))
    node.kwargs = {}
    _stand_in_for_extras(node, len(op._schema.returns), q.meta["val"].device)


def _stand_in_for_extras(node: fx.Node, kept: int, device: torch.device) -> None:
    """The kernel's outputs past the op's (``kept``): its RNG state, sequence offsets, debug mask, a bias's
    gradient. Without dropout, mask or bias nothing reads them but the backward kernel this stage rewrites
    too, so a stand-in of their metadata takes each one's place (None stays None, an int stays the int)."""
    for user in list(node.users):
        if user.target is not operator.getitem or user.args[1] < kept:
            continue
        val = user.meta.get("val")
        if isinstance(val, torch.Tensor):
            with node.graph.inserting_after(user):
                stand_in = node.graph.call_function(aten.empty.memory_format, (list(val.shape),),
                                                    {"dtype": val.dtype, "device": device})
            user.replace_all_uses_with(stand_in)
        else:
            constant = int(val) if isinstance(val, (int, torch.SymInt)) else None
            for reader in list(user.users):
                reader.args, reader.kwargs = fx.node.map_arg((reader.args, reader.kwargs),
                                                             lambda a: constant if a is user else a)
        node.graph.erase_node(user)


def _bound(node: fx.Node) -> dict[str, Any]:
    """The call's arguments by schema name (defaults filled in)."""
    out = {}
    for i, arg in enumerate(node.target._schema.arguments):
        if arg.name in node.kwargs:
            out[arg.name] = node.kwargs[arg.name]
        elif i < len(node.args) and not arg.kwarg_only:
            out[arg.name] = node.args[i]
        elif arg.has_default_value():
            out[arg.name] = arg.default_value
    if "grad_out_" in out:  # the efficient kernel's name for it
        out["grad_out"] = out.pop("grad_out_")
    return out
