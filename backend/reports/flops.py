"""Each rank's FLOPs, as ``torch.utils.flop_counter.FlopCounterMode`` counts them.

Imbalance (causal attention on contiguous sequence shards: the last rank's rows see every key) and work
duplicated across ranks (a replicated matmul every rank repeats) are visible in one figure per rank: the
FLOPs of its local program (stage 4). The program is not run: each call is priced by FlopCounterMode's
own formulas from its (fake) argument and output values, plus fxshard's ops (``fxshard/causal_rows.py``)
and the CPU flash attention kernels where the installed torch's table lacks them (2.13 counts none).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
import torch.fx as fx
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from fxshard.causal_rows import flops as causal_rows_flops
from fxshard.graph import LAYOUT
from fxshard.layout import Layout
from fxshard.lowering.localize import localize

aten = torch.ops.aten



def _flash_for_cpu(query_shape: Any, key_shape: Any, value_shape: Any, *args: Any, **kwargs: Any) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _flash_for_cpu_backward(grad_out_shape: Any, query_shape: Any, key_shape: Any, value_shape: Any, *args: Any,
                            **kwargs: Any) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


# kernels torch's FlopCounterMode counts only in later releases, with the formulas those releases use (shapes)
_MISSING = {aten._scaled_dot_product_flash_attention_for_cpu: _flash_for_cpu,
            aten._scaled_dot_product_flash_attention_for_cpu_backward: _flash_for_cpu_backward}


def counting_mode() -> FlopCounterMode:
    """A FlopCounterMode that counts what ``flops_by_rank`` counts (one device's reference figure)."""
    mode = FlopCounterMode(display=False)
    return FlopCounterMode(display=False, custom_mapping={op: f for op, f in _MISSING.items()
                                                          if op not in mode.flop_registry})


def program_flops(gm: fx.GraphModule, registry: Mapping[Any, Callable] | None = None) -> int:
    """The FLOPs of one program whose nodes carry their values (``meta["val"]``)."""
    return sum(flops_by_node(gm, registry).values())


def flops_by_node(gm: fx.GraphModule, registry: Mapping[Any, Callable] | None = None) -> dict[str, int]:
    """Each node's FLOPs (by name; nodes that compute none left out) in a program whose nodes carry their
    values: a global graph's are one device's (``fxshard.auto_placements`` prices the share each rank does)."""
    registry = registry if registry is not None else counting_mode().flop_registry
    counts: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: a.meta.get("val"))
        counted = causal_rows_flops(node.target, args)
        if counted is None:
            formula = registry.get(getattr(node.target, "overloadpacket", node.target))  # a higher-order op: itself
            counted = formula(*args, **kwargs, out_val=node.meta.get("val")) if formula is not None else 0
        if counted:
            counts[node.name] = int(counted)
    return counts


def flops_by_rank(gm: fx.GraphModule) -> list[int]:
    """Each rank's FLOPs of the planned global ``gm`` (stage 3): its local program's, rank by rank."""
    mesh = next((n.meta[LAYOUT].mesh for n in gm.graph.nodes if isinstance(n.meta.get(LAYOUT), Layout)), None)
    if mesh is None:
        return []
    if not mesh.is_static:
        raise ValueError(f"flops_by_rank: the mesh {mesh} has a symbolic size; explain it on a mesh of numbers")
    registry = counting_mode().flop_registry
    return [program_flops(localize(gm, coordinate), registry) for coordinate in mesh.coordinates()]
