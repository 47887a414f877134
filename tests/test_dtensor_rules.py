"""fxshard's rules lent to DTensor (backend/capture/dtensor_rules.py) for the ops it has no strategy for.

Dynamo traces a DTensor program through DTensor's own sharding propagation, so an op DTensor lacks
breaks the program in front of the backend (CPU flash attention: every Hugging Face model's sdpa on
CPU). The lent strategies must be right in DTensor eager too: DTensor on LocalTensorMode (every rank
in this process) against one device.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from fxshard.backend.capture.dtensor_rules import dtensor_rule, is_lent, lend_rules_to_dtensor
from fxshard.op_kinds import Declared
from fxshard.registry import OPS

aten = torch.ops.aten
WORLD = 2


@pytest.fixture(scope="module")
def fake_world():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    yield
    dist.destroy_process_group()


# what fxshard lends on torch 2.13 and 2.15 alike (2.15 moved DTensor's own rules to single-dim
# strategies; none of these gained one): a torch that gains a rule for one drops it from here
LENT = [aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
        aten._scaled_dot_product_fused_attention_overrideable.default,
        aten._scaled_dot_product_fused_attention_overrideable_backward.default,
        aten._unsafe_masked_index_put_accumulate.default, aten.all.dims, aten.copy.default,
        aten.floor_divide.default, aten.index_add.default, aten.index_copy.default, aten.lift_fresh_copy.default,
        aten.polar.default,
        # fxshard's own mixed-precision ops, for Dynamo's capture of DTensor programs (fxshard/ops.py)
        torch.ops.fxshard.cast_for_compute.default, torch.ops.fxshard.summed.default]
OWN = [aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_flash_attention_backward.default,
       aten._scaled_dot_product_efficient_attention.default, aten.mm.default, aten._softmax.default,
       aten.sum.dim_IntList]


def test_lends_only_what_dtensor_lacks():
    """The backend lent them at import; lending again finds nothing missing; DTensor's own rules
    (the CUDA flash attention, mm) are never replaced, on whichever of its tables they are."""
    own = {op: dtensor_rule(op) for op in OWN}
    assert [op for op in lend_rules_to_dtensor() if op in OPS] == []  # other libraries' ops: lent once defined
    assert [op for op in OWN if dtensor_rule(op) is not own[op] or own[op] is None or is_lent(op)] == []
    declared = [op for op, entry in OPS.items() if isinstance(entry.kind, Declared)
                and isinstance(op, torch._ops.OpOverload) and is_lent(op)]
    assert sorted(map(str, declared)) == sorted(map(str, LENT))


MASKS = {"none": None, "causal": "causal", "[b,1,s,t] float": (2, 1, 6, 6), "[1,1,s,t] bool": (1, 1, 6, 6)}


@pytest.mark.parametrize("kv_heads", [8, 4], ids=["mha", "gqa"])
@pytest.mark.parametrize("mask", list(MASKS), ids=list(MASKS))
def test_cpu_flash_attention_in_dtensor_eager_is_sharded_by_head_and_exact(fake_world, kv_heads, mask):
    """Forward and backward: heads stay sharded (no gather), values and gradients are one device's."""
    torch.manual_seed(0)
    q = torch.randn(2, 8, 6, 16, requires_grad=True)
    k, v = (torch.randn(2, kv_heads, 6, 16, requires_grad=True) for _ in range(2))
    shape = MASKS[mask]
    attn_mask = None if shape in (None, "causal") else (
        torch.rand(shape) > 0.3 if "bool" in mask else torch.randn(shape))
    kwargs = dict(attn_mask=attn_mask, is_causal=shape == "causal", enable_gqa=kv_heads != 8)
    want = F.scaled_dot_product_attention(q, k, v, **kwargs)
    want.sum().backward()
    with LocalTensorMode(WORLD):
        mesh = init_device_mesh("cpu", (WORLD,))
        dq, dk, dv = (distribute_tensor(t.detach(), mesh, [Shard(1)]).requires_grad_() for t in (q, k, v))
        dmask = None if attn_mask is None else distribute_tensor(attn_mask, mesh, [Replicate()])
        out = F.scaled_dot_product_attention(dq, dk, dv, **{**kwargs, "attn_mask": dmask})
        out.sum().backward()
        assert out.placements == (Shard(1),) and dk.grad.placements == (Shard(1),)
        got = [t.full_tensor() for t in (out, dq.grad, dk.grad, dv.grad)]
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, (want, q.grad, k.grad, v.grad)):
        g = g._local_tensors[0] if hasattr(g, "_local_tensors") else g
        torch.testing.assert_close(g, w, msg=lambda m: f"{name}: {m}")


def test_other_libraries_ops_are_lent_once_defined(fake_world):
    """transformers' grouped matmul (an fp32 MoE's experts) is keyed by schema name in the registry: lent
    when transformers has defined it, which may be after the backend's import (captures lend again)."""
    moe = pytest.importorskip("transformers.integrations.moe")  # defines torch.ops.transformers.*
    assert moe is not None
    lend_rules_to_dtensor()
    ops = [torch.ops.transformers.grouped_mm_fallback.default, torch.ops.transformers.grouped_mm_fallback_backward.default]
    assert [op for op in ops if not is_lent(op)] == []


def test_lent_grouped_mm_in_dtensor_eager_keeps_column_parallel_experts_sharded(fake_world):
    """The lent rule in DTensor eager: experts' weights sharded on their output features give the output
    sharded the same way (no gather), with one device's values."""
    pytest.importorskip("transformers.integrations.moe")
    lend_rules_to_dtensor()
    grouped_mm = torch.ops.transformers.grouped_mm_fallback
    torch.manual_seed(0)
    x, w, offs = torch.randn(6, 8), torch.randn(2, 8, 4), torch.tensor([2, 6], dtype=torch.int32)
    with LocalTensorMode(WORLD):
        mesh = init_device_mesh("cpu", (WORLD,))
        out = grouped_mm(distribute_tensor(x, mesh, [Replicate()]), distribute_tensor(w, mesh, [Shard(2)]),
                         distribute_tensor(offs, mesh, [Replicate()]))
        assert out.placements == (Shard(1),)
        got = out.full_tensor()
    got = got._local_tensors[0] if hasattr(got, "_local_tensors") else got
    torch.testing.assert_close(got, grouped_mm(x, w, offs))
