"""Regional compilation: a lowered local program cut at its layers, each distinct layer compiled once.

Inductor's time grows with the graph it is given; a model's layers are the same program on other
weights. So the local forward (backward) is cut into contiguous regions, prologue, one per layer
(``layers.N``), epilogue; a region is keyed by its code (nodes renamed by position) and its inputs'
shapes, strides and dtypes; one region per key goes to ``compile_local`` and every region with that
key calls the result. The program around the regions only sequences calls (``RegionalProgram``; a
region, its role and its key: ``regional_program.py``). ``programs/stage6.py`` runs the steps here in order.
The prologue and the epilogue (embedding, final norm, output projection, loss) are compiled too, once
each: their ops run uncompiled cost more per step than their compile costs once (a training step of
bench/train.py's Llama under TP, one process: ~48 ms with them uncompiled, ~43 compiled, ~42 the whole
program; 1.5-3 s more on the first step, whatever the number of layers); a training step's end with little
to fuse runs as its graph (``end_regions.py``). What runs between two layers
(a layer's gathers started early, its reductions waited late: ``prefetch.py``) is only collectives and
runs as its graph, its collectives bucketed all the same (``compile_local.bucketed_uncompiled``).

Regions come from the program's structure, the same on every rank. Forward: a layer's parameters
(the placeholders ``<prefix>_<N>_...`` of the most common indexed prefix) start region N; any other
input is prologue (-1) or, when it first meets the rest of the program after the last layer's
parameters do (final norm, output projection, targets), epilogue; every node joins the latest
region among its inputs', and what runs between two layers (the next norm's statistics) the later
one. Backward: a saved value places a node in the region of the forward nodes that read it (where
their backward is), a tangent in the epilogue, and every node joins the earliest region among its
inputs' (gradients flow from the last layer to the first). A node computed from no input joins the
one region that reads it, or the program's first. Nodes keep their order within a region and the
regions run in order (forward ascending, backward descending): a valid order, since each node's
region follows its inputs'. Collectives move with their region, in the same order on every rank,
and stay in the region that makes their input (a layer holds its own, the same in every layer), as do
the other nodes stage 5 wrote for a redistribution (``LOWERED_MOVE``: a partial sum's copy on one
rank). Layers that compute alike return alike (``_same_outputs``): one compiled program. Cutting
pays only where a compiled layer serves ``Options.shared_layers`` layers or more (layers whose parameters have
the same names but for the index, and the same global layouts); otherwise (a 2-layer model, a
tensor-parallel MLP of two different Linears) each program is compiled whole: one call, not one per
layer. The root block's gathers (``buckets.tag_blocks``) go to the prologue, and its gradients'
reductions to the backward's end: one bucket each, as FSDP2 gathers the root before the first layer.
With bucketing, the buckets are merged on a copy of the whole program before the cut, and a layer's
gathers start a layer early, its reductions waited a layer late, in regions between two layers (``prefetch.py``).
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Callable, Collection, Mapping, Sequence

import torch
import torch.fx as fx

from fxshard.graph import LAYOUT, LOWERED_MOVE, copy_nodes, graph_module, new_node

from fxshard.layer_names import ROOT, layer_of_inputs, within_layer
from fxshard.backend.inductor.buckets import BLOCK_KEY
from fxshard.backend.layers.regional_program import Region, RegionRole, argument_key, program_structure
from fxshard.backend.options import in_force

__all__ = ["forward_regions", "backward_regions", "saved_regions", "split_regions", "region_maps", "program_copy",
           "last_layer", "cut", "layers_alike"]

_NO_META = ("stack_trace",)  # node meta not copied into a region: it would make equal layers' code differ
_c10d = torch.ops._c10d_functional


def forward_regions(gm: fx.GraphModule, root_gathers_first: bool = True) -> dict[fx.Node, int]:
    """Node -> region of a forward program (placeholders included); empty when it has no layers.
    ``root_gathers_first=False``: where each node's work is, before the root's gathers (and what they
    read) move into the prologue to share its bucket (``saved_regions`` reads that placement)."""
    layers = layer_of_inputs(gm)
    if not layers:
        return {}
    last = max(layers.values())
    source, meets = _single_sources(gm)
    last_meets = min((meets[p] for p, k in layers.items() if k == last and p in meets), default=None)
    index: dict[fx.Node, int] = {}
    for p in gm.graph.find_nodes(op="placeholder"):
        late = last_meets is not None and meets.get(p, -1) > last_meets
        index[p] = layers.get(p, last + 1 if late else -1)
    # what a layer hands the next (a view, a reduction, a conversion) stays in it, as the prologue's stays in
    # the prologue: every layer, the first too, starts alike (the backward sinks such nodes: _sink)
    region = _cut_before_consumers(gm, _assign(gm, index, max, first=-1, final=last + 1), index, source)
    return _root_gathers_first(gm, region) if root_gathers_first else region


def backward_regions(gm: fx.GraphModule, saved: Sequence[int | None], epilogue: int) -> dict[fx.Node, int]:
    """Node -> region of a backward program whose first placeholders are the forward's saved values,
    ``saved[k]`` the region of saved value k's readers (``saved_regions``); the rest (tangents) are the
    epilogue's."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    sources = {p: saved[k] if k < len(saved) else epilogue for k, p in enumerate(placeholders)}
    region = _sink(gm, _assign(gm, sources, min, first=epilogue, final=-1), runs_before=lambda a, b: a > b,
                   first=epilogue)
    return _root_reductions_last(gm, region)


def _root_gathers_first(gm: fx.GraphModule, region: dict[fx.Node, int]) -> dict[fx.Node, int]:
    """The gathers of the parameters outside the layers (block ``root``, ``buckets.tag_blocks``) and what
    they read move into the prologue: one bucket gathers the root's parameters before the first layer,
    as FSDP2 does, where the epilogue's (final norm, output projection) would be a second call."""
    for node in gm.graph.nodes:
        if node.target is _c10d.all_gather_into_tensor.default and _block(node) == ROOT and _single_wait(node):
            for moved in _ancestors(node) | {node, next(iter(node.users))}:
                region[moved] = -1
    return region


def _root_reductions_last(gm: fx.GraphModule, region: dict[fx.Node, int]) -> dict[fx.Node, int]:
    """The reduce_scatters of the root's gradients and what follows them to the outputs move into the
    backward's last region (the prologue's): one bucket after the whole backward, as FSDP2 reduces the
    root's gradients, where the epilogue's would be a second call."""
    for node in gm.graph.nodes:
        if node.target is _c10d.reduce_scatter_tensor.default and _block(node) == ROOT:
            chain, value = [node], node
            while len(value.users) == 1 and next(iter(value.users)).op != "output":
                value = next(iter(value.users))
                if len(value.all_input_nodes) != 1:
                    break
                chain.append(value)
            else:
                for moved in chain:
                    region[moved] = -1
    return region


def _communicates(node: fx.Node) -> bool:
    """A collective or its wait: it stays where its input is made (it starts as soon as it can, and a
    layer's region holds its own collectives only, the same in every layer)."""
    return getattr(node.target, "namespace", None) == "_c10d_functional"


def _block(node: fx.Node) -> str | None:
    return (node.meta.get("custom") or {}).get(BLOCK_KEY)


def _single_wait(node: fx.Node) -> bool:
    return len(node.users) == 1 and next(iter(node.users)).target is _c10d.wait_tensor.default


def _ancestors(node: fx.Node) -> set[fx.Node]:
    found: set[fx.Node] = set()
    stack = [a for a in node.all_input_nodes if a.op == "call_function"]
    while stack:
        n = stack.pop()
        if n not in found:
            found.add(n)
            stack += [a for a in n.all_input_nodes if a.op == "call_function"]
    return found


def saved_regions(forward: fx.GraphModule, region: Mapping[fx.Node, int], num_outputs: int) -> list[int | None]:
    """Per saved value of a forward program (its outputs after the first ``num_outputs``): the region
    of the forward nodes that read it, where the backward needs it; None when several regions do (the
    rotary tables every layer reads) or none: such a value places nothing."""
    output = next(iter(forward.graph.find_nodes(op="output")))
    found: list[int | None] = []
    for value in output.args[0][num_outputs:]:
        readers = {region[u] for u in value.users if u.op != "output"} if isinstance(value, fx.Node) else set()
        found.append(readers.pop() if len(readers) == 1 else None)
    return found


_MANY = object()  # a value computed from several inputs


def _single_sources(gm: fx.GraphModule) -> tuple[dict[fx.Node, Any], dict[fx.Node, int]]:
    """Per node the one placeholder it is computed from (``_MANY``, None: several, none); per placeholder
    the position of the first node that computes from it and from another input (where it "meets")."""
    source: dict[fx.Node, Any] = {}
    meets: dict[fx.Node, int] = {}
    for position, node in enumerate(gm.graph.nodes):
        if node.op == "placeholder":
            source[node] = node
            continue
        found = {source[a] for a in node.all_input_nodes if source.get(a) is not None}
        source[node] = next(iter(found)) if len(found) == 1 else (_MANY if found else None)
        if source[node] is _MANY:
            for s in found - {_MANY}:
                meets.setdefault(s, position)
    return source, meets


def _cut_before_consumers(gm: fx.GraphModule, region: dict[fx.Node, int], index: Mapping[fx.Node, int],
                          source: Mapping[fx.Node, Any]) -> dict[fx.Node, int]:
    """Moves what runs between two layers into the later one, as a block owns its input norm.

    A node computed after the last use of its region's inputs and first needed where a later region's
    inputs meet the program (the norm statistics of the next layer's input, the final norm's) joins
    that region, unless it reads a node its own region needs (the residual add that ends a layer), is
    read by several regions or computed from no input (those stay where ``_assign`` put them).
    """
    def meeting(u: fx.Node) -> int | None:
        if source.get(u) is not _MANY:
            return None
        found = [index[source[a]] for a in u.all_input_nodes if source.get(a) in index]
        return min(found) if found else None

    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    needed: dict[fx.Node, int | None] = {}
    for node in reversed(nodes):
        found = [k for u in node.users if u.op != "output" for k in (meeting(u), needed.get(u)) if k is not None]
        needed[node] = min(found) if found else None

    moved = dict(region)
    stayed: set[fx.Node] = set()

    def anchored(x: fx.Node, k: int) -> bool:
        """``x`` ends region ``k``'s work: a node the region needs (its parameters meet there), or the
        only reader of one that stayed (a redistribution's chain after the layer's last matmul)."""
        if x.op == "placeholder":
            return index.get(x) == k
        if moved.get(x) != k:
            return False
        if x in stayed:
            return sum(u.op != "output" for u in x.users) == 1
        return meeting(x) == k or needed.get(x) is None or needed[x] <= k

    def shared(node: fx.Node) -> bool:  # read by several regions (the rotary tables), or by the program's end
        return len({region[u] if u.op != "output" else None for u in node.users}) > 1

    for node in nodes:
        k, later = region[node], needed[node]
        if later is not None and later > k:
            if source.get(node) is None or shared(node) or _communicates(node) or node.meta.get(LOWERED_MOVE) or \
                    any(anchored(x, k) for x in node.all_input_nodes):
                stayed.add(node)
            else:
                k = later
        moved[node] = max([k] + [moved[x] for x in node.all_input_nodes if x.op == "call_function"])
    return moved


def _sink(gm: fx.GraphModule, region: dict[fx.Node, int], runs_before: Callable[[int, int], bool],
          first: int) -> dict[fx.Node, int]:
    """The backward's: a node of one input (a view, a transpose, zeros like a value) that only a later
    region reads moves into it: the layout a region's reader wants is the reader's business (a layer's
    gradient viewed for the next layer's matmul, the embedding gradient's zeros). A layer's collective
    that only the next region reads moves too (every layer then starts with it), but not the ``first``
    region's, nor the views of its result: the first layer would hold what the others do not, and be
    compiled as a program of its own."""
    for node in reversed([n for n in gm.graph.nodes if n.op == "call_function"]):
        readers = {region[u] for u in node.users if u.op != "output"}
        if region[node] == first and _follows_collective(node):
            continue
        if len(node.all_input_nodes) <= 1 and len(readers) == 1:
            (reader,) = readers
            if runs_before(region[node], reader):
                region[node] = reader
    return region


def _follows_collective(node: fx.Node) -> bool:
    """A collective, its wait, or a chain of one-input nodes (views) from one."""
    while not _communicates(node):
        ins = node.all_input_nodes
        if len(ins) != 1 or ins[0].op != "call_function":
            return False
        node = ins[0]
    return True


def _assign(gm: fx.GraphModule, sources: Mapping[fx.Node, int], combine: Callable[..., int], first: int,
            final: int) -> dict[fx.Node, int]:
    """Each computing node's region: ``combine`` of its inputs'; a node reading no input: the one region
    that reads it, else ``first`` (the output node counts as ``final``)."""
    region: dict[fx.Node, int | None] = dict(sources)
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    for node in nodes:
        known = [region[a] for a in node.all_input_nodes if region.get(a) is not None]
        region[node] = combine(known) if known else None
    for node in reversed(nodes):
        if region[node] is None:
            readers = {final if u.op == "output" else region[u] for u in node.users}
            region[node] = readers.pop() if len(readers) == 1 else first
    return region  # type: ignore[return-value]


def split_regions(gm: fx.GraphModule, region: Mapping[fx.Node, int], descending: bool = False,
                  only: Collection[Any] | None = None, share: bool = False, last: int | None = None) -> list[Region]:
    """The program's computing nodes as regions, in the order they run (ascending region, or descending);
    ``only``: just the regions of these indices (the others' graphs are not built); ``share``: regions of the
    same code on inputs of the same shapes, strides and dtypes share one graph (``_sharing_key``: what compiles
    them is one program already, ``region_key``), so a model's layers build one graph, not one each (~5 ms a
    layer); ``last``: the last layer, what follows is the epilogue (None: every region from 0 up is a layer)."""
    position = {n: k for k, n in enumerate(gm.graph.nodes)}
    nodes = sorted((n for n in gm.graph.nodes if n.op == "call_function" and (only is None or region[n] in only)),
                   key=lambda n: (-region[n] if descending else region[n], position[n]))
    groups: list[list[fx.Node]] = []
    for node in nodes:
        if groups and region[groups[-1][-1]] == region[node]:
            groups[-1].append(node)
        else:
            groups.append([node])
    if not share:
        return [_region(_role(region[g[0]], last), g) for g in groups]
    built: dict[tuple, Region] = {}
    regions = []
    for g in groups:
        inputs, outputs = _boundary(g)
        key = _sharing_key(g, inputs, outputs)
        first = built.get(key)
        if first is None:
            first = built[key] = _region(_role(region[g[0]], last), g, (inputs, outputs))
            first.structure = program_structure(first.graph.graph)
            regions.append(first)
        else:
            role, index = _role(region[g[0]], last)
            regions.append(Region(role, first.graph, inputs, outputs, index, body=g, structure=first.structure))
    return regions


def _boundary(nodes: list[fx.Node]) -> tuple[list[fx.Node], list[fx.Node]]:
    """The outer values ``nodes`` read, in the order they first read them, and those of theirs read outside."""
    inside = set(nodes)
    inputs: dict[fx.Node, None] = {}
    for node in nodes:
        for a in node.all_input_nodes:
            if a not in inside:
                inputs.setdefault(a)
    return list(inputs), [n for n in nodes if any(u not in inside for u in n.users)]


def _sharing_key(nodes: list[fx.Node], inputs: list[fx.Node], outputs: list[fx.Node]) -> tuple:
    """Equal for two regions exactly when ``_region`` builds them the same code on inputs of the same shapes,
    strides and dtypes (what ``region_key`` compiles one program for)."""
    name = {x: ("in", k) for k, x in enumerate(inputs)}
    name.update((n, ("v", k)) for k, n in enumerate(nodes))

    def arg(a: Any) -> Any:
        return argument_key(a, name)

    def meta(x: fx.Node) -> Any:
        val = x.meta.get("val")
        if isinstance(val, torch.Tensor):
            return (tuple(val.shape), tuple(val.stride()), val.dtype, val.device)
        return ("value", repr(val))

    return (tuple(meta(x) for x in inputs), tuple((n.target, arg(n.args), arg(n.kwargs)) for n in nodes),
            tuple(name[o] for o in outputs))


def _region(role: tuple[RegionRole, int | None], nodes: list[fx.Node],
            boundary: tuple[list[fx.Node], list[fx.Node]] | None = None) -> Region:
    """``nodes`` as a program of their own, in ``role`` (and layer): outer values they read become placeholders
    (``boundary``: the values they read and those read outside, where known)."""
    inputs, outputs = boundary if boundary is not None else _boundary(nodes)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for k, x in enumerate(inputs):
        env[x] = graph.placeholder(f"in_{k}")
        env[x].meta = {key: v for key, v in x.meta.items() if key not in _NO_META}
    for k, node in enumerate(nodes):
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: env[a])
        env[node] = new_node(graph, "call_function", node.target, args, kwargs, name=f"v{k}")
        env[node].meta = {key: v for key, v in node.meta.items() if key not in _NO_META}
    graph.output(tuple(env[o] for o in outputs))
    return Region(role[0], graph_module(torch.nn.Module(), graph), inputs, outputs, role[1], body=nodes)


def region_maps(programs: Sequence[fx.GraphModule], num_outputs: int | None = None) -> tuple[dict, ...] | None:
    """Node -> region of each program, before its collectives are bucketed or moved across the cuts: of a forward
    (inference) program, or (``num_outputs`` given) of a training step's forward and backward; None where the
    forward has no layers. A map's value orders its region: -1 the prologue, k layer k, ``last_layer`` + 1 the
    epilogue (``prefetch.py`` adds half-integers, between two layers)."""
    if num_outputs is None:
        (gm,) = programs
        region = forward_regions(gm)
        return (region,) if region else None
    forward, backward = programs
    placed = forward_regions(forward, root_gathers_first=False)
    if not placed:
        return None
    epilogue = max(placed.values()) + 1
    # where the backward of a saved value's readers is: before the root's gathers move into the prologue,
    # which would take a gathered value the loss reads (the targets, in a plan that gathers them) and, the
    # backward's regions being the minimum of their inputs', every gradient after it into the prologue
    saved = saved_regions(forward, placed, num_outputs)
    return _root_gathers_first(forward, dict(placed)), backward_regions(backward, saved, epilogue)


def program_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of a program to cut: bucketing its collectives before the cut (``merge``) rewrites the
    graph, and the lowered program stays what fxshard lowered (the one users and tests read)."""
    graph = fx.Graph()
    graph.output(copy_nodes(graph, gm.graph, {}))
    return graph_module(gm, graph)


def last_layer(gm: fx.GraphModule) -> int:
    """A forward program's last layer (-1: none); what follows it is the epilogue, the backward's too."""
    return max(layer_of_inputs(gm).values(), default=-1)


def cut(gm: fx.GraphModule, region: Mapping[fx.Node, float], last: int, descending: bool = False) -> list[Region]:
    """The program's regions by its region map, or none where cutting gains nothing: one region, or an op a region
    cannot hold. Whether cutting pays at all (``layers_alike`` of the forward: no layer's compiled program serving
    ``shared_layers`` layers, as at two layers or a tensor-parallel MLP's two different Linears, where the whole
    program compiled as one costs no more to compile and less to run: one call instead of one per region, and
    fusion across the cuts) the caller asks first. Both facts come from names and global layouts, so every rank
    decides alike (the cut decides the buckets, which must be the same on every rank)."""
    if not region or any(n.op not in ("placeholder", "get_attr", "call_function", "output") for n in gm.graph.nodes):
        return []
    if any(not isinstance(getattr(gm, n.target), torch.Tensor) for n in gm.graph.find_nodes(op="get_attr")):
        return []  # a subgraph a higher-order op calls (flex attention's score_mod) is no region's input: compiled whole
    regions = split_regions(gm, region, descending, share=True, last=last)
    return _same_outputs(regions) if len(regions) >= 2 else []


def _role(position: float, last: int | None) -> tuple[RegionRole, int | None]:
    """A region map's value as its region's role and layer (``region_maps``); ``last`` None: every region from 0
    up is a layer."""
    if not float(position).is_integer():
        return RegionRole.BETWEEN, None
    if position < 0:
        return RegionRole.PROLOGUE, None
    if last is not None and position > last:
        return RegionRole.EPILOGUE, None
    return RegionRole.LAYER, int(position)


def layers_alike(gm: fx.GraphModule) -> bool:
    """Whether ``shared_layers`` layers of ``gm`` or more take alike parameters: the same names but for the
    layer's index, in the same layouts (global shapes and shardings, not local shapes: those may differ by
    rank) and dtypes."""
    params: dict[int, list[tuple]] = {}
    for p, k in layer_of_inputs(gm).items():
        val = p.meta.get("val")
        params.setdefault(k, []).append((within_layer(p.name), p.meta.get(LAYOUT),
                                         getattr(val, "dtype", None)))
    kinds = Counter(tuple(sorted(v, key=lambda t: t[0])) for v in params.values())
    return max(kinds.values(), default=0) >= in_force().shared_layers


def _same_outputs(regions: list[Region]) -> list[Region]:
    """Layers that compute alike but return different values return them all: one compiled program.

    What a layer returns is what later regions read, and the last layer's reader is the epilogue, not a
    layer: where the next layer reads a value the epilogue does not (the residual stream before its
    all_reduce, with FSDP x TP), the last layer's program would differ from the others' by its outputs
    alone and be compiled apart. Each layer of a group with one body returns the union of the group's
    outputs; a value no region reads is dropped as soon as its region returns (``RegionalProgram``)."""
    groups: dict[tuple, list[Region]] = {}
    for r in regions:
        if r.role is RegionRole.LAYER:
            structure = r.structure if r.structure is not None else program_structure(r.graph.graph)
            groups.setdefault(structure[:-1], []).append(r)  # all but the output node
    for group in groups.values():
        union = sorted({k for r in group for k in _output_positions(r)})
        for r in group:
            if _output_positions(r) != union:
                _return(r, union)
    returned: dict[int, tuple] = {}  # a graph regions share is returned from once: its structure read once
    for r in regions:
        if r.structure is None:
            r.structure = returned.setdefault(id(r.graph), program_structure(r.graph.graph))
    return regions


def _output_positions(region: Region) -> list[int]:
    """Where in the region's body (its computing nodes, in order) each of its outputs is."""
    position = {o: k for k, o in enumerate(region.body)}
    return [position[o] for o in region.outputs]


def _return(region: Region, positions: list[int]) -> None:
    """``region`` returns its body's nodes at ``positions``, in that order."""
    inner = [n for n in region.graph.graph.nodes if n.op == "call_function"]
    output = next(iter(region.graph.graph.find_nodes(op="output")))
    output.args = (tuple(inner[k] for k in positions),)
    region.graph.recompile()
    region.outputs = [region.body[k] for k in positions]
    region.structure = None  # ``region_key`` reads the graph's (regions sharing it return alike: _same_outputs)
