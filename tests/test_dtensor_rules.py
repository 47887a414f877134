"""fxshard's rules lent to DTensor (backend/dtensor_rules.py) for the ops it has no strategy for.

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

from fxshard.backend.dtensor_rules import lend_rules_to_dtensor

aten = torch.ops.aten
WORLD = 2


@pytest.fixture(scope="module")
def fake_world():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    yield
    dist.destroy_process_group()


def test_lends_only_what_dtensor_lacks():
    """The backend lent them at import; lending again finds nothing missing; DTensor's own strategies
    (the CUDA flash attention, mm) are never replaced."""
    prop = DTensor._op_dispatcher.sharding_propagator
    own = prop.op_strategy_funcs[aten._scaled_dot_product_flash_attention.default]
    assert lend_rules_to_dtensor() == []
    assert aten._scaled_dot_product_flash_attention_for_cpu.default in prop.op_strategy_funcs
    assert aten._scaled_dot_product_flash_attention_for_cpu_backward.default in prop.op_strategy_funcs
    assert prop.op_strategy_funcs[aten._scaled_dot_product_flash_attention.default] is own


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
