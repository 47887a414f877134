"""``fxshard.constrain`` wherever a user writes it: each context traces as one graph and pins the layout.

Under ``torch.compile`` the inputs are DTensors, so ``constrain`` meets a DTensor (it is DTensor's
``redistribute`` there, which the trace reads as the pin); under ``simulate`` it meets global
tensors (the marker op). Both are checked in every context, plus checkpointed training.
"""
from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint as checkpoint
from torch._dynamo.utils import counters
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

import fxshard
from fxshard.backend.simulate import lowered_graphs

PIN = [Shard(1)]


class Pinned(torch.nn.Module):
    """The pin in a module method."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fxshard.constrain(x * 2, [Shard(1)]) + 1


class Hooked(torch.nn.Module):
    """The pin in a forward hook (how tests/zoo.py pins the residual stream)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_forward_hook(lambda module, args, out: fxshard.constrain(out, PIN))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


def free_function(x: torch.Tensor) -> torch.Tensor:
    return fxshard.constrain(x * 2, [Shard(1)]) + 1


def closure(placements):
    def inner(x: torch.Tensor) -> torch.Tensor:
        return fxshard.constrain(x * 2, placements) + 1
    return inner


def under_no_grad(x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return fxshard.constrain(x * 2, [Shard(1)]) + 1


def checkpointed(x: torch.Tensor) -> torch.Tensor:
    return checkpoint.checkpoint(lambda t: fxshard.constrain(t * 2, PIN) + 1, x, use_reentrant=False)


CONTEXTS = {
    "module method": Pinned(),
    "forward hook": Hooked(),
    "free function": free_function,
    "lambda": lambda x: fxshard.constrain(x * 2, [Shard(1)]) + 1,
    "closure": closure(PIN),
    "closure, bare placement": closure(Shard(1)),
    "lambda in a closure": lambda x: (lambda t: fxshard.constrain(t, PIN))(x * 2) + 1,
    "under no_grad": under_no_grad,
    "checkpointed region": checkpointed,
}


@pytest.mark.parametrize("context", CONTEXTS)
def test_torch_compile_pins_without_a_graph_break(context, fake_mesh_4):
    counters.clear()
    fn = torch.compile(CONTEXTS[context], backend="fxshard", options={"inductor": False})
    out = fn(distribute_tensor(torch.randn(8, 8), fake_mesh_4, [Shard(0)]))
    torch._dynamo.reset()
    assert (dict(counters["graph_break"]), out.placements) == ({}, (Shard(1),))  # x * 2 + 1 alone is Shard(0)


@pytest.mark.parametrize("context", CONTEXTS)
def test_simulate_matches_one_device(context):
    fn, x = CONTEXTS[context], torch.randn(8, 8)
    out = fxshard.simulate(fn, x, mesh=fxshard.MeshSpec(tp=4), placements={0: Shard(0)})
    with torch.no_grad():
        torch.testing.assert_close(out, fn(x))


STRIDED = [_StridedShard(1, split_factor=2)]  # read under Dynamo, its split_factor once failed ("cls_source
# must not be None for MRO walk" from a closure, "property.__get__" written in place)


@pytest.mark.parametrize("fn", [closure(STRIDED),
                                lambda x: fxshard.constrain(x * 2, [_StridedShard(1, split_factor=2)]) + 1],
                         ids=["closure", "in place"])
def test_a_strided_pin_traces(fn, fake_mesh_4):
    x = torch.randn(8, 8)
    compiled = torch.compile(fn, backend="fxshard", options={"inductor": False})
    out = compiled(distribute_tensor(x, fake_mesh_4, [Shard(0)]))
    torch._dynamo.reset()
    simulated = fxshard.simulate(fn, x, mesh=fxshard.MeshSpec(tp=4), placements={0: Shard(0)})
    assert (out.placements, torch.equal(simulated, fn(x))) == (tuple(STRIDED), True)


def test_eager_constrain_of_a_dtensor_is_its_redistribute(fake_mesh_4):
    x = distribute_tensor(torch.randn(8, 8), fake_mesh_4, [Shard(0)])
    assert fxshard.constrain(x, [Replicate()]).placements == (Replicate(),)


def mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return torch.tanh(torch.tanh(x @ w1) @ w2).sum(1)


def checkpointed_mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return checkpoint.checkpoint(mlp, x, w1, w2, use_reentrant=False)


@pytest.mark.parametrize("fn", [mlp, checkpointed_mlp])
def test_checkpointed_training_matches_one_device(fn):
    args = [torch.randn(8, 6, requires_grad=True), torch.randn(6, 12, requires_grad=True),
            torch.randn(12, 4, requires_grad=True)]
    out, grads = fxshard.simulate(fn, *args, mesh=fxshard.MeshSpec(tp=4), placements={0: Shard(0)}, grad=True)
    fn(*args).sum().backward()
    torch.testing.assert_close((out, [grads[k] for k in sorted(grads)]), (fn(*args), [a.grad for a in args]))


def test_a_checkpointed_region_is_recomputed_not_saved(fake_mesh_4):
    """The forward program keeps only the region's inputs for the backward, as checkpoint does."""
    args = (torch.randn(8, 6, requires_grad=True), torch.randn(6, 12, requires_grad=True),
            torch.randn(12, 4, requires_grad=True))
    saved = {}
    for fn in (mlp, checkpointed_mlp):
        graphs = lowered_graphs(fn, *args, device_mesh=fake_mesh_4, placements={0: Shard(0)}, grad=True)
        forward = graphs[(0,)][0]
        saved[fn.__name__] = {n.name for n in forward.graph.find_nodes(op="output")[0].args[0][1:]}
    assert saved == {"mlp": {"arg0", "arg1", "arg2", "tanh", "tanh_1"}, "checkpointed_mlp": {"arg0", "arg1", "arg2"}}
