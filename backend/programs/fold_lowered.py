"""Stages 4-6 of a folded training step (``fold.py``): lowered on its four layers, cut into regions unfolded.

``lower_folded`` runs stages 4-5 on the four-layer plan for this rank and checks that its lowered layers 1
and L-2 are alike (``fold._Layers.of``). What it returns, a ``FoldedLowering``, gives the step everything but
whole lowered programs: their signature, the bucket cap, and the regions the step runs. The regions come from
the four layers too (``stage6.cut_into_regions``, its unfold step ``unfolded_regions``): their collectives are
bucketed there (``buckets.merge_blocks``, on each region: the cost of a whole program's merge was ~25 ms a
layer) and each node is tagged with its region; the bucketed program is unfolded (layer 1's nodes copied per
dropped layer, each copy's region its layer's); and the whole bucketed program is cut by those regions, its
gathers started a layer early and reductions waited a layer late (``prefetch.py``), exactly as cutting the
unfolded lowered programs would. The lowered programs themselves are unfolded only should someone read them
(``TrainingProgram.forward_graph``; the lowered cache keeps the four layers', ``unfolded_lowered`` makes them
whole when a later run reads them): the step runs its regions.
``tests/test_fold.py`` checks the regions against the whole model's (each one's code, and what every value the
regions hand each other computes).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Sequence

import torch.fx as fx

from fxshard.lowering.groups import MeshGroups
from fxshard.timing import stage

from fxshard.backend.programs.fold import STAMP, Shortened, _Layers, _Step
from fxshard.backend.inductor.compile_local import block_bytes
from fxshard.backend.programs.joint import TrainingPlan
from fxshard.backend.programs.training import LoweredTraining, lower_training

__all__ = ["FoldedLowering", "lower_folded", "unfolded_lowered"]

REGION = "fxshard_region"  # node.meta of a bucketed four-layer program: the region the node runs in


def lower_folded(plan: TrainingPlan, short: Shortened, device_mesh: Any) -> "FoldedLowering | None":
    """Stages 4-5 of the ``short`` plan for this rank (at 64 layers localize and lower 2.1 -> 0.4 s), checked
    unfoldable; None where the lowered layers are not alike (not seen: ``fold.unfold`` found the planned ones
    alike, and a layer's local code follows from its layouts)."""
    coordinate = tuple(int(c) for c in device_mesh.get_coordinate())
    lowered = lower_training(plan, coordinate, MeshGroups(device_mesh))
    with stage("unfold"):
        layers = _Layers.of(_step(lowered, lowered.forward, lowered.backward), short.template, short.successor)
    return FoldedLowering(lowered, short, layers) if layers is not None else None


def _step(lowered: LoweredTraining, forward: fx.GraphModule, backward: fx.GraphModule) -> _Step:
    names = [p.name for p in lowered.forward.graph.find_nodes(op="placeholder")]
    return _Step(forward, backward, lowered.num_outputs, lowered.grad_inputs, names)


@dataclass
class FoldedLowering:
    """This rank's lowered four-layer step, known to unfold: what ``TrainingProgram`` runs a folded step from."""

    short_lowered: LoweredTraining  # stages 4-5 of the four layers
    short: Shortened
    layers: _Layers  # its layers checked alike, ready to copy

    @property
    def signature(self) -> LoweredTraining:
        """The whole step's signature (inputs, outputs, gradients: the four layers' program keeps every input),
        without its programs (``lowered_graphs`` makes them)."""
        return replace(self.short_lowered, forward=None, backward=None)

    def lowered_graphs(self) -> tuple[fx.GraphModule, fx.GraphModule]:
        """The whole step's lowered forward and backward: the four layers' with layer 1's nodes copied."""
        with stage("unfold"):
            whole = self.layers.unfolded()
        if whole is None:
            raise AssertionError("fxshard: a folded step's lowered programs do not unfold in order (please report "
                                 "this; FXSHARD_FOLD=0 plans the whole model)")
        return whole

    @property
    def kept(self) -> tuple[LoweredTraining, tuple[int, int]]:
        """What the lowered cache keeps of the step: the four layers' lowered programs and the layers folded
        (template, successor), from which ``unfolded_lowered`` makes the whole ones when read."""
        return self.short_lowered, (self.short.template, self.short.successor)

    def cap(self) -> int:
        """The bucket cap (``compile_local.block_bytes``): one layer's, the same in four layers as in all."""
        return block_bytes(self.short_lowered.forward)

    def unfolded_regions(self, programs: Sequence[fx.GraphModule], maps: tuple[dict, ...]
                         ) -> tuple[tuple[fx.GraphModule, fx.GraphModule], tuple[dict, dict]] | None:
        """Stage 6's unfold (``stage6.cut_into_regions``, step 5): the four layers' bucketed forward and backward
        (copies of ``short_lowered``'s), each node tagged with its region in ``maps``, made whole, and the whole
        programs' region maps (each copy of the template's nodes in its copied layer's region), as cutting the
        unfolded lowered programs gives them; None where the bucketed layers do not unfold (not seen: then the
        lowered programs are unfolded and cut)."""
        forward, backward = programs
        for gm, region in zip(programs, maps):
            for node in gm.graph.nodes:
                if node.op == "call_function":
                    node.meta[REGION] = region[node]
        with stage("unfold"):
            layers = _Layers.of(_step(self.short_lowered, forward, backward), self.short.template,
                                self.short.successor, maps)
            whole = layers.unfolded() if layers is not None else None
        if whole is None:
            return None
        t = self.short.template
        whole_maps = tuple({n: _region_of(n, t) for n in gm.graph.nodes if n.op == "call_function"} for gm in whole)
        return whole, whole_maps  # type: ignore[return-value]


def unfolded_lowered(short_lowered: LoweredTraining, template: int, successor: int) -> LoweredTraining:
    """A folded step's whole lowered programs from its four layers' (``FoldedLowering.kept``); a ValueError where
    they do not unfold (an entry of the lowered cache from another fxshard: planned again)."""
    layers = _Layers.of(_step(short_lowered, short_lowered.forward, short_lowered.backward), template, successor)
    whole = layers.unfolded() if layers is not None else None
    if whole is None:
        raise ValueError("the kept four layers do not unfold")
    return replace(short_lowered, forward=whole[0], backward=whole[1])


def _region_of(node: fx.Node, template: int) -> Any:
    """A node's region in the unfolded program: its own, or (a copy of the template's node) the copied layer's."""
    region = node.meta[REGION]
    stamp = node.meta.get(STAMP)
    return region if stamp is None else region + (stamp - template)
