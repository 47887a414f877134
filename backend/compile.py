"""Stage 6: this rank's lowered local graph -> Inductor, behind a callable that speaks DTensor.

Inductor compiles on the first call, with that call's real local tensors as examples, so
no fake-tensor mode of Dynamo's leaks into it.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor

from fxshard.layout import Layout
from fxshard.lowering.collectives import lower
from fxshard.lowering.groups import MeshGroups
from fxshard.lowering.localize import localize
from fxshard.graph import output_layouts
from fxshard.placements import placements_from_layout

from .report import StageReporter



class ShardedCallable:
    """Calls the compiled local program of this rank on the local shards of the inputs."""

    def __init__(self, planned: fx.GraphModule, device_mesh: Any, tensor_positions: Sequence[int],
                 input_layouts: Sequence[Layout], inductor: bool = True, reporter: StageReporter | None = None):
        coordinate = tuple(int(c) for c in device_mesh.get_coordinate())
        self.device_mesh = device_mesh
        self.coordinate = coordinate
        self.local_graph = lower(localize(planned, coordinate), coordinate, MeshGroups(device_mesh))
        self.positions = list(tensor_positions)
        self.input_layouts = list(input_layouts)
        self.output_layouts = output_layouts(planned)
        self.output_placements = [placements_from_layout(l) for l in self.output_layouts]
        self.inductor = inductor
        self.reporter = reporter or StageReporter()
        self._run: Callable | None = None
        self._warned_grad = False  # said once per program: its outputs carry no gradient

    def _local_inputs(self, args: Sequence[Any]) -> list[torch.Tensor]:
        out = []
        for pos, layout in zip(self.positions, self.input_layouts):
            x = args[pos]
            if isinstance(x, DTensor):
                local = x._local_tensor
            else:
                local = x if layout.is_replicated else layout.shard(x, self.coordinate)
            if local.requires_grad and torch.is_grad_enabled() and not self._warned_grad:
                self._warned_grad = True
                warnings.warn("this fxshard program was compiled while autograd was not recording (no input "
                              "required grad, or under torch.no_grad()): its outputs carry no gradient",
                              stacklevel=3)
            out.append(local.detach())
        return out

    def __call__(self, *args: Any) -> tuple:
        local = self._local_inputs(args)
        if self._run is None:
            self._run = self._compile(local)
        with torch.no_grad():
            outs = self._run(*local)
        if isinstance(outs, torch.Tensor):
            outs = (outs,)
        return tuple(
            DTensor.from_local(o, self.device_mesh, placements, run_check=False, shape=torch.Size(layout.shape),
                               stride=_contiguous_stride(layout.shape))
            for o, layout, placements in zip(outs, self.output_layouts, self.output_placements))

    def _compile(self, local_inputs: list[torch.Tensor]) -> Callable:
        if not self.inductor:
            return self.local_graph
        from torch._inductor.compile_fx import compile_fx

        with torch.no_grad(), self.reporter.timed("compiling the local program with Inductor"):
            compiled = compile_fx(self.local_graph, local_inputs)
        return compiled


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed([int(x) for x in shape]):
        stride.append(acc)
        acc *= s
    return tuple(reversed(stride))
