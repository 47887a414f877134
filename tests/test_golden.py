"""Golden tests: the printed graph after stage 3 (planned, global) and stage 5 (lowered, rank 0).

These are a reading tool: when one changes, read the diff before accepting it with
EXPECTTEST_ACCEPT=1.
"""
from __future__ import annotations

import torch
from expecttest import assert_expected_inline
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

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
%alias: f32[2, 16] [2] [4@tp 4] = aten.alias(%relu)
%t_1: f32[16, 8] [4@tp 4] [8] = aten.t(%down_weight)
%addmm_1: f32[2, 8] [2] [8] P(sum@tp) = aten.addmm(%redistribute_default, %alias, %t_1)
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
%alias: f32[2, 4] = aten.alias(%relu)
%t_1: f32[4, 8] = aten.t(%down_weight)
%addmm_1: f32[2, 8] = aten.addmm(%clone_default, %alias, %t_1)
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
%view: f32[6, 8] = aten.view(%permute, [6, 8])
%t: f32[8, 6] = aten.t(%view)
%mul: f32[8, 6] = aten.mul.Tensor(%t, 2)
%all_gather_into_tensor_default: f32[32, 6] = _c10d_functional.all_gather_into_tensor(%mul, 4, '0')
%wait_tensor_default: f32[32, 6] = _c10d_functional.wait_tensor(%all_gather_into_tensor_default)
%view_1: f32[3, 64] = aten.view(%wait_tensor_default, [3, 64])
return [%view_1]""")
