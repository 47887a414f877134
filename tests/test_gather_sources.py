"""Parameters are gathered as stored, not as relabelled views (fxshard/sources.py).

An FSDP weight ``w`` is stored ``Shard(0)``; the program reads it as ``t(w)``, a permute or a view,
sharded on another dim. Gathering that view would gather a strided block, which lowering wraps
in permutes and copies; stage 3 gathers ``w`` itself and runs the view on the whole tensor. Each
case: the values match one device, every all_gather of rank 0's lowered program (forward, and
backward in training) reads a placeholder directly, and lowering adds no permute or copy to the
program (it has as many as the program run replicated).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Shard

import fxshard
from fxshard.backend.simulate import fake_world, lowered_graphs

MESH = fxshard.MeshSpec(dp=4)
BANDWIDTH_BOUND = fxshard.CostModel(default_latency=0.0)  # bytes decide, as in tests/test_training.py
aten = torch.ops.aten
COPIES = (aten.clone.default, aten.permute.default, aten._to_copy.default)


class Stack(nn.Module):
    """Three linears: each weight read as ``t(w)`` (nn.Linear)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(32, 64, bias=False), nn.ReLU(), nn.Linear(64, 64, bias=False),
                                    nn.ReLU(), nn.Linear(64, 16, bias=False))

    def forward(self, x):
        return self.layers(x)


class Transposed(nn.Module):
    """``x @ w.transpose(0, 1)``, the weight stored [out, in]."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(48, 32))

    def forward(self, x):
        return torch.relu(x @ self.w.transpose(0, 1))


class Permuted(nn.Module):
    """A 3-D weight permuted and flattened into a matrix: permute, then view."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 4, 32))

    def forward(self, x):
        return torch.relu(x @ self.w.permute(2, 0, 1).reshape(32, 32))


class Viewed(nn.Module):
    """A flat weight viewed as a matrix, then transposed: view, then t."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(16 * 32))

    def forward(self, x):
        return torch.relu(x @ self.w.view(16, 32).t())


CASES = {"linear stack": Stack, "transpose": Transposed, "permute + view": Permuted, "view + t": Viewed}


def _placements(model: nn.Module) -> dict:
    return {**{name: (Shard(0),) for name, _ in model.named_parameters()}, 0: (Shard(0),)}


def _gathered_non_placeholders(gm: torch.fx.GraphModule) -> list[str]:
    """The all_gathers of a lowered program that read anything but a placeholder."""
    return [n.args[0].format_node() for n in gm.graph.nodes
            if n.target is torch.ops._c10d_functional.all_gather_into_tensor.default and n.args[0].op != "placeholder"]


def _copies(gm: torch.fx.GraphModule) -> int:
    return sum(n.target in COPIES for n in gm.graph.nodes)


@pytest.mark.parametrize("case", CASES)
def test_forward_gathers_parameters_as_stored(case):
    torch.manual_seed(0)
    model = CASES[case]()
    x = torch.randn(256, 32)  # every case reads 32 features; 256 rows: moving the batch costs more than a weight
    placements = _placements(model)
    out = fxshard.simulate(model, x, mesh=MESH, placements=placements, cost_model=BANDWIDTH_BOUND)
    torch.testing.assert_close(out, model(x).detach(), rtol=1e-5, atol=1e-5)
    with fake_world(MESH) as device_mesh:
        gm = lowered_graphs(model, x, device_mesh=device_mesh, placements=placements,
                            cost_model=BANDWIDTH_BOUND)[(0,)]
        whole = lowered_graphs(model, x, device_mesh=device_mesh)[(0,)]  # replicated: the program's own copies
    assert [n for n in gm.graph.nodes if "all_gather" in str(n.target)], "nothing gathered?"
    assert (_gathered_non_placeholders(gm), _copies(gm)) == ([], _copies(whole))


def test_training_gathers_parameters_as_stored_both_ways():
    """The backward re-gathers the weights it needs (t(t(w)) in the joint graph) as stored too."""
    torch.manual_seed(1)
    model = Stack()
    x = torch.randn(256, 32)
    placements = _placements(model)

    def loss(x):
        return model(x).square().mean()

    ref = torch.autograd.grad(loss(x), list(model.parameters()))
    _, grads = fxshard.simulate(loss, x, mesh=MESH, placements=placements, grad=True, cost_model=BANDWIDTH_BOUND)
    for (name, _), g in zip(model.named_parameters(), ref):
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6)
    with fake_world(MESH) as device_mesh:
        fwd, bwd = lowered_graphs(loss, x, device_mesh=device_mesh, placements=placements, grad=True,
                                  cost_model=BANDWIDTH_BOUND)[(0,)]
    assert (_gathered_non_placeholders(fwd), _gathered_non_placeholders(bwd), _copies(fwd), _copies(bwd)) == \
        ([], [], 0, 0)
