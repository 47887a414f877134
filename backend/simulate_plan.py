"""``fxshard.simulate_plan``: run one redistribution plan on simulated ranks and measure it.

Every rank's steps are lowered exactly as in a compiled program (``lower_step``: the same local
ops and functional collectives), then run directly on real tensors, every rank in this process:
each rank's local ops run on its own block, and each collective is carried out on its group's
blocks, its group found from the mesh coordinates. No process group, FX recompile or fake-tensor
pass is needed (they were 80% of the cost), so it runs under any process group, or none. The
bytes each collective makes its rank receive are read off the tensors it is given (input sizes,
group sizes, split sizes), not from the planner's formulas, so a test can hold the planner's
``bytes_per_rank`` to what really moves.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx as fx

from fxshard.lowering.collective_ops import COLLECTIVES, LOWERED
from fxshard.lowering.collectives import _Emit, lower_step
from fxshard.mesh import Coordinate, MeshAxis, MeshSpec
from fxshard.plans import Plan

c10d = torch.ops._c10d_functional


@dataclass
class PlanRun:
    result: torch.Tensor  # the global tensor every rank's output stands for (partials reduced)
    outputs: dict[tuple[int, ...], torch.Tensor]  # each rank's local block
    received: list[int]  # per step: bytes the busiest rank received in it, from the lowered graph

    @property
    def bytes_per_rank(self) -> int:
        return sum(self.received)


class _GroupNames:
    """Names for the groups lowering asks for (``axes -> name``) and the axes back from a name:
    stand-ins for process-group names, resolved against mesh coordinates instead of a process group."""

    def __init__(self) -> None:
        self.axes: dict[str, tuple[MeshAxis, ...]] = {}

    def __call__(self, axes: MeshAxis | tuple[MeshAxis, ...]) -> str:
        key = (axes,) if isinstance(axes, MeshAxis) else tuple(axes)
        name = "simulated:" + ",".join(repr(a) for a in key)
        self.axes[name] = key
        return name


def _group_of(axes: Sequence[MeshAxis], coord: dict[str, int]) -> tuple[tuple, int]:
    """(which group of ``axes`` the rank at ``coord`` is in, its position there: row-major over ``axes``)."""
    rest = dict(coord)
    pos = 0
    for a in axes:
        digit = a.coordinate(coord[a.name])
        pos = pos * int(a.size) + digit
        rest[a.name] -= digit * int(a.inner)
    return tuple(sorted(rest.items())), pos


_COLLECTIVES = frozenset(LOWERED)  # what a lowered program runs
_GROUP_ARG = {op: COLLECTIVES[op._opname].group_at for op in LOWERED}


# a reduction's name, as lowering passes it to a functional collective -> that reduction over the
# group's stacked blocks (every reduce op of fxshard.layout.REDUCE_OPS, which gloo and NCCL run too)
_REDUCTIONS: Mapping[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "sum": lambda s: s.sum(0), "avg": lambda s: s.mean(0), "max": lambda s: s.amax(0),
    "min": lambda s: s.amin(0), "product": lambda s: s.prod(0),
}


def _reduce(blocks: Sequence[torch.Tensor], op: str) -> torch.Tensor:
    if op not in _REDUCTIONS:
        raise NotImplementedError(f"simulate_plan: reduce op {op!r} (it runs {', '.join(_REDUCTIONS)})")
    return _REDUCTIONS[op](torch.stack(list(blocks)))


def _collective(target: Any, args: Sequence[tuple], pos: Sequence[int]) -> list[torch.Tensor]:
    """One collective over one group: ``args[i]`` the arguments of the member at group position ``pos[i]``."""
    order = sorted(range(len(pos)), key=lambda i: pos[i])
    xs = [args[i][0] for i in order]  # in group order
    if target is c10d.all_gather_into_tensor.default:
        full = torch.cat(xs)
        return [full.clone() for _ in pos]
    if target is c10d.all_reduce.default:
        full = _reduce(xs, args[0][1])
        return [full.clone() for _ in pos]
    if target is c10d.reduce_scatter_tensor.default:
        chunks = _reduce(xs, args[0][1]).chunk(len(pos))
        return [chunks[p].clone() for p in pos]
    if target is c10d.all_to_all_single.default:  # (x, output_split_sizes, input_split_sizes, group)
        sent = [x.split(list(a[2])) for x, a in zip(xs, (args[i] for i in order))]
        return [torch.cat([sent[src][p] for src in range(len(xs))]) for p in pos]
    raise NotImplementedError(f"simulate_plan cannot run {target}")


def _received(target: Any, args: tuple, n: int, me: int) -> int:
    """Bytes this rank receives in a collective called with ``args`` (group of ``n``; ``me`` its position)."""
    x = args[0]
    nbytes = x.numel() * x.element_size()
    if target is c10d.all_gather_into_tensor.default:
        return (n - 1) * nbytes
    if target is c10d.reduce_scatter_tensor.default:
        return -(-(n - 1) * nbytes // n)
    if target is c10d.all_reduce.default:
        return -(-2 * (n - 1) * nbytes // n)
    if target is c10d.all_to_all_single.default:
        out_splits = args[1]
        row = x.element_size() * math.prod(x.shape[1:])
        return (sum(out_splits) - out_splits[me]) * row
    return 0


class _Ranks:
    """Every rank's lowered graph, run on real tensors: local ops rank by rank, collectives group by group."""

    def __init__(self, mesh: MeshSpec, graphs: Sequence[fx.GraphModule], names: _GroupNames):
        self.mesh, self.graphs, self.names = mesh, graphs, names
        self.coords = [mesh.coordinate_dict(c) for c in mesh.coordinates()]
        self.received: dict[int, int] = {}  # step -> bytes the busiest rank received

    def run(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        nodes = [list(g.graph.nodes) for g in self.graphs]
        envs: list[dict[fx.Node, Any]] = [{} for _ in self.graphs]
        at = [0] * len(self.graphs)
        outputs: list[Any] = [None] * len(self.graphs)
        while True:
            for r in range(len(self.graphs)):  # each rank up to its next collective (or its output)
                at[r] = self._run_local(r, nodes[r], at[r], envs[r], inputs[r], outputs)
            waiting = [nodes[r][at[r]] if at[r] < len(nodes[r]) else None for r in range(len(self.graphs))]
            if all(w is None for w in waiting):
                return outputs
            if any(w is None for w in waiting):
                raise RuntimeError("simulate_plan: some ranks finished while others wait in a collective; not SPMD")
            self._run_collectives(waiting, envs)
            at = [a + 1 for a in at]

    def _run_local(self, r: int, nodes: list[fx.Node], i: int, env: dict, x: torch.Tensor, outputs: list) -> int:
        """Run rank ``r``'s nodes from ``i`` up to its next collective; the index of that collective."""
        while i < len(nodes):
            n = nodes[i]
            if n.op == "placeholder":
                env[n] = x
            elif n.op == "get_attr":
                env[n] = getattr(self.graphs[r], n.target)
            elif n.op == "output":
                outputs[r] = fx.node.map_arg(n.args[0], lambda a: env[a])[0]
            elif n.target in _COLLECTIVES:
                return i
            else:
                args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: env[a])
                env[n] = n.target(*args, **kwargs)
            i += 1
        return i

    def _run_collectives(self, waiting: Sequence[fx.Node], envs: list[dict]) -> None:
        """Every rank waits in a collective: run each group's, its members' arguments together."""
        groups: dict[tuple, list[tuple[int, int, tuple]]] = {}
        for r, n in enumerate(waiting):
            args = fx.node.map_arg(n.args, lambda a: envs[r][a])
            axes = self.names.axes[args[_GROUP_ARG[n.target]]]
            key, pos = _group_of(axes, self.coords[r])
            groups.setdefault((n.target, axes, key), []).append((r, pos, args))
        for (target, axes, _), members in groups.items():
            n = math.prod(int(a.size) for a in axes)
            if sorted(p for _, p, _ in members) != list(range(n)):
                raise RuntimeError(f"simulate_plan: group {axes} of {target} has members at {[p for _, p, _ in members]}")
            outs = _collective(target, [a for _, _, a in members], [p for _, p, _ in members])
            for (r, pos, args), out in zip(members, outs):
                envs[r][waiting[r]] = out
                step = waiting[r].meta["fxshard_step"]
                self.received[step] = max(self.received.get(step, 0), _received(target, args, n, pos))


def simulate_plan(plan: Plan, x: torch.Tensor, blocks: Mapping[tuple[int, ...], torch.Tensor] | None = None) -> PlanRun:
    """Shard ``x`` as ``plan.src``, run the plan on every simulated rank, gather the result as ``plan.dst``.

    ``blocks`` (by mesh coordinate) start the ranks from other blocks of ``x`` in ``plan.src``: another
    decomposition of a Partial (DTensor's value/n on every rank of a Partial(sum), to compare with it).
    """
    src, dst = plan.src, plan.dst
    mesh = src.mesh
    if not mesh.is_static:
        raise ValueError(f"simulate_plan needs a mesh with static sizes, got {mesh}")
    coords = mesh.coordinates()
    names = _GroupNames()
    graphs = [_lowered_graph(plan, c, names, x.device) for c in coords]
    ranks = _Ranks(mesh, graphs, names)
    per_rank = ranks.run([src.shard(x, c) if blocks is None else blocks[c] for c in coords])
    received = [ranks.received.get(k, 0) for k in range(len(plan.steps))]
    outputs = dict(zip(coords, per_rank))
    return PlanRun(dst.unshard(outputs), outputs, received)


def _lowered_graph(plan: Plan, coordinate: Coordinate, names: _GroupNames, device: Any) -> fx.GraphModule:
    """This rank's lowered steps as one graph (interpreted, never recompiled); each node's step in its meta."""
    gm = fx.GraphModule(torch.nn.Module(), fx.Graph())
    value = gm.graph.placeholder("x")
    out = gm.graph.output(None)
    e = _Emit(gm, out, device)
    seen = set(gm.graph.nodes)
    for k, step in enumerate(plan.steps):
        value = lower_step(e, value, step, coordinate, names)
        for n in gm.graph.nodes:
            if n not in seen:
                n.meta["fxshard_step"] = k
                seen.add(n)
    out.args = ([value],)
    return gm
