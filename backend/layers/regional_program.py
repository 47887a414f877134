"""A program cut into regions, as data and as it runs: each region's role, its key, and the regional program.

``regions.py`` cuts a lowered local program into contiguous regions (``Region``), each in one role
(``RegionRole``: the prologue, a layer, what runs between two layers, the epilogue). Two regions whose code
(``program_structure``) and inputs' shapes, strides and dtypes agree have one key (``region_key``) and are one
compiled program. ``RegionalProgram`` runs the regions in order by their ``Schedule`` (which outer values
each reads and writes, and when each is freed), compiling each key once, as the first call reaches it.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx as fx

__all__ = ["RegionRole", "Region", "region_key", "program_structure", "argument_key", "Schedule", "region_schedule",
           "RegionalProgram"]


class RegionRole(enum.Enum):
    """What a region holds, and so how it is compiled (``TrainingProgram._compile_region``)."""

    PROLOGUE = "prologue"  # before the first layer: embedding, rotary tables, masks, the root's gathers
    LAYER = "layer"  # one layer's work: the layers that compute alike are one compiled program
    BETWEEN = "between"  # between two layers: a layer's gathers started early, reductions waited late (prefetch.py)
    EPILOGUE = "epilogue"  # after the last layer: final norm, output projection, loss


@dataclass
class Region:
    """One contiguous piece of a program, as a program of its own: ``inputs`` -> ``outputs``."""

    role: RegionRole
    graph: fx.GraphModule  # placeholders in_0..., nodes v0..., returns a tuple
    inputs: list[fx.Node]  # the outer program's values it reads, in its placeholders' order
    outputs: list[fx.Node]  # its values read after it, in its output tuple's order
    index: int | None = None  # the layer it holds (a ``LAYER``); None for the other roles
    body: list[fx.Node] = field(default_factory=list)  # the outer program's nodes it computes, in order
    # ``program_structure(graph.graph)`` where known before the graph may change (regions loaded from disk
    # share one graph per key, which bucketing an uncompiled region rewrites): what ``region_key`` reads
    structure: tuple | None = None


def region_key(region: Region, inputs: Sequence[Any]) -> tuple:
    """What makes two regions one compiled program: their code (``program_structure``) and their inputs'
    shapes, strides, dtypes."""
    def meta(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return (tuple(x.shape), tuple(x.stride()), x.dtype, x.device)
        return ("value", repr(x))

    structure = region.structure if region.structure is not None else program_structure(region.graph.graph)
    return (structure, tuple(meta(x) for x in inputs))


def program_structure(graph: fx.Graph) -> tuple:
    """What a graph's Python code says, without writing it (code is written on demand: fxshard.graph):
    each node's op, target and arguments, a node named by its position. Equal for two graphs exactly
    when their code is, for the graphs ``regions._region`` makes (names by position)."""
    position: dict[fx.Node, Any] = {}

    def arg(a: Any) -> Any:
        return argument_key(a, position)

    found = []
    for k, node in enumerate(graph.nodes):
        position[node] = ("node", k)
        found.append((node.op, node.target if node.op == "call_function" else repr(node.target),
                      arg(node.args), arg(node.kwargs)))
    return tuple(found)


def argument_key(a: Any, name: Mapping[fx.Node, Any]) -> Any:
    """A node's argument as a comparable value: each node by ``name``, containers by their members, the rest by
    type and ``repr`` (``program_structure``, ``regions._sharing_key``)."""
    if isinstance(a, fx.Node):
        return name[a]
    if isinstance(a, (list, tuple)):
        return (type(a).__name__, tuple(argument_key(x, name) for x in a))
    if isinstance(a, dict):
        return ("dict", tuple((k, argument_key(v, name)) for k, v in a.items()))
    return (type(a).__name__, repr(a))


@dataclass
class Schedule:
    """How a regional program runs its regions: a slot per outer value (the program's inputs, its constants,
    each region's outputs), the slots each region reads and writes and those freed after it, and the
    program's result as slots. What ``RegionalProgram`` needs of the outer program, and all it needs."""

    num_inputs: int
    num_slots: int
    attrs: list[tuple[int, Any]]  # (slot, value) of each constant the program reads (get_attr)
    steps: list[tuple[list[int], list[int], list[int]]]  # per region: slots read, written, freed after it
    result: Any  # the program's output structure, each value a ``_Slot``


def region_schedule(gm: fx.GraphModule, regions: Sequence[Region]) -> Schedule:
    """Every outer value's slot, which slots each region reads and writes, and when each is freed."""
    slot: dict[fx.Node, int] = {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            slot[node] = len(slot)
    attrs = [(slot[n], getattr(gm, n.target)) for n in gm.graph.find_nodes(op="get_attr")]
    num_inputs = len(gm.graph.find_nodes(op="placeholder"))
    for r in regions:
        for o in r.outputs:
            slot[o] = len(slot)
    output = next(iter(gm.graph.find_nodes(op="output")))
    last_read: dict[int, int] = {}
    for k, r in enumerate(regions):
        for x in r.inputs:
            last_read[slot[x]] = k
    kept = {slot[n] for n in output.all_input_nodes}
    for k, r in enumerate(regions):  # a value no one reads (regions._same_outputs) goes at once
        for o in r.outputs:
            last_read.setdefault(slot[o], k)
    steps = [([slot[x] for x in r.inputs], [slot[o] for o in r.outputs],
              [s for s, k2 in last_read.items() if k2 == k and s not in kept])
             for k, r in enumerate(regions)]
    return Schedule(num_inputs, len(slot), attrs, steps, fx.node.map_arg(output.args[0], lambda n: _Slot(slot[n])))


class RegionalProgram:
    """Runs a program region by region; ``compile_region(region, inputs)`` is called once per key.

    ``cache`` (key -> compiled region) may be shared by programs (a training step's forward and
    backward). The first call compiles each region as it reaches it, with its real inputs. The program is
    the outer graph ``gm`` cut into ``regions``, or (``schedule``: regions loaded from disk) its schedule.
    """

    def __init__(self, gm: fx.GraphModule | None, regions: Sequence[Region],
                 compile_region: Callable[[Region, list[Any]], Callable], cache: dict | None = None,
                 schedule: Schedule | None = None):
        self.gm = gm
        self.regions = list(regions)
        self.compile_region = compile_region
        self.cache = cache if cache is not None else {}
        self.compiled: list[Callable | None] = [None] * len(self.regions)
        if schedule is None:
            assert gm is not None, "a regional program needs its outer graph or its schedule"
            schedule = region_schedule(gm, self.regions)
        self.schedule = schedule
        self.num_inputs, self.num_slots = schedule.num_inputs, schedule.num_slots
        self.attrs, self.steps, self.result = schedule.attrs, schedule.steps, schedule.result

    def __call__(self, *args: Any) -> Any:
        return self.call_boxed(list(args))

    def call_boxed(self, args: list[Any]) -> Any:
        """As ``__call__``, taking the list ``args`` over (Inductor's boxed calling convention): the list is
        emptied, so an input no later region reads is freed once its last reader has run, not when the
        whole program returns (a backward's saved activations, layer by layer)."""
        attrs = [value for _, value in self.attrs]
        return self.walk(args, attrs, lambda k, inputs: (self.compiled[k] or self.compiled_region(k, inputs))(*inputs))

    def walk(self, args: Sequence[Any], attrs: Sequence[Any], call: Callable[[int, list[Any]], Sequence[Any]]) -> Any:
        """Runs the regions in order, ``call(k, inputs)`` giving region k's outputs, each value dropped after
        its last reader; returns the program's outputs. (``simulate`` steps every rank's program at once.)"""
        env: list[Any] = [None] * self.num_slots
        env[:self.num_inputs] = args
        if isinstance(args, list):
            args.clear()  # the env holds the inputs now, each until its last reader
        for (s, _), value in zip(self.attrs, attrs):
            env[s] = value
        for k, (reads, writes, frees) in enumerate(self.steps):
            for s, value in zip(writes, call(k, [env[s] for s in reads])):
                env[s] = value
            for s in frees:
                env[s] = None
        return _mapped(self.result, env)

    def compiled_region(self, k: int, inputs: list[Any]) -> Callable:
        """Region k's compiled program, compiled on its first inputs unless a region with its key was."""
        key = region_key(self.regions[k], inputs)
        if key not in self.cache:
            self.cache[key] = self.compile_region(self.regions[k], inputs)
        self.compiled[k] = self.cache[key]
        return self.compiled[k]


@dataclass(frozen=True)
class _Slot:
    index: int


def _mapped(structure: Any, env: list[Any]) -> Any:
    """The program's output structure with each slot's value."""
    if isinstance(structure, (tuple, list)):
        return tuple(_mapped(s, env) for s in structure)
    return env[structure.index] if isinstance(structure, _Slot) else structure

