"""FlexAttention's tensor inputs on CPU as buffers of their own, not views of another buffer.

Inductor's C++ FlexAttention template names each pointer argument by its storage buffer and drops a
view's storage offset (torch 2.13 and 2.15: ``flex_attention(q.reshape(2, 8, 32, 8)[:, 4:])`` compiled
reads heads 0-3; only q, k and v that share one buffer are copied first, ``flex_cpu.py``'s
``_realize_duplicate_buffer_inputs``). fxshard's local programs make such views: a rank's block of a
replicated block mask (context parallelism: its query blocks) or of replicated heads is a slice.
So every tensor the call reads that an aliasing op made is copied into a buffer of its own first, by an
``index_select`` of all its rows (Inductor removes ``clone``, and in 2.15 ``x + 0``, as no-ops).
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from fxshard.graph import argument_leaves, copy_graph_module

aten = torch.ops.aten
FLEX_ATTENTION = torch.ops.higher_order.flex_attention


def _is_view(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    val = node.meta.get("val")
    return node.op == "call_function" and schema is not None and isinstance(val, torch.Tensor) and val.dim() > 0 \
        and any(
        r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


def _on_cpu(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.device.type == "cpu"


def with_fresh_flex_inputs(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm``, or a copy whose CPU flex_attention calls read no view (each copied by ``index_select``)."""
    calls = [n for n in gm.graph.find_nodes(op="call_function", target=FLEX_ATTENTION) if _on_cpu(n.args[0])]
    if not any(_is_view(a) for n in calls for a in argument_leaves(n.args) if isinstance(a, fx.Node)):
        return gm
    gm = copy_graph_module(gm)
    for call in gm.graph.find_nodes(op="call_function", target=FLEX_ATTENTION):
        if not _on_cpu(call.args[0]):
            continue
        fresh: dict[fx.Node, fx.Node] = {}
        for leaf in argument_leaves(call.args):
            if isinstance(leaf, fx.Node) and _is_view(leaf) and leaf not in fresh:
                fresh[leaf] = _copied(gm.graph, call, leaf)
        call.args = fx.node.map_arg(call.args, lambda a: fresh.get(a, a))
    gm.graph.lint()
    gm.recompile()
    return gm


def _copied(graph: fx.Graph, before: fx.Node, x: fx.Node) -> fx.Node:
    val = x.meta["val"]
    rows = int(val.shape[0])
    with graph.inserting_before(before):
        index = graph.call_function(aten.arange.default, (rows,), {"dtype": torch.int64, "device": val.device})
        copy = graph.call_function(aten.index_select.default, (x, 0, index))
    mode = detect_fake_mode([val])
    with mode if mode is not None else torch._subclasses.fake_tensor.FakeTensorMode():
        index.meta["val"] = torch.arange(rows, dtype=torch.int64, device=val.device)
        copy.meta["val"] = torch.index_select(val, 0, index.meta["val"])
    return copy
