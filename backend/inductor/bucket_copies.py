"""A bucket's copies in and out as one library call each, not one generated kernel per member.

Inductor's default merge of an all_gather bucket packs the members with a ``cat`` and unpacks each
gathered member with a ``reshape`` of a strided slice (every rank's piece of it): Inductor generates
one copy kernel per member, each a program of its own since its offsets differ (a 4-layer Llama's
FSDP program: 17 of its 51 C++ kernels, a third of its compile time on CPU, bench/results/compile.md).
FSDP2 does the same copies eagerly, in one ``split_with_sizes_copy``. Here too:

- packing: Inductor's own ``bucketing::_pre_bucket_all_gather`` / ``_pre_bucket_reduce_scatter``
  (its ``custom_ops`` bucket mode: one ``_foreach_copy_`` / ``cat``, a fallback call);
- unpacking a gather: ``fxshard::unpack_gathered``, every member copied out of the gathered buffer by
  one ``split_with_sizes_copy``; a reduce_scatter's members are contiguous slices of its output
  (views, no copy).

What moves, and where, is unchanged: the same collectives, buckets and bytes.

An all_gather bucket may mix dtypes (token ids with activations, a mask with a weight): the members
travel as the bytes of the narrowest one (as Inductor's ``pick_bucket_dtype``) and are viewed back as
their own dtypes, so a gather of int64 ids beside float32 values is one call, not one per dtype
(``gather_key``). A reduce_scatter adds its members up, so its buckets keep one dtype.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.fx as fx

from fxshard.backend.inductor.inductor_calls import (converts_dtype, dtype_index, merge_all_gather_bucket,
                                                    merge_reduce_scatter_bucket, process_collective_bucket,
                                                    resolve_group_name)

__all__ = ["gather_key", "merge_all_gathers", "merge_reduce_scatters", "unflatten_shapes", "unpack_gathered"]

_c10d = torch.ops._c10d_functional


@torch.library.custom_op("fxshard::unpack_gathered", mutates_args=())
def unpack_gathered(gathered: torch.Tensor, group_size: int, numels: Sequence[int], dims: Sequence[int],
                    ranks: Sequence[int]) -> list[torch.Tensor]:
    """The members of a gathered bucket: rank r's piece of member k is ``numels[k]`` elements at its offset in
    rank r's chunk of ``gathered``; member k comes out contiguous, its ``group_size`` pieces one after another,
    in the shape ``dims`` and ``ranks`` give it (``unflatten_shapes``): the gathered member's own (no view after
    the trace: each view is an op to trace per member), or ``(group_size, numels[k])`` for a member of another
    dtype, viewed as its own after."""
    outs = [gathered.new_empty(shape) for shape in unflatten_shapes(dims, ranks)]
    torch.split_with_sizes_copy(gathered.view(group_size, -1), list(numels), dim=1,
                                out=[out.view(group_size, -1) for out in outs])
    return outs


@unpack_gathered.register_fake
def _(gathered: torch.Tensor, group_size: int, numels: Sequence[int], dims: Sequence[int],
      ranks: Sequence[int]) -> list[torch.Tensor]:
    return [gathered.new_empty(shape) for shape in unflatten_shapes(dims, ranks)]


def unflatten_shapes(dims: Sequence[int], ranks: Sequence[int]) -> list[list[int]]:
    """Shapes given flat, as a custom op's schema takes them (no list of lists): ``ranks[k]`` sizes each."""
    shapes, start = [], 0
    for rank in ranks:
        shapes.append(list(dims[start:start + rank]))
        start += rank
    return shapes


def _gather_bucket(ins: list[torch.Tensor], group_name: Any, group_size: int, dtype: torch.dtype,
                   out_dtypes: list[torch.dtype], rank: int) -> list[torch.Tensor]:
    """What one bucketed all_gather runs (traced into the graph in place of its members): the members
    packed as ``dtype`` (the narrowest of ``out_dtypes``, theirs), each gathered piece viewed back."""
    numels = [x.numel() * d.itemsize // dtype.itemsize for x, d in zip(ins, out_dtypes)]  # in units of dtype
    total = sum(numels)
    pack = torch.ops.bucketing._pre_bucket_all_gather
    dtype_ints = [dtype_index(d) for d in out_dtypes]
    if "group_name" in (a.name for a in pack.default._schema.arguments):  # torch 2.11 takes the group's name too
        out = pack(ins, group_size, group_name, dtype, dtype_ints, rank, None)
    else:
        out = pack(ins, group_size, dtype, dtype_ints, rank, None)
    gathered = torch.ops.c10d_functional.wait_tensor(_c10d.all_gather_into_tensor_out.default(
        out.narrow(0, total * rank, total), group_size, group_name, out=out))
    shapes = [(x.shape[0] * group_size, *x.shape[1:]) if d == dtype else (group_size, n)
              for x, d, n in zip(ins, out_dtypes, numels)]
    members = torch.ops.fxshard.unpack_gathered(gathered, group_size, numels, [n for s in shapes for n in s],
                                                [len(s) for s in shapes])
    return [m if d == dtype else m.view(d).view(x.shape[0] * group_size, *x.shape[1:])
            for m, x, d in zip(members, ins, out_dtypes)]


def gather_key(node: fx.Node) -> tuple:
    """The all_gathers one bucket may take: those of one process group, whatever their dtypes (packed
    as bytes); a member that converts its dtype on the way in (Inductor's default merge, one dtype)
    only with others of its dtype."""
    group = resolve_group_name(node.args[2])
    return (group, node.meta["val"].dtype) if converts_dtype(node) else (group,)


def merge_all_gathers(graph: fx.Graph, bucket: list[fx.Node], insert_before: fx.Node | None = None) -> None:
    """One all_gather for ``bucket`` (members of one process group (``gather_key``), each read by its wait alone),
    placed before ``insert_before`` (None: after the last member). A bucket whose members convert their
    dtype on the way in is merged by Inductor's default merge (its copies convert)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    if any(converts_dtype(n) for n in bucket):
        merge_all_gather_bucket(graph, bucket, insert_before)
        return
    _, group_size, group_name = bucket[0].args
    dtypes = [n.meta["val"].dtype for n in bucket]
    dtype = min(dtypes, key=lambda d: d.itemsize)  # the narrowest: every member's bytes are whole units of it
    rank = torch.distributed.get_rank(_resolve_process_group(resolve_group_name(group_name)))

    def trace_args(ins: list[fx.Node]) -> tuple:
        return ([n.meta["val"] for n in ins], group_name, group_size, dtype, dtypes, rank)

    process_collective_bucket(graph, bucket, _gather_bucket, trace_args, insert_before)


def merge_reduce_scatters(graph: fx.Graph, bucket: list[fx.Node], insert_before: fx.Node | None = None) -> None:
    """One reduce_scatter for ``bucket``, its input packed by one library call."""
    merge_reduce_scatter_bucket(graph, bucket, "custom_ops", insert_before)
