"""Golden tests: the printed graph after stage 3 (planned, global) and stage 5 (lowered, rank 0).

These are a reading tool: when one changes, read the diff before accepting it with
EXPECTTEST_ACCEPT=1.
"""
from __future__ import annotations

import torch
from expecttest import assert_expected_inline
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from fxshard import MeshSpec
from fxshard.backend.explain import explain
from fxshard.lowering.collectives import lower
from fxshard.lowering.groups import MeshGroups
from fxshard.lowering.localize import localize
from fxshard.printing import format_graph


def stage5(explanation, mesh, coordinate=(0,)) -> str:
    local = lower(localize(explanation.graph, coordinate), coordinate, MeshGroups(mesh))
    return format_graph(local, layouts=False)


def test_mlp_megatron(fake_mesh_4, make_mlp):
    torch.manual_seed(0)
    model = make_mlp()
    parallelize_module(model, fake_mesh_4, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    e = explain(model, torch.randn(2, 8), mesh=fake_mesh_4)
    assert_expected_inline(str(e), """\
%arg0: f32[2, 8] [2] [8] = input
%up_weight: f32[16, 8] [4@tp 4] [8] = input
%up_bias: f32[16] [4@tp 4] = input
%down_weight: f32[8, 16] [8] [4@tp 4] = input
%down_bias: f32[8] [8] = input
%redistribute_default: f32[8] [8] P(sum@tp) = redistribute(%down_bias) from [8]: local_partial(tp sum)
%t: f32[8, 16] [8] [4@tp 4] = aten.t(%up_weight)
%addmm: f32[2, 16] [2] [4@tp 4] = aten.addmm(%up_bias, %arg0, %t)
%relu: f32[2, 16] [2] [4@tp 4] = aten.relu(%addmm)
%t_1: f32[16, 8] [4@tp 4] [8] = aten.t(%down_weight)
%addmm_1: f32[2, 8] [2] [8] P(sum@tp) = aten.addmm(%redistribute_default, %relu, %t_1)
%redistribute_default_1: f32[2, 8] [2] [8] = redistribute(%addmm_1) from [2] [8] P(sum@tp): all_reduce(tp sum)
return [%redistribute_default_1]
communication: 1 x all_reduce(tp); 96 bytes received per rank""")
    assert_expected_inline(stage5(e, fake_mesh_4), """\
%arg0: f32[2, 8] = input
%up_weight: f32[4, 8] = input
%up_bias: f32[4] = input
%down_weight: f32[8, 4] = input
%down_bias: f32[8] = input
%clone_default: f32[8] = aten.clone(%down_bias)
%t: f32[8, 4] = aten.t(%up_weight)
%addmm: f32[2, 4] = aten.addmm(%up_bias, %arg0, %t)
%relu: f32[2, 4] = aten.relu(%addmm)
%t_1: f32[4, 8] = aten.t(%down_weight)
%addmm_1: f32[2, 8] = aten.addmm(%clone_default, %relu, %t_1)
%all_reduce_default: f32[2, 8] = _c10d_functional.all_reduce(%addmm_1, 'sum', '0')
%wait_tensor_default: f32[2, 8] = _c10d_functional.wait_tensor(%all_reduce_default)
return [%wait_tensor_default]""")


def chain(x: torch.Tensor) -> torch.Tensor:
    y = x.permute(2, 0, 1)  # [6, 8, 4]
    z = y.reshape(6, 32)  # merges the sharded dim with a local one: no communication
    w = z.t()  # [32, 6]
    return (w * 2).reshape(3, 64)  # cuts through the shard: planned as a gather


def test_transpose_permute_reshape_chain(fake_mesh_4):
    e = explain(chain, torch.randn(8, 4, 6), mesh=fake_mesh_4, placements={0: (Shard(0),)})
    assert_expected_inline(str(e), """\
%arg0: f32[8, 4, 6] [4@tp 2] [4] [6] = input
%permute: f32[6, 8, 4] [6] [4@tp 2] [4] = aten.permute(%arg0, [2, 0, 1])
%view: f32[6, 32] [6] [4@tp 8] = aten.view(%permute, [6, 32])
%t: f32[32, 6] [4@tp 8] [6] = aten.t(%view)
%mul: f32[32, 6] [4@tp 8] [6] = aten.mul.Tensor(%t, 2)
%redistribute_default: f32[32, 6] [32] [6] = redistribute(%mul) from [4@tp 8] [6]: all_gather(tp dim 0)
%view_1: f32[3, 64] [3] [64] = aten.view(%redistribute_default, [3, 64])
return [%view_1]
communication: 1 x all_gather(tp); 576 bytes received per rank""")
    assert_expected_inline(stage5(e, fake_mesh_4, (1,)), """\
%arg0: f32[2, 4, 6] = input
%permute: f32[6, 2, 4] = aten.permute(%arg0, [2, 0, 1])
%view: f32[6, 8] = aten.reshape(%permute, [6, 8])
%t: f32[8, 6] = aten.t(%view)
%mul: f32[8, 6] = aten.mul.Tensor(%t, 2)
%all_gather_into_tensor_default: f32[32, 6] = _c10d_functional.all_gather_into_tensor(%mul, 4, '0')
%wait_tensor_default: f32[32, 6] = _c10d_functional.wait_tensor(%all_gather_into_tensor_default)
%view_1: f32[3, 64] = aten.reshape(%wait_tensor_default, [3, 64])
return [%view_1]""")


B, T, H, A = 2, 4, 16, 4


def attention(x, wq, wk, wv, wo):
    """The attention reshape chain of a Llama block (no RoPE, no mask): heads stay sharded throughout."""
    hd = H // A
    q = (x @ wq.t()).view(B, T, A, hd).transpose(1, 2)
    k = (x @ wk.t()).view(B, T, A, hd).transpose(1, 2)
    v = (x @ wv.t()).view(B, T, A, hd).transpose(1, 2)
    scores = torch.softmax(q @ k.transpose(-2, -1) / hd ** 0.5, dim=-1)
    return ((scores @ v).transpose(1, 2).reshape(B, T, H)) @ wo.t()


def fused_qkv(x, wqkv):
    """One fused projection [3h, h], laid out [3 tp h/tp], split into q, k, v without communication."""
    q, k, v = (x @ wqkv.t()).view(B, T, 3, A, H // A).unbind(2)
    return (q * k + v).reshape(B, T, H)


MESHES = {"1d": (MeshSpec(tp=4), (), (Replicate(),)), "2d": (MeshSpec(dp=2, tp=2), (Replicate(),), (Shard(0), Replicate()))}


def explain_attention(mesh_name: str) -> str:
    mesh, lead, x_placements = MESHES[mesh_name]
    plan = {0: x_placements, 1: lead + (Shard(0),), 2: lead + (Shard(0),), 3: lead + (Shard(0),), 4: lead + (Shard(1),)}
    return str(explain(attention, torch.randn(B, T, H), *[torch.randn(H, H) for _ in range(4)], mesh=mesh,
                       placements=plan))


def explain_fused_qkv(mesh_name: str) -> str:
    mesh, lead, x_placements = MESHES[mesh_name]
    plan = {0: x_placements, 1: lead + (_StridedShard(0, split_factor=3),)}
    return str(explain(fused_qkv, torch.randn(B, T, H), torch.randn(3 * H, H), mesh=mesh, placements=plan))


def test_llama_attention_chain_1d():
    assert_expected_inline(explain_attention("1d"), """\
%arg1: f32[16, 16] [4@tp 4] [16] = input
%arg0: f32[2, 4, 16] [2] [4] [16] = input
%arg2: f32[16, 16] [4@tp 4] [16] = input
%arg3: f32[16, 16] [4@tp 4] [16] = input
%arg4: f32[16, 16] [16] [4@tp 4] = input
%t: f32[16, 16] [16] [4@tp 4] = aten.t(%arg1)
%view: f32[8, 16] [8] [16] = aten.view(%arg0, [8, 16])
%mm: f32[8, 16] [8] [4@tp 4] = aten.mm(%view, %t)
%_unsafe_view: f32[2, 4, 16] [2] [4] [4@tp 4] = aten._unsafe_view(%mm, [2, 4, 16])
%view_1: f32[2, 4, 4, 4] [2] [4] [4@tp] [4] = aten.view(%_unsafe_view, [2, 4, 4, 4])
%transpose: f32[2, 4, 4, 4] [2] [4@tp] [4] [4] = aten.transpose.int(%view_1, 1, 2)
%t_1: f32[16, 16] [16] [4@tp 4] = aten.t(%arg2)
%mm_1: f32[8, 16] [8] [4@tp 4] = aten.mm(%view, %t_1)
%_unsafe_view_1: f32[2, 4, 16] [2] [4] [4@tp 4] = aten._unsafe_view(%mm_1, [2, 4, 16])
%view_3: f32[2, 4, 4, 4] [2] [4] [4@tp] [4] = aten.view(%_unsafe_view_1, [2, 4, 4, 4])
%transpose_1: f32[2, 4, 4, 4] [2] [4@tp] [4] [4] = aten.transpose.int(%view_3, 1, 2)
%t_2: f32[16, 16] [16] [4@tp 4] = aten.t(%arg3)
%mm_2: f32[8, 16] [8] [4@tp 4] = aten.mm(%view, %t_2)
%_unsafe_view_2: f32[2, 4, 16] [2] [4] [4@tp 4] = aten._unsafe_view(%mm_2, [2, 4, 16])
%view_5: f32[2, 4, 4, 4] [2] [4] [4@tp] [4] = aten.view(%_unsafe_view_2, [2, 4, 4, 4])
%transpose_2: f32[2, 4, 4, 4] [2] [4@tp] [4] [4] = aten.transpose.int(%view_5, 1, 2)
%transpose_3: f32[2, 4, 4, 4] [2] [4@tp] [4] [4] = aten.transpose.int(%transpose_1, -2, -1)
%expand: f32[2, 4, 4, 4] [2] [4@tp] [4] [4] = aten.expand(%transpose, [2, 4, 4, 4])
%clone: f32[2, 4, 4, 4] [2] [4@tp] [4] [4] = aten.clone(%expand, memory_format=torch.contiguous_format)
%_unsafe_view_3: f32[8, 4, 4] [2 4@tp] [4] [4] = aten._unsafe_view(%clone, [8, 4, 4])
%expand_1: f32[2, 4, 4, 4] [2] [4@tp] [4] [4] = aten.expand(%transpose_3, [2, 4, 4, 4])
%clone_1: f32[2, 4, 4, 4] [2] [4@tp] [4] [4] = aten.clone(%expand_1, memory_format=torch.contiguous_format)
%_unsafe_view_4: f32[8, 4, 4] [2 4@tp] [4] [4] = aten._unsafe_view(%clone_1, [8, 4, 4])
%bmm: f32[8, 4, 4] [2 4@tp] [4] [4] = aten.bmm(%_unsafe_view_3, %_unsafe_view_4)
%_unsafe_view_5: f32[2, 4, 4, 4] [2] [4@tp] [4] [4] = aten._unsafe_view(%bmm, [2, 4, 4, 4])
%div: f32[2, 4, 4, 4] [2] [4@tp] [4] [4] = aten.div.Tensor(%_unsafe_view_5, 2.0)
%amax: f32[2, 4, 4, 1] [2] [4@tp] [4] [1] = aten.amax(%div, [-1], True)
%sub: f32[2, 4, 4, 4] [2] [4@tp] [4] [4] = aten.sub.Tensor(%div, %amax)
%exp: f32[2, 4, 4, 4] [2] [4@tp] [4] [4] = aten.exp(%sub)
%sum_1: f32[2, 4, 4, 1] [2] [4@tp] [4] [1] = aten.sum.dim_IntList(%exp, [-1], True)
%div_1: f32[2, 4, 4, 4] [2] [4@tp] [4] [4] = aten.div.Tensor(%exp, %sum_1)
%expand_2: f32[2, 4, 4, 4] [2] [4@tp] [4] [4] = aten.expand(%div_1, [2, 4, 4, 4])
%view_6: f32[8, 4, 4] [2 4@tp] [4] [4] = aten.view(%expand_2, [8, 4, 4])
%expand_3: f32[2, 4, 4, 4] [2] [4@tp] [4] [4] = aten.expand(%transpose_2, [2, 4, 4, 4])
%clone_2: f32[2, 4, 4, 4] [2] [4@tp] [4] [4] = aten.clone(%expand_3, memory_format=torch.contiguous_format)
%_unsafe_view_6: f32[8, 4, 4] [2 4@tp] [4] [4] = aten._unsafe_view(%clone_2, [8, 4, 4])
%bmm_1: f32[8, 4, 4] [2 4@tp] [4] [4] = aten.bmm(%view_6, %_unsafe_view_6)
%_unsafe_view_7: f32[2, 4, 4, 4] [2] [4@tp] [4] [4] = aten._unsafe_view(%bmm_1, [2, 4, 4, 4])
%transpose_4: f32[2, 4, 4, 4] [2] [4] [4@tp] [4] = aten.transpose.int(%_unsafe_view_7, 1, 2)
%clone_3: f32[2, 4, 4, 4] [2] [4] [4@tp] [4] = aten.clone(%transpose_4, memory_format=torch.contiguous_format)
%_unsafe_view_8: f32[2, 4, 16] [2] [4] [4@tp 4] = aten._unsafe_view(%clone_3, [2, 4, 16])
%t_3: f32[16, 16] [4@tp 4] [16] = aten.t(%arg4)
%view_7: f32[8, 16] [8] [4@tp 4] = aten.view(%_unsafe_view_8, [8, 16])
%mm_3: f32[8, 16] [8] [16] P(sum@tp) = aten.mm(%view_7, %t_3)
%_unsafe_view_9: f32[2, 4, 16] [2] [4] [16] P(sum@tp) = aten._unsafe_view(%mm_3, [2, 4, 16])
return [%_unsafe_view_9]
communication: none""")


def test_llama_attention_chain_2d():
    assert_expected_inline(explain_attention("2d"), """\
%arg1: f32[16, 16] [2@tp 8] [16] = input
%arg0: f32[2, 4, 16] [2@dp] [4] [16] = input
%arg2: f32[16, 16] [2@tp 8] [16] = input
%arg3: f32[16, 16] [2@tp 8] [16] = input
%arg4: f32[16, 16] [16] [2@tp 8] = input
%t: f32[16, 16] [16] [2@tp 8] = aten.t(%arg1)
%view: f32[8, 16] [2@dp 4] [16] = aten.view(%arg0, [8, 16])
%mm: f32[8, 16] [2@dp 4] [2@tp 8] = aten.mm(%view, %t)
%_unsafe_view: f32[2, 4, 16] [2@dp] [4] [2@tp 8] = aten._unsafe_view(%mm, [2, 4, 16])
%view_1: f32[2, 4, 4, 4] [2@dp] [4] [2@tp 2] [4] = aten.view(%_unsafe_view, [2, 4, 4, 4])
%transpose: f32[2, 4, 4, 4] [2@dp] [2@tp 2] [4] [4] = aten.transpose.int(%view_1, 1, 2)
%t_1: f32[16, 16] [16] [2@tp 8] = aten.t(%arg2)
%mm_1: f32[8, 16] [2@dp 4] [2@tp 8] = aten.mm(%view, %t_1)
%_unsafe_view_1: f32[2, 4, 16] [2@dp] [4] [2@tp 8] = aten._unsafe_view(%mm_1, [2, 4, 16])
%view_3: f32[2, 4, 4, 4] [2@dp] [4] [2@tp 2] [4] = aten.view(%_unsafe_view_1, [2, 4, 4, 4])
%transpose_1: f32[2, 4, 4, 4] [2@dp] [2@tp 2] [4] [4] = aten.transpose.int(%view_3, 1, 2)
%t_2: f32[16, 16] [16] [2@tp 8] = aten.t(%arg3)
%mm_2: f32[8, 16] [2@dp 4] [2@tp 8] = aten.mm(%view, %t_2)
%_unsafe_view_2: f32[2, 4, 16] [2@dp] [4] [2@tp 8] = aten._unsafe_view(%mm_2, [2, 4, 16])
%view_5: f32[2, 4, 4, 4] [2@dp] [4] [2@tp 2] [4] = aten.view(%_unsafe_view_2, [2, 4, 4, 4])
%transpose_2: f32[2, 4, 4, 4] [2@dp] [2@tp 2] [4] [4] = aten.transpose.int(%view_5, 1, 2)
%transpose_3: f32[2, 4, 4, 4] [2@dp] [2@tp 2] [4] [4] = aten.transpose.int(%transpose_1, -2, -1)
%expand: f32[2, 4, 4, 4] [2@dp] [2@tp 2] [4] [4] = aten.expand(%transpose, [2, 4, 4, 4])
%clone: f32[2, 4, 4, 4] [2@dp] [2@tp 2] [4] [4] = aten.clone(%expand, memory_format=torch.contiguous_format)
%_unsafe_view_3: f32[8, 4, 4] [2@dp 2@tp 2] [4] [4] = aten._unsafe_view(%clone, [8, 4, 4])
%expand_1: f32[2, 4, 4, 4] [2@dp] [2@tp 2] [4] [4] = aten.expand(%transpose_3, [2, 4, 4, 4])
%clone_1: f32[2, 4, 4, 4] [2@dp] [2@tp 2] [4] [4] = aten.clone(%expand_1, memory_format=torch.contiguous_format)
%_unsafe_view_4: f32[8, 4, 4] [2@dp 2@tp 2] [4] [4] = aten._unsafe_view(%clone_1, [8, 4, 4])
%bmm: f32[8, 4, 4] [2@dp 2@tp 2] [4] [4] = aten.bmm(%_unsafe_view_3, %_unsafe_view_4)
%_unsafe_view_5: f32[2, 4, 4, 4] [2@dp] [2@tp 2] [4] [4] = aten._unsafe_view(%bmm, [2, 4, 4, 4])
%div: f32[2, 4, 4, 4] [2@dp] [2@tp 2] [4] [4] = aten.div.Tensor(%_unsafe_view_5, 2.0)
%amax: f32[2, 4, 4, 1] [2@dp] [2@tp 2] [4] [1] = aten.amax(%div, [-1], True)
%sub: f32[2, 4, 4, 4] [2@dp] [2@tp 2] [4] [4] = aten.sub.Tensor(%div, %amax)
%exp: f32[2, 4, 4, 4] [2@dp] [2@tp 2] [4] [4] = aten.exp(%sub)
%sum_1: f32[2, 4, 4, 1] [2@dp] [2@tp 2] [4] [1] = aten.sum.dim_IntList(%exp, [-1], True)
%div_1: f32[2, 4, 4, 4] [2@dp] [2@tp 2] [4] [4] = aten.div.Tensor(%exp, %sum_1)
%expand_2: f32[2, 4, 4, 4] [2@dp] [2@tp 2] [4] [4] = aten.expand(%div_1, [2, 4, 4, 4])
%view_6: f32[8, 4, 4] [2@dp 2@tp 2] [4] [4] = aten.view(%expand_2, [8, 4, 4])
%expand_3: f32[2, 4, 4, 4] [2@dp] [2@tp 2] [4] [4] = aten.expand(%transpose_2, [2, 4, 4, 4])
%clone_2: f32[2, 4, 4, 4] [2@dp] [2@tp 2] [4] [4] = aten.clone(%expand_3, memory_format=torch.contiguous_format)
%_unsafe_view_6: f32[8, 4, 4] [2@dp 2@tp 2] [4] [4] = aten._unsafe_view(%clone_2, [8, 4, 4])
%bmm_1: f32[8, 4, 4] [2@dp 2@tp 2] [4] [4] = aten.bmm(%view_6, %_unsafe_view_6)
%_unsafe_view_7: f32[2, 4, 4, 4] [2@dp] [2@tp 2] [4] [4] = aten._unsafe_view(%bmm_1, [2, 4, 4, 4])
%transpose_4: f32[2, 4, 4, 4] [2@dp] [4] [2@tp 2] [4] = aten.transpose.int(%_unsafe_view_7, 1, 2)
%clone_3: f32[2, 4, 4, 4] [2@dp] [4] [2@tp 2] [4] = aten.clone(%transpose_4, memory_format=torch.contiguous_format)
%_unsafe_view_8: f32[2, 4, 16] [2@dp] [4] [2@tp 8] = aten._unsafe_view(%clone_3, [2, 4, 16])
%t_3: f32[16, 16] [2@tp 8] [16] = aten.t(%arg4)
%view_7: f32[8, 16] [2@dp 4] [2@tp 8] = aten.view(%_unsafe_view_8, [8, 16])
%mm_3: f32[8, 16] [2@dp 4] [16] P(sum@tp) = aten.mm(%view_7, %t_3)
%_unsafe_view_9: f32[2, 4, 16] [2@dp] [4] [16] P(sum@tp) = aten._unsafe_view(%mm_3, [2, 4, 16])
return [%_unsafe_view_9]
communication: none""")


def test_fused_qkv_chain_1d():
    assert_expected_inline(explain_fused_qkv("1d"), """\
%arg1: f32[48, 16] [3 4@tp 4] [16] = input
%arg0: f32[2, 4, 16] [2] [4] [16] = input
%t: f32[16, 48] [16] [3 4@tp 4] = aten.t(%arg1)
%view: f32[8, 16] [8] [16] = aten.view(%arg0, [8, 16])
%mm: f32[8, 48] [8] [3 4@tp 4] = aten.mm(%view, %t)
%_unsafe_view: f32[2, 4, 48] [2] [4] [3 4@tp 4] = aten._unsafe_view(%mm, [2, 4, 48])
%view_1: f32[2, 4, 3, 4, 4] [2] [4] [3] [4@tp] [4] = aten.view(%_unsafe_view, [2, 4, 3, 4, 4])
%unbind = aten.unbind.int(%view_1, 2)
%getitem: f32[2, 4, 4, 4] [2] [4] [4@tp] [4] = getitem(%unbind, 0)
%getitem_1: f32[2, 4, 4, 4] [2] [4] [4@tp] [4] = getitem(%unbind, 1)
%getitem_2: f32[2, 4, 4, 4] [2] [4] [4@tp] [4] = getitem(%unbind, 2)
%mul: f32[2, 4, 4, 4] [2] [4] [4@tp] [4] = aten.mul.Tensor(%getitem, %getitem_1)
%add: f32[2, 4, 4, 4] [2] [4] [4@tp] [4] = aten.add.Tensor(%mul, %getitem_2)
%view_2: f32[2, 4, 16] [2] [4] [4@tp 4] = aten.view(%add, [2, 4, 16])
return [%view_2]
communication: none""")


def test_fused_qkv_chain_2d():
    assert_expected_inline(explain_fused_qkv("2d"), """\
%arg1: f32[48, 16] [3 2@tp 8] [16] = input
%arg0: f32[2, 4, 16] [2@dp] [4] [16] = input
%t: f32[16, 48] [16] [3 2@tp 8] = aten.t(%arg1)
%view: f32[8, 16] [2@dp 4] [16] = aten.view(%arg0, [8, 16])
%mm: f32[8, 48] [2@dp 4] [3 2@tp 8] = aten.mm(%view, %t)
%_unsafe_view: f32[2, 4, 48] [2@dp] [4] [3 2@tp 8] = aten._unsafe_view(%mm, [2, 4, 48])
%view_1: f32[2, 4, 3, 4, 4] [2@dp] [4] [3] [2@tp 2] [4] = aten.view(%_unsafe_view, [2, 4, 3, 4, 4])
%unbind = aten.unbind.int(%view_1, 2)
%getitem: f32[2, 4, 4, 4] [2@dp] [4] [2@tp 2] [4] = getitem(%unbind, 0)
%getitem_1: f32[2, 4, 4, 4] [2@dp] [4] [2@tp 2] [4] = getitem(%unbind, 1)
%getitem_2: f32[2, 4, 4, 4] [2@dp] [4] [2@tp 2] [4] = getitem(%unbind, 2)
%mul: f32[2, 4, 4, 4] [2@dp] [4] [2@tp 2] [4] = aten.mul.Tensor(%getitem, %getitem_1)
%add: f32[2, 4, 4, 4] [2@dp] [4] [2@tp 2] [4] = aten.add.Tensor(%mul, %getitem_2)
%view_2: f32[2, 4, 16] [2@dp] [4] [2@tp 8] = aten.view(%add, [2, 4, 16])
return [%view_2]
communication: none""")


def test_mlp_training_forward_and_backward_megatron():
    """Training a column/row-parallel MLP: the forward all-reduces the row-parallel output once, the
    backward the input's gradient once; each weight's gradient is computed in its own layout."""
    from fxshard.backend.driver import plan_function

    torch.manual_seed(0)
    x = torch.randn(4, 8, requires_grad=True)
    w1 = torch.randn(16, 8, requires_grad=True)
    w2 = torch.randn(8, 16, requires_grad=True)

    def loss(x, w1, w2):
        return torch.relu(x @ w1.t()) @ w2.t()

    _, planned = plan_function(lambda x, w1, w2: loss(x, w1, w2).sum(), (x, w1, w2), mesh=MeshSpec(tp=4),
                               placements={1: (Shard(0),), 2: (Shard(1),)}, training=True)
    plan = planned.training
    assert_expected_inline("== forward\n" + format_graph(plan.forward) + "\n== backward\n" + format_graph(plan.backward),
                           """\
== forward
%arg1: f32[16, 8] [4@tp 4] [8] = input
%arg0: f32[4, 8] [4] [8] = input
%arg2: f32[8, 16] [8] [4@tp 4] = input
%t: f32[8, 16] [8] [4@tp 4] = aten.t(%arg1)
%mm: f32[4, 16] [4] [4@tp 4] = aten.mm(%arg0, %t)
%relu: f32[4, 16] [4] [4@tp 4] = aten.relu(%mm)
%t_1: f32[16, 8] [4@tp 4] [8] = aten.t(%arg2)
%mm_1: f32[4, 8] [4] [8] P(sum@tp) = aten.mm(%relu, %t_1)
%sum_1: f32[] [] P(sum@tp) = aten.sum(%mm_1)
%detach_2: f32[] [] P(sum@tp) = aten.detach(%sum_1)
%redistribute_default: f32[] [] = redistribute(%detach_2) from [] P(sum@tp): all_reduce(tp sum)
return [%redistribute_default, %arg1, %arg0, %arg2, %relu]
== backward
%saved_arg1: f32[16, 8] [4@tp 4] [8] = input
%saved_arg0: f32[4, 8] [4] [8] = input
%saved_arg2: f32[8, 16] [8] [4@tp 4] = input
%saved_relu: f32[4, 16] [4] [4@tp 4] = input
%tangent_0: f32[] [] = input
%t: f32[8, 16] [8] [4@tp 4] = aten.t(%saved_arg1)
%detach: f32[4, 16] [4] [4@tp 4] = aten.detach(%saved_relu)
%t_1: f32[16, 8] [4@tp 4] [8] = aten.t(%saved_arg2)
%expand: f32[4, 8] [4] [8] = aten.expand(%tangent_0, [4, 8])
%t_2: f32[8, 4] [8] [4] = aten.t(%expand)
%mm_2: f32[8, 16] [8] [4@tp 4] = aten.mm(%t_2, %saved_relu)
%t_3: f32[16, 8] [4@tp 4] [8] = aten.t(%mm_2)
%t_4: f32[8, 16] [8] [4@tp 4] = aten.t(%t_1)
%mm_3: f32[4, 16] [4] [4@tp 4] = aten.mm(%expand, %t_4)
%t_5: f32[8, 16] [8] [4@tp 4] = aten.t(%t_3)
%detach_1: f32[4, 16] [4] [4@tp 4] = aten.detach(%detach)
%le: b8[4, 16] [4] [4@tp 4] = aten.le.Scalar(%detach_1, 0)
%scalar_tensor: f32[] [] = aten.scalar_tensor(0, dtype=float32, layout=torch.strided, device=device)
%where: f32[4, 16] [4] [4@tp 4] = aten.where.self(%le, %scalar_tensor, %mm_3)
%t_6: f32[16, 4] [4@tp 4] [4] = aten.t(%where)
%mm_4: f32[16, 8] [4@tp 4] [8] = aten.mm(%t_6, %saved_arg0)
%t_7: f32[8, 16] [8] [4@tp 4] = aten.t(%mm_4)
%t_8: f32[16, 8] [4@tp 4] [8] = aten.t(%t)
%mm_5: f32[4, 8] [4] [8] P(sum@tp) = aten.mm(%where, %t_8)
%redistribute_default_1: f32[4, 8] [4] [8] = redistribute(%mm_5) from [4] [8] P(sum@tp): all_reduce(tp sum)
%t_9: f32[16, 8] [4@tp 4] [8] = aten.t(%t_7)
return [%t_9, %redistribute_default_1, %t_5]""")
