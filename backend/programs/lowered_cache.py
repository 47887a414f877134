"""Each rank's lowered programs kept on disk: a script's second run skips fxshard's stages 1-5.

A second run of a training script captures the same Dynamo graph, for inputs of the same metadata, on
the same mesh, and fxshard planned it again from scratch every time (1.2-2.1 s at 1-4 layers of
bench/compile.py's Llama, 5-6x DTensor + FSDP2's whole warm first step, whose AOTAutograd cache hands
over its compiled blocks at once). What stages 1-5 produce for one rank (its lowered local forward and
backward, or inference program, and the program's signature: input positions and layouts, output
layouts, which inputs get gradients) is kept under a key of everything they read:

- the captured program: the code of its graph and of every graph it calls (a nested compile region's
  body), the values of its tensor constants, the bytecode of the user's Python functions it calls
  (``allow_in_graph``), whether it ends at a graph break;
- each input's metadata: type, shape, strides, dtype, device, whether it requires grad, and a DTensor's
  placements and mesh; non-tensor inputs by value;
- the planning options (layouts given per input, names, strictness, cost model, training split,
  Inductor, bucketing, regional) and the device mesh: its shape and names, this rank's coordinate, and
  its process groups' names (the lowered collectives name them);
- the process-wide state the program is traced under, which no graph holds (``cache_files.ambient_state``:
  autocast per device type, grad mode, default dtype, deterministic algorithms, SDPA's backends, ...): the
  same graph under bf16 autocast is another program;
- fxshard's own source (every module of the package) and torch's version: a change to either makes
  every entry stale.

A folded step (``fold.py``) is kept as its four layers' lowered programs and the layers it folded; they are
made whole when read (``fold_lowered.unfolded_lowered``), as a second run reads them only should someone ask.

A program that holds something this key cannot read (a module call, a fake constant, an input of an
unknown type), or whose lowered programs name this process's state (a routed-experts op's body), is
planned every time. A program whose stages someone watches (``on_graph``, ``debug_dir``,
DEBUG logs) is loaded as any other: the watcher sees its lowered programs, the ones that run. The store is
on when Inductor's FX graph cache is, in Inductor's cache directory (``TORCHINDUCTOR_CACHE_DIR``), as
``prepared_cache.py``'s: clearing one clears both, ``TORCHINDUCTOR_FORCE_DISABLE_CACHES=1`` turns both
off; ``FXSHARD_LOWERED_CACHE=0`` turns this one off alone (the tests do, but for its own: a test compiling
a program an earlier test compiled would otherwise skip the stages it checks). A loaded program's fake values are computed again from its inputs' local shapes, as stage 4 computes
them; its planned global graphs are planned again only if someone reads them (``TrainingProgram.plan``).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import pathlib
import pickle
import sys
import types
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from fxshard.graph import LAYOUT, LOWERED_MOVE, code_on_demand
from fxshard.lowering.localize import program_fake_values
from fxshard.routing import ROUTED_OPS

from fxshard.backend.inductor.cache_files import ambient_state, cache_path, stable, tensor_digest, write_whole
from fxshard.backend.inductor.inductor_calls import counters, fx_graph_cache_on
from fxshard.backend.options import in_force
from fxshard.backend.programs.graph_records import graph_from_records, graph_records
from fxshard.backend.programs.fold_lowered import unfolded_lowered
from fxshard.backend.programs.inference import LoweredInference
from fxshard.backend.layers.regional_program import Region, RegionRole, program_structure
from fxshard.backend.programs.training import KeptRegions, LoweredTraining

__all__ = ["lowered_key", "load_lowered", "read_lowered_graphs", "store_lowered", "store_regions", "source_files"]

_FORMAT = 2  # of the entries: a change to what is kept makes the old ones unreadable, not wrong
_KEPT_META = (LAYOUT, LOWERED_MOVE)  # what the later stages read of a lowered node besides its fake value


@dataclass
class _Entry:
    """What is kept besides the graphs (``_kept``): the program's signature (``lowered``, its graphs None), and
    the INFO lines the planned graphs gave (``StageReporter.summarize``)."""

    lowered: LoweredTraining | LoweredInference
    eager_layouts: list[Any]
    summaries: list[str]
    regions: KeptRegions | None = None  # a training step's regions, where kept (``store_regions``)


def lowered_key(gm: fx.GraphModule, inputs: Sequence[Any], device_mesh: Any, options: Mapping[str, Any]) -> str | None:
    """The key of ``gm``'s lowered programs for this rank, or None where nothing is kept (Inductor's FX graph
    cache off, or something the key cannot read)."""
    if (not fx_graph_cache_on() or device_mesh is None
            or not in_force().lowered_cache):
        return None
    program = _program_text(gm)
    described = [_input_text(x) for x in inputs]
    if program is None or any(d is None for d in described):
        return None
    ambient = ambient_state()
    if ambient is None:
        return None
    reason = getattr(gm, "compile_subgraph_reason", None)
    parts = [_FORMAT, torch.__version__, _source_digest(), ambient, program,
             bool(getattr(reason, "graph_break", False)), described, _mesh_text(device_mesh),
             [(name, _option_text(value)) for name, value in sorted(options.items())]]
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def _program_text(gm: fx.GraphModule) -> list | None:
    """The code of ``gm`` and of every graph module in it, and its tensor constants' digests; None where it
    holds anything else (another module, a fake constant)."""
    parts: list[Any] = []
    for name, module in gm.named_modules():
        if not isinstance(module, fx.GraphModule):
            return None
        constants = _constants(module)
        if constants is None:
            return None
        parts.append((name, module.code))
        parts += [(name, target, value.dtype, tuple(value.shape), tensor_digest(value)) for target, value in constants]
        for node in module.graph.nodes:
            if (node.op == "call_function" and isinstance(node.target, types.FunctionType)
                    and (node.target.__module__ or "").partition(".")[0] != "torch"):
                function = _function_text(node.target)  # the graph names it; its body is the user's
                if function is None:
                    return None
                parts.append(function)
    return parts


def _function_text(fn: types.FunctionType) -> tuple | None:
    """A user's Python function the graph calls (``allow_in_graph``), by its bytecode, constants, defaults, the
    plain values its closure holds and the plain module globals it reads (``SCALE = 2.0``); None where the
    closure holds anything else. Functions it calls in turn are read by name only."""
    def code_text(code: types.CodeType) -> tuple:
        return (code.co_code, code.co_names,
                tuple(code_text(c) if isinstance(c, types.CodeType) else repr(c) for c in code.co_consts))

    def names(code: types.CodeType) -> set[str]:
        return set(code.co_names).union(*(names(c) for c in code.co_consts if isinstance(c, types.CodeType)))

    cells = [cell.cell_contents for cell in fn.__closure__ or ()]
    if not all(_plain(c) for c in cells):
        return None
    read = sorted((name, repr(fn.__globals__[name])) for name in names(fn.__code__)
                  if name in fn.__globals__ and _plain(fn.__globals__[name]))
    return (fn.__module__, fn.__qualname__, code_text(fn.__code__), repr(fn.__defaults__), repr(cells), read)


def _plain(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def _constants(gm: fx.GraphModule) -> list[tuple[str, torch.Tensor]] | None:
    """The tensors ``gm``'s ``get_attr`` nodes read (graph modules aside), or None where one is not a real
    tensor (a fake one has no value to keep or digest)."""
    constants = []
    for node in gm.graph.find_nodes(op="get_attr"):
        value = functools.reduce(getattr, node.target.split("."), gm)
        if isinstance(value, fx.GraphModule):
            continue
        if not isinstance(value, torch.Tensor) or isinstance(value, (FakeTensor, DTensor)):
            return None
        constants.append((node.target, value))
    return constants


def _input_text(x: Any) -> Any:
    if isinstance(x, DTensor):
        return ("DTensor", _tensor_text(x), tuple(map(repr, x.placements)), x.device_mesh.mesh.tolist(),
                x.device_mesh.mesh_dim_names)
    if isinstance(x, torch.Tensor):
        return (type(x).__name__, _tensor_text(x))
    if isinstance(x, DeviceMesh):
        return ("DeviceMesh", x.device_type, x.mesh.tolist(), x.mesh_dim_names)
    if x is None or isinstance(x, (bool, int, float, str, torch.SymInt, torch.dtype, torch.device)):
        return repr(x)
    return None


def _tensor_text(x: torch.Tensor) -> tuple:
    return (tuple(map(repr, x.shape)), tuple(map(repr, x.stride())), x.dtype, str(x.device), x.requires_grad)


def _mesh_text(device_mesh: Any) -> tuple:
    groups = tuple(device_mesh.get_group(d).group_name for d in range(device_mesh.ndim))
    return (device_mesh.device_type, device_mesh.mesh.tolist(), device_mesh.mesh_dim_names,
            tuple(int(c) for c in device_mesh.get_coordinate()), groups)


def _option_text(value: Any) -> Any:
    """An option as the same text in every process (layouts, dataclasses and names by their repr)."""
    if isinstance(value, Mapping):
        return tuple((repr(k), _option_text(v)) for k, v in sorted(value.items(), key=lambda kv: repr(kv[0])))
    if isinstance(value, (list, tuple)):
        return tuple(map(_option_text, value))
    kept = stable(value)
    return kept if isinstance(kept, tuple) else repr(kept)


def source_files() -> list[tuple[str, pathlib.Path]]:
    """Every module of the package, its sub-packages' included (a moved module is a changed source), by its path
    within its package's folder."""
    files = []
    for package in ("fxshard", "fxshard.lowering", "fxshard.backend"):  # imported already: this module imports them
        root = pathlib.Path(sys.modules[package].__file__).parent
        files += [(str(path.relative_to(root)), path) for path in sorted(root.rglob("*.py"))]
    return files


@functools.cache
def _source_digest() -> str:
    """fxshard's source, read once per process (an explicit cache)."""
    digest = hashlib.sha256()
    for name, path in source_files():
        digest.update(name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _path(key: str) -> pathlib.Path:
    return cache_path("fxshard_lowered", key)


def load_lowered(key: str) -> _Entry | None:
    """The entry kept under ``key``, its programs' fake values computed again; None where none is kept or it
    cannot be read. A training step whose regions were kept comes back as those (``regions``; its lowered
    programs are not read, nor cut again)."""
    if _regions_path(key).exists():
        entry = _load_regions(key)
        if entry is not None:
            counters["fxshard"]["lowered_cache_hit"] += 1
            counters["fxshard"]["regions_cache_hit"] += 1
            return entry
    entry = _read_lowered(key)
    counters["fxshard"]["lowered_cache_miss" if entry is None else "lowered_cache_hit"] += 1
    return entry


def _read_lowered(key: str) -> _Entry | None:
    """The lowered programs' entry (``store_lowered``), or None where none is kept or it cannot be read."""
    path = _path(key)
    if not path.exists():
        return None
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    try:
        stored = pickle.loads(path.read_bytes())
        entry: _Entry = stored["entry"]
        for attribute, kept in stored["graphs"].items():
            setattr(entry.lowered, attribute, _restored(kept, mode))
        if stored.get("folded") is not None:  # a folded step's four layers (fold_lowered.FoldedLowering.kept)
            entry.lowered = unfolded_lowered(entry.lowered, *stored["folded"])
    except Exception:  # a torn, foreign or stale file: planned again, and stored over it
        return None
    return entry


def read_lowered_graphs(key: str) -> tuple[fx.GraphModule, fx.GraphModule]:
    """The lowered forward and backward kept under ``key``, for a training program whose regions alone were
    loaded (``TrainingProgram.forward_graph``, read)."""
    entry = _read_lowered(key)
    if entry is None or not isinstance(entry.lowered, LoweredTraining):
        raise RuntimeError("this training program's regions were loaded from disk, and its lowered programs "
                           f"cannot be read from {_path(key)}; set FXSHARD_LOWERED_CACHE=0 to plan it in this run")
    return entry.lowered.forward, entry.lowered.backward


def _kept(graph: fx.GraphModule, meta: Sequence[str]) -> tuple:
    """A local program as it is kept: its records (``graph_records``, with the node metadata ``meta`` names)
    and its inputs' metadata (shape, strides, dtype, device), from which its fake values are computed again.
    A ValueError where it holds what does not pickle as itself (a fake constant, a module)."""
    if _constants(graph) is None or list(graph.children()):
        raise ValueError("a program with a fake constant or a module is not kept")
    inputs = [_value_meta(n) for n in graph.graph.find_nodes(op="placeholder")]
    return graph_records(graph, meta), inputs


def _restored(kept: tuple, mode: FakeTensorMode, values: bool = True) -> fx.GraphModule:
    """The program ``_kept`` kept, every value's fake tensor computed again in ``mode`` from its inputs'; without
    ``values``, its inputs' alone (a region: its compile computes what it reads, ``complete_fake_values``)."""
    records, inputs = kept
    with code_on_demand():  # its code written when first run or read, as every stage's graphs
        graph = graph_from_records(*records)
    with mode:
        fakes = [torch.empty_strided(shape, stride, dtype=dtype, device=device)
                 for shape, stride, dtype, device in inputs]
    if values:
        program_fake_values(graph, fakes, mode)
    else:
        for placeholder, x in zip(graph.graph.find_nodes(op="placeholder"), fakes):
            placeholder.meta["val"] = x
    return graph


def _value_meta(node: fx.Node) -> tuple:
    val = node.meta["val"]
    return (tuple(int(s) for s in val.shape), tuple(int(s) for s in val.stride()), val.dtype, str(val.device))


def store_lowered(key: str, lowered: LoweredTraining | LoweredInference, eager_layouts: Sequence[Any],
                  summaries: Sequence[str], folded: tuple[int, int] | None = None) -> None:
    """Keep ``lowered`` under ``key`` (``folded``: a folded step's four layers, and its template and successor
    layers: made whole when read, ``fold_lowered.unfolded_lowered``). Written whole or not at all (ranks write
    their own keys, and a rank may write one while another process reads it)."""
    attributes = ("forward", "backward") if isinstance(lowered, LoweredTraining) else ("graph",)
    if any(_names_process_state(getattr(lowered, a)) for a in attributes):
        return
    try:
        graphs = {a: _kept(getattr(lowered, a), _KEPT_META) for a in attributes}
        bare = dataclasses.replace(lowered, **{a: None for a in attributes})
        payload = pickle.dumps({"entry": _Entry(bare, list(eager_layouts), list(summaries)), "graphs": graphs,
                                "folded": folded}, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # something in it does not pickle: planned again next time
        return
    write_whole(_path(key), payload)


def _names_process_state(gm: fx.GraphModule | None) -> bool:
    """A program calling a routed-experts op names its body by a key of this process's registry
    (fxshard/routing.py), which another process fills only when it traces the program: planned every time."""
    return gm is not None and any(n.target in ROUTED_OPS for n in gm.graph.nodes)


def _regions_path(key: str) -> pathlib.Path:
    return cache_path("fxshard_lowered", key + ".regions")


# what the stages after the cut read of a region's node besides its fake value: the block tags bucketing reads
_REGION_META = ("custom",) + _KEPT_META


def store_regions(key: str, lowered: LoweredTraining, eager_layouts: Sequence[Any], summaries: Sequence[str],
                  kept: KeptRegions) -> None:
    """Keep a training step's regions under ``key`` beside its lowered programs (``store_lowered``): each
    program's schedule, and one graph per distinct region (the regions a key shares compile to one program:
    ``regional_program.region_key``), layers and the regions between two layers alike (those repeat too: 73 graphs
    for 135 regions at 32 layers until they were shared). A second run loads these instead of cutting again."""
    graphs: list[tuple] = []
    shared: dict[tuple, int] = {}
    regions: dict[str, list[tuple[str, int | None, int]]] = {}
    if any(_names_process_state(region.graph) for listed in kept.regions.values() for region in listed):
        return
    try:
        for which, listed in kept.regions.items():
            regions[which] = []
            for region in listed:
                inputs = tuple(_value_meta(n) for n in region.graph.graph.find_nodes(op="placeholder"))
                same = (program_structure(region.graph.graph), inputs)
                number = shared.get(same)
                if number is None:
                    number = shared[same] = len(graphs)
                    graphs.append(_kept(region.graph, _REGION_META))
                regions[which].append((region.role.value, region.index, number))
        bare = dataclasses.replace(lowered, forward=None, backward=None)
        payload = pickle.dumps({"entry": _Entry(bare, list(eager_layouts), list(summaries)),
                                "schedules": kept.schedules, "regions": regions, "graphs": graphs, "cap": kept.cap},
                               protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # something in it does not pickle: cut again next time
        return
    write_whole(_regions_path(key), payload)


def _load_regions(key: str) -> _Entry | None:
    """The entry ``store_regions`` kept. Its region graphs come without fake values, which were most of the
    load (0.19 -> 0.03 s at 1 layer): a layer's compile computes those of the program it prepares, or loads
    prepared, from its example inputs (``compile_inner.compile_direct``), the other regions' compiles theirs
    from their first inputs (``localize.complete_fake_values``)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    try:
        stored = pickle.loads(_regions_path(key).read_bytes())
        graphs = [(graph, program_structure(graph.graph))
                  for graph in (_restored(kept, mode, values=False) for kept in stored["graphs"])]
        regions = {which: [Region(RegionRole(role), graphs[number][0], [], [], index, structure=graphs[number][1])
                           for role, index, number in listed]
                   for which, listed in stored["regions"].items()}
        entry: _Entry = stored["entry"]
        entry.regions = KeptRegions(stored["schedules"], regions, stored["cap"])
    except Exception:  # a torn, foreign or stale file: the lowered programs are read, and cut again
        return None
    return entry
