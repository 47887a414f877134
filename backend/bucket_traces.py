"""What Inductor's bucket merges redo at every layer, done once or not at all.

One trace per kind of bucket: the layers' buckets are alike, so their merges are traced once.

Inductor's merge of a bucket (``torch/_inductor/fx_passes/bucketing.py``, ``process_collective_bucket``)
traces the function that runs the merged collective with ``make_fx`` on the members' fake values and
copies the traced nodes into the program. Every layer's bucket of a kind has the same members (the same
shapes, strides and dtypes, the same group): its trace is the same graph, made again, tens of
milliseconds each (an 8-layer FSDP program merges 26 buckets; bench/results/compile.md). Within
``traces_reused`` a trace is made once per function and signature of its arguments and the copies
read it (Inductor copies a trace's nodes into the program and never changes the trace).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx

__all__ = ["traces_reused", "inputs_not_sorted"]


@contextlib.contextmanager
def traces_reused() -> Iterator[None]:
    """Within the block, Inductor's bucket merges trace each (function, argument signature) once."""
    from torch._inductor.fx_passes import bucketing

    original: Callable[[Any, Any], fx.GraphModule] = bucketing._trace
    traces: dict = {}

    def trace(fn: Any, inputs: Any) -> fx.GraphModule:
        try:
            key = _signature((fn, inputs))
        except _Unkeyed:
            return original(fn, inputs)
        if key not in traces:
            traces[key] = original(fn, inputs)
        return traces[key]

    bucketing._trace = trace
    try:
        yield
    finally:
        bucketing._trace = original


@contextlib.contextmanager
def inputs_not_sorted() -> Iterator[None]:
    """Within the block, Inductor's merges leave the program's inputs out of the region they sort.

    After a merge, ``_sort_bucket_region`` looks for the merged collective's inputs along the program,
    back to its placeholders and forward to its output, and sorts the nodes between. A placeholder (a
    parameter's shard, the input of an FSDP gather) precedes every op and is never found: each gather's
    merge walked the whole program, 0.45 s of a 64-layer program's 129 merges under the profiler (quadratic
    in the layers).
    Without them the walks stop at the inputs that are ops, and the same nodes are sorted."""
    from torch._inductor.fx_passes import bucketing

    original = getattr(bucketing, "_sort_bucket_region", None)
    if original is None:  # a torch that sorts otherwise
        yield
        return

    def sort(graph: fx.Graph, new_nodes: list[fx.Node], new_nodes_inputs: list[fx.Node]) -> None:
        original(graph, new_nodes, [n for n in new_nodes_inputs if n.op not in ("placeholder", "get_attr")])

    bucketing._sort_bucket_region = sort
    try:
        yield
    finally:
        bucketing._sort_bucket_region = original


class _Unkeyed(Exception):
    """A trace argument with no signature (symbolic sizes, an unhashable value): traced every time."""


def _signature(value: Any) -> Any:
    """What a trace depends on: a tensor's shape, strides, dtype and device; containers by their
    items; other values as they are (a group's name, a size, a dtype, the function)."""
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
