"""A DTensor's attributes read inside a compiled program are the DTensor's, not those of fxshard's stand-in.

The pattern of torchtitan's fused QKV projection (tests/test_torchtitan.py runs the real one): a
``local_map`` built from the activation's own ``placements`` and ``device_mesh``, its function run on
the local blocks. Dynamo leaves ``y.device_mesh`` in the graph as an attribute read and the local_map's
``to_local()`` of an activation fxshard had not pinned (backend/capture/dtensor_reads.py).
"""
from __future__ import annotations

import pytest
import torch
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.experimental import local_map
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

import fxshard
from fxshard.backend.simulate import fake_world


class LocalSplit(torch.nn.Module):
    """A column-parallel projection, then a local_map over its output's own placements and mesh: the output's
    heads (local -1), each scaled, split in two."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 32, bias=False)

    def forward(self, x: torch.Tensor):
        y = self.proj(x)

        def halves(t):
            heads = t.view(t.shape[0], -1, 4) * 2
            a, b = torch.split(heads, [2, 2], dim=-1)
            return a.reshape(t.shape[0], -1).contiguous(), b.reshape(t.shape[0], -1).contiguous()

        if isinstance(y, DTensor):
            halves = local_map(halves, out_placements=(y.placements,) * 2, in_placements=(y.placements,),
                               device_mesh=y.device_mesh)
        return halves(y)


def model_and_reference(x):
    torch.manual_seed(0)
    model = LocalSplit()
    with torch.no_grad():
        ref = model(x)
    return model, ref


def test_local_map_over_an_activations_own_placements_matches_one_device():
    x = torch.randn(8, 16)
    model, ref = model_and_reference(x)
    with fake_world(fxshard.MeshSpec(tp=4)) as mesh:
        with LocalTensorMode(4):
            parallelize_module(model, mesh, {"proj": ColwiseParallel(use_local_output=False)})
        with torch.no_grad():
            out = fxshard.simulate(model, x)
    for o, r in zip(out, ref):
        torch.testing.assert_close(o, r)


@pytest.fixture
def mesh_4():
    with fake_world(fxshard.MeshSpec(tp=4)) as mesh:
        yield mesh


def test_compiled_local_map_gives_the_eager_dtensors(mesh_4):
    """torch.compile(backend="fxshard"): the outputs are DTensors of the placements local_map declared, each
    rank's block eager's (rank 0's here, on a fake process group: the program needs no communication)."""
    x = torch.randn(8, 16)
    model, ref = model_and_reference(x)
    parallelize_module(model, mesh_4, {"proj": ColwiseParallel(use_local_output=False)})
    with torch.no_grad():
        out = torch.compile(model, backend="fxshard")(x)
    for o, r in zip(out, ref):
        assert isinstance(o, DTensor) and o.placements == (Shard(1),)
        torch.testing.assert_close(o.to_local(), r[:, :4])
