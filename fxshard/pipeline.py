"""Stages 2-3 as one pure function: a traced global graph in, a planned global graph out."""
from __future__ import annotations

import warnings
from typing import Mapping, Sequence

import torch.fx as fx

from .costs import CostModel
from .factories import shard_factories
from .graph import LOCALIZE
from .layout import Layout
from .local_regions import check_local_regions, mark_local_accumulations
from .mesh import MeshSpec
from .policies import DEFAULT_REFINEMENT, Refinement
from .propagate import Decisions, propagate
from .redistribute import insert_redistributes
from .reduce_together import reduce_together
from .refine import propagate_with_pins
from .softmax_statistics import gather_softmax_statistics
from .registry import recipe_of
from .timing import stage


def propagate_graph(gm: fx.GraphModule, mesh: MeshSpec, input_layouts: Mapping[str, Layout],
                    strict: bool = False, cost_model: CostModel | None = None,
                    output_layouts: Sequence[Layout | None] | None = None,
                    refinement: Refinement = DEFAULT_REFINEMENT,
                    output_names: Sequence[str | None] = (), memo: Decisions | None = None) -> fx.GraphModule:
    """Stage 2 alone (``shard_graph``'s arguments): every node's layout and the layouts it requires of its
    arguments, refined, in place, with no redistribution inserted; propagating the same graph again with other
    input layouts overwrites them (``fxshard.auto_placements`` prices its candidates so)."""
    fallbacks: dict[str, str] = {}
    memo = memo if memo is not None else Decisions()
    propagate_with_pins(lambda pinned, foreseen=None: propagate(
        gm, mesh, input_layouts, strict=strict, cost_model=cost_model, pinned=pinned, output_layouts=output_layouts,
        fallbacks=fallbacks, memo=memo, foreseen=foreseen), gm, cost_model, refinement, output_names)
    for op, seen in fallbacks.items():
        warnings.warn(f"fxshard: no sharding rule for {op} (input layouts: {seen}); it runs replicated (its inputs "
                      "are gathered wherever they are sharded). Give it an entry in fxshard.registry.OPS.",
                      stacklevel=3)
    return gm


def shard_graph(gm: fx.GraphModule, mesh: MeshSpec, input_layouts: Mapping[str, Layout],
                strict: bool = False, cost_model: CostModel | None = None,
                output_layouts: Sequence[Layout | None] | None = None,
                refinement: Refinement = DEFAULT_REFINEMENT,
                output_names: Sequence[str | None] = (), memo: Decisions | None = None) -> fx.GraphModule:
    """Propagate layouts through ``gm`` and insert planned redistributions (in place; returns ``gm``).

    ``output_layouts`` requires layouts of outputs (None where any DTensor-expressible one will do);
    ``output_names`` says which input each output is the gradient of (None: none), for refinement's
    prices (``refine.planned_cost``: one block's gradients are reduced in one call).
    Every node whose arguments stage 4 rewrites gets its localization recipe (``graph.LOCALIZE``).
    ``memo``: decisions made planning another copy of this program (``Decisions.another_copy``).
    """
    propagate_graph(gm, mesh, input_layouts, strict=strict, cost_model=cost_model, output_layouts=output_layouts,
                    refinement=refinement, output_names=output_names, memo=memo)
    with stage("plan"):
        shard_factories(gm)
        check_local_regions(gm)
        insert_redistributes(gm, cost_model=cost_model)
        reduce_together(gm, cost_model)
        gather_softmax_statistics(gm, cost_model)
        for node in gm.graph.nodes:
            recipe = recipe_of(node)
            if recipe is not None:
                node.meta[LOCALIZE] = recipe
        mark_local_accumulations(gm)
    return gm

