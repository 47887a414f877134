"""The graph contract: every key of ``node.meta`` fxshard reads or writes, declared in one table.

Every stage passes the same ``torch.fx`` graph on, annotated in ``node.meta``. ``META_KEYS`` below names each
key, who writes it and what it holds: torch's own (``val``: the fake value; Dynamo's ``example_value``,
``grapharg``, ``stack_trace``, ...), read as torch writes them, and fxshard's, written through the constants
here (or, for a key one backend module owns, the constant beside it). tests/test_architecture.py reads the
sources and fails on a key not in the table, and on a declared key no stage names any more.

The helpers below are the graph questions several stages ask (a node's tensor arguments, what
it requires of them, which input a value views, the outputs).
"""
from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import torch
import torch.fx as fx
from torch.fx._lazy_graph_module import _make_graph_module, _use_lazy_graph_module

from .layout import Layout

LAYOUT = "layout"
ARG_LAYOUTS = "arg_layouts"
PLAN = "plan"
SRC_LAYOUT = "src_layout"
NEEDED_BY = "needed_by"
LOCALIZE = "localize"
LOCAL_REGION = "fxshard_local_region"
EAGER_SHAPE = "fxshard_eager_local_shape"
REGION_EXIT = "fxshard_region_exit"
CHECKPOINTED = "fxshard_checkpointed"
GROUP_AXES = "fxshard_group_axes"  # the mesh axes whose process group an op's ``group`` argument names (stage 5)
LOWERED_MOVE = "fxshard_lowered_move"  # a node stage 5 wrote for a redistribution (regions keep it with its input)

PROPAGATED = (LAYOUT, ARG_LAYOUTS)  # what one propagation writes (refine.py snapshots these)


class MetaKey(NamedTuple):
    key: str
    writer: str  # who writes it (torch's keys: which part of torch)
    holds: str


META_KEYS: tuple[MetaKey, ...] = (
    # torch's own
    MetaKey("val", "torch (make_fx, Dynamo); every stage that makes a node",
            "the node's fake value (a tuple of them for a multi-output op)"),
    MetaKey("tensor_meta", "torch (make_fx, ShapeProp)", "a tensor value's shape, strides and dtype"),
    MetaKey("example_value", "Dynamo", "the fake value of a node of Dynamo's graph (the global one: a DTensor)"),
    MetaKey("grapharg", "Dynamo", "a placeholder's input: its example and its source (what Dynamo guards)"),
    MetaKey("stack_trace", "Dynamo, make_fx", "the user's code that made the node"),
    MetaKey("nn_module_stack", "Dynamo", "the modules the node ran in (outermost first)"),
    MetaKey("custom", "torch.fx.traceback (AOTAutograd carries it to the joint graph)",
            "a user's annotations; fxshard's keys in it are ``CUSTOM_KEYS``"),
    MetaKey("eager_input_vals", "make_fx; backend/inductor/bucket_traces.py records it as make_fx does",
            "an op's arguments' values, for Inductor's passes that need them eagerly"),
    MetaKey("user_visible_output_idxs", "Inductor; backend/inductor/compile_inner.py on the output node",
            "which outputs keep the program's strides"),
    # fxshard's
    MetaKey(LAYOUT, "stage 2 (fxshard/propagate.py)", "``Layout`` of a tensor value; for a multi-output op a "
            "tuple, one per output (``None`` for a non-tensor output); ``getitem`` nodes pick theirs"),
    MetaKey(ARG_LAYOUTS, "stage 2 (fxshard/propagate.py)", "the layouts a node requires of its tensor "
            "arguments, in argument order (of the output node: of the returned values)"),
    MetaKey(PLAN, "stage 3 (fxshard/redistribute.py)", "a ``redistribute`` node's ``Plan`` (fxshard/plans.py)"),
    MetaKey(SRC_LAYOUT, "stage 3 (fxshard/redistribute.py)",
            "a ``redistribute`` node's input layout (``layout`` is its output's)"),
    MetaKey(NEEDED_BY, "stage 3 (fxshard/redistribute.py)",
            "a ``redistribute`` node's consumers, as text (``redistribution_reason``)"),
    MetaKey(LOCALIZE, "stage 3 (fxshard/pipeline.py)", "how stage 4 rewrites the node's non-tensor arguments "
            "for one rank (a recipe of fxshard/localization.py; absent: nothing to rewrite)"),
    MetaKey(LOCAL_REGION, "stage 1 (backend/capture/trace.py)",
            "where in the user's code a node computed from a ``to_local()`` shard came from"),
    MetaKey(EAGER_SHAPE, "stage 1 (backend/capture/trace.py)",
            "``(coordinate, shape)``: the local shape eager code had for this value there"),
    MetaKey(REGION_EXIT, "stage 1 (backend/capture/trace.py)",
            "the pin ``DTensor.from_local`` ends a local region with (where, in the code)"),
    MetaKey(CHECKPOINTED, "stage 1 (backend/capture/trace.py)", "where the ``torch.utils.checkpoint`` region a "
            "forward node ran in was called: the training split recomputes it in the backward instead of saving it"),
    MetaKey(GROUP_AXES, "stage 4 (lowering/localize.py, a ``RoutedGroup`` recipe)", "the mesh axes whose process "
            "group stage 5 (lowering/collectives.py) writes into an op's ``group`` argument (routed experts)"),
    MetaKey(LOWERED_MOVE, "stage 5 (lowering/collectives.py)",
            "True: a node written for a redistribution (regions keep it with its input)"),
    MetaKey("fxshard_stamp", "backend/programs/fold.py (``STAMP``)",
            "of an unfolded program's copy of the template's node: the layer it is for"),
    MetaKey("fxshard_region", "backend/programs/fold_lowered.py (``REGION``)",
            "of a bucketed four-layer program's node: the region it runs in"),
    MetaKey("fxshard_step", "backend/simulate_plan.py", "the index of the plan step a simulated node lowers"),
)

# fxshard's keys inside torch's ``node.meta["custom"]`` (which AOTAutograd carries into the joint graph)
CUSTOM_KEYS: tuple[MetaKey, ...] = (
    MetaKey("fxshard_block", "backend/inductor/buckets.py (``BLOCK_KEY``)", "the block a collective belongs to"),
    MetaKey("fxshard_merged", "backend/inductor/buckets.py", "True: a block's merged collective"),
)


# ---- typed accessors -------------------------------------------------------------------------------
def required_layouts(node: fx.Node) -> tuple[Any, ...] | None:
    """What a propagated node requires of its tensor arguments (None: not propagated)."""
    return node.meta.get(ARG_LAYOUTS)


def set_strategy(node: fx.Node, required: Sequence[Layout], out: Any) -> None:
    """Stage 2's decision for ``node``: its arguments in ``required``, its output(s) laid out as ``out``."""
    node.meta[ARG_LAYOUTS] = tuple(required)
    node.meta[LAYOUT] = out


def value(node: Any) -> Any:
    """The fake value torch recorded for a node (None for a non-node or a node without one)."""
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def metadata(v: Any) -> Any:
    """What an op's rules and decompositions may read of a value, hashable: a tensor's shape, strides,
    storage offset, dtype and device (its elements are fake); nodes by their fake value; containers
    element-wise; other constants by type and value."""
    if isinstance(v, fx.Node):
        v = value(v)
    if isinstance(v, torch.Tensor):
        return (tuple(v.shape), tuple(v.stride()), v.storage_offset(), v.dtype, v.device)
    if isinstance(v, (tuple, list)):
        return (type(v), tuple(metadata(x) for x in v))
    if isinstance(v, dict):
        return (dict, tuple((k, metadata(x)) for k, x in v.items()))
    return (type(v), v)


def dtype_of(node: fx.Node) -> torch.dtype:
    v = value(node)
    return v.dtype if isinstance(v, torch.Tensor) else torch.float32




# ---- graph questions -------------------------------------------------------------------------------
def argument_leaves(tree: Any, out: list[Any] | None = None) -> list[Any]:
    """The leaves of a node's arguments (tuples, lists, dicts, in order), as ``pytree.tree_leaves``
    gives them for fx's containers: a plain recursion, several times faster (propagation asks per node)."""
    out = [] if out is None else out
    if not isinstance(tree, (tuple, list, dict)):
        out.append(tree)
        return out
    for x in tree.values() if isinstance(tree, dict) else tree:
        if isinstance(x, (tuple, list, dict)):  # recursing into containers only: half the calls
            argument_leaves(x, out)
        else:
            out.append(x)
    return out


def tensor_inputs(node: fx.Node) -> list[fx.Node]:
    """The tensor-valued input nodes of ``node`` in argument order (duplicates kept)."""
    flat = argument_leaves((node.args, node.kwargs))
    return [a for a in flat if isinstance(a, fx.Node) and isinstance(value(a), torch.Tensor)]


def requirements(node: fx.Node, arguments: Sequence[fx.Node] | None = None) -> list[tuple[fx.Node, Layout]]:
    """(tensor argument, the layout ``node`` requires of it) pairs of a propagated node; ``arguments``:
    its ``tensor_inputs`` (an output node's: the values it returns), where the caller has them already."""
    required = required_layouts(node)
    if required is None:
        return []
    args = tensor_inputs(node) if arguments is None else arguments
    return list(zip([a for a in args if LAYOUT in a.meta], required))


def output_node(gm: fx.GraphModule) -> fx.Node:
    return next(n for n in reversed(gm.graph.nodes) if n.op == "output")


def outputs(gm: fx.GraphModule) -> list[fx.Node]:
    """The values a graph returns (its output node's flat tuple)."""
    return list(output_node(gm).args[0])


def output_layouts(gm: fx.GraphModule) -> tuple[Layout, ...]:
    return tuple(a.meta[LAYOUT] for a in outputs(gm))




def input_root(node: fx.Node, relabels: Any) -> fx.Node | None:
    """The placeholder ``node`` is a relabelling of (through the ops in ``relabels``), or None."""
    while node.op == "call_function" and node.target in relabels and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node if node.op == "placeholder" else None


def reachable(node: fx.Node, step: Any) -> set[fx.Node]:
    """Every node reached from ``node`` by ``step`` (node -> its neighbours: ``lambda n: n.users`` for
    descendants, ``lambda n: n.all_input_nodes`` for ancestors), ``node`` itself excluded unless on a cycle."""
    found: set[fx.Node] = set()
    stack = [node]
    while stack:
        for other in step(stack.pop()):
            if other not in found:
                found.add(other)
                stack.append(other)
    return found


def eliminate_dead_code(graph: fx.Graph) -> None:
    """``graph.eliminate_dead_code()`` for a graph in order (not linted here) and without submodules: each node
    that no one reads and that has no side effect (``Node.is_impure``; random ops are impure), in reverse order.
    fx's asks every node whether it is impure before counting its readers: in a 32-layer step unfolded from four
    layers (backend/programs/fold.py) that was ~14k schema reads for a few hundred dead nodes."""
    for node in reversed(graph.nodes):
        if not node.users and node.op != "output" and not node.is_impure(True):
            graph.erase_node(node)


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy with its own nodes (and their meta dicts), so a rewrite leaves ``gm`` as it was."""
    graph = fx.Graph()
    out = copy_nodes(graph, gm.graph, {})
    graph.output(out)
    return graph_module(gm, graph)


def new_node(graph: fx.Graph, op: str, target: Any, args: tuple = (), kwargs: dict | None = None,
             name: str | None = None, type_expr: Any = None) -> fx.Node:
    """``graph.create_node(op, target, args, kwargs, name, type_expr)`` in about half its time.

    torch 2.13's ``create_node`` walks every call's arguments with pytree (~23 of its ~50 us) for a raw
    symbolic size, only to warn of one; fxshard's stages copy tens of thousands of nodes a step (copies of
    programs, layers stamped and unfolded, regions) whose sizes are ints. The node is made without arguments
    and they are set after (the setter updates users as the constructor does); a graph whose module watches
    nodes being made (a create-node hook would see them without arguments) takes ``create_node``."""
    module = graph.owning_module
    if module is not None and getattr(module, "_create_node_hooks", None):
        return graph.create_node(op, target, args, kwargs, name, type_expr)
    node = graph.create_node(op, target, name=name, type_expr=type_expr)
    if args:
        node.args = args
    if kwargs:
        node.kwargs = kwargs
    return node


def copy_node(graph: fx.Graph, node: fx.Node, arg_transform: Any = lambda a: a) -> fx.Node:
    """``graph.node_copy(node, arg_transform)`` made by ``new_node``: its name (if free), type and a copy of its
    meta."""
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), arg_transform)
    copied = new_node(graph, node.op, node.target, args, kwargs, node.name, node.type)
    copied.meta = dict(node.meta)
    return copied


def copy_nodes(graph: fx.Graph, source: fx.Graph, val_map: dict[fx.Node, Any]) -> Any:
    """``graph.graph_copy(source, val_map)`` made by ``copy_node``: every node of ``source`` not in ``val_map``
    copied (and entered there) up to its output, whose value it returns (None without an output)."""
    for node in source.nodes:
        if node in val_map:
            continue
        if node.op == "output":
            return fx.node.map_arg(node.args[0], val_map.__getitem__)
        val_map[node] = copy_node(graph, node, val_map.__getitem__)
    return None


def graph_module(root: torch.nn.Module, graph: fx.Graph) -> fx.GraphModule:
    """``fx.GraphModule(root, graph)``; made within ``code_on_demand()``, it writes its Python code when first
    run or read, not at once."""
    return _make_graph_module(root, graph)


def code_on_demand() -> Any:
    """A block within which graph modules made (and ``recompile()``d) write their Python code only when first
    run or read (torch's lazy graph modules, as Inductor's passes use them). The stages rewrite and copy
    graphs that never run as Python (the planned global graph; what Inductor compiles from its nodes):
    writing each one's code at once (``exec`` of thousands of lines) was ~10% of fxshard's compile."""
    return _use_lazy_graph_module(True)
