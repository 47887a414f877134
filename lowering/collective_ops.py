"""torch's functional collectives (``_c10d_functional``), each declared once: its kind and where its group is.

Stage 5 writes four of them, each read by one ``wait_tensor`` (``collectives.py``); a merged bucket gathers
into its buffer (``all_gather_into_tensor_out``); DTensor and FSDP2 also issue the in-place and broadcast
forms, which traffic reports count. Every other set of collectives (what stage 6 buckets, windows or
prefetches, what simulation runs, what a test counts in Inductor's code) is a named part of this table.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["NAMESPACE", "NAMESPACES", "Collective", "COLLECTIVES", "ALL_GATHER", "ALL_GATHER_OUT", "REDUCE_SCATTER",
           "ALL_REDUCE", "ALL_TO_ALL", "WAIT", "LOWERED"]

NAMESPACE = "_c10d_functional"
# where a user's program (Dynamo's graph) may call them: the legacy and the autograd-aware forms too
NAMESPACES = (NAMESPACE, "c10d_functional", "_c10d_functional_autograd")
_c10d = torch.ops._c10d_functional


class Collective(NamedTuple):
    """What one functional collective is: its kind, as a plan's step names it (``fxshard.plans.STEP_KINDS``;
    or ``broadcast``), and the indices of its group-size argument (None: it takes none) and group name."""

    kind: str
    group_size_at: int | None
    group_at: int


COLLECTIVES: dict[str, Collective] = {  # the op's name in NAMESPACE -> what it is
    "all_gather_into_tensor": Collective("all_gather", 1, 2),
    "all_gather_into_tensor_out": Collective("all_gather", 1, 2),
    "reduce_scatter_tensor": Collective("reduce_scatter", 2, 3),
    "all_reduce": Collective("all_reduce", None, 2),
    "all_reduce_": Collective("all_reduce", None, 2),
    "all_to_all_single": Collective("all_to_all", None, 3),
    "broadcast": Collective("broadcast", None, 2),
    "broadcast_": Collective("broadcast", None, 2),
}
ALL_GATHER = _c10d.all_gather_into_tensor.default
ALL_GATHER_OUT = _c10d.all_gather_into_tensor_out.default  # a merged bucket's gather, into its buffer
REDUCE_SCATTER = _c10d.reduce_scatter_tensor.default
ALL_REDUCE = _c10d.all_reduce.default
ALL_TO_ALL = _c10d.all_to_all_single.default
WAIT = _c10d.wait_tensor.default
LOWERED = (ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE, ALL_TO_ALL)  # what stage 5 writes (each read by one WAIT)
