"""``fxshard.simulate``: run every rank's lowered local program in one process.

The local programs of all ranks have the same nodes (SPMD), differing only in constants
(slice offsets, uneven sizes, which rank holds a partial value). They run in lockstep
under ``LocalTensorMode``: a node whose arguments agree on every rank runs once on
LocalTensors (collectives included); a node whose arguments differ runs per rank.

A function Dynamo splits into several graphs runs graph by graph (``SimulatedGraphs``): each
graph's programs run on the ranks' blocks the graphs before it left, in their layouts
(``graph_runs.py``), and the Python between graphs reads their full values.
"""
from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.distributed._local_tensor import LocalIntNode, LocalTensor, LocalTensorMode
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from fxshard.costs import CostModel
from fxshard.graph import LOCAL_REGION, output_layouts
from fxshard.layout import Layout
from fxshard.lowering.groups import MeshGroups
from fxshard.lowering.localize import own_shard_indexing
from fxshard.mesh import MeshSpec
from fxshard.placements import layout_as_dtensor
from fxshard.policies import DEFAULT_TRAINING_SPLIT, MixedPrecision, TrainingSplit
from fxshard.routing import PYTHON_FORMS

from fxshard.backend.capture.capture import Captured, capture_graphs
from fxshard.backend.capture.mixed_precision import under_policy
from fxshard.backend.driver import PlannedProgram, plan_function
from fxshard.backend.graph_runs import RunPlanner
from fxshard.backend.capture.inputs import named_inputs
from fxshard.backend.layers.regional_program import Region, RegionalProgram, RegionRole
from fxshard.backend.programs.lower_for_rank import lower_for_rank
from fxshard.backend.programs.stage6 import Cut, cut_into_regions
from fxshard.backend.reports.traffic import functional_group, received_by_rank


@contextlib.contextmanager
def fake_world(spec: MeshSpec, device_type: str = "cpu") -> Iterator[Any]:
    """A DeviceMesh over a fake process group of ``spec``'s size (made here unless one exists)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not spec.is_static:
        raise ValueError(f"simulate needs a mesh with static sizes, got {spec}")
    world = int(spec.world_size)
    created = False
    if dist.is_initialized():
        if dist.get_backend() != "fake" or dist.get_world_size() != world:
            raise RuntimeError(
                f"simulate runs all {world} ranks in this process and needs a fake process group of that size; "
                f"one is already initialized (backend {dist.get_backend()}, world size {dist.get_world_size()}). "
                "Call simulate outside torch.distributed programs.")
    else:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
        created = True
    try:
        yield init_device_mesh(device_type, tuple(int(s) for s in spec.sizes), mesh_dim_names=spec.names)
    finally:
        if created:
            dist.destroy_process_group()
            _forget_meshes()


def _forget_meshes() -> None:
    """Clear DTensor's sharding-propagation caches (Python's and the C++ fast path's) as a world made here ends.
    They key specs whose ``DeviceMesh`` compares by value, not by process group, so a second fake world of the
    same shape got the first's mesh back from them (``nn.Parameter(dt)``'s detach), and its dead group
    ('Group ... is not registered'). Missing on a torch without the function: nothing to clear then."""
    try:
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    except ImportError:
        return
    _clear_sharding_prop_cache()


def _key(a: Any, index: Mapping[fx.Node, int]) -> Any:
    if isinstance(a, fx.Node):
        return ("node", index[a])
    if isinstance(a, (list, tuple)):
        return (type(a).__name__,) + tuple(_key(x, index) for x in a)
    if isinstance(a, dict):
        return ("dict",) + tuple((k, _key(v, index)) for k, v in sorted(a.items()))
    return ("value", repr(a))


def _warn_of_rank_numbers(gm: fx.GraphModule) -> None:
    """Warn where simulated ranks may not compute what real ones do: code on ``to_local()`` shards indexing
    its rank's own shard (a vocab-parallel lookup shifted by ``dist.get_rank()``). Dynamo captures such a
    number as a constant, this process's rank's, and simulate runs that one capture on every rank; real
    ranks each capture their own."""
    nodes = own_shard_indexing(gm)
    if nodes:
        where = nodes[0].meta.get(LOCAL_REGION) or nodes[0].name
        warnings.warn(
            f"simulate: {', '.join('%' + n.name for n in nodes[:3])} index their rank's own shard inside code run on "
            f"to_local() shards ({where}); numbers that code computed from the rank (dist.get_rank()) are this "
            "process's rank's on every simulated rank, so the result may differ from real ranks'. Check it on "
            "real ranks (examples/ranks.py spawn), which each capture their own.", stacklevel=3)


class RankTraffic(TorchDispatchMode):
    """Bytes each simulated rank received, summed over the collectives it ran (``traffic.received_by_rank``),
    whether a graph node or an op's own code (a dropless MoE's dispatch) called them: ``record`` reads a
    collective node's call with every rank's tensors and split sizes (as LocalTensors and ``LocalIntNode``
    ints hold them), and entered as a dispatch mode over ``LocalTensorMode`` around an op's Python form it
    sees the collectives that code calls. Sizes computed from the data count as they were. ``groups`` names
    the process groups the programs were lowered with; rank r sits at ``coords[r]``."""

    def __init__(self, mesh: MeshSpec, coords: Sequence[tuple[int, ...]], groups: MeshGroups):
        super().__init__()
        self.groups = groups
        self.coords = [mesh.coordinate_dict(c) for c in coords]
        self.received = [0] * len(coords)

    def record(self, func: Any, args: Sequence[Any], out: Any) -> None:
        """Add what each rank received in ``func(*args) -> out`` where ``func`` is a functional collective."""
        name = functional_group(func, args)
        if name is None:
            return
        for r, coord in enumerate(self.coords):
            index = self.groups.index_in_group(name, coord)
            if index is None:
                raise RuntimeError(f"simulate: {func} runs on group {name!r}, which the ranks' programs were not "
                                   "lowered with; its traffic cannot be read")
            mine = pytree.tree_map(lambda v: _at_rank(v, r), tuple(args))
            self.received[r] += received_by_rank(func, mine, _at_rank(out, r), index)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.record(func, args, out)
        return out


def _at_rank(v: Any, r: int) -> Any:
    """Rank r's value of a LocalTensor or of a SymInt that holds each rank's int (``LocalIntNode``)."""
    if isinstance(v, torch.SymInt) and isinstance(v.node, LocalIntNode):
        return v.node._local_ints[r]
    return _rank_value(v, r)


def run_lockstep(graphs: Sequence[fx.GraphModule], inputs: Sequence[Sequence[torch.Tensor]],
                 final_inputs: list | None = None, traffic: RankTraffic | None = None) -> list[list[torch.Tensor]]:
    """Run one graph per rank (rank r = graphs[r]) in lockstep; returns each rank's outputs.
    ``final_inputs`` (a list) receives each rank's inputs as the programs left them (written in place);
    ``traffic`` adds up what each rank received."""
    ranks = len(graphs)
    node_lists = [list(g.graph.nodes) for g in graphs]
    if len({len(n) for n in node_lists}) != 1:
        raise RuntimeError("the ranks' local programs differ in length; they are not SPMD")
    indexes = [{n: i for i, n in enumerate(nodes)} for nodes in node_lists]
    env: list[Any] = [None] * len(node_lists[0])
    outputs: list[list[torch.Tensor]] = []
    with LocalTensorMode(ranks) as mode:
        placeholder = 0
        for i in range(len(node_lists[0])):
            nodes = [node_lists[r][i] for r in range(ranks)]
            first = nodes[0]
            if first.op == "placeholder":
                k = placeholder
                env[i] = mode.rank_map(lambda r: inputs[r][k])
                placeholder += 1
                continue
            if first.op == "output":
                outs = first.args[0]
                flat = [env[indexes[0][o]] for o in outs]
                outputs = [[_rank_value(v, r) for v in flat] for r in range(ranks)]
                if final_inputs is not None:
                    held = [env[j] for j, n in enumerate(node_lists[0]) if n.op == "placeholder"]
                    final_inputs[:] = [[_rank_value(v, r) for v in held] for r in range(ranks)]
                break
            if first.op == "get_attr":  # rank-specific constants (exchange tables), subgraphs (flex attention's)
                attrs = [getattr(graphs[r], node_lists[r][i].target) for r in range(ranks)]
                env[i] = (mode.rank_map(lambda r: attrs[r]) if isinstance(attrs[0], torch.Tensor) else
                          attrs[0] if all(a is attrs[0] for a in attrs) else _RankObjects(attrs))
                continue
            if first.op != "call_function":
                raise RuntimeError(f"simulate cannot run node {first.format_node()}")
            keys = {(n.target, _key(n.args, indexes[r]), _key(n.kwargs, indexes[r])) for r, n in enumerate(nodes)}
            if isinstance(first.target, torch._ops.HigherOrderOperator):  # LocalTensors run no higher-order op
                env[i] = _per_rank_call(mode, nodes, lambda r, a: _rank_value(env[indexes[r][a]], r))
            elif first.target in PYTHON_FORMS and len(keys) == 1:  # its code runs on every rank's tensors at once
                args, kwargs = fx.node.map_arg((first.args, first.kwargs), lambda a: env[indexes[0][a]])
                with traffic if traffic is not None else contextlib.nullcontext():  # the collectives it calls
                    env[i] = PYTHON_FORMS[first.target](*args, **kwargs, each=_each_rank(mode))
            elif len(keys) == 1:
                args, kwargs = fx.node.map_arg((first.args, first.kwargs), lambda a: env[indexes[0][a]])
                env[i] = first.target(*args, **kwargs)
                if traffic is not None:
                    traffic.record(first.target, args, env[i])
            elif first.target is torch.ops._c10d_functional.all_to_all_single.default:
                # per-rank split sizes: one call over all ranks with LocalIntNode sizes
                args = fx.node.map_arg(first.args, lambda a: env[indexes[0][a]])
                splits = [_rank_ints([n.args[k] for n in nodes]) for k in (1, 2)]
                env[i] = first.target(args[0], *splits, first.args[3])
                if traffic is not None:
                    traffic.record(first.target, (args[0], *splits, first.args[3]), env[i])
            elif isinstance(first.meta.get("val"), (tuple, list)):  # rank-specific arguments, several outputs
                env[i] = _per_rank_call(mode, nodes, lambda r, a: _rank_value(env[indexes[r][a]], r))
            else:
                def per_rank(r: int) -> torch.Tensor:
                    n = nodes[r]
                    args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: _rank_value(env[indexes[r][a]], r))
                    return n.target(*args, **kwargs)

                env[i] = mode.rank_map(per_rank)
    return outputs


def _each_rank(mode: LocalTensorMode) -> Callable[..., list]:
    """``each(fn, *args)``: ``fn`` on each rank's tensors of ``args`` alone (LocalTensors unpacked), its
    list of results as LocalTensors (``fxshard.routing.run_routed``'s body)."""
    def each(fn: Callable, *args: Any) -> list:
        with mode.disable():
            results = [fn(*pytree.tree_map(lambda v: _rank_value(v, r), args)) for r in sorted(mode.ranks)]
        ranks = sorted(mode.ranks)
        return [mode.rank_map(lambda r: results[ranks.index(r)][j]) for j in range(len(results[0]))]

    return each


class _RankObjects(list):
    """Each rank's object of one ``get_attr`` where they differ (a subgraph localized per rank)."""


def _per_rank_call(mode: LocalTensorMode, nodes: Sequence[fx.Node], value: Callable[[int, fx.Node], Any]) -> Any:
    """Each rank's call of its node on its own values, outside the mode; a tuple of results comes back as a
    tuple of LocalTensors."""
    with mode.disable(), _disable_current_modes():  # off the dispatch stack: a higher-order op asks every mode there
        results = [n.target(*fx.node.map_arg(n.args, lambda a: value(r, a)),
                            **fx.node.map_arg(n.kwargs, lambda a: value(r, a))) for r, n in enumerate(nodes)]
    if isinstance(results[0], (tuple, list)):
        return type(results[0])(_local(mode, [res[j] for res in results]) for j in range(len(results[0])))
    return _local(mode, results)


def _local(mode: LocalTensorMode, values: Sequence[Any]) -> Any:
    return mode.rank_map(lambda r: values[r]) if isinstance(values[0], torch.Tensor) else values[0]


def run_regions_lockstep(graphs: Sequence[fx.GraphModule], regions: Sequence[Sequence[Region]],
                         inputs: Sequence[Sequence[torch.Tensor]],
                         traffic: RankTraffic | None = None) -> tuple[list[list[torch.Tensor]], int]:
    """``run_lockstep`` region by region, as regional compilation runs each rank's program (regions.py):
    a region whose key an earlier one had runs that earlier region's graph. Returns each rank's
    outputs and how many layer region graphs rank 0 ran (what Inductor would compile)."""
    ranks = len(graphs)
    programs = [RegionalProgram(g, rs, lambda region, _: region.graph) for g, rs in zip(graphs, regions)]
    if any(p.steps != programs[0].steps for p in programs):
        raise RuntimeError("the ranks' local programs have different regions; they are not SPMD")
    args = [tuple(inputs[r][i] for r in range(ranks)) for i in range(len(inputs[0]))]
    attrs = [tuple(p.attrs[j][1] for p in programs) for j in range(len(programs[0].attrs))]

    def call(k: int, values: list[Any]) -> list[tuple]:
        per_rank = [[v[r] for v in values] for r in range(ranks)]
        outs = run_lockstep([p.compiled_region(k, per_rank[r]) for r, p in enumerate(programs)], per_rank,
                            traffic=traffic)
        return [tuple(o[j] for o in outs) for j in range(len(outs[0]))]

    result = programs[0].walk(args, attrs, call)
    first = programs[0]
    layer_graphs = {id(first.compiled[k]) for k, region in enumerate(first.regions) if region.role is RegionRole.LAYER}
    return [[v[r] for v in result] for r in range(ranks)], len(layer_graphs)


def _run_ranks(graphs: Sequence[fx.GraphModule], cuts: Sequence[Cut] | None, which: int,
               inputs: Sequence[Sequence[torch.Tensor]], traffic: RankTraffic) -> tuple[list[list[torch.Tensor]], int]:
    """Every rank's program in lockstep, whole or (``cuts``: each rank's, program ``which`` of it) region by region."""
    if cuts is None or not cuts[0].regions[which]:
        return run_lockstep(graphs, inputs, traffic=traffic), 0
    return run_regions_lockstep([c.graphs[which] for c in cuts], [c.regions[which] for c in cuts], inputs, traffic)


def _rank_ints(per_rank: Sequence[Sequence[int]]) -> list:
    """Per-rank int lists -> one list of SymInts that hold each rank's value."""
    return [torch.SymInt(LocalIntNode({r: int(v[k]) for r, v in enumerate(per_rank)}))
            if len({int(v[k]) for v in per_rank}) > 1 else int(per_rank[0][k]) for k in range(len(per_rank[0]))]


def _rank_value(v: Any, r: int) -> Any:
    if isinstance(v, _RankObjects):
        return v[r]
    return v._local_tensors[r] if isinstance(v, LocalTensor) else v


@dataclass
class SimulatedRun:
    """Every rank's outputs of a simulated program, with the layouts that say what they hold."""

    coordinates: list[tuple[int, ...]]  # rank r is at coordinates[r]
    outputs: list[list[torch.Tensor]]  # outputs[r][k]: rank r's local block of output k
    output_layouts: tuple
    grads: list[list[torch.Tensor]] | None = None  # grads[r][k]: rank r's block of gradient k (training)
    grad_layouts: tuple = ()
    grad_keys: tuple = ()  # what gradient k is of: an argument index or a parameter name
    graph: fx.GraphModule | None = None  # the planned global graph (training: the joint one; None: folded)
    region_graphs: int = 0  # regional: the distinct layer region graphs rank 0 ran, forward and backward (else 0)
    # each rank's lowered local program (stage 5) by coordinate, as ``lowered_graphs`` gives it (training: the
    # pair forward, backward): the collectives the ranks ran, to read without planning the program again
    lowered: dict = field(default_factory=dict)
    # bytes_received[r]: what rank r received over the whole run (forward and backward), summed over the
    # collectives it ran, with split sizes as the data made them (``RankTraffic``)
    bytes_received: list[int] = field(default_factory=list)

    def full(self) -> list[torch.Tensor]:
        """Each output as its global tensor (partial outputs reduced)."""
        return _unshard(self.coordinates, self.outputs, self.output_layouts)

    def full_grads(self) -> dict[Any, torch.Tensor]:
        """Each gradient as its global tensor, by argument index or parameter name."""
        if self.grads is None:
            raise ValueError("this run has no gradients; simulate with grad=True")
        return dict(zip(self.grad_keys, _unshard(self.coordinates, self.grads, self.grad_layouts)))


def _unshard(coords: Sequence[tuple[int, ...]], per_rank: Sequence[Sequence[torch.Tensor]],
             layouts: Sequence[Any]) -> list[torch.Tensor]:
    return [layout.unshard({c: per_rank[r][k] for r, c in enumerate(coords)}) for k, layout in enumerate(layouts)]


def simulate_ranks(fn: Callable, *args: Any, mesh: Any = None, placements: Mapping[Any, Any] | None = None,
                   strict: bool = False, cost_model: CostModel | None = None,
                   local_inputs: Callable[[Any, torch.Tensor], Mapping] | None = None, grad: bool = False,
                   grad_outputs: Sequence[torch.Tensor] | None = None, regional: bool = False,
                   fold: bool = False, mixed_precision: MixedPrecision | None = None) -> SimulatedRun:
    """Like ``simulate`` but keeps each rank's local outputs.

    ``local_inputs(layout, global_value) -> {coordinate: block}`` overrides how inputs are split
    (default ``layout.shard``), e.g. to give Partial inputs arbitrary per-rank shares.
    With ``grad`` the joint forward+backward program runs (backend/programs/joint.py): gradients of
    the inputs that require grad, seeded with ``grad_outputs`` (default ones), come back too.
    ``regional``: each rank's programs run region by region, as regional compilation cuts and
    reuses them (backend/layers/regions.py); each region runs as a graph, without Inductor. ``fold``: a training
    program of repeated layers (captured as nested compile regions) is planned on four of them and unfolded,
    as ``fxshard.compile`` plans it (backend/programs/fold.py); each rank's programs are lowered from the unfolded plan.
    """
    captured, planned = plan_function(fn, args, mesh=mesh, placements=placements, training=grad, strict=strict,
                                      cost_model=cost_model, fold=fold, mixed_precision=mixed_precision)
    program, gm, training = planned.program, planned.forward, planned.training
    spec = program.mesh
    objects = [captured.objects[p] for p in program.tensor_positions]
    in_layouts = [program.input_layouts[n] for n in program.input_names]
    device = objects[0].device.type if objects else "cpu"
    coords = spec.coordinates()
    split = local_inputs or (lambda layout, v: {c: layout.shard(v, c) for c in coords})
    blocks = [_rank_blocks(obj, coords, name) if isinstance(obj, DTensor) else split(layout, obj.detach())
              for obj, layout, name in zip(objects, in_layouts, program.input_names)]
    _warn_of_rank_numbers(gm)
    with fake_world(spec, device) as device_mesh:
        groups = MeshGroups(device_mesh)
        graphs = [lower_for_rank(gm, c, groups) for c in coords]
        backward = [lower_for_rank(training.backward, c, groups) for c in coords] if grad else []
        # stage 6 as regional compilation cuts (stage6.py), its buckets not merged: each rank's cut programs
        cuts = [cut_into_regions(programs, num_outputs=training.num_outputs if grad else None)
                for programs in (zip(graphs, backward) if grad else zip(graphs))] if regional else None
        traffic = RankTraffic(spec, coords, groups)
        per_rank, compiled = _run_ranks(graphs, cuts, 0, [[b[c] for b in blocks] for c in coords], traffic)
        if not grad:
            return SimulatedRun(coords, per_rank, output_layouts(gm), graph=planned.graph, region_graphs=compiled,
                                lowered=dict(zip(coords, graphs)), bytes_received=traffic.received)
        n = training.num_outputs
        run = SimulatedRun(coords, [outs[:n] for outs in per_rank], training.output_layouts)
        seeds = list(grad_outputs) if grad_outputs is not None else [torch.ones_like(o) for o in run.full()]
        tangents = [{c: layout.shard(t, c) for c in coords} for t, layout in zip(seeds, training.output_layouts)]
        grads, compiled_backward = _run_ranks(
            backward, cuts, 1, [per_rank[r][n:] + [t[c] for t in tangents] for r, c in enumerate(coords)], traffic)
    names = named_inputs(fn, args, captured.objects)
    keys = tuple(names[program.tensor_positions[k]][1] for k in training.grad_inputs)
    return SimulatedRun(coords, run.outputs, run.output_layouts, grads, training.grad_layouts, keys, planned.graph,
                        compiled + compiled_backward, dict(zip(coords, zip(graphs, backward))), traffic.received)


def lowered_graphs(fn: Callable, *args: Any, device_mesh: Any, placements: Mapping[Any, Any] | None = None,
                   strict: bool = False, cost_model: CostModel | None = None, grad: bool = False,
                   training_split: TrainingSplit = DEFAULT_TRAINING_SPLIT) -> dict:
    """Every rank's lowered local program (stage 5) of ``fn(*args)`` on ``device_mesh``, by coordinate.

    Arguments are global tensors (with ``placements``) or DTensors, as in ``simulate``; nothing runs.
    With ``grad`` each value is the pair (forward, backward) of the training program, cut as
    ``training_split`` says.
    """
    groups = MeshGroups(device_mesh)
    _, planned = plan_function(fn, args, mesh=device_mesh, placements=placements, training=grad, strict=strict,
                               cost_model=cost_model, training_split=training_split)
    coords = planned.program.mesh.coordinates()
    if grad:
        return {c: (lower_for_rank(planned.training.forward, c, groups),
                    lower_for_rank(planned.training.backward, c, groups)) for c in coords}
    return {c: lower_for_rank(planned.graph, c, groups) for c in coords}


def _rank_blocks(x: DTensor, coords: Sequence[tuple[int, ...]], name: str) -> dict:
    """Every rank's shard of a DTensor made under LocalTensorMode (its local tensor holds them all)."""
    local = x._local_tensor
    if not isinstance(local, LocalTensor) and all(p.is_replicate() for p in x.placements):
        return {c: local.detach() for c in coords}  # replicated: every rank holds this tensor
    if not isinstance(local, LocalTensor):
        raise TypeError(
            f"input {name} is a DTensor whose local tensor is one rank's shard, so simulate cannot know the other "
            "ranks' shards. Make the DTensors (distribute_tensor, parallelize_module) under "
            "torch.distributed._local_tensor.LocalTensorMode(world_size), or pass global tensors and placements=.")
    ranks = x.device_mesh.mesh.flatten().tolist()
    return {c: local._local_tensors[r].detach() for c, r in zip(coords, ranks)}


class SimulatedGraphs:
    """Runs each graph run of a function on every simulated rank, as Dynamo reaches it.

    A graph's outputs go back to the function as full tensors (or, where Dynamo traced them as
    DTensors, as DTensors whose local tensor holds every rank's block, as under LocalTensorMode);
    the ranks' blocks and layouts stay with them for the graphs that read them later.
    """

    def __init__(self, planner: RunPlanner, stack: contextlib.ExitStack):
        self.planner = planner
        self.stack = stack  # holds the fake process group from the first run to the end of the function
        self.device_mesh: Any = None

    def __call__(self, captured: Captured, inputs: Sequence[Any]) -> tuple:
        return self.run(captured, inputs, self.planner.plan(captured, inputs))

    def run(self, captured: Captured, inputs: Sequence[Any], planned: PlannedProgram) -> tuple:
        """Run ``planned`` (the plan of this run of ``captured``) on every rank; returns what Python reads."""
        program, gm = planned.program, planned.graph
        objects = [inputs[p] for p in program.tensor_positions]
        if self.device_mesh is None:
            device = objects[0].device.type if objects else "cpu"
            self.device_mesh = self.stack.enter_context(fake_world(program.mesh, device))
        coords = program.mesh.coordinates()
        blocks = [self._blocks(obj, program.input_layouts[name], name, coords)
                  for obj, name in zip(objects, program.input_names)]
        groups = MeshGroups(self.device_mesh)
        _warn_of_rank_numbers(gm)
        graphs = [lower_for_rank(gm, c, groups) for c in coords]
        final: list = []
        per_rank = run_lockstep(graphs, [[b[c] for b in blocks] for c in coords], final)
        for k in written_inputs(gm):  # Python (or a later graph) reads what the graph wrote in place
            self._write_back(objects[k], program.input_layouts[program.input_names[k]],
                             {c: final[r][k] for r, c in enumerate(coords)})
        layouts = output_layouts(gm)
        kept = [{c: per_rank[r][k] for r, c in enumerate(coords)} for k in range(len(layouts))]
        examples = _output_examples(captured)
        mesh = program.device_mesh  # the DTensor inputs' DeviceMesh, if any
        values = tuple(_value(blocks, layout, example, mesh) for blocks, layout, example in zip(kept, layouts, examples))
        self.planner.carry(values, layouts, kept)
        return values

    def full(self, value: Any) -> Any:
        """What the function returned, each output of a run as its full tensor (not a DTensor of blocks)."""
        carried = self.planner.carried(value)
        if carried is None or carried[1] is None or not isinstance(value, DTensor):
            return value
        return carried[0].unshard(carried[1])

    def _write_back(self, obj: torch.Tensor, layout: Layout, blocks: Mapping) -> None:
        """An input the graph wrote in place (``x.index_add_``, a static cache): the caller's tensor
        and the blocks later runs read take the new value."""
        if isinstance(obj, DTensor):
            raise NotImplementedError("simulate: a graph writes in place into a DTensor argument; pass it as a "
                                      "plain tensor with placements= instead")
        with torch.no_grad():
            obj.copy_(layout.unshard(blocks))
        if self.planner.carried(obj) is not None:
            self.planner.carry((obj,), (layout,), (dict(blocks),))

    def _blocks(self, obj: torch.Tensor, layout: Layout, name: str, coords: Sequence[tuple[int, ...]]) -> Mapping:
        carried = self.planner.carried(obj)
        if carried is not None and carried[1] is not None:
            return carried[1]
        if isinstance(obj, DTensor):
            return _rank_blocks(obj, coords, name)
        value = obj.detach()
        return {c: layout.shard(value, c) for c in coords}


def written_inputs(gm: fx.GraphModule) -> list[int]:
    """Positions of the placeholders a functionalized graph writes back into (``copy_`` epilogue)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    written = {n.args[0] for n in gm.graph.nodes
               if n.op == "call_function" and n.target is torch.ops.aten.copy_.default and n.args[0] in placeholders}
    return [k for k, n in enumerate(placeholders) if n in written]


def holds_every_rank(x: Any) -> bool:
    """A DTensor made under LocalTensorMode: its local tensor holds every rank's block."""
    return isinstance(x, DTensor) and isinstance(x._local_tensor, LocalTensor)


def _output_examples(captured: Captured) -> list[Any]:
    out = next(n for n in reversed(captured.gm.graph.nodes) if n.op == "output")
    return [a.meta.get("example_value") if isinstance(a, fx.Node) else a for a in out.args[0]]


def _value(blocks: Mapping, layout: Layout, example: Any, device_mesh: Any) -> torch.Tensor:
    """What the function reads of an output: its full value, or a DTensor of every rank's block."""
    if not isinstance(example, DTensor) or device_mesh is None:
        return layout.unshard(blocks)
    coords = layout.mesh.coordinates()
    ranks = device_mesh.mesh.flatten().tolist()
    local = LocalTensor({rank: blocks[c] for c, rank in zip(coords, ranks)})
    return layout_as_dtensor(local, device_mesh, layout)


def simulate(fn: Callable, *args: Any, mesh: Any = None, placements: Mapping[Any, Any] | None = None,
             strict: bool = False, cost_model: CostModel | None = None, grad: bool = False,
             mixed_precision: MixedPrecision | None = None) -> Any:
    """Run ``fn(*args)`` sharded over ``mesh`` on simulated ranks; return the outputs as full tensors.

    Arguments are global tensors; ``placements`` says how to shard them (argument index or
    parameter name -> DTensor placements or Layout), as in ``explain``. A model parallelized
    with ``parallelize_module`` (or DTensor arguments) works too when its DTensors were made
    under ``LocalTensorMode(world_size)``, which holds every rank's shard; ``mesh`` is then
    the DTensors' own.

    Returns what ``fn`` returns, each tensor the full value the simulated ranks computed. A
    function Dynamo splits into several graphs (an ``if`` on a tensor, ``.item()``) runs graph by
    graph; the Python between graphs reads the full values of the outputs it uses.

    With ``grad=True`` the training program runs (forward, then backward seeded with ones) and
    the result is ``(outputs, grads)``: ``grads`` maps each input that requires grad (argument
    index or parameter name) to its full gradient. Training needs the function as one graph.
    ``mixed_precision`` (``fxshard.MixedPrecision``): the program as it runs under that policy.
    """
    if grad:
        run = simulate_ranks(fn, *args, mesh=mesh, placements=placements, strict=strict, cost_model=cost_model,
                             grad=True, mixed_precision=mixed_precision)
        outs = run.full()
        return (outs[0] if len(outs) == 1 else tuple(outs)), run.full_grads()
    planner = RunPlanner(fn, args, mesh=mesh, placements=placements, strict=strict, cost_model=cost_model)
    with contextlib.ExitStack() as stack:
        ranks = SimulatedGraphs(planner, stack)
        _, result = capture_graphs(under_policy(fn, mixed_precision), args, ranks)
    planner.check_placements()
    return pytree.tree_map(ranks.full, result)
