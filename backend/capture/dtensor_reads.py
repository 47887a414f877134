"""What an attribute read of a DTensor inside a traced program gives: what DTensor itself answers.

Stage 1 replays Dynamo's graph on plain global stand-ins, so ``getattr(x, "device_mesh")`` (torchtitan's
``FusedQKVLinear`` builds a ``local_map`` from ``qkv.device_mesh`` and ``qkv.placements``) would ask a
plain tensor. The eager program asked a DTensor, and Dynamo's example value of ``x`` is that DTensor (a
fake one, with its real mesh and placements): its spec answers. The stand-in answers what the two share
(``shape``, ``dtype``, ``device``: a stand-in holds the global shape, as a DTensor reports it), and a read
of the local block is ``to_local()``.
"""
from __future__ import annotations

from typing import Any

import torch.fx as fx
from torch.distributed.tensor import DTensor

# attribute -> how it is answered: "spec" (the eager DTensor's value), "local" (the to_local() block)
READS = {
    "device_mesh": "spec",
    "placements": "spec",
    "_spec": "spec",
    "_local_tensor": "local",
}


def eager_dtensor(node: fx.Node | None) -> DTensor | None:
    """The DTensor that the value read by ``node`` (a ``getattr(x, name)`` of Dynamo's graph) was
    eagerly, from Dynamo's example value of ``x``; None where ``x`` was no DTensor."""
    if node is None or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    example = node.args[0].meta.get("example_value")
    return example if isinstance(example, DTensor) else None


def read_kind(node: fx.Node | None, name: Any) -> str | None:
    """``"spec"`` or ``"local"`` (``READS``) where ``node`` reads a DTensor's ``name`` that the global
    stand-in cannot answer as DTensor does; None where the stand-in's own attribute is the answer."""
    if not isinstance(name, str) or name not in READS:
        return None
    return READS[name] if eager_dtensor(node) is not None else None
