"""Fixes a user can follow, for the programs stage 1 cannot read as one global-shape program.

Each function reads Dynamo's graph (not the trace) and says everything that must change, in one go:
a local shard handed to ``from_local`` (which modules' styles then need ``use_local_output=False``),
and a program that issues its own collectives (transformers' tensor parallelism, and what to write
instead). Only messages are made here; nothing is traced.
"""
from __future__ import annotations

import re
from typing import Any

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor

from fxshard.backend.capture.dynamo_compat import dtensor_prim
from fxshard.backend.capture.inputs import from_local_arguments, is_from_local

from fxshard.lowering.collective_ops import NAMESPACES as COLLECTIVE_NAMESPACES


def own_collective(gm: fx.GraphModule) -> fx.Node | None:
    """The first node of Dynamo's graph that runs a collective itself (``dist.all_reduce``, a functional
    collective): the program is already one rank's, not the global program fxshard shards."""
    graphs = [m.graph for m in gm.modules() if isinstance(m, fx.GraphModule)]  # a region's body holds its layer
    for graph in graphs:
        for node in graph.nodes:
            if node.op == "call_function" and _op_name(node.target).split(".")[0] in COLLECTIVE_NAMESPACES:
                return node
    return None


def _op_name(target: Any) -> str:
    """``namespace.name`` of an ATen-style op, its overload packet (as Dynamo records it) or an overload; "" else."""
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name.replace("::", ".")
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._opname}"
    return ""


def own_collective_message(node: fx.Node) -> str:
    """What to do about a program's own collective: for transformers' tensor parallelism, the model loaded
    plain and its own plan given to fxshard as placements; otherwise DTensors fxshard communicates for."""
    op = _op_name(node.target)
    stack = node.meta.get("stack_trace") or ""
    head = f"the program runs its own collective {op} ({where(node)})"
    if "transformers" in stack:
        return (f"{head}: transformers' tensor parallelism (from_pretrained(..., tp_plan='auto') or "
                "distributed_config=DistributedConfig(tp_size=...)) wraps each sharded module so that it computes on "
                "local tensors and all-reduces its outputs itself, and the attention uses per-rank head counts: the "
                "program Dynamo hands over is one rank's, not a global one fxshard can shard. Load the model without "
                "tp_plan/distributed_config and give fxshard transformers' own plan as placements:\n"
                "    model = AutoModelForCausalLM.from_pretrained(path)\n"
                "    fxshard.load_sharded(model, path, mesh, plan=fxshard.ShardPlan.from_tp_plan(model.tp_plan))\n"
                "    logits = fxshard.compile(Logits(model))(input_ids)  # Logits: a module whose forward returns "
                "model(input_ids=ids, use_cache=False).logits\n"
                "fxshard.compile traces the model in global shapes (its rotary tables stay plain tensors) and inserts "
                "the all_reduces itself.")
    return (f"{head} on one rank's tensor: fxshard compiles one program in global shapes and inserts every "
            "collective itself, so a collective the program issues has no place in it. Keep the values DTensors "
            "(parallelize_module's styles with use_local_output=False, x.redistribute(placements) where a layout "
            "must change) and let fxshard communicate; a program of plain tensors and its own collectives, "
            "with no DTensor, is one rank's program: compile it with backend='inductor'.")


def local_input_message(gm: fx.GraphModule, from_local: fx.Node, placements: Any) -> str | None:
    """For ``from_local`` of a plain program input (a local sequence shard, torchtitan's SP plan on a block):
    pass it as a DTensor, and every module whose style then hands a local tensor to an op that also reads a
    DTensor gets ``use_local_output=False``. None where the tensor is not a program input."""
    args, _ = from_local_arguments(from_local.target, from_local.args, from_local.kwargs)
    source = args[0] if args else None
    if not isinstance(source, fx.Node) or source.op != "placeholder":
        return None
    name = _input_name(source)
    shown = list(placements)
    modules = _styles_to_keep_dtensors(gm, source)
    fix = (f"Pass the input as a DTensor, {name} = DTensor.from_local({name}, mesh, {shown}) (this rank's shard, "
           f"as now) or distribute_tensor(full, mesh, {shown})")
    if modules:
        listed = ", ".join(repr(m) for m in modules)
        fix += (f", and set use_local_output=False in the parallel styles of {listed} (e.g. "
                "RowwiseParallel(output_layouts=Shard(1), use_local_output=False)): their outputs meet values computed "
                f"from {name}, which are then DTensors, and DTensor does not mix them with local tensors")
    return (f"DTensor.from_local({name}, {shown}) on a plain input ({where(from_local)}): {name} is one rank's shard, "
            "and fxshard compiles global programs, so it cannot know the other ranks' shards. " + fix +
            ". The output is then a DTensor (.to_local() is this rank's shard, as before).")


def _styles_to_keep_dtensors(gm: fx.GraphModule, source: fx.Node) -> list[str]:
    """The modules (by path) whose ``to_local()`` outputs must stay DTensors once ``source`` is one: found by
    propagating which values are DTensors and turning the local outputs each mixed op reads, until none mixes."""
    kept: set[fx.Node] = set()
    while True:
        mixed = _mixed_local_outputs(gm, source, kept)
        if not mixed - kept:
            break
        kept |= mixed
    return sorted({_module_of(n) for n in kept})


def _mixed_local_outputs(gm: fx.GraphModule, source: fx.Node, kept: set[fx.Node]) -> set[fx.Node]:
    """The ``to_local()`` nodes whose plain values reach an op that also reads a DTensor, with ``source`` and
    the outputs of ``kept`` DTensors."""
    is_dtensor: dict[fx.Node, bool] = {}
    found: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            is_dtensor[node] = node is source or isinstance(node.meta.get("example_value"), DTensor)
            continue
        if node.op == "output":
            continue
        kind = _dtensor_call(node)
        if kind == "to_local":
            is_dtensor[node] = node in kept
            continue
        if kind in ("from_local", "redistribute"):
            is_dtensor[node] = True
            continue
        tensors = [a for a in torch.utils._pytree.tree_leaves((node.args, node.kwargs))
                   if isinstance(a, fx.Node) and isinstance(a.meta.get("example_value"), torch.Tensor)]
        flags = [is_dtensor.get(a, False) for a in tensors]
        is_dtensor[node] = kind != "full_tensor" and any(flags)
        if any(flags) and not all(flags):
            for a, flag in zip(tensors, flags):
                if not flag:
                    found |= _local_outputs_above(a, is_dtensor)
    return found


def _local_outputs_above(node: fx.Node, is_dtensor: dict[fx.Node, bool]) -> set[fx.Node]:
    """The ``to_local()`` nodes a plain value is computed from, through plain values only."""
    out, stack, seen = set(), [node], set()
    while stack:
        n = stack.pop()
        if n in seen or is_dtensor.get(n, False):
            continue
        seen.add(n)
        if _dtensor_call(n) == "to_local":
            out.add(n)
            continue
        stack.extend(a for a in n.all_input_nodes)
    return out


def _dtensor_call(node: fx.Node) -> str | None:
    """Which DTensor API call a Dynamo node is (``to_local``, ``from_local``, ``redistribute``, ``full_tensor``)."""
    if node.op == "call_method" and node.target in ("to_local", "redistribute", "full_tensor"):
        return node.target
    if node.op == "call_function":
        if is_from_local(node.target):
            return "from_local"
        return dtensor_prim(node.target)
    return None


def _module_of(node: fx.Node) -> str:
    """The path of the module whose forward hook made ``node`` (``attention.wo``), from Dynamo's module stack."""
    stack = list((node.meta.get("nn_module_stack") or {}).values())
    if not stack:
        return node.name
    path = stack[-1][0] if isinstance(stack[-1], tuple) else str(stack[-1])
    return re.sub(r"^L\['[^']*'\]\.?", "", path) or "the model itself"


def _input_name(node: fx.Node) -> str:
    """A Dynamo placeholder as the user's code names it (``L['x']`` -> ``x``)."""
    grapharg = node.meta.get("grapharg")
    source = grapharg.source.name if grapharg is not None and hasattr(grapharg.source, "name") else node.target
    source = source() if callable(source) else source
    match = re.fullmatch(r"L\['([^']*)'\]", str(source))
    return match.group(1) if match else str(source)


def where(node: fx.Node) -> str:
    """The user's line a Dynamo node came from (its stack trace's last frame), or the node's name."""
    stack = (node.meta.get("stack_trace") or "").strip().splitlines()
    frames = [line.strip() for line in stack if line.strip().startswith("File ")]
    outside_torch = [f for f in frames if "site-packages/torch/" not in f]  # the caller of torch's collective
    return (outside_torch or frames or [node.name])[-1]
