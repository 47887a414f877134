"""Readable text for stage graphs: one line per node with its shape and layout.

This text is what golden tests compare and what ``explain`` prints, so it avoids
anything unstable (object ids, device strings, stack traces).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from .graph import LAYOUT, PLAN

_DTYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64",
           torch.int64: "i64", torch.int32: "i32", torch.bool: "b8"}


def _target_name(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        ns, name = target.namespace, target._schema.name.split("::")[-1]
        overload = "" if target._overloadname == "default" else f".{target._overloadname}"
        return f"{ns}.{name}{overload}"
    return getattr(target, "__name__", str(target))


def _arg(a: Any) -> str:
    if isinstance(a, fx.Node):
        return f"%{a.name}"
    if isinstance(a, (list, tuple)):
        inner = ", ".join(_arg(x) for x in a)
        return f"[{inner}]"
    if isinstance(a, torch.dtype):
        return str(a).replace("torch.", "")
    if isinstance(a, torch.device):
        return "device"
    return repr(a)


def _type(val: Any) -> str:
    if isinstance(val, torch.Tensor):
        return f"{_DTYPES.get(val.dtype, str(val.dtype).replace('torch.', ''))}[{', '.join(str(s) for s in val.shape)}]"
    return ""


def format_graph(gm: fx.GraphModule, layouts: bool = True) -> str:
    """One line per node: ``%name: f32[8, 16] <layout> = op(args)``; redistributions show their plan."""
    lines = []
    for node in gm.graph.nodes:
        head = f"%{node.name}"
        typ = _type(node.meta.get("val"))
        if typ:
            head += f": {typ}"
        layout = node.meta.get(LAYOUT) if layouts else None
        if layout is not None and not isinstance(layout, tuple):
            head += f" {layout}"
        if node.op == "placeholder":
            lines.append(f"{head} = input")
        elif node.op == "get_attr":
            lines.append(f"{head} = constant {node.target}")
        elif node.op == "output":
            lines.append("return " + _arg(node.args[0]))
        else:
            plan = node.meta.get(PLAN)
            if plan is not None and layouts:
                steps = ", ".join(str(s) for s in plan.steps) or "no-op"
                lines.append(f"{head} = redistribute(%{node.args[0].name}) from {node.meta['src_layout']}: {steps}")
                continue
            args = ", ".join([_arg(a) for a in node.args] + [f"{k}={_arg(v)}" for k, v in node.kwargs.items()])
            lines.append(f"{head} = {_target_name(node.target)}({args})")
    return "\n".join(lines)
