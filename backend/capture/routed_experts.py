"""Stage 1: a dropless MoE's routed region in Dynamo's graph -> one ``fxshard::routed_experts`` call.

The region (fxshard/routing.py says why it may be one op): the pairs' expert ids ``keys`` sorted
(``order = argsort(keys)``, or ``sort(keys)[1]``, stable or not), rows gathered by ``order`` (pair space)
or ``order // k`` (token space: ``k`` choices per token), row-wise ops and grouped matmuls over them
whose offsets come from the keys' per-expert counts (``histc`` / ``bincount`` / torchtitan's one-hot sum
of topk ids, then ``cumsum``), expert stacks spread over the rows by those counts (``repeat_interleave``: GPT-OSS's
biases; ``S[sort(keys)[0]]``: transformers'), and the results added back into their tokens (``index_add`` /
``scatter_add`` / ``torchtitan::deterministic_scatter_add`` by the same indices) or put back in pair order by
the sort's inverse (transformers' ``inv[order] = arange``, ``rows[inv]``). The rewrite is made only when
every value of the region is read by the region or by those exits (so the rows' order is never
seen), and only when an expert weight stack arrives sharded by expert, or every stack replicated while
an input is sharded (each rank then routes its own tokens, no dispatch); anything else leaves the
graph as it is, which is exact (the routing then runs replicated and the experts are gathered).

``rewrite`` returns the graph with each such region replaced: the rows in pair order (a token row
repeated ``k`` times), the op, and each add written as a sum over the ``k`` choices.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
import torch.fx as fx

from fxshard.graph import copy_graph_module
from fxshard.layout import Layout
from fxshard.routing import ROUTED_OPS, register_body

from fxshard.backend.capture import routed_kernels  # noqa: F401  (the ops' compiled kernels)
from fxshard.backend.capture.moe_forms import (
    BODY_FORMS, COUNT_OPS, added_back, argument, example, expanded_index, is_grouped_mm, last_bin_is_top_expert,
    one_hot_counts, name_of, row_wise, runs_a_cumsum, schema_name, sorted_source, sorts_by_expert, stack_source,
    shape_of, strip_calls, stripped)

__all__ = ["rewrite"]


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
    spreads: dict = field(default_factory=dict)  # a stack's rows repeated by the counts -> that stack (_spread)


def _orders(gm: fx.GraphModule) -> list[tuple[fx.Node, fx.Node]]:
    """(order, keys) for each stable argsort (or sort's indices) of 1-D integer keys."""
    found = []
    for n in gm.graph.nodes:
        name = name_of(n)
        if name == "argsort" and argument(n, 1, "dim", -1) in (0, -1) and n.kwargs.get("stable"):
            keys = n.args[0]
            order = n
        elif name == "getitem" and sorts_by_expert(n.args[0]) and n.args[1] == 1:
            keys, order = n.args[0].args[0], n
        else:
            continue
        v = example(keys)
        if isinstance(v, torch.Tensor) and v.ndim == 1 and not v.dtype.is_floating_point:
            found.append((order, keys))
    return found


def _counts_of(gm: fx.GraphModule, keys: fx.Node) -> tuple[fx.Node, int] | None:
    """The per-expert counts of ``keys`` (histc over [0, E) in E bins, or bincount with minlength E)."""
    root = stripped(keys)
    for n in gm.graph.nodes:
        name = name_of(n)
        if name not in ("histc", "bincount") or stripped(sorted_source(stripped(n.args[0]))) is not root:
            continue
        if shape_of(n.args[0]) != shape_of(keys):
            continue
        if name == "histc":
            bins, lo, hi = argument(n, 1, "bins", 100), argument(n, 2, "min", 0), argument(n, 3, "max", 0)
            if isinstance(bins, int) and lo == 0 and (hi == bins or last_bin_is_top_expert(bins, hi)):
                return n, bins
        else:
            minlength = argument(n, 2, "minlength", 0)
            if isinstance(minlength, int) and minlength > 0 and argument(n, 1, "weights") is None:
                return n, minlength
    for n in gm.graph.nodes:
        experts = one_hot_counts(n, root, shape_of(keys))
        if experts is not None:
            return n, experts
    return None


def _index_k(n: Any, region: Region) -> int | None:
    """``k`` where ``n`` is ``order`` (1) or ``order // k``."""
    if n is region.order:
        return 1
    if name_of(n) == "floordiv" and n.args[0] is region.order and isinstance(n.args[1], int):
        return n.args[1]
    if name_of(n) == "div" and n.args[0] is region.order and n.kwargs.get("rounding_mode") == "floor" \
            and isinstance(n.args[1], int):
        return n.args[1]
    return None


def _adds_rows_into_tokens(added: tuple, region: Region) -> bool:
    """The add's destination has a row per token of the index (``order // k``: pairs / k rows) and the rows'
    features: what the sum over the k choices it becomes adds into."""
    dest, index, src = added
    k, pairs = region.indices[index], shape_of(region.keys)[0]
    shape, rows = shape_of(dest), shape_of(src)
    return shape is not None and rows is not None and shape[0] * k == pairs and shape[1:] == rows[1:]


def _gathered(n: fx.Node, region: Region) -> tuple[fx.Node, fx.Node] | None:
    """(source, index) of a row gather ``t[i]`` / ``index_select(t, 0, i)`` / ``gather(t, 0, i.expand)``."""
    name = name_of(n)
    if name == "getitem" and isinstance(n.args[1], fx.Node):
        return n.args[0], n.args[1]
    if name == "index_select" and argument(n, 1, "dim") == 0:
        return n.args[0], argument(n, 2, "index")
    if name == "gather" and argument(n, 1, "dim") == 0:
        index, src = argument(n, 2, "index"), n.args[0]
        if shape_of(index) is not None and shape_of(src) is not None and shape_of(index)[1:] == shape_of(src)[1:]:
            return src, expanded_index(index)
    return None


def _inverse_write(inv: Any, region: Region) -> fx.Node | None:
    """The ``inv[order] = arange(N)`` (``operator.setitem``) where ``inv`` is ``empty_like(order)`` written so and
    then only read by row gathers ``t[inv]``: the inverse permutation of the sort (transformers' grouped_mm experts
    restore the pairs' order so); None otherwise (another write or read of ``inv`` could see the order)."""
    pairs = shape_of(region.keys)[0]
    if name_of(inv) not in ("empty_like", "empty", "new_empty") or shape_of(inv) != (pairs,):
        return None
    writes = [u for u in inv.users if u.target is operator.setitem]
    reads = [u for u in inv.users if name_of(u) == "getitem" and u.args[1] is inv and u.args[0] is not inv]
    if len(writes) != 1 or len(writes) + len(reads) != len(inv.users):
        return None
    write = writes[0]
    _, index, value = write.args
    if index is not region.order or name_of(value) != "arange" or not 1 <= len(value.args) <= 2 \
            or value.kwargs.get("step", 1) != 1 or tuple(value.args) not in ((pairs,), (0, pairs)):
        return None
    nodes = list(write.graph.nodes)
    return write if all(nodes.index(write) < nodes.index(r) for r in reads) else None


def _unsorts(n: fx.Node, region: Region) -> tuple[None, fx.Node, fx.Node] | None:
    """(None, inv, source) where ``n`` is ``source[inv]``, the sorted rows put back in pair order by the sort's
    inverse (``_inverse_write``): that is the op's own output for ``source``, so ``n`` becomes it (an exit with
    no add); the pairs' order is the keys', never the sort's, so it shows nothing of the rows' order."""
    if name_of(n) != "getitem" or not isinstance(n.args[1], fx.Node) or _inverse_write(n.args[1], region) is None:
        return None
    return None, n.args[1], n.args[0]


def _eliminate_dead_code(graph: fx.Graph, kept: set) -> None:
    """Removes what the rewrite left unread, and nothing else: ``graph.eliminate_dead_code`` drops every unread
    ``call_method``, in-place ones too (DeepseekV3's attention writes ``key_states[..., :d].copy_(k_nope)`` and its
    router ``group_mask.scatter_(..)``, their results unread: dropped, its logits went wrong), and recurses into
    subgraphs; ``kept`` are the nodes unread before the rewrite (the region's own aside), left as they were."""
    for node in reversed(graph.nodes):
        if not node.users and node not in kept and not node.is_impure():
            graph.erase_node(node)


def _drop_inverses(graph: fx.Graph, inverses: list, kept: set) -> None:
    """After the exits that read them are gone: each inverse permutation's write (a setitem, which dead code
    elimination keeps) where nothing reads it, and then what computed it (the global sort)."""
    _eliminate_dead_code(graph, kept)
    for inv in dict.fromkeys(inverses):
        if all(u.target is operator.setitem for u in inv.users):
            for u in list(inv.users):
                graph.erase_node(u)
    _eliminate_dead_code(graph, kept)


def _grow(gm: fx.GraphModule, region: Region) -> bool:
    """The region's row nodes, count nodes and exits from its seeds; False where a value escapes it."""
    inside: set[fx.Node] = set(region.seeds)
    counted: set[fx.Node] = {region.counts}
    for n in gm.graph.nodes:
        if n in inside or n is region.counts:
            continue
        uses_rows = [a for a in n.all_input_nodes if a in inside]
        stack = (_spread(n, region, counted) or _by_sorted_keys(n, region)) if not uses_rows else None
        if stack is not None and stack not in inside:
            inside.add(n)
            region.spreads[n] = stack
            if stack not in region.stacks:
                region.stacks.append(stack)
            continue
        if not uses_rows:
            if name_of(n) in COUNT_OPS and n.all_input_nodes and all(a in counted for a in n.all_input_nodes) \
                    and shape_of(n) is not None and len(shape_of(n)) == 1:  # per expert still: [experts]
                counted.add(n)
            continue
        added = added_back(n)
        if added is not None and added[2] in inside and added[0] not in inside and added[1] in region.indices \
                and _adds_rows_into_tokens(added, region):
            region.exits[n] = added
            continue
        unsorted = _unsorts(n, region)
        if unsorted is not None and unsorted[2] in inside:
            region.exits[n] = unsorted
            continue
        if is_grouped_mm(n):
            a, b, offs = n.args[0], n.args[1], argument(n, 2, "offs")
            extra = [x for x in list(n.args[3:]) + [v for k, v in n.kwargs.items() if k != "offs"] if x is not None]
            if a in inside and b not in inside and offs in counted and runs_a_cumsum(offs) and not extra \
                    and shape_of(b) is not None \
                    and shape_of(b)[0] == region.experts:
                inside.add(n)
                if b not in region.stacks:
                    region.stacks.append(b)
                continue
            return False
        if row_wise(n, lambda a: a in inside):
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
    others = [a for n in region.rows if n not in region.seeds and n not in region.spreads for a in n.all_input_nodes
              if a not in inside and a not in counted and a not in region.stacks
              and isinstance(example(a), torch.Tensor)]
    region.others = list(dict.fromkeys(others))
    return bool(region.exits) and bool(region.stacks)


def _spread(n: fx.Node, region: Region, counted: set) -> fx.Node | None:
    """The stack ``S`` where ``n`` gives each row its expert's row of ``S``: ``S.repeat_interleave(counts, dim=0)``
    (the rows sorted by expert, ``counts[e]`` of them expert ``e``'s), or as GPT-OSS writes it for a static size,
    ``cat([S, S.new_zeros(1, ..)]).repeat_interleave(cat([counts, (N - cumsum(counts)[-1]).unsqueeze(0)]),
    dim=0, output_size=N)`` with ``N`` the pairs: the counts sum to ``N``, so the padding row is repeated 0 times.
    On a rank that is its experts' rows of ``S`` repeated by their counts, as many as the rows it received."""
    if name_of(n) != "repeat_interleave" or argument(n, 2, "dim") != 0 or len(n.args) < 2 or shape_of(n) is None:
        return None
    pairs = shape_of(region.keys)[0]
    source, repeats = n.args[0], strip_calls(argument(n, 1, "repeats"), ("long", "to", "int"))
    if argument(n, 3, "output_size", pairs) != pairs or not isinstance(shape_of(n)[0], int) or shape_of(n)[0] != pairs:
        return None
    if repeats is region.counts:
        stack = source
    elif name_of(source) == "cat" and name_of(repeats) == "cat" and argument(source, 1, "dim", 0) == 0 \
            and argument(repeats, 1, "dim", 0) == 0 and len(source.args[0]) == 2 and len(repeats.args[0]) == 2:
        stack, pad = source.args[0]
        counts, tail = repeats.args[0]
        tail = strip_calls(tail, ("long", "to", "int", "unsqueeze", "view", "reshape"))
        last = tail.args[1] if name_of(tail) == "sub" and tail.args[0] == pairs and len(tail.args) == 2 else None
        total = strip_calls(last.args[0], ("long", "to", "int")) if name_of(last) == "getitem" else None
        if strip_calls(counts, ("long", "to", "int")) is not region.counts or total is None or last.args[1] != -1 \
                or last.args[0] not in counted or name_of(total) != "cumsum" \
                or argument(total, 1, "dim", 0) not in (0, -1) \
                or strip_calls(total.args[0], ("long", "to", "int")) is not region.counts \
                or name_of(pad) not in ("new_zeros", "zeros") or shape_of(pad) is None or shape_of(pad)[0] != 1:
            return None
    else:
        return None
    shape = shape_of(stack)
    if not isinstance(stack, fx.Node) or shape is None or shape[0] != region.experts or shape[1:] != shape_of(n)[1:]:
        return None
    return stack


def _by_sorted_keys(n: fx.Node, region: Region) -> fx.Node | None:
    """The stack ``S`` where ``n`` is ``S[sort(keys)[0]]``, each sorted row's expert's row of ``S`` (transformers'
    grouped_mm experts gather their biases so): the sorted keys are each expert ``e`` ``counts[e]`` times, so that
    is ``S.repeat_interleave(counts, dim=0)``, a spread (``_spread``) whatever order the sort left within an expert."""
    if name_of(n) != "getitem" or n.op != "call_function" or not isinstance(n.args[1], fx.Node):
        return None
    stack, index = n.args
    sort = region.order.args[0] if name_of(region.order) == "getitem" else None
    if name_of(index) != "getitem" or index.args[0] is not sort or index.args[1] != 0 \
            or sort.args[0] is not region.keys:
        return None
    shape = shape_of(stack)
    if shape is None or shape[0] != region.experts or shape_of(n) != (shape_of(region.keys)[0], *shape[1:]):
        return None
    return stack


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
        if shape_of(keys) is None:
            continue
        pairs = shape_of(keys)[0]
        region.indices = {n: k for n in gm.graph.nodes if (k := _index_k(n, region)) is not None}
        for n in gm.graph.nodes:
            got = _gathered(n, region)
            if got is None or got[1] not in region.indices:
                continue
            source, index = got
            k = region.indices[index]
            if shape_of(source) is not None and shape_of(source)[0] * k == pairs and source not in region.seeds:
                region.seeds[n] = (source, k)
        if region.seeds and _grow(gm, region):
            regions.append(region)
    return regions


def _sharded_by_expert(region: Region, layouts: Mapping[fx.Node, Layout]) -> bool:
    """A stack arrives sharded by expert (expert parallelism), or every stack arrives replicated while an input
    is sharded (data or context parallelism: each rank routes its own tokens through every expert, no
    collective, where the region as written would gather every rank's tokens for its sort)."""
    stacks = [layouts.get(stack_source(stack)) for stack in region.stacks]
    if any(layout is not None and layout.ndim and layout.dim_is_sharded(0) for layout in stacks):
        return True
    return bool(stacks) and all(layout is not None and layout.is_replicated for layout in stacks) \
        and any(not layout.is_replicated for layout in layouts.values())


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
        if n in region.spreads:  # the rank's experts' rows of the stack: as many as the rows it received
            rows = graph.call_method("size", (env[next(iter(region.seeds))], 0))
            repeats = graph.call_method("long", (env[region.counts],))
            env[n] = graph.call_method("repeat_interleave", (env[region.spreads[n]], repeats),
                                       {"dim": 0, "output_size": rows})
            continue
        env[n] = graph.node_copy(n, lambda a: env[a])
        env[n].target = BODY_FORMS.get(schema_name(n), env[n].target)
    sources = list(dict.fromkeys(src for _, _, src in region.exits.values()))
    graph.output(tuple(env[s] for s in sources))
    return fx.GraphModule(torch.nn.Module(), graph), sources


def _pairs(graph: fx.Graph, source: fx.Node, k: int) -> fx.Node:
    """A token-space tensor in pair space: each row repeated ``k`` times (a view of a broadcast: no gather)."""
    if k == 1:
        return source
    shape = shape_of(source)
    wide = graph.call_method("expand", (graph.call_method("unsqueeze", (source, 1)), shape[0], k, *shape[1:]))
    return graph.call_method("reshape", (wide, shape[0] * k, *shape[1:]))


def _replace(gm: fx.GraphModule, region: Region) -> None:
    body, sources = _body(gm, region)
    key = register_body(body)
    graph = gm.graph
    unread = {n for n in graph.nodes if not n.users and n not in region.rows}  # kept: _eliminate_dead_code
    first_exit = min(region.exits, key=list(graph.nodes).index)
    counts_dtype = example(region.counts).dtype
    with graph.inserting_before(first_exit):
        rows = [_pairs(graph, source, k) for source, k in region.seeds.values()]
        call = graph.call_function(ROUTED_OPS[0], (key, rows, region.keys, region.stacks + region.others,
                                                    region.experts, len(region.stacks), counts_dtype))
        outs = {s: graph.call_function(operator.getitem, (call, i)) for i, s in enumerate(sources)}
    for node, (dest, index, source) in region.exits.items():
        k = 1 if dest is None else region.indices[index]  # an unsorting gather's rows are the op's (_unsorts)
        shape = shape_of(source)
        with graph.inserting_before(node):
            out = outs[source]
            if k > 1:
                out = graph.call_method("sum", (graph.call_method("view", (out, shape[0] // k, k, *shape[1:])), 1))
            new = out if dest is None else graph.call_function(operator.add, (dest, out))
        node.replace_all_uses_with(new)
    _drop_inverses(graph, [index for dest, index, _ in region.exits.values() if dest is None], unread)


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
