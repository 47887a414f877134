"""Stage 4: rewrite a planned global graph into this rank's local program (still with redistributes).

Shapes baked into op arguments (view sizes, expand sizes, a redistribution's output) become
this rank's local sizes. A fake-tensor pass then checks every node's local shape against its
layout, so an op whose arguments fxshard does not know how to localize fails loudly here
instead of computing the wrong thing.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from fxshard.layout import Layout
from fxshard.mesh import Coordinate
from fxshard.ops import REDISTRIBUTE

aten = torch.ops.aten

# op -> index of the argument that holds the op's output shape
SHAPE_ARGS: dict[Any, int] = {
    aten.view.default: 1,
    aten._unsafe_view.default: 1,
    aten.reshape.default: 1,
    aten.expand.default: 1,
    REDISTRIBUTE: 3,
}


class LocalizeError(RuntimeError):
    pass


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    return fx.GraphModule(gm, graph)


def localize(gm: fx.GraphModule, coordinate: Coordinate) -> fx.GraphModule:
    """A copy of the planned global ``gm`` with this rank's local shapes."""
    local = copy_graph_module(gm)
    for node in local.graph.nodes:
        layout = node.meta.get("layout")
        if node.op == "call_function" and node.target in SHAPE_ARGS and isinstance(layout, Layout):
            args = list(node.args)
            args[SHAPE_ARGS[node.target]] = [int(s) for s in layout.local_shape(coordinate)]
            node.args = tuple(args)
    local.recompile()
    propagate_local_shapes(local, coordinate, check=True)
    return local


def local_fake_inputs(gm: fx.GraphModule, coordinate: Coordinate, mode: FakeTensorMode) -> list[torch.Tensor]:
    fakes = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        val, layout = node.meta["val"], node.meta["layout"]
        with mode:
            fakes.append(torch.empty([int(s) for s in layout.local_shape(coordinate)], dtype=val.dtype,
                                     device=val.device))
    return fakes


def propagate_local_shapes(gm: fx.GraphModule, coordinate: Coordinate, check: bool) -> None:
    """Recompute ``meta["val"]`` with local fake tensors; with ``check``, compare against layouts."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    FakeTensorProp(gm, mode).propagate(*local_fake_inputs(gm, coordinate, mode))
    if not check:
        return
    for node in gm.graph.nodes:
        layout, val = node.meta.get("layout"), node.meta.get("val")
        if isinstance(layout, Layout) and isinstance(val, torch.Tensor):
            want = tuple(int(s) for s in layout.local_shape(coordinate))
            if tuple(val.shape) != want:
                raise LocalizeError(
                    f"{node.format_node()}: its local result has shape {list(val.shape)} but its layout {layout} "
                    f"gives {list(want)} at coordinate {coordinate}. fxshard does not know how to localize the "
                    f"arguments of {node.target}; add it to fxshard.lowering.localize.SHAPE_ARGS or give it a rule "
                    "that replicates its inputs.")
