"""Which layer a value is of, by its name alone: the first indexed module in it.

A model's repeated layers are the members of an indexed container (``nn.ModuleList``, ``nn.Sequential``):
``model.layers.12.self_attn.q_proj.weight`` is of layer 12 of ``model.layers``, and so is the graph input
named after it, ``model_layers_12_self_attn_q_proj_weight``. Buckets (FSDP2 gathers one layer's parameters in
one call), refinement's prices, regional compilation and folding all ask this module, from names alone, so
that every rank answers alike without the model at hand. Names are read with ``_`` or ``.`` between parts.
"""
from __future__ import annotations

import collections
import re
from typing import Iterable

import torch.fx as fx
from torch import nn

__all__ = ["ROOT", "block_of", "layer_index", "common_layer", "renumbered", "within_layer", "unnumbered", "any_layer",
           "layer_of_inputs", "layer_members"]

ROOT = "root"  # the block of every name outside an indexed module
# the first indexed module in a name: "layers_0_attention_wq_weight" -> ("layers", 0), then "attention_wq_weight"
_INDEXED = re.compile(r"^(.*?)[_.](\d+)(?:[_.]|$)")


def block_of(name: str) -> str:
    """The first indexed module in a name (``layers_0_attention_wq_weight`` -> ``layers_0``), or ``ROOT``;
    a value saved from a parameter (``saved_``) is of the parameter's block."""
    m = _INDEXED.match(name.removeprefix("saved_"))
    return m.string[:m.end(2)] if m else ROOT


def layer_index(name: str) -> int | None:
    """The layer index in a name (``layers_7_wq_weight`` -> 7, ``model.layers.12.mlp`` -> 12), or None."""
    m = _INDEXED.match(name)
    return int(m.group(2)) if m else None


def common_layer(names: Iterable[str]) -> int | None:
    """The one layer all ``names`` are of; None where they are of several, or one is of none (or none given)."""
    found = {layer_index(name) for name in names}
    return found.pop() if len(found) == 1 and None not in found else None


def renumbered(name: str, layer: int) -> str:
    """A name for another layer: ``layers_1_wq_weight`` -> ``layers_7_wq_weight``."""
    m = _INDEXED.match(name)
    assert m is not None, f"{name} is not an indexed module's input"
    return name[:m.start(2)] + str(layer) + name[m.end(2):]


def within_layer(name: str) -> str:
    """A name within its layer, alike in every layer: ``layers_1_wq_weight`` -> ``wq_weight``."""
    m = _INDEXED.match(name)
    assert m is not None, f"{name} is not an indexed module's input"
    return name[m.end():]


def any_layer(name: str) -> str:
    """A name for every layer at once: ``layers.1.attention.wq.weight`` -> ``layers.*.attention.wq.weight``
    (a name of no layer is itself)."""
    m = _INDEXED.match(name)
    return name if m is None else name[:m.start(2)] + "*" + name[m.end(2):]


def unnumbered(name: str) -> str:
    """A name with every number in it made ``#`` (``layers_3_w1_weight`` -> ``layers_#_w#_weight``): names
    alike in every layer, and in every expert of a layer, share it."""
    return re.sub(r"\d+", "#", name)


def layer_of_inputs(gm: fx.GraphModule) -> dict[fx.Node, int]:
    """Placeholder -> layer index, for the indexed container most placeholders share (``layers``)."""
    found = {p: _INDEXED.match(p.name) for p in gm.graph.find_nodes(op="placeholder")}
    containers = collections.Counter(m.group(1) for m in found.values() if m)
    if not containers:
        return {}
    container = containers.most_common(1)[0][0]
    return {p: int(m.group(2)) for p, m in found.items() if m and m.group(1) == container}


def layer_members(module: nn.Module) -> list[nn.Module]:
    """The members of ``module``'s indexed containers (``ModuleList``, ``Sequential``, nested ones included)
    whose class occurs in their container twice or more: the module-side answer to what is a layer."""
    members: list[nn.Module] = []
    for container in module.modules():
        if isinstance(container, (nn.ModuleList, nn.Sequential)):
            count = collections.Counter(type(member) for member in container)
            members += [member for member in container if count[type(member)] > 1]
    return members
