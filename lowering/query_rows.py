"""Stage 4 for a causal attention kernel whose query rows are sharded (``fxshard.localization.QueryRows``).

The call becomes fxshard's op of the same arguments (``fxshard/causal_rows.py``) given the global
positions of the rank's rows, in runs: the rank computes its rows over the keys before them and its
own causal block, not one device's top-left causal mask on its local rows.
"""
from __future__ import annotations

from typing import Any

import torch.fx as fx

from fxshard.causal_rows import CAUSAL_ROWS_OPS, KERNEL_OF, runs_of
from fxshard.graph import LAYOUT
from fxshard.layout import Layout
from fxshard.localization import QueryRows
from fxshard.mesh import Coordinate

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
    kernel = KERNEL_OF[node.target]
    node.target = CAUSAL_ROWS_OPS[1 if recipe.backward else 0]
    node.args = tuple(values[n] for n in names) + (runs_of(rows), kernel, values.get("scale"))
    node.kwargs = {}


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
    return out
