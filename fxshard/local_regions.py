"""Check local regions: code that ran on ``to_local()`` shards, read by fxshard as a global program.

Stage 1 tags every node computed from a local shard with ``LOCAL_REGION`` (where in the
user's code it came from), the node that produced each eager value with ``EAGER_SHAPE``
(the coordinate and the local shape eager code had there), and the pin that
``DTensor.from_local`` ends a region with with ``REGION_EXIT``. Reading the region
globally runs exactly the eager per-rank code when no value in it is redistributed and
every local shape is the eager one; anything else is an error, never a silent change of
meaning.
"""
from __future__ import annotations

from typing import Sequence

import torch.fx as fx

from .graph import ARG_LAYOUTS, EAGER_SHAPE, LAYOUT, LOCAL_REGION, LOCALIZE, REGION_EXIT, tensor_inputs
from .layout import Layout
from .localization import MaskedAccumulate, MaskedLookup

_ADVICE = ("That code runs on each rank's shard in eager mode; fxshard reads it as a global program and the two "
           "disagree here. Keep DTensors through it instead (use_local_output=False in the parallel style), "
           "or write its views with -1 for the sharded size.")


class LocalRegionError(RuntimeError):
    """Code after to_local() means something else read globally than it did per rank."""


def check_local_regions(gm: fx.GraphModule) -> None:
    """Raise LocalRegionError where a propagated local region differs from its eager per-rank meaning."""
    for node in gm.graph.nodes:
        where = node.meta.get(LOCAL_REGION) or node.meta.get(REGION_EXIT)
        if where is None:
            continue
        _check_inputs(node, where)
        eager = node.meta.get(EAGER_SHAPE)
        layout = node.meta.get(LAYOUT)
        if eager is not None and isinstance(layout, Layout):
            coordinate, shape = eager
            local = tuple(int(s) for s in layout.local_shape(coordinate))
            if local != tuple(shape):
                raise LocalRegionError(
                    f"{where}: on the rank at {coordinate} this value had local shape {list(shape)} in eager mode, "
                    f"but read globally it is laid out as {layout} (local shape {list(local)}). {_ADVICE}")


def _check_inputs(node: fx.Node, where: str) -> None:
    required: Sequence = node.meta.get(ARG_LAYOUTS, ())
    for a, want in zip(tensor_inputs(node), required):
        have = a.meta.get(LAYOUT)
        if isinstance(want, Layout) and have != want:
            what = "from_local() declares" if node.meta.get(REGION_EXIT) else f"{node.target} needs"
            raise LocalRegionError(f"{where}: {what} {want} but the value computed from local shards is laid out as "
                                   f"{have}, so it would need a redistribution eager code never did. {_ADVICE}")


def mark_local_accumulations(gm: fx.GraphModule) -> None:
    """Give a lookup's backward the mark of the local region its lookup lies in.

    A region's lookup of the rank's own table shard keeps the ids eager computed for that shard
    (``lowering/localize.indexes_its_own_shard``: torchtitan's vocab-parallel embedding shifts them by
    ``dist.get_rank()`` itself). Autograd makes the accumulation of its gradient outside the region, at
    the same ids, which may be computed on plain tensors and so carry no mark: unmarked, stage 4 shifted
    them into the rank's block a second time and the rank's rows of the table gradient got nothing.
    Run on the planned joint graph, where the lookup and its accumulation are both still there."""
    for node in gm.graph.nodes:
        recipe = node.meta.get(LOCALIZE)
        if not isinstance(recipe, MaskedAccumulate) or LOCAL_REGION in node.meta:
            continue
        for ids in node.args[recipe.indices]:
            lookups = [u for u in getattr(ids, "users", ()) if LOCAL_REGION in u.meta
                       and isinstance(u.meta.get(LOCALIZE), MaskedLookup) and u.args[u.meta[LOCALIZE].index] is ids]
            if lookups:
                node.meta[LOCAL_REGION] = lookups[0].meta[LOCAL_REGION]
