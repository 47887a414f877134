"""Stage 6 for inference: this rank's lowered local program behind a callable that speaks DTensor.

Inductor compiles on the first call, with that call's real local tensors as examples, so
no fake-tensor mode of Dynamo's leaks into it.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from fxshard.graph import code_on_demand, output_layouts
from fxshard.layout import Layout
from fxshard.lowering.groups import MeshGroups

from fxshard.backend.inductor.collector import collector_paused
from fxshard.backend.inductor.compile_local import BucketPolicy, block_bytes, compile_local
from fxshard.backend.capture.inputs import InputReader
from fxshard.backend.capture.outputs import OutputWriter
from fxshard.backend.layers.regional_program import Region, RegionalProgram
from fxshard.backend.programs.lower_for_rank import lower_for_rank
from fxshard.backend.programs.stage6 import cut_into_regions
from fxshard.backend.reports.report import StageReporter


@dataclass
class LoweredInference:
    """This rank's lowered program (stages 4-5) and the layouts of its outputs. Kept on disk whole
    (``lowered_cache.py``): a second run starts here."""

    graph: fx.GraphModule
    tensor_positions: list[int]  # of each placeholder in the caller's inputs
    input_layouts: list[Layout]  # of each placeholder
    output_layouts: tuple[Layout, ...]


def lower_inference(planned: fx.GraphModule, coordinate: tuple[int, ...], groups: MeshGroups,
                    tensor_positions: Sequence[int], input_layouts: Sequence[Layout]) -> LoweredInference:
    """Stages 4-5 of a planned program for the rank at ``coordinate``."""
    return LoweredInference(lower_for_rank(planned, coordinate, groups), list(tensor_positions), list(input_layouts), output_layouts(planned))


class InferenceProgram:
    """Calls the compiled local program of this rank on the local shards of the inputs."""

    def __init__(self, planned: fx.GraphModule | None, device_mesh: Any, tensor_positions: Sequence[int],
                 input_layouts: Sequence[Layout], inductor: bool = True, bucketing: bool = True, reporter: StageReporter | None = None,
                 eager_layouts: Sequence[Any] = (), regional: bool = True, lowered: LoweredInference | None = None):
        """From the ``planned`` global program (stages 4-5 run here), or from this rank's ``lowered`` one (a
        second run's, loaded from disk: ``lowered_cache.py``)."""
        coordinate = tuple(int(c) for c in device_mesh.get_coordinate())
        self.device_mesh = device_mesh
        self.coordinate = coordinate
        if lowered is None:
            assert planned is not None, "an InferenceProgram needs its planned or its lowered program"
            lowered = lower_inference(planned, coordinate, MeshGroups(device_mesh), tensor_positions, input_layouts)
        self.lowered = lowered
        self.local_graph = lowered.graph
        self.positions = list(lowered.tensor_positions)
        self.input_layouts = list(lowered.input_layouts)
        self.output_layouts = lowered.output_layouts
        # per output: None (a DTensor) or the layout whose plain block the user's program holds (outputs.py)
        self.eager = list(eager_layouts) or [None] * len(self.output_layouts)
        self.read_inputs = InputReader(self.positions, self.input_layouts, coordinate)
        self.write_outputs = OutputWriter(self.output_layouts, device_mesh, self.eager)
        self.inductor = inductor
        # a bucket per block's parameter gathers, others capped at a block's bytes (compile_local.py)
        self.buckets = BucketPolicy(block_bytes(self.local_graph)) if bucketing else None
        self.regional = regional  # compile each distinct layer once (backend/layers/regions.py)
        self.reporter = reporter or StageReporter()
        self._run: Callable | None = None
        self._warned_grad = False  # said once per program: its outputs carry no gradient
        # first calls that run the local program as its FX graph, Inductor compiling at the next: a program
        # that may serve one call only (backend/programs/sizes.py: a size before one program serves them all)
        self.uncompiled_calls = 0

    @property
    def compiled(self) -> bool:
        return self._run is not None

    def __call__(self, *args: Any) -> tuple:
        if not self._warned_grad and torch.is_grad_enabled() and any(
                isinstance(args[p], torch.Tensor) and args[p].requires_grad for p in self.positions):
            self._warned_grad = True
            warnings.warn("this fxshard program was compiled while autograd was not recording (no input "
                          "required grad, or under torch.no_grad()): its outputs carry no gradient", stacklevel=2)
        local = self.read_inputs(args, differentiable=False)
        if self._run is None and self.uncompiled_calls:
            self.uncompiled_calls -= 1
            with torch.no_grad():
                outs = self.local_graph(*local)
        elif self._run is None:
            outs = self._compile_and_run(local)
        else:
            with torch.no_grad():
                outs = self._run(*local)
        if isinstance(outs, torch.Tensor):
            outs = (outs,)
        return self.write_outputs(outs)

    def _compile_region(self, region: Region, inputs: list[torch.Tensor]) -> Callable:
        """Any region compiled, the prologue and the epilogue too, as a training step's (regions.py): an
        uncompiled prologue's (embedding, rotary tables, masks) and epilogue's ops cost more per call than
        the layers' compiled ones (a 2-layer decode step at 0.64x the tokens/s, bench/results/overhead.md)."""
        policy = self.buckets and BucketPolicy(self.buckets.cap, tagged=True)  # tagged before the split
        return compile_local(region.graph, inputs, policy)

    def _compile_and_run(self, local_inputs: list[torch.Tensor]) -> Any:
        """The first call: Inductor compiles the program (regionally: each region as the call reaches it)."""
        if not self.inductor:
            self._run = self.local_graph
            with torch.no_grad():
                return self._run(*local_inputs)
        # the cut into regions is fxshard's stage, not Inductor's (no collections meanwhile: backend/inductor/collector.py)
        with torch.no_grad(), self.reporter.timed("regions"), collector_paused(), code_on_demand():
            bucketing = self.buckets is not None
            cut = cut_into_regions((self.local_graph,), bucketing=bucketing, overlap=bucketing) if self.regional else None
        with torch.no_grad(), self.reporter.timed("compiling the local program with Inductor"):
            if cut is not None and cut.regions[0]:
                self._run = RegionalProgram(cut.graphs[0], cut.regions[0], self._compile_region)
            else:
                self._run = compile_local(self.local_graph, local_inputs, self.buckets)
            return self._run(*local_inputs)
