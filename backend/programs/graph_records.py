"""A lowered program as plain records that ``pickle`` writes and reads at C speed, and back.

``torch.fx._graph_pickler`` keeps any graph, through a Python object per node and a pytree walk per
argument: at 32 layers (a training step's 21k local nodes) it wrote a step's programs in 2.1 s, a tenth
of the first step spent on a store. A lowered program holds only calls of operators and Python functions
on tensors, sizes and constants, so a node is a tuple (op, name, target, args, kwargs, type, kept metadata),
an argument node its position (``_Ref``), an operator its name (``_Op``: operators do not pickle).
"""
from __future__ import annotations

import functools
from typing import Any, Iterable

import torch
import torch.fx as fx
from torch.fx.node import map_aggregate, map_arg

from fxshard.graph import graph_module, new_node

from fxshard.backend.inductor.inductor_calls import register_bucketing_ops

__all__ = ["graph_records", "graph_from_records"]


class _Ref(int):
    """An argument that is the program's node at this position."""

    __slots__ = ()


def graph_records(gm: fx.GraphModule, kept_meta: Iterable[str]) -> tuple[list[tuple], dict[str, Any]]:
    """``gm``'s nodes as records, with the node metadata named in ``kept_meta``, and its attributes
    (``get_attr`` targets: real tensors, which ``pickle`` keeps by value). A ValueError for a graph the
    records cannot hold (a pytree calling convention, a submodule's attribute)."""
    if type(gm.graph._codegen) is not fx.graph.CodeGen:  # a pytree signature (make_fx's): not kept
        raise ValueError(f"a graph with a {type(gm.graph._codegen).__name__} is not kept as records")
    kept = tuple(kept_meta)
    position: dict[fx.Node, _Ref] = {}
    records = []
    for k, node in enumerate(gm.graph.nodes):
        position[node] = _Ref(k)
        target = node.target
        if isinstance(target, torch._ops.OpOverload):
            target = _Op(target.namespace, target._opname, target._overloadname)
        args, kwargs = map_arg((node.args, node.kwargs), position.__getitem__)
        records.append((node.op, node.name, target, args, kwargs, node.type,
                        {key: node.meta[key] for key in kept if key in node.meta}))
    attributes = {n.target: functools.reduce(getattr, n.target.split("."), gm)
                  for n in gm.graph.find_nodes(op="get_attr")}
    if any("." in target for target in attributes):  # a submodule's attribute: not kept
        raise ValueError(f"a graph reading attributes of submodules {sorted(attributes)} is not kept as records")
    return records, attributes


def graph_from_records(records: list[tuple], attributes: dict[str, Any]) -> fx.GraphModule:
    """The graph module ``graph_records`` read (its Python code written on demand, as any graph made within
    ``fxshard.graph.code_on_demand``)."""
    graph = fx.Graph()
    made: list[fx.Node] = []

    def node_of(a: Any) -> Any:
        return made[a] if type(a) is _Ref else a

    for op, name, target, args, kwargs, type_expr, meta in records:
        if type(target) is _Op:
            target = target.resolve()
        args, kwargs = map_aggregate((args, kwargs), node_of)
        node = new_node(graph, op, target, args, kwargs, name=name, type_expr=type_expr)
        if node.name != name:
            raise ValueError(f"a kept program's node {name!r} came back as {node.name!r}")
        node.meta.update(meta)
        made.append(node)
    root = torch.nn.Module()
    for target, value in attributes.items():
        setattr(root, target, value)
    return graph_module(root, graph)


class _Op(tuple):
    """An operator overload by name: ``(namespace, name, overload)``."""

    __slots__ = ()

    def __new__(cls, namespace: str, name: str, overload: str) -> "_Op":
        return super().__new__(cls, (namespace, name, overload))

    def __getnewargs__(self) -> tuple:
        return tuple(self)

    def resolve(self) -> torch._ops.OpOverload:
        namespace, name, overload = self
        if namespace in _REGISTERED_BY and not hasattr(getattr(torch.ops, namespace), name):
            _REGISTERED_BY[namespace]()  # a fresh process has not imported it yet
        return getattr(getattr(getattr(torch.ops, namespace), name), overload)


# operator namespaces a module registers on import, which a program kept by one process may hold before
# another process has imported it (Inductor's bucketing ops, in a merged program's regions): what registers them
_REGISTERED_BY = {"bucketing": register_bucketing_ops}
