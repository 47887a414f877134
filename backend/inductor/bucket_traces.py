"""What Inductor's bucket merges redo at every layer, done once, cheaply, or not at all.

One trace per kind of bucket: the layers' buckets are alike, so their merges are traced once.

Inductor's merge of a bucket (``torch/_inductor/fx_passes/bucketing.py``, ``process_collective_bucket``)
traces the function that runs the merged collective with ``make_fx`` on the members' fake values and
copies the traced nodes into the program. Every layer's bucket of a kind has the same members (the same
shapes, strides and dtypes, the same group): its trace is the same graph, made again, tens of
milliseconds each (an 8-layer FSDP program merges 26 buckets; bench/results/compile.md). Within
``traces_reused`` a trace is made once per function and signature of its arguments and the copies
read it (Inductor copies a trace's nodes into the program and never changes the trace).

And a trace is made without ``make_fx`` (``recorded``) where the function is one whose recording is
tested to be make_fx's graph (``RECORDED``: the bucket functions, a handful of ops each on fake tensors of
static sizes): make_fx's proxies and their bookkeeping cost about as much again as the fake tensors' own
dispatch (a nine-member gather: ~40 ms against ~20).
"""
from __future__ import annotations

import contextlib
import functools
import operator
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakTensorKeyDictionary

from fxshard.backend.inductor.inductor_calls import RECORDED_MERGES, bucketing_function, bucketing_rebound

__all__ = ["RECORDED", "traces_reused", "inputs_not_sorted", "recorded", "users_kept"]

# the functions ``recorded`` traces (by name: Inductor's merges, or this project's), each checked against
# make_fx's trace of it by tests/test_compile_time.py; any other is traced by make_fx
RECORDED = ("fxshard.backend.inductor.bucket_copies._gather_bucket", *RECORDED_MERGES)
_CONSTANTS = (str, int, float, bool, type(None), torch.dtype, torch.device)  # arguments a trace bakes in


@contextlib.contextmanager
def traces_reused() -> Iterator[None]:
    """Within the block, Inductor's bucket merges trace each (function, argument signature) once, and
    those of ``RECORDED`` functions by ``recorded``."""
    original: Callable[[Any, Any], fx.GraphModule] | None = bucketing_function("_trace")
    if original is None:  # a torch that traces otherwise
        yield
        return
    traces: dict = {}

    def made(fn: Any, inputs: Any) -> fx.GraphModule:
        gm = recorded(fn, inputs)
        return gm if gm is not None else original(fn, inputs)

    def trace(fn: Any, inputs: Any) -> fx.GraphModule:
        try:
            key = _signature((fn, inputs))
        except _Unkeyed:
            return original(fn, inputs)
        if key not in traces:
            traces[key] = made(fn, inputs)
        return traces[key]

    with bucketing_rebound("_trace", trace):
        yield


@contextlib.contextmanager
def inputs_not_sorted() -> Iterator[None]:
    """Within the block, Inductor's merges leave the program's inputs out of the region they sort.

    After a merge, ``_sort_bucket_region`` looks for the merged collective's inputs along the program,
    back to its placeholders and forward to its output, and sorts the nodes between. A placeholder (a
    parameter's shard, the input of an FSDP gather) precedes every op and is never found: each gather's
    merge walked the whole program, 0.45 s of a 64-layer program's 129 merges under the profiler (quadratic
    in the layers).
    Without them the walks stop at the inputs that are ops, and the same nodes are sorted."""
    original = bucketing_function("_sort_bucket_region")
    if original is None:  # a torch that sorts otherwise
        yield
        return

    def sort(graph: fx.Graph, new_nodes: list[fx.Node], new_nodes_inputs: list[fx.Node]) -> None:
        original(graph, new_nodes, [n for n in new_nodes_inputs if n.op not in ("placeholder", "get_attr")])

    with bucketing_rebound("_sort_bucket_region", sort):
        yield


@contextlib.contextmanager
def users_kept() -> Iterator[None]:
    """Within the block, a merge whose merged values have the metadata of those they replace leaves their
    readers' fake values as they are.

    After a merge Inductor recomputes the fake value of every reader of a replaced value (the op run again
    on its new arguments' values, ``_recompute_changed_user_metadata``), for the case where the merged one
    is laid out otherwise (a strided slice of the bucket); it keeps a recomputed value only where its
    metadata changed. fxshard's gathers give each member back contiguous, as it was: nothing can change,
    and the readers (each layer's weights' matmuls) were dispatched again for nothing (~6 ms a merge).
    A merge whose values do change is recomputed as before."""
    insert = bucketing_function("_insert_fn_trace_before_node")
    recompute = bucketing_function("_recompute_changed_user_metadata")
    same = bucketing_function("_same_metadata")
    if insert is None or recompute is None or same is None:  # a torch that merges otherwise
        yield
        return

    def inserted(graph: fx.Graph, fn: Any, inputs: Any, before: fx.Node, graph_inputs: list[fx.Node],
                 graph_outputs: list[fx.Node]) -> tuple[dict[fx.Node, fx.Node], list[fx.Node]]:
        replaced = [(node, node.meta.get("val")) for node in graph_outputs]
        readers: list[fx.Node] = []
        with bucketing_rebound("_recompute_changed_user_metadata", readers.extend):
            replacements, new_nodes = insert(graph, fn, inputs, before, graph_inputs, graph_outputs)
        if not all(same(val, replacements[node].meta.get("val")) for node, val in replaced):
            recompute(readers)
        return replacements, new_nodes

    with bucketing_rebound("_insert_fn_trace_before_node", inserted):
        yield


class _Unkeyed(Exception):
    """A trace argument with no signature (symbolic sizes, an unhashable value): traced every time."""


def _signature(value: Any) -> Any:
    """What a trace depends on: a tensor's shape, strides, dtype and device; containers by their
    items; a partial by its function and bound arguments; other values as they are (a group's name,
    a size, a dtype, the function)."""
    if isinstance(value, functools.partial):  # torch 2.15 merges a reduce_scatter by a new partial each time
        return ("partial", _signature(value.func), _signature(value.args),
                _signature(tuple(sorted(value.keywords.items()))))
    if isinstance(value, torch.Tensor):
        sizes = (*value.shape, *value.stride())
        if not all(type(s) is int for s in sizes):
            raise _Unkeyed
        return ("tensor", tuple(value.shape), value.stride(), value.dtype, value.device)
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_signature(v) for v in value))
    try:
        hash(value)
    except TypeError:
        raise _Unkeyed from None
    return ("value", value)


def recorded(fn: Any, inputs: Any) -> fx.GraphModule | None:
    """``fn`` traced as Inductor's ``bucketing._trace`` traces it (``make_fx`` in the inputs' fake mode with
    the Python dispatcher, its ``detach`` nodes dropped), by recording the ops it dispatches: the same nodes,
    names, values and metadata. None where ``fn`` is not one of ``RECORDED`` or an input is not a fake tensor
    of static sizes or a constant, or ``fn`` reads a tensor from elsewhere: make_fx traces those."""
    from torch._dispatch.python import enable_python_dispatcher
    from torch._guards import detect_fake_mode

    leaves = pytree.tree_leaves(inputs)
    fake_mode = detect_fake_mode(leaves)
    if (_name(fn) not in RECORDED or fake_mode is None or _should_save_eager_input_vals is None
            or not all(isinstance(x, _CONSTANTS) or _static_fake(x) for x in leaves)):
        return None
    recorder = _Recorder(_detach_traced_as())
    for k, x in enumerate(leaves):  # make_fx makes one placeholder per argument, constants too
        placeholder = recorder.graph.placeholder(f"arg{k}")
        if isinstance(x, torch.Tensor):
            recorder.bind(x, placeholder)
    try:
        with fake_mode, enable_python_dispatcher(), recorder:
            out = fn(*inputs)
        recorder.graph.output([recorder.node_of(x) for x in pytree.tree_leaves(out)])
    except _Unrecorded:
        return None
    for node in recorder.graph.find_nodes(op="call_function", target=torch.ops.aten.detach.default):
        node.replace_all_uses_with(node.args[0])
        recorder.graph.erase_node(node)
    return fx.GraphModule(torch.nn.Module(), recorder.graph)


try:  # what make_fx's proxy mode does per op, which the recorder does as it does
    from torch.fx.experimental.proxy_tensor import _should_save_eager_input_vals, extract_val, snapshot_fake
    from torch.fx.passes.shape_prop import _extract_tensor_metadata
except ImportError:  # a torch without them: make_fx traces
    _should_save_eager_input_vals = None


def _name(fn: Any) -> str:
    """A bucket function's qualified name, through the partials that bind its arguments (torch 2.15's
    reduce_scatter merge binds its inputs' shapes and unpadded indices by keyword)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', '')}"


@functools.cache
def _detach_traced_as() -> Any:
    """The op make_fx records a ``detach`` as, asked of make_fx once: ``aten.alias`` from torch 2.15 (its default
    decompositions rewrite ``detach``), ``aten.detach`` before (which ``bucketing._trace`` drops)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.fx.experimental.proxy_tensor import make_fx

    with unset_fake_temporarily():
        graph = make_fx(torch.ops.aten.detach.default)(torch.empty(0)).graph
    return next(node.target for node in graph.nodes if node.op == "call_function")


def _static_fake(x: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(x, FakeTensor) and all(type(n) is int for n in (*x.shape, *x.stride()))


class _Unrecorded(Exception):
    """The function read a tensor that is neither an input nor made by a recorded op."""


class _Recorder(TorchDispatchMode):
    """Each op dispatched, a node of ``graph`` as make_fx's proxy mode makes it: named after the op, its
    tensors the nodes that made them, its value (``val``, ``tensor_meta``) and, where make_fx keeps them,
    its arguments' values; a list result gets a ``getitem`` node per element, made at once. An op that writes
    into its arguments (``out=``) and returns nothing is a node with no value, as make_fx makes it."""

    def __init__(self, detach_as: Any) -> None:
        super().__init__()
        self.graph = fx.Graph()
        self._detach_as = detach_as  # what make_fx records a detach as (``_detach_traced_as``)
        # held weakly, as make_fx's tracker holds them: torch.empty's and torch.zeros's bindings detach a result held
        # elsewhere, a detach make_fx never sees (and which torch 2.15's make_fx, recording it as an alias, keeps)
        self._nodes: WeakTensorKeyDictionary = WeakTensorKeyDictionary()

    def node_of(self, x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        known = self._nodes.get(x)
        if known is None:
            raise _Unrecorded
        return known

    def bind(self, x: torch.Tensor, node: fx.Node) -> None:
        """``x`` is now ``node``'s value (an op writing into its ``out`` argument makes it the op's)."""
        self._nodes[x] = node
        node.meta["val"] = snapshot_fake(x)
        node.meta["tensor_meta"] = _extract_tensor_metadata(x)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is torch.ops.aten.detach.default:
            func = self._detach_as
        # torch 2.15's custom-ops gather unpacks by ``split_with_sizes_copy.out``, a mutation returning nothing
        if not (func._schema.is_mutable or any(isinstance(x, torch.Tensor) for x in pytree.tree_leaves(out))):
            return out  # a device, a size: make_fx records none (static sizes are constants to it too)
        node_args, node_kwargs = pytree.tree_map(self.node_of, (args, kwargs))
        node = self.graph.create_node("call_function", func, node_args, node_kwargs,
                                      name=self.graph._target_to_str(func.overloadpacket.__name__))
        if _should_save_eager_input_vals(func, (node_args, node_kwargs)):
            node.meta["eager_input_vals"] = fx.node.map_aggregate(
                (node_args, node_kwargs), lambda v: extract_val(v.meta["val"]) if isinstance(v, fx.Node) else None)
        if isinstance(out, torch.Tensor):
            self.bind(out, node)
        elif out is not None:
            node.meta["val"] = extract_val(out)
            for k, x in enumerate(out):
                self.bind(x, self.graph.create_node("call_function", operator.getitem, (node, k), name="getitem"))
        return out
