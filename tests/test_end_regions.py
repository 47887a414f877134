"""backend/layers/end_regions.py: a training step's prologue or epilogue is compiled where its ops, run as they are,
cost a step more than ``worth_seconds`` (backend/options.py); the estimate reads layouts, so every rank decides
alike. Which ends of a real step are compiled: tests/test_regions.py."""
from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.fx.experimental.proxy_tensor import make_fx

from fxshard.backend import options
from fxshard.backend.layers import end_regions
from fxshard.graph import LAYOUT
from fxshard.mesh import MeshSpec
from fxshard.placements import layout_from_placements

DP = MeshSpec(dp=4)


def _program(rows: int, local_rows: int, placement) -> torch.fx.GraphModule:
    """x -> (x * 2).exp() + 1, returned: ``mul`` and ``exp`` pass values to ops of the region, ``add`` returns
    its own; ``x`` is [rows, 256] float32 laid out by ``placement``, ``local_rows`` of them on this rank."""
    gm = make_fx(lambda x: ((x * 2).exp() + 1,))(torch.randn(local_rows, 256))
    layout = layout_from_placements(DP, (rows, 256), [placement])
    for node in gm.graph.nodes:
        if node.op != "output":
            node.meta[LAYOUT] = layout
    return gm


def test_an_end_costs_a_call_per_generated_op_and_the_values_it_passes():
    gm = _program(1024, 1024, Replicate())
    passed = 2 * 1024 * 256 * 4  # mul's and exp's values, read by the next op; add's is returned
    tuned = options.DEFAULTS
    assert end_regions.eager_seconds(gm) == 3 * tuned.op_seconds + 2 * passed / tuned.bytes_per_second
    assert end_regions.worth_compiling(gm)  # ~2 ms a step
    assert not end_regions.worth_compiling(_program(16, 16, Replicate()))  # calls alone: 30 us


def test_every_rank_of_an_uneven_layout_estimates_alike():
    """Rows 1023 on 4 ranks: 256 on the first three, 255 on the last; the estimate reads the layout's largest
    local shape, not the rank's own."""
    first, last = _program(1023, 256, Shard(0)), _program(1023, 255, Shard(0))
    assert end_regions.eager_seconds(first) == end_regions.eager_seconds(last)
    assert end_regions.eager_seconds(first) == end_regions.eager_seconds(_program(1024, 256, Shard(0)))


def test_a_value_without_a_layout_counts_its_call_alone():
    gm = _program(1024, 1024, Replicate())
    for node in gm.graph.nodes:
        node.meta.pop(LAYOUT, None)
    assert end_regions.eager_seconds(gm) == 3 * options.DEFAULTS.op_seconds
