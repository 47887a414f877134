"""Stage 1: a dropless MoE's routed region in Dynamo's graph -> one ``fxshard::routed_experts`` call.

The region (fxshard/routing.py says why it may be one op): the pairs' expert ids ``keys`` sorted
stably (``order = argsort(keys)``), rows gathered by ``order`` (pair space) or ``order // k`` (token
space: ``k`` choices per token), row-wise ops and grouped matmuls over them whose offsets come from
the keys' per-expert counts (``histc`` / ``bincount``, then ``cumsum``), and the results added back
into their tokens (``index_add`` / ``scatter_add`` by the same indices). The rewrite is made only when
every value of the region is read by the region or by those adds (so the rows' order is never
seen), and only when an expert weight stack arrives sharded by expert; anything else leaves the
graph as it is, which is exact (the routing then runs replicated and the experts are gathered).

``rewrite`` returns the graph with each such region replaced: the rows in pair order (a token row
repeated ``k`` times), the op, and each add written as a sum over the ``k`` choices.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx as fx

from fxshard.graph import copy_graph_module
from fxshard.layout import Layout
from fxshard.routing import ROUTED_OPS, register_body

__all__ = ["rewrite"]

_ELEMENTWISE = frozenset({
    "mul", "add", "sub", "truediv", "div", "neg", "silu", "gelu", "relu", "sigmoid", "tanh", "exp", "pow", "square",
    "sqrt", "rsqrt", "clamp", "float", "bfloat16", "half", "to", "type_as", "contiguous", "erf", "abs", "where",
})
_COUNT_OPS = frozenset({"cumsum", "to", "int", "long", "float", "view", "reshape", "type"})  # safe on each rank's counts
_CASTS_AND_FLATS = frozenset({"to", "float", "long", "int", "view", "reshape", "flatten", "contiguous"})
_STACK_VIEWS = frozenset({"transpose", "to", "bfloat16", "float", "half", "contiguous", "permute"})


def _name(n: Any) -> str | None:
    if not isinstance(n, fx.Node):
        return None
    if n.op == "call_method":
        return n.target
    if n.op == "call_function":
        return getattr(n.target, "__name__", None)
    return None


def _val(n: Any) -> Any:
    return n.meta.get("example_value") if isinstance(n, fx.Node) else None


def _shape(n: Any) -> tuple | None:
    v = _val(n)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def _arg(n: fx.Node, i: int, key: str, default: Any = None) -> Any:
    """Argument ``i`` (or keyword ``key``) of a call, counting the tensor a method is called on as argument 0."""
    return n.args[i] if len(n.args) > i else n.kwargs.get(key, default)


def _stripped(n: Any) -> Any:
    """``n`` without casts and flattening views (``keys.view(-1).float()`` -> ``keys``' root)."""
    while _name(n) in _CASTS_AND_FLATS and n.op == "call_method" or (_name(n) == "flatten" and n.op == "call_function"):
        n = n.args[0]
    return n


@dataclass
class Region:
    order: fx.Node  # argsort of the keys
    keys: fx.Node
    counts: fx.Node
    experts: int
    indices: dict = field(default_factory=dict)  # node -> k: order (1) or order // k
    seeds: dict = field(default_factory=dict)  # gathered rows -> (source, k)
    rows: list = field(default_factory=list)  # the region's row-wise nodes, in graph order (seeds first)
    count_nodes: list = field(default_factory=list)  # nodes computed from the counts alone (offsets)
    exits: dict = field(default_factory=dict)  # add node -> (destination, index node, source row node)
    stacks: list = field(default_factory=list)  # grouped matmuls' expert weight stacks
    others: list = field(default_factory=list)  # other tensors the region reads (broadcast over rows)


def _orders(gm: fx.GraphModule) -> list[tuple[fx.Node, fx.Node]]:
    """(order, keys) for each stable argsort (or sort's indices) of 1-D integer keys."""
    found = []
    for n in gm.graph.nodes:
        name = _name(n)
        if name == "argsort" and _arg(n, 1, "dim", -1) in (0, -1) and n.kwargs.get("stable"):
            keys = n.args[0]
            order = n
        elif name == "getitem" and _name(n.args[0]) == "sort" and n.args[1] == 1 and n.args[0].kwargs.get("stable"):
            keys, order = n.args[0].args[0], n
        else:
            continue
        v = _val(keys)
        if isinstance(v, torch.Tensor) and v.ndim == 1 and not v.dtype.is_floating_point:
            found.append((order, keys))
    return found


def _counts_of(gm: fx.GraphModule, keys: fx.Node) -> tuple[fx.Node, int] | None:
    """The per-expert counts of ``keys`` (histc over [0, E) in E bins, or bincount with minlength E)."""
    root = _stripped(keys)
    for n in gm.graph.nodes:
        name = _name(n)
        if name not in ("histc", "bincount") or _stripped(n.args[0]) is not root:
            continue
        if _shape(n.args[0]) != _shape(keys):
            continue
        if name == "histc":
            bins, lo, hi = _arg(n, 1, "bins", 100), _arg(n, 2, "min", 0), _arg(n, 3, "max", 0)
            if isinstance(bins, int) and lo == 0 and hi == bins:
                return n, bins
        else:
            minlength = _arg(n, 2, "minlength", 0)
            if isinstance(minlength, int) and minlength > 0 and _arg(n, 1, "weights") is None:
                return n, minlength
    return None


def _index_k(n: Any, region: Region) -> int | None:
    """``k`` where ``n`` is ``order`` (1) or ``order // k``."""
    if n is region.order:
        return 1
    if _name(n) == "floordiv" and n.args[0] is region.order and isinstance(n.args[1], int):
        return n.args[1]
    if _name(n) == "div" and n.args[0] is region.order and n.kwargs.get("rounding_mode") == "floor" \
            and isinstance(n.args[1], int):
        return n.args[1]
    return None


def _expanded_index(n: Any) -> Any:
    """The 1-D index under ``index.view(-1, 1).expand(-1, d)`` (a gather's or scatter_add's index)."""
    while _name(n) in ("expand", "view", "reshape", "unsqueeze", "expand_as"):
        n = n.args[0]
    return n


def _gathered(n: fx.Node, region: Region) -> tuple[fx.Node, fx.Node] | None:
    """(source, index) of a row gather ``t[i]`` / ``index_select(t, 0, i)`` / ``gather(t, 0, i.expand)``."""
    name = _name(n)
    if name == "getitem" and isinstance(n.args[1], fx.Node):
        return n.args[0], n.args[1]
    if name == "index_select" and _arg(n, 1, "dim") == 0:
        return n.args[0], _arg(n, 2, "index")
    if name == "gather" and _arg(n, 1, "dim") == 0:
        index, src = _arg(n, 2, "index"), n.args[0]
        if _shape(index) is not None and _shape(src) is not None and _shape(index)[1:] == _shape(src)[1:]:
            return src, _expanded_index(index)
    return None


def _added(n: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node] | None:
    """(destination, index, source) of ``Z.index_add(0, i, s)`` / ``Z.scatter_add(0, i.expand, s)``."""
    name = _name(n)
    if name == "index_add" and _arg(n, 1, "dim") == 0 and _arg(n, 4, "alpha", 1) == 1:
        return n.args[0], _arg(n, 2, "index"), _arg(n, 3, "source")
    if name == "scatter_add" and _arg(n, 1, "dim") == 0:
        index, src = _arg(n, 2, "index"), _arg(n, 3, "src")
        if _shape(index) == _shape(src):
            return n.args[0], _expanded_index(index), src
    return None


def _row_wise(n: fx.Node, inside: Callable[[Any], bool]) -> bool:
    """Whether ``n`` computes each row from the same row of its region inputs (and broadcast others)."""
    name, out = _name(n), _shape(n)
    if out is None or not out:  # a chunk or split of the rows' features (a tuple), or a scalar (not row-wise)
        return isinstance(_val(n), (tuple, list)) and name in ("chunk", "split") and inside(n.args[0]) \
            and _arg(n, 2, "dim", 0) not in (0, -len(_shape(n.args[0])))
    rows = out[0]
    tensors = [a for a in n.all_input_nodes if isinstance(_val(a), torch.Tensor)]
    if any(inside(a) and _shape(a)[0] != rows for a in tensors):
        return False
    if name in _ELEMENTWISE:
        return all(inside(a) or len(_shape(a)) < len(out) or _shape(a)[0] == 1 for a in tensors)
    source = n.args[0]
    if not inside(source) or [a for a in tensors if inside(a)] != [source] * len([a for a in tensors if inside(a)]):
        return False
    if name == "getitem":  # a chunk's part, or rows kept whole: x[:, None], x[..., ::2]
        index = n.args[1]
        if isinstance(_val(source), (tuple, list)):
            return isinstance(index, int)
        index = index if isinstance(index, tuple) else (index,)
        first = index[0] if index else None
        return (first == slice(None) or first is Ellipsis and len(_shape(source)) > len(index) - 1) \
            and not any(isinstance(i, fx.Node) for i in index)
    if name in ("view", "reshape", "flatten", "unsqueeze"):
        return out[0] == _shape(source)[0] and (name != "unsqueeze" or _arg(n, 1, "dim") not in (0, -len(out)))
    if name == "_grouped_mm":
        return False  # region.grow checks its operands
    return False


def _grow(gm: fx.GraphModule, region: Region) -> bool:
    """The region's row nodes, count nodes and exits from its seeds; False where a value escapes it."""
    inside: set[fx.Node] = set(region.seeds)
    counted: set[fx.Node] = {region.counts}
    for n in gm.graph.nodes:
        if n in inside or n is region.counts:
            continue
        uses_rows = [a for a in n.all_input_nodes if a in inside]
        if not uses_rows:
            if _name(n) in _COUNT_OPS and n.all_input_nodes and all(a in counted for a in n.all_input_nodes):
                counted.add(n)
            continue
        added = _added(n)
        if added is not None and added[2] in inside and added[0] not in inside and added[1] in region.indices:
            region.exits[n] = added
            continue
        if _name(n) == "_grouped_mm":
            a, b, offs = n.args[0], n.args[1], _arg(n, 2, "offs")
            extra = [x for x in list(n.args[3:]) + [v for k, v in n.kwargs.items() if k != "offs"] if x is not None]
            if a in inside and b not in inside and offs in counted and not extra and _shape(b) is not None \
                    and _shape(b)[0] == region.experts:
                inside.add(n)
                if b not in region.stacks:
                    region.stacks.append(b)
                continue
            return False
        if _row_wise(n, lambda a: a in inside):
            inside.add(n)
            continue
        return False
    for n in inside:  # nothing of the region is read outside it but by its exits
        if any(u not in inside and u not in region.exits for u in n.users):
            return False
        if any(u in region.exits and region.exits[u][2] is not n for u in n.users):
            return False
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    region.rows = sorted(inside, key=order.__getitem__)
    region.count_nodes = sorted((c for c in counted if c is not region.counts and _feeds(c, inside, counted)),
                                key=order.__getitem__)
    others = [a for n in region.rows if n not in region.seeds for a in n.all_input_nodes
              if a not in inside and a not in counted and a not in region.stacks and isinstance(_val(a), torch.Tensor)]
    region.others = list(dict.fromkeys(others))
    return bool(region.exits) and bool(region.stacks)


def _feeds(c: fx.Node, rows: set, counted: set) -> bool:
    """Whether count node ``c`` reaches a row node through count nodes."""
    todo, seen = [c], {c}
    while todo:
        n = todo.pop()
        for u in n.users:
            if u in rows:
                return True
            if u in counted and u not in seen:
                seen.add(u)
                todo.append(u)
    return False


def _find(gm: fx.GraphModule) -> list[Region]:
    regions = []
    for order, keys in _orders(gm):
        counted = _counts_of(gm, keys)
        if counted is None:
            continue
        region = Region(order, keys, counted[0], counted[1])
        pairs = _shape(keys)[0]
        region.indices = {n: k for n in gm.graph.nodes if (k := _index_k(n, region)) is not None}
        for n in gm.graph.nodes:
            got = _gathered(n, region)
            if got is None or got[1] not in region.indices:
                continue
            source, index = got
            k = region.indices[index]
            if _shape(source) is not None and _shape(source)[0] * k == pairs:
                region.seeds[n] = (source, k)
        if region.seeds and _grow(gm, region):
            regions.append(region)
    return regions


def _stack_source(n: fx.Node) -> fx.Node:
    """The tensor a weight stack is a view or cast of, as long as its dim 0 stays the experts'."""
    while _name(n) in _STACK_VIEWS:
        if _name(n) in ("transpose", "permute"):
            ndim = len(_shape(n))
            moved = [a % ndim for a in n.args[1:] if isinstance(a, int)]
            if _name(n) == "permute" and moved[:1] != [0] or _name(n) == "transpose" and 0 in moved:
                break
        n = n.args[0]
    return n


def _sharded_by_expert(region: Region, layouts: Mapping[fx.Node, Layout]) -> bool:
    for stack in region.stacks:
        layout = layouts.get(_stack_source(stack))
        if layout is not None and layout.ndim and layout.dim_is_sharded(0):
            return True
    return False


def _body(gm: fx.GraphModule, region: Region) -> tuple[fx.GraphModule, list[fx.Node]]:
    """The region as a graph: (sorted rows of each seed, the counts, stacks, others) -> the exits' sources."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for k, seed in enumerate(region.seeds):
        env[seed] = graph.placeholder(f"rows_{k}")
    env[region.counts] = graph.placeholder("counts")
    for k, x in enumerate(region.stacks + region.others):
        env[x] = graph.placeholder(f"extra_{k}")
    for n in sorted(region.count_nodes + [r for r in region.rows if r not in region.seeds],
                    key=list(gm.graph.nodes).index):
        env[n] = graph.node_copy(n, lambda a: env[a])
    sources = list(dict.fromkeys(src for _, _, src in region.exits.values()))
    graph.output(tuple(env[s] for s in sources))
    return fx.GraphModule(torch.nn.Module(), graph), sources


def _pairs(graph: fx.Graph, source: fx.Node, k: int) -> fx.Node:
    """A token-space tensor in pair space: each row repeated ``k`` times (a view of a broadcast: no gather)."""
    if k == 1:
        return source
    shape = _shape(source)
    wide = graph.call_method("expand", (graph.call_method("unsqueeze", (source, 1)), shape[0], k, *shape[1:]))
    return graph.call_method("reshape", (wide, shape[0] * k, *shape[1:]))


def _replace(gm: fx.GraphModule, region: Region) -> None:
    body, sources = _body(gm, region)
    key = register_body(body)
    graph = gm.graph
    first_exit = min(region.exits, key=list(graph.nodes).index)
    counts_dtype = _val(region.counts).dtype
    with graph.inserting_before(first_exit):
        rows = [_pairs(graph, source, k) for source, k in region.seeds.values()]
        call = graph.call_function(ROUTED_OPS[0], (key, rows, region.keys, region.stacks + region.others,
                                                    region.experts, len(region.stacks), counts_dtype))
        outs = {s: graph.call_function(operator.getitem, (call, i)) for i, s in enumerate(sources)}
    for node, (dest, index, source) in region.exits.items():
        k = region.indices[index]
        shape = _shape(source)
        with graph.inserting_before(node):
            out = outs[source]
            if k > 1:
                out = graph.call_method("sum", (graph.call_method("view", (out, shape[0] // k, k, *shape[1:])), 1))
            new = graph.call_function(operator.add, (dest, out))
        node.replace_all_uses_with(new)
    graph.eliminate_dead_code()


def rewrite(gm: fx.GraphModule, layouts: Mapping[fx.Node, Layout]) -> fx.GraphModule:
    """``gm`` with each dropless routed region whose experts are sharded by expert as a routed-experts op
    (a copy; ``gm`` itself where there is none). ``layouts``: the placeholders' layouts."""
    regions = [r for r in _find(gm) if _sharded_by_expert(r, layouts)]
    if not regions:
        return gm
    out = copy_graph_module(gm)
    mapping = dict(zip(gm.graph.nodes, out.graph.nodes))
    for region in _find(out):
        if any(mapping.get(r.order) is region.order for r in regions):
            _replace(out, region)
    out.recompile()
    return out
