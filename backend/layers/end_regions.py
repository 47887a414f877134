"""Whether a training step's prologue or epilogue is worth compiling: what its ops cost run as they are.

A training step cut into regions (regions.py) compiles each distinct layer once; its prologue and epilogue
(embedding, rotary tables, masks; final norm, output projection, loss) are one program each way, each a
compile of its own, whatever the model's depth: ~0.7-2.4 s of Inductor each on this project's machine, two
C++ compiles where the C++ wrapper takes them (cpu_wrapper.py). Compiled, an end saves what Inductor saves
anywhere: a call per op and, where its ops read each other's values, the passes over memory a fused kernel
does not make. Where it has little of either, its compile costs more than it saves in thousands of steps.
Measured (bench/compile.py's FSDP Llama, 4 layers, one process; an end's median time a step, compiled /
run as its graph): the forward prologue (the root's gathers, the embedding lookup, rotary tables: 11 ops
Inductor would generate, 58 KB of values only the region reads; 0.17 ms by the estimate below) 2.73 / 2.80
ms, for ~1.1 s of compile; the backward prologue (the embedding's gradient scattered into zeros, the root's
gradients packed for their reduce_scatter: 4.2 MB; 4.3 ms) 1.66 / 2.95 ms; the epilogues 5-12 ms.

``eager_seconds`` estimates what a region's generated ops cost a step uncompiled beyond what they cost
compiled: ``op_seconds`` a call, and the bytes of every value a generated op makes that only the region
reads (a fused kernel may keep it in registers, or write it once where its reader wants it), written and
read back at ``bytes_per_second``. An end is compiled where that reaches ``worth_seconds`` (the three are
``backend/options.py``'s). Inference programs compile their ends always (inference.py): a decode step's ends
are many small ops run per token.

Every rank decides alike: an end compiled on one rank and run as its graph on another would bucket and order
its collectives alike but round its values differently. So a value's size is its layout's largest local
shape (``Layout.max_local_shape``, the same on every rank), and a value without a layout (a node lowering
wrote) counts its call, not its bytes.
"""
from __future__ import annotations

import math

import torch
import torch.fx as fx

from fxshard.graph import LAYOUT
from fxshard.layout import Layout

from fxshard.backend.inductor.cpu_wrapper import generated_op
from fxshard.backend.options import in_force

__all__ = ["eager_seconds", "worth_compiling"]


def eager_seconds(gm: fx.GraphModule) -> float:
    """What ``gm``'s generated ops cost a step run as its graph beyond their cost compiled (module docstring)."""
    calls, passed = 0, 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or not generated_op(node.target):
            continue
        calls += 1
        if node.users and all(u.op == "call_function" for u in node.users):  # read in the region only
            passed += _bytes(node)
    options = in_force()
    return calls * options.op_seconds + 2 * passed / options.bytes_per_second


def worth_compiling(gm: fx.GraphModule) -> bool:
    """Whether a training step's prologue or epilogue is compiled (the module docstring)."""
    return eager_seconds(gm) >= in_force().worth_seconds


def _bytes(node: fx.Node) -> int:
    """The bytes of ``node``'s value on the rank that holds the most of it; 0 without a layout."""
    layout, value = node.meta.get(LAYOUT), node.meta.get("val")
    if not isinstance(layout, Layout) or not isinstance(value, torch.Tensor):
        return 0
    try:
        return math.prod(int(n) for n in layout.max_local_shape()) * value.element_size()
    except TypeError:  # a symbolic size: large enough to compile
        options = in_force()
        return int(options.worth_seconds * options.bytes_per_second)
