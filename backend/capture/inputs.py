"""A program's inputs: their names, the one mesh they live on, their layouts, and each rank's shards.

Users say how inputs are sharded in several ways: DTensor arguments and parameters (made by
``distribute_tensor``, ``parallelize_module`` or ``fxshard.load_sharded``), a ``placements=`` map
of plain tensors (argument index or parameter name -> placements, their text, a bare placement on a
one-axis mesh, or a ``Layout``). ``input_layouts`` turns all of them into layouts, for every
entry point (the backend, ``fxshard.compile``, ``explain``, ``simulate``); ``fxshard.constrain``
pins layouts inside the program. Everything else is replicated.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor

from fxshard.layout import Layout
from fxshard.mesh import Coordinate, MeshSpec
from fxshard.placements import layout_from_placements, user_layout

from fxshard.backend.capture.dynamo_compat import dtensor_prim, prim_arguments


class InputError(ValueError):
    """Inputs that do not say one consistent sharding: several meshes, unknown names, two placements."""


def one_mesh(meshes: Iterable[Any], what: str, names: Sequence[str] | None = None) -> Any:
    """The one DeviceMesh among ``meshes`` (None if there is none); several are an error naming
    each mesh and (with ``names``, one per mesh given) the tensors on it."""
    unique: list[Any] = []
    holders: list[list[str]] = []
    for k, m in enumerate(meshes):
        i = next((j for j, u in enumerate(unique) if m == u), None)
        if i is None:
            unique.append(m)
            holders.append([])
            i = len(unique) - 1
        if names is not None and k < len(names):
            holders[i].append(names[k])
    if len(unique) > 1:
        parts = [describe_mesh(m) + (f" (holding {', '.join(h[:3])}{', ...' if len(h) > 3 else ''})" if h else "")
                 for m, h in zip(unique, holders)]
        raise InputError(f"fxshard compiles one program on one DeviceMesh; {what} mixes {len(unique)}: "
                         + " and ".join(parts) + ". Put all its DTensors on the same mesh (distribute_tensor or "
                         "DTensor.from_local onto it); a model split over meshes, such as pipeline stages on "
                         "sub-meshes, is one program per mesh (fxshard.backend.pipelining).")
    return unique[0] if unique else None


def describe_mesh(mesh: Any) -> str:
    """A DeviceMesh as an error shows it: axes with sizes and the ranks it spans."""
    names = mesh.mesh_dim_names or tuple(f"d{i}" for i in range(mesh.ndim))
    axes = ", ".join(f"{n}={s}" for n, s in zip(names, mesh.shape))
    return f"DeviceMesh({axes}; ranks {mesh.mesh.tolist()})"


def find_device_mesh(example_inputs: Sequence[Any], gm: fx.GraphModule | None = None) -> Any:
    """The one DeviceMesh a program uses (from DTensor inputs, mesh inputs, or its from_local calls), or None."""
    from torch.distributed.device_mesh import DeviceMesh

    placeholders = [n.target for n in gm.graph.nodes if n.op == "placeholder"] if gm is not None else []
    named = placeholders if len(placeholders) == len(example_inputs) else [f"input {k}" for k in
                                                                          range(len(example_inputs))]
    pairs = [(named[k], x.device_mesh) for k, x in enumerate(example_inputs) if isinstance(x, DTensor)]
    pairs += [(named[k], x) for k, x in enumerate(example_inputs) if isinstance(x, DeviceMesh)]
    if gm is not None:
        for node in gm.graph.nodes:
            if node.op == "call_function" and is_from_local(node.target):
                args, kwargs = from_local_arguments(node.target, node.args, node.kwargs)
                mesh = args[1] if len(args) > 1 else kwargs.get("device_mesh")
                if isinstance(mesh, DeviceMesh):
                    pairs.append((f"from_local at {node.name}", mesh))
    return one_mesh([m for _, m in pairs], "this program", [n for n, _ in pairs])


def is_from_local(target: Any) -> bool:
    """A Dynamo graph's ``DTensor.from_local`` call: the function itself, or torch 2.11's closure for it."""
    return dtensor_prim(target) == "from_local" or (
        getattr(target, "__name__", "") == "from_local" and "tensor" in getattr(target, "__module__", ""))


def from_local_arguments(target: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[tuple, dict]:
    """``(args, kwargs)`` of a from_local call as ``DTensor.from_local`` takes them (backend/capture/dynamo_compat.py)."""
    return prim_arguments(target, args, kwargs) if dtensor_prim(target) else (tuple(args), dict(kwargs))


def named_inputs(fn: Callable, args: Sequence[Any], objects: Sequence[Any]) -> list[tuple[str, Any]]:
    """(name, key) for each of ``objects`` (a captured program's inputs): the key is the argument
    index or the parameter/buffer name, None for anything else."""
    named: dict[int, tuple[str, Any]] = {}
    for module in modules_of(fn):
        for name, t in list(module.named_parameters()) + list(module.named_buffers()):
            named.setdefault(id(t), (name.replace(".", "_"), name))
    for i, a in enumerate(args):
        named.setdefault(id(a), (f"arg{i}", i))
    return [named.get(id(obj), (f"input{k}", None)) for k, obj in enumerate(objects)]


def modules_of(fn: Callable) -> list[torch.nn.Module]:
    """The modules whose parameter names name ``fn``'s inputs: ``fn`` itself, the module of a bound
    method (``model.loss``), or the modules a closure or ``functools.partial`` holds
    (``lambda ids: model(input_ids=ids).logits``), or the module-level modules its code names."""
    if isinstance(fn, torch.nn.Module):
        return [fn]
    if isinstance(getattr(fn, "__self__", None), torch.nn.Module):
        return [fn.__self__]
    held = list(getattr(fn, "args", ())) + list(getattr(fn, "keywords", {}).values())  # functools.partial
    held += [c.cell_contents for c in getattr(fn, "__closure__", None) or () if _filled(c)]
    code, scope = getattr(fn, "__code__", None), getattr(fn, "__globals__", {})
    held += [scope[n] for n in (code.co_names if code else ()) if n in scope]  # a module-level model
    found = [m for m in held if isinstance(m, torch.nn.Module)]
    inner = getattr(fn, "func", None)
    return found + (modules_of(inner) if callable(inner) else [])


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # an empty cell
        return False
    return True


def describe(key: Any) -> str:
    """How an error names an input: ``argument 0`` or ``parameter 'up.weight'``."""
    return f"argument {key}" if isinstance(key, int) else f"parameter {key!r}"


def input_layouts(objects: Sequence[Any], mesh: MeshSpec, keys: Sequence[Any] | None = None,
                  placements: Mapping[Any, Any] | None = None) -> dict[int, Layout]:
    """The layout of each tensor among ``objects``, by position: a DTensor's own placements; a plain
    tensor's from ``placements`` (keyed as ``keys`` names the objects), else replicated."""
    placements = dict(placements or {})
    keys = list(keys) if keys is not None else [None] * len(objects)
    known = {k for k in keys if k is not None}
    unknown = [k for k in placements if k not in known]
    if unknown:
        raise KeyError(f"placements names {unknown}, which are not inputs of the function; "
                       f"use argument indices or parameter names: {sorted(str(k) for k in known)}")
    layouts: dict[int, Layout] = {}
    for pos, (key, obj) in enumerate(zip(keys, objects)):
        if not isinstance(obj, torch.Tensor):
            continue
        if isinstance(obj, DTensor):
            if key in placements:
                raise InputError(f"{describe(key)} is already a DTensor with placements {obj.placements}; "
                                 "do not also give it placements")
            layouts[pos] = dtensor_layout(obj, mesh)
        elif key in placements:
            layouts[pos] = user_layout(describe(key), placements[key], mesh, obj.shape)
        else:
            layouts[pos] = Layout.replicated(mesh, obj.shape)
    return layouts


def dtensor_layout(obj: DTensor, mesh: MeshSpec) -> Layout:
    """A DTensor's layout on ``mesh``: its placements, in its spec's shard order where it gives one."""
    spec = obj._spec
    explicit = bool(getattr(spec, "shard_order", None)) and not getattr(spec, "use_strided_shard_as_shard_order", True)
    return layout_from_placements(mesh, obj.shape, obj.placements, spec.shard_order if explicit else None)


class InputReader:
    """This rank's block of each tensor input, per call; which plain inputs need slicing is worked
    out once per program, and a block is detached only where it requires grad (the compiled
    inference program never records autograd)."""

    def __init__(self, positions: Sequence[int], layouts: Sequence[Layout], coordinate: Coordinate):
        self.positions = list(positions)
        self.layouts = list(layouts)
        self.coordinate = coordinate
        # per input: None where a plain tensor is whole on every rank, else its layout (sliced per call)
        self.sliced = [None if layout.is_replicated else layout for layout in self.layouts]

    def __call__(self, args: Sequence[Any], differentiable: bool) -> list[torch.Tensor]:
        """The blocks of ``args``' tensor inputs: a DTensor's local tensor (``differentiable``: the DTensor
        itself, which the training step unwraps, its gradient coming back as ``DTensorGradients`` makes
        it), a plain tensor's block."""
        out = []
        for pos, layout in zip(self.positions, self.sliced):
            x = args[pos]
            if isinstance(x, DTensor):
                local = x if differentiable else x._local_tensor
            else:
                local = x if layout is None else layout.shard(x, self.coordinate)
            out.append(local.detach() if not differentiable and local.requires_grad else local)
        return out


class DTensorGradients:
    """A DTensor input's gradient, from its local block, as ``to_local()``'s backward makes it: a DTensor
    with the input's mesh, placements (a Partial one Replicate) and global shape and strides.

    ``to_local()``'s backward goes through ``DTensor.from_local`` for every gradient of every step
    (an autograd.Function, a new spec checked field by field: about 0.15 ms each on this project's CPU,
    4.5 ms a step for a 4-layer Llama's 30 parameters, bench/results/gpu.md). The spec depends only on
    the input's spec, so it is made once per input spec and shared by the gradients of later calls,
    as ``outputs.AsDTensor`` shares its outputs' specs."""

    def __init__(self) -> None:
        self.specs: dict[int, tuple[Any, Any]] = {}  # id(input spec) -> (input spec, gradient spec)

    def __call__(self, grad: torch.Tensor | None, like: tuple[Any, tuple[int, ...]] | None) -> Any:
        """``grad``, the local gradient of an input given as ``(its spec, its local block's strides)``."""
        if grad is None or like is None:
            return grad
        spec, local_stride = like
        if grad.stride() != local_stride:  # the spec's global strides are those of the input's block
            grad = torch.empty_strided(grad.shape, local_stride, dtype=grad.dtype, device=grad.device).copy_(grad)
        entry = self.specs.get(id(spec))
        if entry is None or entry[0] is not spec:
            entry = self.specs[id(spec)] = (spec, _gradient_spec(spec))
        return DTensor.__new__(DTensor, grad, entry[1], requires_grad=False)


def _gradient_spec(spec: Any) -> Any:
    """The spec of the gradient of a DTensor of ``spec``: a copy (never the input's own object, which
    sharding propagation may change), Partial placements Replicate, as ``to_local()``'s backward."""
    import copy

    from torch.distributed.tensor import Replicate

    out = copy.copy(spec)
    if any(p.is_partial() for p in spec.placements):
        out.placements = tuple(Replicate() if p.is_partial() else p for p in spec.placements)
    return out
