"""Load-time sharding: each rank reads only its own shard of every tensor of a checkpoint.

A parameter's layout says which indices of each dim a rank holds (``Layout.local_indices``);
those indices are a few contiguous runs per dim (one for ``Shard``, several for a strided
fused QKV ``[3 · tp · h/tp]``). The reader slices exactly those runs out of the checkpoint:
positioned reads of a safetensors file straight into the block's memory, or a
``torch.load(mmap=True)`` state dict whose pages are touched only where indexed. Nothing is communicated and no rank materializes a full tensor.

A ``ShardPlan`` maps parameter-name patterns to placements and named transforms; it never
mentions the number of ranks, so one plan (saved as JSON) loads on any mesh.
"""
from __future__ import annotations

import ctypes
import fnmatch
import itertools
import json
import pathlib
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard

from .layout import Layout, LayoutError
from .mesh import Coordinate
from .placements import as_dtensor, as_mesh_spec, layout_from_placements, placements_from_str, placements_to_str


class LoadError(ValueError):
    """A checkpoint that does not fit the module or the plan; names the parameter."""


# ---- transforms: applied to a rank's block after reading, registered by name -----------------------
TRANSFORMS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}


def register_transform(name: str, fn: Callable[[torch.Tensor], torch.Tensor] | None = None):
    """Register ``fn(local_block) -> local_block`` under ``name`` (usable as a decorator)."""
    def add(f: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
        TRANSFORMS[name] = f
        return f
    return add(fn) if fn is not None else add


for _dtype in ("float32", "float16", "bfloat16"):
    register_transform(_dtype, lambda t, d=getattr(torch, _dtype): t.to(d))


# ---- the plan ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Source:
    """A parameter stored as a part of a fused checkpoint tensor: ``name``'s indices
    [offset, offset + size) along ``dim`` (size: the parameter's own). Grouped-query q, k, v in one
    ``wqkv`` (q with more heads than k and v) or gate|up load as separate parameters, each part
    sharded on its own, so every rank reads only its heads of each part."""

    name: str
    dim: int = 0
    offset: int = 0


@dataclass(frozen=True)
class TensorSpec:
    placements: tuple[Placement, ...]
    transforms: tuple[str, ...] = ()
    source: Source | None = None

@dataclass
class PlanEntry:
    pattern: str  # fnmatch pattern on parameter names
    placements: tuple[Placement, ...] | None = None  # None: the module's own (DTensor) placements
    transforms: tuple[str, ...] = ()
    source: Source | None = None  # read from a part of another checkpoint tensor (a fused one)


@dataclass
class ShardPlan:
    """Parameter-name patterns -> placements and transforms; the first matching entry wins."""

    entries: list[PlanEntry] = field(default_factory=list)

    @classmethod
    def of(cls, mapping: Mapping[str, Any] | "ShardPlan" | None) -> "ShardPlan":
        """From ``{pattern: placements | {"placements": ..., "transforms": [...]}}``."""
        if mapping is None:
            return cls()
        if isinstance(mapping, ShardPlan):
            return mapping
        entries = []
        for pattern, spec in mapping.items():
            if isinstance(spec, Mapping):
                placements = spec.get("placements")
                source = spec.get("source")
                if isinstance(source, Mapping):
                    source = Source(**source)
                entries.append(PlanEntry(pattern, _placements(placements) if placements is not None else None,
                                         tuple(spec.get("transforms", ())), source))
            else:
                entries.append(PlanEntry(pattern, _placements(spec)))
        return cls(entries)

    @classmethod
    def from_tp_plan(cls, tp_plan: Mapping[str, str]) -> "ShardPlan":
        """Hugging Face transformers' tensor-parallel plan (``model.tp_plan``: module pattern -> style name) as the
        placements its styles give each module's weight and bias, so fxshard shards the model in global shapes."""
        entries = []
        for pattern, style in tp_plan.items():
            if style not in HF_STYLE_PLACEMENTS:
                raise LoadError(f"{pattern}: transformers' parallel style {style!r} has no parameter placements "
                                f"fxshard reads; known: {sorted(HF_STYLE_PLACEMENTS)}. Give its parameters' "
                                "placements in a plan of your own ({pattern + '.weight': 'S(0)'})")
            for leaf, placement in zip(("weight", "bias"), HF_STYLE_PLACEMENTS[style]):
                if placement is not None:
                    entries.append(PlanEntry(f"{pattern}.{leaf}", (placement,)))
        return cls(entries)

    def lookup(self, name: str) -> PlanEntry | None:
        return next((e for e in self.entries if fnmatch.fnmatchcase(name, e.pattern)), None)

    def to_json(self) -> str:
        def entry(e: PlanEntry) -> dict:
            out: dict = {"placements": placements_to_str(e.placements) if e.placements is not None else None,
                         "transforms": list(e.transforms)}
            if e.source is not None:
                out["source"] = {"name": e.source.name, "dim": e.source.dim, "offset": e.source.offset}
            return out
        return json.dumps({e.pattern: entry(e) for e in self.entries}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "ShardPlan":
        return cls.of(json.loads(text))


# transformers' style names (transformers/distributed/tensor_parallel.py) -> (weight, bias) placements on the tp
# axis, as each style's ``shard_param`` distributes them; None: left whole (plain). Replicating styles shard nothing.
HF_STYLE_PLACEMENTS: dict[str, tuple[Placement | None, Placement | None]] = {
    **{name: (Shard(0), Shard(0)) for name in ("colwise", "colwise_rep", "colwise_gather_output")},
    **{name: (Shard(1), None) for name in ("rowwise", "rowwise_rep", "rowwise_split_input")},
    "embedding_rowwise": (Shard(0), None),
    "embedding_colwise": (Shard(1), None),
    **{name: (None, None) for name in ("sequence_parallel", "replicate", "replicated_with_grad_allreduce",
                                      "all_reduce", "local_params")},
}


def _placements(spec: Any) -> tuple[Placement, ...]:
    if isinstance(spec, str):
        return placements_from_str(spec)
    if isinstance(spec, Placement):
        return (spec,)
    return tuple(spec)


# ---- reading ----------------------------------------------------------------------------------------
class Checkpoint:
    """Tensors by name, each readable in pieces: safetensors file(s) or a torch.save state dict."""

    def __init__(self, source: str | pathlib.Path | Mapping[str, torch.Tensor]):
        self._files: dict[str, Any] = {}
        self._where: dict[str, Any] = {}
        self.bytes_read = 0
        if isinstance(source, Mapping):
            self._tensors = dict(source)
            return
        path = pathlib.Path(source)
        self._tensors = {}
        if path.is_dir():
            index = next(iter(sorted(path.glob("*.safetensors.index.json"))), None)
            if index is not None:
                for name, file in json.loads(index.read_text())["weight_map"].items():
                    self._where[name] = path / file
            else:
                for file in sorted(path.glob("*.safetensors")):
                    self._add_safetensors(file)
            if not self._where:
                raise LoadError(f"{path} holds no safetensors files (and no *.safetensors.index.json)")
        elif path.suffix == ".safetensors":
            self._add_safetensors(path)
        else:
            state = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
            if not isinstance(state, Mapping):
                raise LoadError(f"{path} is not a state dict (a torch.save of {type(state).__name__})")
            self._tensors = dict(state)

    def _add_safetensors(self, file: pathlib.Path) -> None:
        for name in self._open(file).names():
            self._where[name] = file

    def _open(self, file: pathlib.Path) -> "_SafetensorsFile":
        if file not in self._files:
            self._files[file] = _SafetensorsFile(file)
        return self._files[file]

    def keys(self) -> list[str]:
        return sorted(set(self._tensors) | set(self._where))

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self._tensors:
            return tuple(self._tensors[name].shape)
        return self._open(self._where[name]).shape(name)

    def read(self, name: str, runs: Sequence[Sequence[tuple[int, int]]]) -> torch.Tensor:
        """The block of ``name`` made of the index runs ``[(start, stop), ...]`` of each dim, in order."""
        if name in self._tensors:
            block = _read_runs(self._tensors[name], list(runs))
            self.bytes_read += block.numel() * block.element_size()
        else:
            file = self._open(self._where[name])
            before = file.bytes_read
            block = file.read(name, list(runs))
            self.bytes_read += file.bytes_read - before  # what actually came from the file
        return block


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool}


class _SafetensorsFile:
    """A .safetensors file read with plain positioned reads into the block's own memory.

    The format is an 8-byte header length, a JSON header (dtype, shape, byte offsets per tensor)
    and the raw row-major data. Reading through a memory map would leave every touched page of the
    file resident in the process as well as the copy; reading into the block costs only the block.
    """

    def __init__(self, path: pathlib.Path):
        self.path = path
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        self.data_start = 8 + n
        self.bytes_read = 0  # tensor data read so far (the header not counted)
        header.pop("__metadata__", None)
        self.header = header

    def names(self) -> list[str]:
        return list(self.header)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def read(self, name: str, runs: list[Sequence[tuple[int, int]]]) -> torch.Tensor:
        info = self.header[name]
        dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
        if dtype is None:
            raise LoadError(f"{name}: safetensors dtype {info['dtype']} is not supported")
        shape = tuple(info["shape"])
        local = [sum(b - a for a, b in r) for r in runs]
        out = torch.empty(local, dtype=dtype)
        if out.numel() == 0:
            return out
        itemsize = out.element_size()
        stride = [1] * len(shape)
        for d in range(len(shape) - 2, -1, -1):
            stride[d] = stride[d + 1] * shape[d + 1]
        k = len(shape) - 1  # the last dim that is not read whole: below it every read is contiguous
        while k > 0 and list(runs[k]) == [(0, shape[k])]:
            k -= 1
        # the block's own memory as a writable buffer (no numpy needed): reads land in place
        buffer = memoryview((ctypes.c_char * (out.numel() * itemsize)).from_address(out.data_ptr())).cast("B")
        base_offset = self.data_start + info["data_offsets"][0]
        pos = 0
        outer = [[i for a, b in runs[d] for i in range(a, b)] for d in range(k)]
        with open(self.path, "rb", buffering=0) as f:
            for index in itertools.product(*outer):
                base = sum(i * stride[d] for d, i in enumerate(index))
                for a, b in (runs[k] if shape else [(0, 1)]):
                    start = (base + a * (stride[k] if shape else 1)) * itemsize
                    n = (b - a) * (stride[k] if shape else 1) * itemsize
                    f.seek(base_offset + start)
                    if f.readinto(buffer[pos:pos + n]) != n:
                        raise LoadError(f"{name}: {self.path} ends early")
                    pos += n
                    self.bytes_read += n
        return out


def _read_runs(source: Any, runs: list[Sequence[tuple[int, int]]]) -> torch.Tensor:
    multi = next((d for d, r in enumerate(runs) if len(r) != 1), None)
    if multi is None:
        index = tuple(slice(a, b) for (a, b), in runs)
        return source[index].clone() if isinstance(source, torch.Tensor) else source[index]
    parts = [_read_runs(source, runs[:multi] + [[run]] + runs[multi + 1:]) for run in runs[multi]]
    return torch.cat(parts, dim=multi)


def index_runs(indices: torch.Tensor) -> list[tuple[int, int]]:
    """Increasing contiguous runs of ``indices`` as [start, stop) pairs, in order."""
    runs: list[tuple[int, int]] = []
    for i in indices.tolist():
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs or [(0, 0)]


# ---- per-rank blocks --------------------------------------------------------------------------------
def local_block(checkpoint: Checkpoint, name: str, layout: Layout, coordinate: Coordinate,
                offset: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """This rank's block of tensor ``name`` under ``layout``, read run by run (the layout's indices
    along dim ``offset[0]`` shifted by ``offset[1]``: a part of a fused tensor)."""
    runs = [index_runs(layout.local_indices(d, coordinate)) if layout.dim_is_sharded(d) else [(0, int(layout.shape[d]))]
            for d in range(layout.ndim)]
    dim, shift = offset
    if shift:
        runs[dim] = [(a + shift, b + shift) for a, b in runs[dim]]
    return checkpoint.read(name, runs)


def read_shards(checkpoint: Checkpoint | str | pathlib.Path | Mapping[str, torch.Tensor],
                specs: Mapping[str, TensorSpec | tuple], mesh: Any, coordinate: Coordinate,
                expected_shapes: Mapping[str, Sequence[int]] | None = None) -> dict[str, torch.Tensor]:
    """{name: this rank's block} for every name in ``specs`` ({name: TensorSpec or (placements, transforms)}).

    Everything is checked before anything is returned: missing keys, shapes, placements that do
    not fit the mesh, transform names, parts that do not fit their fused tensor.
    """
    ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else Checkpoint(checkpoint)
    specs = {n: v if isinstance(v, TensorSpec) else TensorSpec(tuple(v[0]), tuple(v[1])) for n, v in specs.items()}
    spec = as_mesh_spec(mesh)
    available = set(ckpt.keys())
    missing = sorted({t.source.name if t.source else n for n, t in specs.items()} - available)
    if missing:
        raise missing_tensors(missing, available)
    layouts: dict[str, Layout] = {}
    for name, t in specs.items():
        shape = _checked_shape(ckpt, name, t, expected_shapes)
        unknown = [x for x in t.transforms if x not in TRANSFORMS]
        if unknown:
            raise LoadError(f"{name}: transform {unknown[0]!r} is not registered "
                            f"(fxshard.load.register_transform); known: {sorted(TRANSFORMS)}")
        try:
            layouts[name] = layout_from_placements(spec, shape, t.placements)
        except (LayoutError, IndexError, ValueError) as e:
            raise LoadError(f"{name}: placements {placements_to_str(t.placements)} do not fit shape {list(shape)} on "
                            f"{spec}: {e}") from e
    out = {}
    for name, t in specs.items():
        offset = (t.source.dim, t.source.offset) if t.source else (0, 0)
        block = local_block(ckpt, t.source.name if t.source else name, layouts[name], coordinate, offset)
        for x in t.transforms:
            block = TRANSFORMS[x](block)
        out[name] = block
    return out


def _checked_shape(ckpt: Checkpoint, name: str, t: TensorSpec,
                   expected_shapes: Mapping[str, Sequence[int]] | None) -> tuple[int, ...]:
    expected = tuple(expected_shapes[name]) if expected_shapes is not None else None
    if t.source is None:
        shape = ckpt.shape(name)
        if expected is not None and expected != shape:
            raise LoadError(f"{name}: the checkpoint holds shape {list(shape)}, the module expects {list(expected)}")
        return shape
    fused, d = ckpt.shape(t.source.name), t.source.dim
    if expected is None:
        raise LoadError(f"{name}: a part of {t.source.name} needs the parameter's shape (expected_shapes)")
    fits = len(fused) == len(expected) and all(a == b for i, (a, b) in enumerate(zip(fused, expected)) if i != d)
    if not fits or not 0 <= t.source.offset <= fused[d] - expected[d]:
        raise LoadError(f"{name}: shape {list(expected)} at offset {t.source.offset} of dim {d} does not fit in "
                        f"{t.source.name} {list(fused)}")
    return expected


def load_sharded(module: torch.nn.Module, checkpoint: Any, device_mesh: Any, plan: Any = None,
                 strict: bool = True, prefix: str | None = None) -> torch.nn.Module:
    """Fill ``module``'s parameters and buffers with DTensors holding only this rank's shard.

    ``checkpoint``: a safetensors file, a directory of safetensors (with the Hugging Face index
    json or without), a ``torch.save`` state dict path (read with ``mmap=True``), a dict, or a
    torch.distributed.checkpoint directory (read by DCP itself, which reshards).
    ``plan``: ``{pattern: placements | {"placements": ..., "transforms": [...]}}`` or a
    ``ShardPlan``; a name no entry matches keeps what the module has: a DTensor's placements, or
    a plain tensor (whole on every rank, as ``parallelize_module`` leaves unsharded norms).
    ``module`` may live on the meta device. With ``strict``, checkpoint tensors the
    module does not have are an error. Nothing is assigned unless every tensor loaded.
    ``prefix``: where the module's state sits in the checkpoint (``"model."`` for a DCP save of
    ``{"model": model.state_dict(), "optim": ...}``); by default the one prefix under which the checkpoint
    holds every name the module has, none if it holds them as they are. Other keys belong to other state
    (an optimizer's) and are not the module's. Non-persistent buffers (in no state dict) keep their values.
    """
    from torch.distributed.tensor import DTensor

    plan = ShardPlan.of(plan)
    targets = _state_tensors(module)
    specs: dict[str, TensorSpec] = {}
    plain: set[str] = set()  # stays a plain tensor: the module has one and the plan gives no placements
    for name, value in targets.items():
        entry = plan.lookup(name)
        own = tuple(value.placements) if isinstance(value, DTensor) else (Replicate(),) * device_mesh.ndim
        placements = entry.placements if entry is not None and entry.placements is not None else own
        if not isinstance(value, DTensor) and (entry is None or entry.placements is None):
            plain.add(name)
        specs[name] = TensorSpec(placements, entry.transforms if entry else (), entry.source if entry else None)
    dcp_dir = isinstance(checkpoint, (str, pathlib.Path)) and (pathlib.Path(checkpoint) / ".metadata").is_file()
    ckpt = None if dcp_dir else checkpoint if isinstance(checkpoint, Checkpoint) else Checkpoint(checkpoint)
    keys = set(_dcp_metadata(pathlib.Path(checkpoint)) if dcp_dir else ckpt.keys())
    wanted = {t.source.name if t.source else n for n, t in specs.items()}
    prefix = checkpoint_prefix(keys, wanted, prefix)
    if dcp_dir:
        return _load_dcp(module, pathlib.Path(checkpoint), device_mesh, specs, targets, strict, plain, prefix)
    if strict:
        extra = sorted(k for k in keys if k.startswith(prefix) and k[len(prefix):] not in set(targets) | wanted)
        if extra:
            raise LoadError(f"the checkpoint has tensors the module does not: {extra[:8]} (strict=False ignores them)")
    coordinate = tuple(device_mesh.get_coordinate())
    blocks = read_shards(ckpt, {prefix + n: _prefixed(t, prefix) for n, t in specs.items()}, device_mesh, coordinate,
                         expected_shapes={prefix + n: tuple(v.shape) for n, v in targets.items()})
    for name in specs:
        shape = tuple(targets[name].shape)
        block = blocks[prefix + name].to(device_mesh.device_type)
        value = block if name in plain else as_dtensor(block, device_mesh, specs[name].placements, shape)
        _assign(module, name, value, isinstance(targets[name], torch.nn.Parameter))
    return module


def _state_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameters and persistent buffers of ``module`` by name: what its ``state_dict`` holds, so what a
    checkpoint can (a non-persistent buffer, a rotary table's ``inv_freq``, is made by the module itself)."""
    out = dict(module.named_parameters())
    for name, buffer in module.named_buffers():
        owner, _, leaf = name.rpartition(".")
        if leaf not in module.get_submodule(owner)._non_persistent_buffers_set:
            out[name] = buffer
    return out


def checkpoint_prefix(keys: set[str], wanted: set[str], given: str | None = None) -> str:
    """The prefix under which ``keys`` hold every name in ``wanted``: ``given`` (a dot added), "" where the names
    are there as they are, else the one prefix that holds them all; "" where none or several do (the error
    about the missing names then names the prefixes: ``missing_tensors``)."""
    if given is not None:
        return given if given == "" or given.endswith(".") else given + "."
    if not wanted or wanted <= keys:
        return ""
    fits = _prefixes_holding(keys, wanted)
    return fits[0] if len(fits) == 1 else ""


def _prefixes_holding(keys: set[str], names: set[str]) -> list[str]:
    """The prefixes ``p`` (ending in a dot) for which ``keys`` hold ``p + name`` for every one of ``names``."""
    counts = _prefix_counts(keys, names)
    return sorted(p for p, n in counts.items() if n == len(names))


def _prefix_counts(keys: set[str], names: set[str]) -> dict[str, int]:
    """{prefix ending in a dot: how many of ``names`` ``keys`` hold under it}, one pass over the keys' dots."""
    counts: dict[str, int] = {}
    for k in keys:
        for i, c in enumerate(k):
            if c == "." and k[i + 1:] in names:
                counts[k[:i + 1]] = counts.get(k[:i + 1], 0) + 1
    return counts


def missing_tensors(missing: Sequence[str], keys: set[str]) -> LoadError:
    """The error for checkpoint names ``keys`` lack: where the keys carry a prefix the names lack (a DCP save of
    ``{"model": ..., "optim": ...}``), which prefix holds them and the ``prefix=`` argument that loads through it."""
    message = f"the checkpoint has no tensor for {list(missing[:8])}{' ...' if len(missing) > 8 else ''}"
    held = _prefix_counts(keys, set(missing))
    if not held:
        return LoadError(message)
    full = sorted(p for p, n in held.items() if n == len(missing))
    if len(full) > 1:
        choices = ", ".join(f"prefix={p!r}" for p in full)
        return LoadError(f"{message}; the checkpoint holds all of them under several prefixes: pass one of {choices} "
                         "to load_sharded")
    p = full[0] if full else max(sorted(held), key=lambda q: held[q])
    example = next(p + m for m in missing if p + m in keys)
    saved_as = f"{{{p[:-1]!r}: model.state_dict(), ...}}" if p.count(".") == 1 else "a nested dict"
    found = (f"its keys carry a prefix the module's names lack, {p!r} (e.g. {example!r}: DCP's key for a save of "
             f"{saved_as})")
    if held[p] == len(missing):
        return LoadError(f"{message}: {found}; pass prefix={p!r} to load_sharded")
    lacking = [p + m for m in missing if p + m not in keys]
    return LoadError(f"{message}: {found}, but under it the checkpoint has no tensor for {lacking[:8]} either "
                     f"({held[p]} of the {len(missing)} are there): the checkpoint holds another module's state; "
                     f"prefix={p!r} reads it once the names match")


def _prefixed(spec: TensorSpec, prefix: str) -> TensorSpec:
    """``spec`` with its fused source's name under ``prefix`` too: the plan names tensors as the module does."""
    if not prefix or spec.source is None:
        return spec
    return TensorSpec(spec.placements, spec.transforms, Source(prefix + spec.source.name, spec.source.dim,
                                                                spec.source.offset))


def _dcp_metadata(path: pathlib.Path) -> dict[str, Any]:
    """A torch.distributed.checkpoint directory's entries by (flattened) key: nested dicts saved as ``a.b``."""
    import torch.distributed.checkpoint as dcp

    return dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata


def _load_dcp(module: torch.nn.Module, path: pathlib.Path, device_mesh: Any,
              specs: Mapping[str, TensorSpec], targets: Mapping[str, Any],
              strict: bool, plain: set[str], prefix: str) -> torch.nn.Module:
    """A torch.distributed.checkpoint directory: DCP itself reads (and reshards) into empty DTensors."""
    import torch.distributed.checkpoint as dcp

    metadata = _dcp_metadata(path)
    missing = sorted(n for n in targets if prefix + n not in metadata)
    if missing:
        raise missing_tensors([prefix + n for n in missing], set(metadata))
    extra = sorted(k for k in metadata if k.startswith(prefix) and k[len(prefix):] not in targets)
    if strict and extra:
        raise LoadError(f"the checkpoint has tensors the module does not: {extra[:8]} (strict=False ignores them)")
    spec = as_mesh_spec(device_mesh)
    coordinate = tuple(device_mesh.get_coordinate())
    state = {}
    for name, t in specs.items():
        placements = t.placements
        if t.source is not None:
            raise LoadError(f"{name}: parts of fused tensors (source=) load from safetensors and torch.save "
                            "checkpoints, not DCP")
        shape = tuple(metadata[prefix + name].size)
        if shape != tuple(targets[name].shape):
            raise LoadError(f"{name}: the checkpoint holds shape {list(shape)}, the module expects "
                            f"{list(targets[name].shape)}")
        if t.transforms:
            raise LoadError(f"{name}: transforms apply to safetensors and torch.save checkpoints; DCP loads into "
                            "the DTensor as it is")
        layout = layout_from_placements(spec, shape, placements)
        local = torch.empty([int(s) for s in layout.local_shape(coordinate)],
                            dtype=metadata[prefix + name].properties.dtype)
        state[prefix + name] = local if name in plain else as_dtensor(local, device_mesh, placements, shape)
    dcp.load(state, checkpoint_id=str(path))
    for name in specs:
        _assign(module, name, state[prefix + name], isinstance(targets[name], torch.nn.Parameter))
    return module


def _assign(module: torch.nn.Module, name: str, value: torch.Tensor, parameter: bool) -> None:
    *path, leaf = name.split(".")
    owner = module.get_submodule(".".join(path)) if path else module
    if parameter:
        requires_grad = owner._parameters[leaf].requires_grad
        owner._parameters[leaf] = torch.nn.Parameter(value, requires_grad=requires_grad)
    else:
        owner._buffers[leaf] = value

