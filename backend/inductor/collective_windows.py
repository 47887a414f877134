"""A collective's window: the compute that does not need its result runs between its start and its wait.

Tensor parallelism's backward reduces each block's input gradient (the column-parallel projections'
partial sums: an all_reduce, or with sequence parallelism a reduce_scatter) while that block's weight
gradients, which read only the gradient before it and a saved or recomputed activation, have yet to run:
Megatron-LM issues the reduction asynchronously and computes the weight gradients meanwhile. Inductor's
scheduler would too (``sink_waits_iterative`` moves a wait below compute that does not read its result),
but two things stop it:

- its topological order puts the weight gradients' matmuls *before* the collective's start, among the
  input gradients' (they read the same gradient), where no pass moves them past the start;
- its fusion merges the recomputed norm output, which those matmuls read, with the norm's backward, which
  reads the reduced gradient: the matmuls then follow the wait (one kernel writes both).

``CollectiveWindows``, an Inductor post-grad pass, adds ordering edges (Inductor's ``control_deps``): each
lone collective's start before every compute kernel (``COMPUTE``: matmuls, attention) that neither feeds
it nor reads its result, and that kernel before its wait. A kernel goes to the first such collective in
program order (one window; later windows see the edges already made, so no edge closes a cycle), never
to one where it would make a collective start before another that started before it (every rank must
issue the same collectives in one order), and a fusion that would put the kernel's inputs behind the
wait becomes a cycle Inductor refuses. The sort that applies the edges moves nodes later, never earlier:
a kernel goes behind a start, and a start gets ahead only of the kernels its window took (a gathered
buffer lives through its window: TP + SP's gathered gradients, one block's activation each). A collective
whose result another lone one reads through no matmul (TP + SP's backward: the reduce_scattered input
gradient, the norm's backward, the residual's gradient gathered) gets no window of its own: Inductor's
reordering would raise the second over it (``_starts_another``), so its kernels go to the second's.

Lone: no other collective of its kind (all_reduce, reduce_scatter, all_gather) is independent of it in
the data flow, as in a chain of activations and their gradients (TP's, TP + SP's). A lone all_reduce is
one Inductor's greedy all_reduce bucketing, which runs after this pass and expects a collective's wait as
it was made, would leave alone; the gathers and reduce_scatters were bucketed before it
(``backend/inductor/buckets.py``). FSDP's gathers and reduce_scatters, independent of each other across blocks,
are not lone: Inductor's reordering prefetches them within the memory it allows, which a window that
holds every independent kernel behind a start would not. ``tests/test_overlap.py`` reads the generated
code.
"""
from __future__ import annotations

import hashlib
import pathlib
from typing import Iterable

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.utils._ordered_set import OrderedSet

from fxshard.graph import reachable
from fxshard.lowering.collective_ops import ALL_TO_ALL, LOWERED

__all__ = ["COMPUTE", "CollectiveWindows", "collective_windows"]

aten = torch.ops.aten
_c10d = torch.ops._c10d_functional
# the kernels worth overlapping with a collective: a library's, not fused by Inductor
COMPUTE = frozenset({
    aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten.convolution, aten.convolution_backward,
    aten._scaled_dot_product_flash_attention_for_cpu, aten._scaled_dot_product_flash_attention_for_cpu_backward,
    aten._scaled_dot_product_flash_attention, aten._scaled_dot_product_flash_attention_backward,
    aten._scaled_dot_product_efficient_attention, aten._scaled_dot_product_efficient_attention_backward,
    aten._scaled_dot_product_cudnn_attention, aten._scaled_dot_product_cudnn_attention_backward,
})
# the collectives that get windows, where lone (the module docstring)
WINDOWED = frozenset(LOWERED) - {ALL_TO_ALL}  # a subset: the kinds "Lone" names (an all_to_all gets no window)


class CollectiveWindows(CustomGraphPass):
    """Inductor's post-grad pass (``collective_windows``); its cache key is this file."""

    def __call__(self, graph: fx.Graph) -> None:
        collective_windows(graph)

    def uuid(self) -> str:
        return hashlib.sha256(pathlib.Path(__file__).read_bytes()).hexdigest()


def collective_windows(graph: fx.Graph) -> dict[fx.Node, list[fx.Node]]:
    """Each lone collective of ``graph`` -> the compute kernels put between its start and its wait (the
    module docstring); the edges are made with Inductor's ``control_deps``. Nothing where this torch has no
    ``preserve_node_ordering`` or ``_stable_topological_sort``."""
    try:
        from torch._dynamo.graph_deduplication import _stable_topological_sort
        from torch._inductor.fx_passes.control_dependencies import preserve_node_ordering
    except ImportError:  # a torch without ordering edges: the order Inductor chooses
        return {}
    windows = _windows(graph)
    if not windows:
        return {}
    after: dict[fx.Node, list[fx.Node]] = {}  # node -> the nodes it must follow, beyond its inputs
    for start, kernels in windows.items():
        wait = _wait_of(start)
        for kernel in kernels:
            after.setdefault(kernel, []).append(start)
        after.setdefault(wait, []).extend(kernels)
    edges = {node: OrderedSet(deps) for node, deps in after.items()}
    # each node after its inputs and its edges, moved no further than they make it (raises on a cycle)
    _stable_topological_sort(graph, edges)
    preserve_node_ordering(graph, edges)
    return windows


def _windows(graph: fx.Graph) -> dict[fx.Node, list[fx.Node]]:
    """Each lone collective's start -> its window's kernels, in program order (first window first).

    A kernel joins a window only if it neither leads to the start nor follows from it, counting the
    windows made before and the order collectives are issued in: no window makes a collective start
    before one that started before it in the program (each rank must issue them in one order)."""
    nodes = [n for n in graph.nodes if n.op == "call_function"]
    starts = [n for n in nodes if n.target in WINDOWED and _wait_of(n) is not None]
    kernels = [n for n in nodes if _is_compute(n)]
    if not starts or not kernels:
        return {}
    extra_inputs: dict[fx.Node, list[fx.Node]] = {}  # the edges beyond the data flow, both ways
    extra_users: dict[fx.Node, list[fx.Node]] = {}

    def link(earlier: fx.Node, later: fx.Node) -> None:
        extra_inputs.setdefault(later, []).append(earlier)
        extra_users.setdefault(earlier, []).append(later)

    def inputs(n: fx.Node) -> Iterable[fx.Node]:
        return [*n.all_input_nodes, *extra_inputs.get(n, ())]

    def users(n: fx.Node) -> Iterable[fx.Node]:
        return [*n.users, *extra_users.get(n, ())]

    issued = _issued(graph)
    for earlier, later in zip(issued, issued[1:]):
        link(earlier, later)
    placed: set[fx.Node] = set()
    windows: dict[fx.Node, list[fx.Node]] = {}
    # a collective another of its kind is independent of: Inductor may bucket the two, or prefetch them (FSDP's)
    lone = [n for n in starts if _lone(n, [other for other in starts if other.target is n.target])]
    collectives, lone_starts = set(issued), set(lone)
    for start in lone:
        if _starts_another(_wait_of(start), collectives, lone_starts):
            continue  # Inductor would raise that one over this window: the kernels go to its window
        before, behind = reachable(start, inputs), reachable(start, users)
        window = [k for k in kernels if k not in placed and k not in before and k not in behind]
        if not window:
            continue
        wait = _wait_of(start)
        for kernel in window:
            link(start, kernel)
            link(kernel, wait)
        placed.update(window)
        windows[start] = window
    return windows


def _lone(start: fx.Node, kind: list[fx.Node]) -> bool:
    """No other collective of ``kind`` (``start``'s own) is independent of ``start`` in the data flow."""
    related = reachable(start, lambda n: n.all_input_nodes) | reachable(start, lambda n: n.users)
    return all(other is start or other in related for other in kind)


def _starts_another(wait: fx.Node, collectives: set[fx.Node], lone: set[fx.Node]) -> bool:
    """Whether a lone collective reads ``wait``'s result through no compute kernel and no other collective
    (TP + SP's backward: a block's input gradient reduce_scattered, the norm's backward, the residual
    gradient gathered for the block before). Inductor's ``reorder_communication_preserving_peak_memory``
    raises a collective together with the nodes it reads, up to the first matmul or collective, over any
    node it does not read, and counts no ordering edge: it would raise that collective, ``wait`` with it,
    over ``wait``'s window, whose kernels would overlap the second collective instead. They are given to
    the second's window from the start."""
    reached = reachable(wait, lambda n: () if n in collectives or _is_compute(n) else n.users)
    return not reached.isdisjoint(lone)


def _is_compute(node: fx.Node) -> bool:
    """A kernel worth overlapping (``COMPUTE``)."""
    return getattr(node.target, "overloadpacket", None) in COMPUTE


def _issued(graph: fx.Graph) -> list[fx.Node]:
    """The collectives of ``graph`` in the order they are issued (waits aside)."""
    return [n for n in graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
            and n.target.namespace == "_c10d_functional" and n.target is not _c10d.wait_tensor.default]


def _wait_of(start: fx.Node) -> fx.Node | None:
    """The collective's ``wait_tensor``: its one reader, as fxshard lowers it."""
    readers = list(start.users)
    if len(readers) == 1 and readers[0].target is _c10d.wait_tensor.default:
        return readers[0]
    return None
