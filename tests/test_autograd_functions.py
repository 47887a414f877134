"""Custom ``torch.autograd.Function``s in a sharded program: the forward runs as its ATen ops, and
training differentiates through the Function's own backward, not the derivative of its forward.

Each Function's backward below differs from its forward's derivative on purpose, so a trace that
differentiated the forward's ops instead would get other gradients.
"""
from __future__ import annotations

import warnings

import pytest
import torch
from torch.distributed.tensor import Shard

import fxshard
from fxshard.backend.capture.trace import TraceError


class DoubledRelu(torch.autograd.Function):
    """relu(2x), with an in-place op on a temporary in its body; backward: 3 * grad where x > 0."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        y = x.clone()
        y.mul_(2)
        return torch.relu(y)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * 3 * (x > 0)


class StraightThroughClip(torch.autograd.Function):
    """Clamps to [-bound, bound] and returns which elements it clipped (not differentiable);
    backward passes the gradient through unchanged."""

    @staticmethod
    def forward(ctx, x, bound):
        clipped = x.abs() > bound
        ctx.mark_non_differentiable(clipped)
        return x.clamp(-bound, bound), clipped

    @staticmethod
    def backward(ctx, grad, _):
        return grad, None


class DoubledInPlace(torch.autograd.Function):
    """2x written into x (ctx.mark_dirty): a mutation of the Function's input."""

    @staticmethod
    def forward(ctx, x):
        x.mul_(2)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


def doubled_relu(h: torch.Tensor) -> torch.Tensor:
    return DoubledRelu.apply(h)


def straight_through_clip(h: torch.Tensor) -> torch.Tensor:
    y, clipped = StraightThroughClip.apply(h, 0.3)
    return y * (1 + clipped.float())


class MLP(torch.nn.Module):
    def __init__(self, activation):
        super().__init__()
        self.up = torch.nn.Linear(8, 16)
        self.down = torch.nn.Linear(16, 8)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.activation(self.up(x)))


MEGATRON = {"up.weight": (Shard(0),), "up.bias": (Shard(0),), "down.weight": (Shard(1),)}
ACTIVATIONS = [doubled_relu, straight_through_clip]


def run(grad: bool, activation) -> tuple:
    torch.manual_seed(0)
    model, x = MLP(activation), torch.randn(4, 8)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="fxshard")  # the Function's ops all have rules
        with torch.set_grad_enabled(grad):
            got = fxshard.simulate(model, x, mesh=fxshard.MeshSpec(tp=2), placements=MEGATRON, grad=grad)
    return model, x, got


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_inference_runs_the_forward(activation):
    model, x, got = run(False, activation)
    with torch.no_grad():
        torch.testing.assert_close(got, model(x))


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_training_uses_the_functions_backward(activation):
    model, x, (out, grads) = run(True, activation)
    want = model(x)
    want.sum().backward()
    torch.testing.assert_close(out, want.detach())
    assert set(grads) == {n for n, _ in model.named_parameters()}
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, msg=name)


def test_a_function_that_modifies_its_input_is_refused_with_the_fix():
    torch.manual_seed(0)
    model = MLP(lambda h: DoubledInPlace.apply(h))
    with pytest.raises(TraceError, match=r"mark_dirty.*return new tensors instead"):
        fxshard.simulate(model, torch.randn(4, 8), mesh=fxshard.MeshSpec(tp=2), placements=MEGATRON)
