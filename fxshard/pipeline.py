"""Stages 2-3 as one pure function: a traced global graph in, a planned global graph out."""
from __future__ import annotations

from typing import Mapping, Sequence

import torch.fx as fx

from .factories import shard_factories
from .layout import Layout
from .local_regions import check_local_regions
from .mesh import MeshSpec
from .planner import CostModel
from .propagate import propagate
from .redistribute import insert_redistributes
from .refine import propagate_with_pins


def shard_graph(gm: fx.GraphModule, mesh: MeshSpec, input_layouts: Mapping[str, Layout],
                strict: bool = False, cost_model: CostModel | None = None,
                output_layouts: Sequence[Layout | None] | None = None) -> fx.GraphModule:
    """Propagate layouts through ``gm`` and insert planned redistributions (in place; returns ``gm``).

    ``output_layouts`` requires layouts of outputs (None where any DTensor-expressible one will do).
    """
    propagate_with_pins(lambda pinned: propagate(gm, mesh, input_layouts, strict=strict, cost_model=cost_model,
                                                 pinned=pinned, output_layouts=output_layouts), gm, cost_model)
    shard_factories(gm)
    check_local_regions(gm)
    return insert_redistributes(gm, cost_model=cost_model)


def output_layouts(gm: fx.GraphModule) -> tuple[Layout, ...]:
    out = next(n for n in gm.graph.nodes if n.op == "output")
    return tuple(a.meta["layout"] for a in out.args[0])
