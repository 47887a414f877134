"""Stage 1: Dynamo's graph + example inputs -> a functional ATen graph in global shapes.

DTensor inputs become plain fake tensors of their global shape plus a Layout; plain
tensors are replicated. The DTensor API calls that ``parallelize_module`` hooks leave in
Dynamo's graph are read as global-program facts: ``x.redistribute(placements)`` and
``full_tensor()`` pin a layout (``fxshard.constrain``); ``to_local()`` followed by
pointwise ops and ``DTensor.from_local`` with the same placements is the identity.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor, Replicate
from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx

from fxshard.decompose import decomposition_table, eliminate_common_subexpressions, fold_one_hot_sums
from fxshard.graph import CHECKPOINTED, EAGER_SHAPE, LOCAL_REGION, REGION_EXIT
from fxshard.layout import Layout
from fxshard.mesh import MeshSpec
from fxshard.ops import constrain_op
from fxshard.placements import as_mesh_spec, layout_from_placements, placements_to_str

from fxshard.backend.capture import inputs, routed_experts
from fxshard.backend.capture.block_joint import Templates, stamp
from fxshard.backend.capture.custom_functions import (apply_autograd_function, apply_unlifted_function,
                                                     is_autograd_function, is_unlifted_function, mutates_inputs)
from fxshard.backend.capture.dtensor_reads import eager_dtensor, read_kind
from fxshard.backend.capture.functional_copy import copy_into, is_copy_, needs_own_copy
from fxshard.backend.capture.dynamo_compat import dtensor_prim, prim_arguments
from fxshard.backend.capture.inputs import find_device_mesh, from_local_arguments, is_from_local
from fxshard.backend.capture.trace_hints import local_input_message, own_collective, own_collective_message


class TraceError(RuntimeError):
    """The program cannot be read as one global-shape program."""


class TangentMismatch(TraceError):
    """The tangents a joint trace was given do not match the forward's outputs (``outputs``: their
    shapes, dtypes and devices), so the caller may trace again with these."""

    def __init__(self, outputs: Sequence[tuple[tuple[int, ...], torch.dtype, torch.device]]):
        super().__init__(f"the tangents do not match the forward's outputs {list(outputs)}")
        self.outputs = list(outputs)


DERIVED = "derived from a local shard"


@dataclass
class TracedProgram:
    """A global ATen graph with one placeholder per tensor input, and what fxshard knows of them."""

    gm: fx.GraphModule
    mesh: MeshSpec
    device_mesh: Any  # torch DeviceMesh when the program has one (None for MeshSpec-only analysis)
    input_layouts: dict[str, Layout]
    tensor_positions: list[int]  # position in the caller's inputs of each placeholder of gm
    input_names: list[str] = field(default_factory=list)
    joint: "JointSignature | None" = None  # set when gm is a joint forward+backward graph
    # per output: the layout it is the to_local() of, DERIVED (computed from such shards), or None
    output_views: tuple[Any, ...] = ()


@dataclass(frozen=True)
class JointSignature:
    """How a joint graph's inputs and outputs split into forward and backward.

    Placeholders are the primals (``input_names``) then one tangent per forward output;
    outputs are the ``num_forward_outputs`` forward outputs, then one gradient per primal
    that requires grad (``grad_inputs`` indexes the primals), zeros where it has none.
    """

    num_forward_outputs: int
    grad_inputs: tuple[int, ...]
    tangent_names: tuple[str, ...]


class TensorMap:
    """A dict keyed by tensor identity that keeps its keys alive.

    Keying by ``id()`` alone is wrong during tracing: a freed tensor's id is reused by the
    next tensor allocated, which would inherit its entry.
    """

    def __init__(self) -> None:
        self._items: dict[int, tuple[torch.Tensor, Any]] = {}

    def get(self, t: Any, default: Any = None) -> Any:
        item = self._items.get(id(t))
        return item[1] if item is not None and item[0] is t else default

    def __contains__(self, t: Any) -> bool:
        item = self._items.get(id(t))
        return item is not None and item[0] is t

    def __setitem__(self, t: torch.Tensor, value: Any) -> None:
        self._items[id(t)] = (t, value)

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, t: torch.Tensor) -> Any:
        if t not in self:
            raise KeyError("tensor not in map")
        return self._items[id(t)][1]


def _pretty_name(dynamo_name: str) -> str:
    name = re.sub(r"^L_", "", dynamo_name).rstrip("_")
    name = re.sub(r"^self_modules_", "", name)
    name = re.sub(r"^self_parameters_", "", name)
    name = name.replace("_modules_", "_").replace("_parameters_", "_").replace("_buffers_", "_")
    return name or "arg"


class _GlobalInterpreter(fx.Interpreter):
    """Runs Dynamo's graph on global fake tensors under make_fx, reading DTensor calls as pins."""

    def __init__(self, gm: fx.GraphModule, mesh: MeshSpec, known: TensorMap, coordinate: tuple[int, ...]):
        super().__init__(gm)
        self.mesh = mesh
        self.known = known  # tensor -> layout fixed by an input or a pin
        self.local_views = TensorMap()  # tensor -> layout it is the to_local() of (DERIVED: computed from one)
        self.coordinate = coordinate  # the rank whose shapes Dynamo's example values hold
        self.templates: Templates | None = None  # a joint trace's stamped blocks (block_joint.py)

    def _pin(self, x: torch.Tensor, placements: Sequence[Any]) -> torch.Tensor:
        placements = tuple(placements)
        layout = layout_from_placements(self.mesh, x.shape, placements)
        if self.known.get(x) == layout:
            return x
        y = constrain_op(x, placements_to_str(placements))
        self.known[y] = layout
        return y

    def run_node(self, n: fx.Node) -> Any:
        self._current = n  # the Dynamo node being run: its example value holds eager (local) shapes
        return super().run_node(n)

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        method = dtensor_prim(target)
        if method in ("redistribute", "to_local"):  # torch 2.11's closure for the method (backend/capture/dynamo_compat.py)
            return self.call_method(method, *prim_arguments(target, args, kwargs))
        if is_from_local(target):
            args, kwargs = from_local_arguments(target, args, kwargs)
            return self._from_local(*args, **kwargs)
        if target is getattr:
            kind = read_kind(self._current, args[1] if len(args) > 1 else None)
            if kind == "spec":  # the eager DTensor's mesh or placements, not the stand-in's (dtensor_reads.py)
                return getattr(eager_dtensor(self._current), args[1])
            if kind == "local":
                return self.call_method("to_local", (args[0],), {})
        if target is torch.ops.higher_order.tag_activation_checkpoint:
            return self._checkpointed(*args, **kwargs)
        if target is torch.ops.higher_order.invoke_subgraph:
            return self._inlined(*args)
        if is_autograd_function(target):
            if mutates_inputs(kwargs):
                raise TraceError(f"{self._where()}: a custom autograd.Function modifies its inputs in place "
                                 "(ctx.mark_dirty), which fxshard cannot trace as a functional program; "
                                 "return new tensors instead")
            return self._run_local_aware(lambda: apply_autograd_function(*args, **kwargs), args, kwargs)
        if is_unlifted_function(target):
            return self._run_local_aware(lambda: apply_unlifted_function(target, *args, **kwargs), args, kwargs)
        if is_copy_(target) and needs_own_copy(args, kwargs):  # a joint trace's copy_ (functional_copy.py)
            return self._run_local_aware(lambda: copy_into(*args, **kwargs), args, kwargs)
        if target is torch.ops.higher_order.flex_attention and any(args[7:9]):
            return self._flex_with_captures(target, args, kwargs)
        return self._run_local_aware(lambda: super(_GlobalInterpreter, self).call_function(target, args, kwargs),
                                     args, kwargs)

    def _flex_with_captures(self, target: Any, args: Any, kwargs: Any) -> Any:
        """flex_attention whose score_mod or mask_mod reads tensors it captures (its last two arguments):
        torch's functionalize, under which stage 1 traces, has no rule for that call (plain
        make_fx(functionalize(...)) of the same graph fails alike): say so, and what to write instead."""
        try:
            return self._run_local_aware(lambda: super(_GlobalInterpreter, self).call_function(target, args, kwargs),
                                         args, kwargs)
        except RuntimeError as e:
            if "Functionalize rule" not in str(e):
                raise
            raise TraceError(
                f"{self._where()}: flex_attention's score_mod or mask_mod reads tensors it captures "
                f"({len(args[7]) + len(args[8])} of them: a module's buffer or a closure's tensor), which fxshard's "
                "trace cannot run: torch's functionalize has no rule for that call ('NYI: Functionalize rule for "
                "custom_function_call'). Compute the values inside the function from its indices instead (ALiBi's "
                "slopes from h: 2 ** (-8 * (h + 1) / heads); fxshard hands each rank's copy global head indices).") from e

    def call_method(self, target: str, args: Any, kwargs: Any) -> Any:
        x = args[0]
        if target == "redistribute":
            placements = kwargs.get("placements", args[2] if len(args) > 2 else None)
            if placements is None:
                raise TraceError("x.redistribute() without placements cannot be traced; pass placements=")
            return self._pin(x, placements)
        if target == "full_tensor":
            return self._pin(x, [Replicate()] * self.mesh.ndim)
        if target == "to_local":
            layout = self.known.get(x)
            eager = eager_dtensor(getattr(self, "_current", None))
            if layout is None and eager is not None:
                # the local block is eager's, of the placements the DTensor had (a local_map's input): pinned
                x = self._pin(x, eager.placements)
                layout = self.known[x]
            if layout is None:
                raise TraceError("to_local() of a DTensor whose layout fxshard cannot know at trace time; "
                                 "redistribute it to explicit placements first")
            if layout.is_replicated:
                return x
            self.local_views[x] = layout
            return x
        if is_copy_(target) and needs_own_copy(args, kwargs):
            return self._run_local_aware(lambda: copy_into(*args, **kwargs), args, kwargs)
        return self._run_local_aware(lambda: super(_GlobalInterpreter, self).call_method(target, args, kwargs),
                                     args, kwargs)

    def _from_local(self, local: Any, device_mesh: Any = None, placements: Any = None, **_: Any) -> torch.Tensor:
        placements = tuple(placements or [Replicate()] * self.mesh.ndim)
        layout = layout_from_placements(self.mesh, local.shape, placements)
        view = self.local_views.get(local)
        if view == layout:
            out = torch.ops.aten.alias.default(local)  # a new object: the global value, no longer a local view
            self.known[out] = layout
            return out
        if view is not None:  # the end of a local region: stage 2 checks the region computed this layout
            out = self._tagged(lambda: self._pin(local, placements), {REGION_EXIT: self._where()})
            self.known[out] = layout
            return out
        if not layout.is_replicated:
            hint = local_input_message(self.module, self._current, placements)
            raise TraceError(hint or (
                f"DTensor.from_local(x, {list(placements)}) on a plain tensor: fxshard compiles global programs, so "
                "it cannot know the other ranks' shards. Pass the input as a DTensor (distribute_tensor) instead, "
                "or as a replicated plain tensor."))
        return self._pin(local, placements)

    def _checkpointed(self, body: fx.GraphModule, *operands: Any, **_: Any) -> Any:
        """A ``torch.utils.checkpoint`` region: its body read by this interpreter, its nodes tagged.

        The higher-order op would run the body with a plain ``fx.Interpreter``, to which the DTensor
        API calls it holds (``redistribute``, ``fxshard.constrain`` on DTensors) are unknown methods;
        checkpoint's recomputation is the training split's job (``CHECKPOINTED`` nodes are recomputed).
        """
        return self._tagged(lambda: self._nested(body).run(*operands), {CHECKPOINTED: self._where()})

    def _inlined(self, body: fx.GraphModule, identifier: Any, *operands: Any) -> Any:
        """A call of a nested compile region (a repeated block Dynamo traced once,
        ``backend/layers/block_regions.py``): its body read inline, as Dynamo gives it without regions, or in
        a joint trace stamped out from its joint traced once (``backend/capture/block_joint.py``)."""
        if self.templates is not None and not any(isinstance(x, torch.Tensor) and x in self.local_views
                                                  for x in operands):
            out = self.templates.call(body, operands)
            if out is not None:
                return out
        return self._nested(body).run(*operands)

    def _nested(self, body: fx.GraphModule) -> "_GlobalInterpreter":
        """An interpreter of a higher-order op's body sharing this one's pins and local views."""
        inner = _GlobalInterpreter(body, self.mesh, self.known, self.coordinate)
        inner.local_views = self.local_views
        inner.templates = self.templates
        return inner

    def _where(self) -> str:
        n = getattr(self, "_current", None)
        stack = (n.meta.get("stack_trace") or "").strip().splitlines() if n is not None else []
        stack = [line for line in stack if line.strip(" ^~")]  # Python 3.11's carets under the expression
        return (stack[-2].strip() + ": " + stack[-1].strip()) if len(stack) >= 2 else str(n)

    def _tagged(self, run: Any, meta: dict) -> Any:
        graph = get_proxy_mode().tracer.graph
        before = set(graph.nodes)
        out = run()
        for node in graph.nodes:
            if node not in before and node.op == "call_function":
                node.meta.update(meta)
        return out

    def _run_local_aware(self, run: Any, args: Any, kwargs: Any) -> Any:
        """Ops on to_local() shards form a local region: read globally, checked against eager shapes.

        Eager, the code between ``to_local()`` and ``from_local()`` runs on each rank's shard.
        fxshard reads it as the global program it is a shard of (a view with -1, a per-head
        attention, a pointwise op); stage 2 then checks that no value in the region needs a
        redistribution and that every value's local shape is the one eager had, so reading
        it globally runs exactly the eager local program.
        """
        views = [a for a in torch.utils._pytree.tree_leaves((args, kwargs))
                 if isinstance(a, torch.Tensor) and a in self.local_views]
        if not views:
            return run()
        graph = get_proxy_mode().tracer.graph
        before = set(graph.nodes)
        try:
            out = run()
        except RuntimeError as e:
            raise TraceError(
                f"{self._where()}: this code runs on the local shard of a DTensor (after to_local()) and fxshard reads "
                f"it as the global program it is a shard of, where it fails: {e}. It likely uses a local size (from "
                "x.shape) where the global program needs another; write that size as -1, or keep DTensors "
                "(use_local_output=False in the parallel style).") from e
        new = [n for n in graph.nodes if n not in before and n.op == "call_function"]
        for node in new:
            node.meta[LOCAL_REGION] = self._where()
        outs = [o for o in torch.utils._pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
        eager = [e for e in torch.utils._pytree.tree_leaves(getattr(self, "_current", None) and
                                                            self._current.meta.get("example_value"))
                 if isinstance(e, torch.Tensor)]
        for k, o in enumerate(outs):
            self.local_views[o] = DERIVED
            producer = next((n for n in reversed(new) if isinstance(n.meta.get("val"), torch.Tensor)
                             and tuple(n.meta["val"].shape) == tuple(o.shape)), None)
            if producer is not None and k < len(eager) and len(eager) == len(outs):
                shape = _static_shape(eager[k])
                if shape is not None:
                    producer.meta[EAGER_SHAPE] = (self.coordinate, shape)
        return out


def _static_shape(t: torch.Tensor) -> tuple[int, ...] | None:
    try:
        return tuple(int(s) for s in t.shape)
    except (TypeError, ValueError, RuntimeError):
        return None


def trace_global(gm: fx.GraphModule, example_inputs: Sequence[Any], mesh: MeshSpec | None = None,
                 layouts: Mapping[int, Layout] | None = None, names: Sequence[str] | None = None,
                 tangents: Sequence[torch.Tensor] | None = None) -> TracedProgram:
    """Stage 1. ``layouts`` gives the inputs' layouts by position (``inputs.input_layouts``; by default
    DTensors bring their own and plain tensors are replicated).

    With ``tangents`` (one example per output of the forward program: its shape and dtype)
    the graph is the joint forward+backward program (``TracedProgram.joint`` says how it splits):
    autograd runs over the functionalized forward inside the trace, as AOTAutograd's joint does.
    """
    collective = own_collective(gm)
    if collective is not None:
        raise TraceError(own_collective_message(collective))
    device_mesh = find_device_mesh(example_inputs, gm)
    if mesh is None:
        if device_mesh is None:
            raise TraceError("no DeviceMesh found: give at least one DTensor input (or a mesh)")
        mesh = as_mesh_spec(device_mesh)
    elif device_mesh is not None and as_mesh_spec(device_mesh) != mesh:
        raise TraceError(f"the program's DeviceMesh {as_mesh_spec(device_mesh)} is not the given mesh {mesh}")
    if layouts is None:
        layouts = inputs.input_layouts(example_inputs, mesh)

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    gm = routed_experts.rewrite(gm, {ph: layouts[i] for i, ph in enumerate(placeholders) if i in layouts})
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_inputs):
        raise TraceError(f"Dynamo graph has {len(placeholders)} inputs but {len(example_inputs)} example inputs")
    fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
    fakes: list[torch.Tensor] = []
    positions: list[int] = []
    tensor_layouts: list[Layout] = []
    pretty: list[str] = []
    constants: dict[int, Any] = {}
    needs_grad: list[bool] = []
    for i, (ph, x) in enumerate(zip(placeholders, example_inputs)):
        if not isinstance(x, torch.Tensor):
            constants[i] = x
            continue
        needs_grad.append(tangents is not None and x.requires_grad and x.dtype.is_floating_point)
        device = x._local_tensor.device if isinstance(x, DTensor) else x.device
        with fake_mode:
            fakes.append(torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=device))
        tensor_layouts.append(layouts.get(i) or Layout.replicated(mesh, x.shape))
        positions.append(i)
        pretty.append(names[i] if names is not None else _pretty_name(ph.target))

    n_inputs = len(example_inputs)
    coordinate = _tracing_coordinate(device_mesh, mesh)
    output_views: list[Any] = []
    decompositions = decomposition_table(training=tangents is not None)
    stamping: list[Templates | None] = [Templates(lambda body: _GlobalInterpreter(body, mesh, TensorMap(), coordinate),
                                                  decompositions)]

    unread = unread_inputs(gm)  # made placeholders after the trace, not traced (``_with_unread_inputs``)
    read = [k for k, pos in enumerate(positions) if pos not in unread]

    def run(*tensors: torch.Tensor) -> Any:
        env: list[Any] = [None] * n_inputs
        known = TensorMap()
        for k, t in zip(read, tensors):
            env[positions[k]] = t
            known[t] = tensor_layouts[k]
        for pos, c in constants.items():
            env[pos] = c
        interp = _GlobalInterpreter(gm, mesh, known, coordinate)
        interp.templates = stamping[0]
        with torch.set_grad_enabled(tangents is not None):
            out = interp.run(*env)
        flat = out if isinstance(out, (tuple, list)) else (out,)
        for o in flat:
            if not isinstance(o, torch.Tensor):
                raise TraceError(f"the compiled program returns a {type(o).__name__}; fxshard supports tensor outputs")
        output_views[:] = [interp.local_views.get(o) for o in flat]
        return tuple(flat)

    joint = None
    read_fakes = [fakes[k] for k in read]
    if tangents is None:
        with fake_mode:
            traced = _stamped(lambda: make_fx(torch.func.functionalize(run, remove="mutations"), tracing_mode="real",
                                              decomposition_table=decompositions)(*read_fakes), stamping)
            _with_unread_inputs(traced, fakes, read, ())
    else:
        grad_inputs = tuple(k for k, g in enumerate(needs_grad) if g)
        traced_at = {k: i for i, k in enumerate(read)}  # an input's position among the traced ones
        traced_grads = tuple(traced_at[k] for k in grad_inputs if k in traced_at)
        with fake_mode:
            for k in grad_inputs:
                fakes[k].requires_grad_(True)
            tangent_fakes = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tangents]
            traced = _stamped(lambda: make_fx(_joint(run, len(read_fakes), traced_grads), tracing_mode="real",
                                              decomposition_table=decompositions)(*read_fakes, *tangent_fakes),
                              stamping)
            _with_unread_inputs(traced, fakes, read, grad_inputs)
        tangent_names = tuple(f"tangent_{k}" for k in range(len(tangent_fakes)))
        pretty += list(tangent_names)
        tensor_layouts += [Layout.replicated(mesh, t.shape) for t in tangents]  # callers set these (joint.py)
        joint = JointSignature(len(tangent_fakes), grad_inputs, tangent_names)
    eliminate_common_subexpressions(traced)
    fold_one_hot_sums(traced)
    traced_ph = [n for n in traced.graph.nodes if n.op == "placeholder"]
    input_layouts: dict[str, Layout] = {}
    used: set[str] = set()
    for node, name, layout in zip(traced_ph, pretty, tensor_layouts):
        unique = name
        k = 1
        while unique in used:
            unique = f"{name}_{k}"
            k += 1
        used.add(unique)
        node._rename(unique)  # made an identifier where it is none: a Sequential's "0_weight" -> "_0_weight"
        node.target = node.name  # the program's code names its arguments by their targets
        input_layouts[node.name] = layout
    traced.recompile()
    primal_names = [n.name for n in traced_ph][:len(positions)]
    return TracedProgram(traced, mesh, device_mesh, input_layouts, positions, primal_names, joint, tuple(output_views))


def _stamped(trace: Callable[[], fx.GraphModule], stamping: list[Templates | None]) -> fx.GraphModule:
    """``trace()``'s graph with its repeated blocks stamped out of templates (``stamping[0]``,
    ``block_joint.py``). Should stamping fail where reading the blocks inline does not, the program is
    traced again inline (``stamping[0]`` set to None): stamping saves time, it never costs a program."""
    def traced() -> fx.GraphModule:
        gm = trace()
        if stamping[0] is not None and stamping[0].used:
            stamp(gm)
        return gm

    try:
        return traced()
    except TraceError:
        raise  # the program's own error (or a TangentMismatch for the caller): inline reads it alike
    except Exception:  # noqa: BLE001
        if stamping[0] is None or not stamping[0].used:
            raise
        stamping[0] = None
        return traced()


def unread_inputs(gm: fx.GraphModule) -> set[int]:
    """The positions of the inputs no node of ``gm`` reads: a folded model's dropped layers' parameters
    (``fold.shorten``), which stage 1 does not trace."""
    return {i for i, ph in enumerate(gm.graph.find_nodes(op="placeholder")) if not ph.users}


def _with_unread_inputs(traced: fx.GraphModule, fakes: Sequence[torch.Tensor], read: Sequence[int],
                        grad_inputs: Sequence[int]) -> None:
    """``traced`` (a trace of the inputs ``read`` of ``fakes``) made the program of all of them: a placeholder
    for each input not read, where it stands among the inputs, and a ``zeros_like`` of it for its gradient
    (where ``grad_inputs`` asks for one), what autograd gives an input no output depends on (``_joint``). Made
    here, not traced: a 32-layer model folded to four leaves 252 parameters unread, each a fake input and a
    ``zeros_like`` dispatched through ``make_fx`` (~1 ms each)."""
    if len(read) == len(fakes):
        return
    from torch.fx.passes.shape_prop import _extract_tensor_metadata

    graph = traced.graph
    placeholders = list(graph.find_nodes(op="placeholder"))
    after = placeholders[len(read)] if len(placeholders) > len(read) else next(n for n in graph.nodes
                                                                                 if n.op != "placeholder")
    slots = dict(zip(read, placeholders))
    following = after  # the input after k's: k's placeholder goes before it
    for k in reversed(range(len(fakes))):
        if k not in slots:
            with graph.inserting_before(following):
                slots[k] = graph.placeholder(f"unread_{k}")
            slots[k].meta.update(val=fakes[k], tensor_meta=_extract_tensor_metadata(fakes[k]))
        following = slots[k]
    if not grad_inputs:
        return
    out = next(iter(graph.find_nodes(op="output")))
    values = list(out.args[0])
    is_read = set(read)
    read_grads = [k for k in grad_inputs if k in is_read]
    num_outputs = len(values) - len(read_grads)
    traced_grads = dict(zip(read_grads, values[num_outputs:]))
    grads = []
    for k in grad_inputs:
        if k in traced_grads:
            grads.append(traced_grads[k])
            continue
        with graph.inserting_before(out):
            zeros = graph.create_node("call_function", torch.ops.aten.zeros_like.default, (slots[k],),
                                      {"pin_memory": False}, name="zeros_like")
        zeros.meta.update(val=torch.zeros_like(fakes[k].detach()))
        zeros.meta["tensor_meta"] = _extract_tensor_metadata(zeros.meta["val"])
        grads.append(zeros)
    out.args = (tuple(values[:num_outputs] + grads),)
    traced.recompile()


def _joint(forward: Any, num_primals: int, grad_inputs: Sequence[int]) -> Any:
    """(primals, tangents) -> (forward outputs, gradients of the primals in ``grad_inputs``).

    Autograd runs outside functionalization (functorch transforms refuse requires_grad
    inside them): the forward is functionalized, its backward formulas are mutation-free.
    """
    def joint(*args: torch.Tensor) -> tuple:
        primals, tangents = args[:num_primals], args[num_primals:]
        with torch.enable_grad():
            outs = torch.func.functionalize(forward, remove="mutations")(*primals)
        if len(outs) != len(tangents):
            raise TraceError(f"the program has {len(outs)} outputs but {len(tangents)} tangents were given")
        metas = [(tuple(o.shape), o.dtype, o.device) for o in outs]
        if metas != [(tuple(t.shape), t.dtype, t.device) for t in tangents]:
            raise TangentMismatch(metas)
        pairs = [(o, t) for o, t in zip(outs, tangents) if o.requires_grad]
        wrt = [primals[k] for k in grad_inputs]
        grads: Sequence[Any] = [None] * len(wrt)
        if pairs and wrt:
            grads = torch.autograd.grad([o for o, _ in pairs], wrt, [t for _, t in pairs], allow_unused=True)
        detached = tuple(o.detach() for o in outs)
        # an input no output depends on gets zeros, made last (as _with_unread_inputs makes an unread input's)
        return detached + tuple(g if g is not None else torch.zeros_like(p) for g, p in zip(grads, wrt))

    return joint


def _tracing_coordinate(device_mesh: Any, mesh: MeshSpec) -> tuple[int, ...]:
    """This process's mesh coordinate (Dynamo's example values are its shards); rank 0's when simulated."""
    coordinate = device_mesh.get_coordinate() if device_mesh is not None else None
    if coordinate is None or not dist.is_initialized() or dist.get_backend() == "fake":
        return (0,) * mesh.ndim
    return tuple(int(c) for c in coordinate)
