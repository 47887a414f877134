"""The block a parameter belongs to, by its name alone: the first indexed module in it.

FSDP2 gathers one block's parameters in one call and reduce-scatters its gradients in one; fxshard
buckets its collectives the same way (``backend/inductor/buckets.py``), and refinement prices a plan's moves
of one block's parameters as the one call they become (``refine.planned_cost``).
"""
from __future__ import annotations

import re

__all__ = ["ROOT", "block_of"]

ROOT = "root"  # the block of every parameter outside an indexed module
# the first indexed module in a parameter's name: "layers_0_attention_wq_weight" -> "layers_0"
_BLOCK = re.compile(r"^(.*?_\d+)(?:_|$)")


def block_of(name: str) -> str:
    """The block of a graph input named after a parameter (or saved from one: ``saved_``), by name alone."""
    match = _BLOCK.match(name.removeprefix("saved_"))
    return match.group(1) if match else ROOT
