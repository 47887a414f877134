"""``fxshard.simulate_plan``: run one redistribution plan on simulated ranks and measure it.

Every rank's steps are lowered exactly as in a compiled program, run together under
``LocalTensorMode``, and the bytes each collective makes its rank receive are read off the
lowered graph (input sizes, group sizes, split sizes) rather than from the planner's own
formulas, so a test can hold the planner's ``bytes_per_rank`` to what really moves.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from fxshard.lowering.collectives import _Emit, lower_step
from fxshard.lowering.groups import MeshGroups
from fxshard.plans import Plan, Step

from .simulate import fake_world, run_lockstep

c10d = torch.ops._c10d_functional


@dataclass
class PlanRun:
    result: torch.Tensor  # the global tensor every rank's output stands for (partials reduced)
    outputs: dict[tuple[int, ...], torch.Tensor]  # each rank's local block
    received: list[int]  # per step: bytes the busiest rank received in it, from the lowered graph

    @property
    def bytes_per_rank(self) -> int:
        return sum(self.received)


def _group_position(step: Step, coord: dict[str, int]) -> int:
    pos = 0
    for a in step.axes:
        pos = pos * int(a.size) + a.coordinate(coord[a.name])
    return pos


def _received(node: fx.Node, n: int, me: int) -> int:
    """Bytes this rank receives in collective ``node`` (group of ``n``; ``me`` its position)."""
    x = node.args[0].meta["val"]
    nbytes = x.numel() * x.element_size()
    if node.target is c10d.all_gather_into_tensor.default:
        return (n - 1) * nbytes
    if node.target is c10d.reduce_scatter_tensor.default:
        return -(-(n - 1) * nbytes // n)
    if node.target is c10d.all_reduce.default:
        return -(-2 * (n - 1) * nbytes // n)
    if node.target is c10d.all_to_all_single.default:
        out_splits = node.args[1]
        row = x.element_size() * math.prod(x.shape[1:])
        return (sum(out_splits) - out_splits[me]) * row
    return 0


def simulate_plan(plan: Plan, x: torch.Tensor) -> PlanRun:
    """Shard ``x`` as ``plan.src``, run the plan on every simulated rank, gather the result as ``plan.dst``."""
    src, dst = plan.src, plan.dst
    mesh = src.mesh
    coords = mesh.coordinates()
    graphs, step_nodes = [], []
    with fake_world(mesh) as device_mesh:
        groups = MeshGroups(device_mesh)
        for c in coords:
            gm = fx.GraphModule(torch.nn.Module(), fx.Graph())
            value = gm.graph.placeholder("x")
            out = gm.graph.output(None)
            e = _Emit(gm, out, x.device)
            mine = []
            for step in plan.steps:
                seen = set(gm.graph.nodes)
                value = lower_step(e, value, step, c, groups)
                mine.append([n for n in gm.graph.nodes if n not in seen])
            out.args = ([value],)
            gm.recompile()
            mode = FakeTensorMode(allow_non_fake_inputs=True)
            local = src.shard(x, c)
            FakeTensorProp(gm, mode).propagate(mode.from_tensor(local))
            graphs.append(gm)
            step_nodes.append(mine)
        per_rank = run_lockstep(graphs, [[src.shard(x, c)] for c in coords])
    received = []
    for k, step in enumerate(plan.steps):
        n = int(step.group_size)
        worst = 0
        for r, c in enumerate(coords):
            me = _group_position(step, mesh.coordinate_dict(c))
            worst = max(worst, sum(_received(node, n, me) for node in step_nodes[r][k]
                                   if node.op == "call_function" and node.target in _COLLECTIVES))
        received.append(worst)
    outputs = {c: per_rank[r][0] for r, c in enumerate(coords)}
    return PlanRun(dst.unshard(outputs), outputs, received)


_COLLECTIVES = {c10d.all_gather_into_tensor.default, c10d.reduce_scatter_tensor.default,
                c10d.all_reduce.default, c10d.all_to_all_single.default}
