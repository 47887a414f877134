"""What a program puts on the wire: its collectives, read from a lowered graph or from calls.

One classification serves both sides of a comparison: the functional collectives in a
lowered local graph (fxshard's stage-5 output, sizes from ``meta["val"]``) and the
collectives an eager program dispatches (DTensor under ``CommDebugMode``). Bytes are those
one rank receives, by the planner's formula (``fxshard.costs.collective_bytes``), so a
ratio between the two counts the same thing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.fx as fx

from fxshard.costs import collective_bytes
from fxshard.lowering.collective_ops import COLLECTIVES

c10d = torch.ops._c10d_functional

# op packet -> (kind, index of the group-size argument or None, index of the group-name argument)
_FUNCTIONAL = {getattr(c10d, name): collective for name, collective in COLLECTIVES.items()}
# the in-place c10d ops (torch.distributed.* calls, FSDP2): packet -> (kind, input index, group index)
_C10D = {
    torch.ops.c10d._allgather_base_: ("all_gather", 1, 2),
    torch.ops.c10d._reduce_scatter_base_: ("reduce_scatter", 1, 2),
    torch.ops.c10d.alltoall_base_: ("all_to_all", 1, 2),
    torch.ops.c10d.allreduce_: ("all_reduce", 0, 1),
    torch.ops.c10d.broadcast_: ("broadcast", 0, 1),
}
_NOT_COMMUNICATION = {c10d.wait_tensor, c10d._wrap_tensor_autograd}


class UnknownCollectiveError(NotImplementedError):
    """A communication op this module cannot size: counting it as free would undercount."""


@dataclass(frozen=True)
class CollectiveCall:
    kind: str  # all_reduce, all_gather, reduce_scatter, all_to_all, broadcast
    group_size: int
    input_bytes: int  # one rank's input

    @property
    def bytes_received(self) -> int:
        if self.kind == "broadcast":
            return self.input_bytes
        return int(collective_bytes(self.kind, self.group_size, self.input_bytes))


def _group_size(name_or_group: Any) -> int:
    if isinstance(name_or_group, str):
        from torch.distributed.distributed_c10d import _resolve_process_group

        return _resolve_process_group(name_or_group).size()
    if isinstance(name_or_group, torch.ScriptObject):  # a c10d op's boxed ProcessGroup
        name_or_group = torch.distributed.ProcessGroup.unbox(name_or_group)
    return name_or_group.size()


def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size()


def _is_communication(packet: Any) -> bool:
    return getattr(packet, "_qualified_op_name", "").split("::")[0] in ("_c10d_functional", "c10d", "_dtensor") \
        and packet not in _NOT_COMMUNICATION and "get_process_group" not in str(packet)


def collective_call(op: Any, args: Sequence[Any]) -> CollectiveCall | None:
    """The collective ``op(*args)`` performs (tensors real or fake), or None for a local op."""
    packet = getattr(op, "_overloadpacket", op)
    if packet in _FUNCTIONAL:
        kind, size_at, name_at = _FUNCTIONAL[packet]
        size = int(args[size_at]) if size_at is not None else _group_size(args[name_at])
        return CollectiveCall(kind, size, _nbytes(args[0]))
    if packet in _C10D:
        kind, input_at, group_at = _C10D[packet]
        inputs = args[input_at] if isinstance(args[input_at], (list, tuple)) else [args[input_at]]
        return CollectiveCall(kind, _group_size(args[group_at]), sum(_nbytes(t) for t in inputs))
    if packet is getattr(torch.ops._dtensor, "shard_dim_alltoall", None):
        return CollectiveCall("all_to_all", _group_size(args[3]), _nbytes(args[0]))
    if _is_communication(packet):
        raise UnknownCollectiveError(f"{op} communicates, but fxshard.backend.reports.traffic cannot size it")
    return None


def functional_group(op: Any, args: Sequence[Any]) -> str | None:
    """The group name a functional collective ``op(*args)`` runs on, or None for any other op."""
    collective = _FUNCTIONAL.get(getattr(op, "_overloadpacket", op))
    return None if collective is None else args[collective.group_at]


def received_by_rank(op: Any, args: Sequence[Any], output: Any, index_in_group: int) -> int:
    """Bytes one rank received in a collective it ran (``args`` its arguments, ``output`` its result, real
    tensors), ``index_in_group`` its place in the group: an all_to_all with split sizes counts the rows that
    came from the other ranks (data-dependent, as a dropless MoE's dispatch); every other collective the
    planner's formula on its input, as ``CollectiveCall.bytes_received``."""
    packet = getattr(op, "_overloadpacket", op)
    if packet is c10d.all_to_all_single and output.dim() > 0 and list(args[1]):
        row_bytes = torch.Size(output.shape[1:]).numel() * output.element_size()
        return (int(sum(int(s) for s in args[1])) - int(args[1][index_in_group])) * row_bytes
    call = collective_call(op, args)
    return 0 if call is None else call.bytes_received


def collective_calls(gm: fx.GraphModule) -> list[CollectiveCall]:
    """The collectives of a lowered local graph, in program order (its shapes in ``meta["val"]``)."""
    calls = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        args = fx.node.map_arg(node.args, lambda a: a.meta.get("val"))  # a subgraph's get_attr has none
        call = collective_call(node.target, args)
        if call is not None:
            calls.append(call)
    return calls


def summarize(calls: Sequence[CollectiveCall]) -> tuple[dict[str, int], int]:
    """({kind: count}, bytes received) of a list of collectives."""
    counts: dict[str, int] = {}
    for c in calls:
        counts[c.kind] = counts.get(c.kind, 0) + 1
    return counts, sum(c.bytes_received for c in calls)
