"""Collectives across regional compilation's cuts: a layer's gathers started a layer early, the
reductions of its gradients waited a layer late, as FSDP2 prefetches and defers them.

Cut into regions (regions.py), a program's collectives overlap compute inside their own region only:
Inductor cannot start layer k+1's gathers while layer k computes, for they are in another program.
So, on the whole program's region map (node -> region), before the cut:

- a gather computed from the program's inputs alone (a layer's parameters; with its bucket's packing)
  starts between the two layers that run before its own: the layer in between computes while it
  moves. Its wait, and what reads it, stay with its layer, which begins with them;
- a collective whose result only leaves the program (a layer's gradients, reduced) is waited between
  the two layers that run after its own: the next layer computes while it moves.

A region between two layers (``RegionRole.BETWEEN``) has a half-integer place in the region map (``k - 1.5``
runs between layers k-2 and k-1: regions run sorted by their map value, the backward's descending) and runs
as its graph: it only starts or waits.
Every layer's region stays one program (each begins with its gathers' waits and ends with its
reductions' starts), so regional compilation compiles no more than before. A collective's tensor
crosses regions un-waited: a functional collective's work waits in a registry, keyed by its tensor,
until ``wait_tensor`` (a region that waits it may be compiled: Inductor's wait reads its input).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from fxshard.lowering.collective_ops import ALL_GATHER, ALL_GATHER_OUT

__all__ = ["start_early_wait_late"]

_c10d = torch.ops._c10d_functional
_GATHERS = (ALL_GATHER, ALL_GATHER_OUT)  # a subset: what starts a layer early


def start_early_wait_late(gm: fx.GraphModule, region: dict[fx.Node, float], last: int,
                          descending: bool = False) -> dict[fx.Node, float]:
    """``region`` with the gathers of layers 0..``last`` started a layer early and the collectives whose
    results only leave the program waited a layer late (``descending``: the regions run last to first)."""
    ahead = -1 if descending else 1  # the index of the next region to run, relative
    for node in list(gm.graph.nodes):
        k = region.get(node)
        if node.op != "call_function" or not _is_layer(k, last) or not _single_wait(node):
            continue
        if node.target in _GATHERS and (early := _from_inputs_alone(node, region, k)) is not None:
            for n in early:
                region[n] = k - 1.5 * ahead
        elif (late := _leaving(next(iter(node.users)))) is not None:
            for n in late:
                region[n] = k + 1.5 * ahead
    return region


def _is_layer(k: float | None, last: int) -> bool:
    return k is not None and float(k).is_integer() and 0 <= k <= last


def _single_wait(node: fx.Node) -> bool:
    return getattr(node.target, "namespace", None) == "_c10d_functional" and len(node.users) == 1 \
        and next(iter(node.users)).target is _c10d.wait_tensor.default


def _from_inputs_alone(node: fx.Node, region: dict[fx.Node, float], k: float) -> set[fx.Node] | None:
    """The collective and what it is computed from in its region, when that reads the program's inputs
    alone (a parameter's packing and views: nothing the layer computes); else None."""
    found: set[fx.Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n in found or n.op in ("placeholder", "get_attr"):
            continue
        if n.op != "call_function" or region.get(n) != k:
            return None  # computed by an earlier region, or something a region cannot hold
        found.add(n)
        stack += n.all_input_nodes
    return found


def _leaving(wait: fx.Node) -> set[fx.Node] | None:
    """The wait and everything computed from it, when all of it only leaves the program (each node reads
    nothing else and is read by the output or by the others); else None."""
    found = {wait}
    stack = [wait]
    while stack:
        for user in stack.pop().users:
            if user.op == "output" or user in found:
                continue
            if user.op != "call_function" or any(a not in found for a in user.all_input_nodes):
                return None
            found.add(user)
            stack.append(user)
    return found
