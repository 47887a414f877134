"""Stages 4-5 for one rank: the planned global program as the local program the rank at a coordinate runs.

``localize`` gives each node its local shapes and the rank's constants (slice offsets, uneven sizes, which
rank holds a partial value); ``lower`` writes each planned redistribution as the collectives on the mesh's
process groups. Every program that runs on ranks (inference, training, a folded step, simulate, pipelining)
is lowered here, so the two stages are composed in one place.
"""
from __future__ import annotations

import torch.fx as fx

from fxshard.lowering.collectives import lower
from fxshard.lowering.groups import MeshGroups
from fxshard.lowering.localize import localize
from fxshard.timing import stage

__all__ = ["lower_for_rank"]


def lower_for_rank(planned: fx.GraphModule, coordinate: tuple[int, ...], groups: MeshGroups) -> fx.GraphModule:
    """Stages 4-5 of ``planned`` (a planned global program: stage 3's) for the rank at ``coordinate``."""
    with stage("localize"):
        localized = localize(planned, coordinate)
    with stage("lower"):
        return lower(localized, coordinate, groups)
