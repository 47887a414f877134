"""Stage 6 up to Inductor, composed in one place: a rank's lowered program(s) cut into the regions that compile.

Inference, training, a folded training step and simulate cut their lowered programs here (``cut_into_regions``),
lazily where the program compiles at its first call. The steps, in the order they run:

1. copy: the steps below rewrite copies (``regions.program_copy``); the lowered programs stay what stage 5
   wrote (what users, tests and the lowered cache read);
2. tag blocks (bucketing): each gather and gradient reduce_scatter named with its layer's block
   (``buckets.tag_blocks``), from the whole program's names (a region's are not the parameters');
3. region maps: each node's region, prologue, layers, epilogue (``regions.region_maps``);
4. merge buckets (bucketing): a block's collectives one call, on the whole program (``buckets.merge_blocks``);
5. unfold (a folded step): the four layers' bucketed programs made whole, each copy of a layer's nodes in
   its layer's region (``fold_lowered.FoldedLowering.unfolded_regions``);
6. prefetch (overlap): a layer's gathers started a layer early, its reductions waited a layer late
   (``prefetch.start_early_wait_late``);
7. cut: the regions (``regions.cut``), or none where no cut pays (``regions.layers_alike``).

Then each region compiles as the first call reaches it (``regional_program.RegionalProgram``): a training
step's prologue and epilogue only where that pays (``end_regions.py``, ``TrainingProgram._compile_region``),
every region of an inference program; Inductor buckets and windows their collectives (``compile_local``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch.fx as fx

from fxshard.backend.inductor.buckets import merge_blocks, tag_blocks
from fxshard.backend.layers.prefetch import start_early_wait_late
from fxshard.backend.layers.regional_program import Region
from fxshard.backend.layers.regions import cut, last_layer, layers_alike, program_copy, region_maps

__all__ = ["Cut", "Unfold", "cut_into_regions"]

Maps = tuple[dict[fx.Node, float], ...]
# a folded step's bucketed four-layer programs and their region maps -> the whole programs and theirs; None
# where they do not unfold
Unfold = Callable[[Sequence[fx.GraphModule], Maps], "tuple[Sequence[fx.GraphModule], Maps] | None"]


@dataclass
class Cut:
    """What stage 6 cut: per program (the inference program; a training step's forward and backward) the
    program its regions were cut from (bucketed), and its regions; all empty where no cut pays (compiled whole)."""

    graphs: tuple[fx.GraphModule, ...]
    regions: tuple[list[Region], ...]


def cut_into_regions(lowered: Sequence[fx.GraphModule], *, num_outputs: int | None = None,
                     grad_names: Sequence[str | None] = (), bucketing: bool = False, overlap: bool = True,
                     unfold: Unfold | None = None) -> Cut | None:
    """Steps 1-7 (the module docstring) on ``lowered``: one inference program, or (``num_outputs``: the forward's
    outputs before its saved values) a training step's forward and backward, whose outputs are the gradients
    ``grad_names`` name. ``bucketing`` runs steps 2 and 4, ``overlap`` step 6, ``unfold`` step 5 (``lowered``:
    the four layers'); None where those do not unfold (not seen: the whole lowered programs are cut then)."""
    whole = tuple([] for _ in lowered)
    if unfold is None and not layers_alike(lowered[0]):  # no cut pays (the backward's layers are the forward's):
        return Cut(tuple(lowered), whole)                 # nor are copies bucketed for one (seconds at 2 layers)
    graphs = [program_copy(gm) for gm in lowered]  # 1
    if bucketing:  # 2
        for gm, names in zip(graphs, ((), grad_names)):
            tag_blocks(gm, names)
    maps = region_maps(graphs, num_outputs)  # 3
    if maps is None:
        return Cut(tuple(graphs), whole)
    if bucketing:  # 4: on the four layers where folded (on the whole program a merge cost ~25 ms a layer)
        for gm, region in zip(graphs, maps):
            if region:
                merge_blocks(gm, region)
    if unfold is not None:  # 5
        unfolded = unfold(graphs, maps)
        if unfolded is None:
            return None
        graphs, maps = list(unfolded[0]), unfolded[1]
        if not layers_alike(graphs[0]):
            return Cut(tuple(graphs), whole)
    last = last_layer(graphs[0])
    regions: list[list[Region]] = []
    for k, (gm, region) in enumerate(zip(graphs, maps)):
        descending = k == 1  # the backward runs its regions last to first
        if overlap and region:  # 6
            start_early_wait_late(gm, region, last, descending)
        regions.append(cut(gm, region, last, descending))  # 7
        if not regions[0]:  # nor does the backward's cut pay: its epilogue is the tangents' plumbing, no loss
            return Cut(tuple(graphs), whole)
    return Cut(tuple(graphs), tuple(regions))
