"""``decompose.fold_one_hot_sums``: a sum over the classes of a one-hot comparison is the value at the target.

Cross-entropy's backward (fxshard's ``nll_loss_backward``: the gradient where the class arange equals
the target) feeds log-softmax's backward, which sums it over the classes. At most one class equals an
integer target, exactly one when it is in range, so the sum is the target's own value, zero for an
ignored or out-of-range target: computed from the targets alone, nothing over the vocabulary (a
vocab-sharded plan neither reduces nor gathers it). Checked on real values against the graph as traced,
targets out of range and ignored included; values that vary over the classes are left as they are.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from fxshard.decompose import decomposition_table, fold_one_hot_sums

aten = torch.ops.aten
CLASSES = 11


def one_hot_sum(keepdim: bool, per_class: bool):
    def f(t: torch.Tensor, g: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        t = t.unsqueeze(1)
        hit = (torch.arange(CLASSES) == t) & (t != -100)
        value = -g * w if per_class else -g.unsqueeze(1)  # per class: a weight per class, not one value a row
        return torch.where(hit, value, torch.zeros(())).sum(1, keepdim=keepdim)
    return f


def targets() -> torch.Tensor:
    return torch.tensor([0, 3, CLASSES - 1, -100, -1, CLASSES, CLASSES + 5, 7])  # in range, ignored, out of range


def ops(gm: torch.fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("keepdim", [True, False])
def test_the_sum_of_a_one_hot_row_is_the_value_at_its_target(keepdim):
    t, g, w = targets(), torch.randn(8), torch.randn(CLASSES)
    gm = make_fx(one_hot_sum(keepdim, per_class=False), tracing_mode="fake")(t, g, w)
    expected = gm(t, g, w)
    assert aten.sum.dim_IntList in ops(gm) and aten.eq.Tensor in ops(gm)
    fold_one_hot_sums(gm)
    assert aten.sum.dim_IntList not in ops(gm) and aten.eq.Tensor not in ops(gm) and aten.arange.default not in ops(gm)
    got = gm(t, g, w)
    assert got.shape == expected.shape and torch.equal(got, expected)
    assert torch.equal(got.flatten()[3:7], torch.zeros(4))  # ignored and out-of-range targets: zero


def test_a_value_that_varies_over_the_classes_is_summed_as_it_is():
    t, g, w = targets(), torch.randn(8, 1), torch.randn(CLASSES)
    gm = make_fx(one_hot_sum(True, per_class=True), tracing_mode="fake")(t, g, w)
    before = ops(gm)
    fold_one_hot_sums(gm)
    assert ops(gm) == before


def test_cross_entropys_backward_sums_no_one_hot():
    """The joint trace of cross-entropy (fxshard's decompositions): log-softmax's backward sums the one-hot
    gradient over the classes; folded, the one sum over the classes left is the forward's own (the
    softmax's denominator), and the gradient of the logits is the same."""
    logits = torch.randn(8, CLASSES, requires_grad=True)
    y = torch.tensor([0, 3, CLASSES - 1, -100, 5, -100, 2, 7])

    def grad(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return torch.autograd.grad(F.cross_entropy(x, t), x)[0]

    gm = make_fx(grad, tracing_mode="fake", decomposition_table=decomposition_table(training=True))(logits, y)
    assert ops(gm).count(aten.sum.dim_IntList) == 2
    fold_one_hot_sums(gm)
    assert ops(gm).count(aten.sum.dim_IntList) == 1
    torch.testing.assert_close(gm(logits, y), grad(logits, y))


def test_the_fold_makes_its_values_in_the_graphs_own_fake_mode():
    """Under torch.compile(backend="fxshard") the fold runs inside Dynamo's tracing context, whose fake mode is
    not the one the graph was traced in (``torch._guards.detect_fake_mode`` returns the context's first):
    the fold's values are made in the graph's own ("Mixing fake modes NYI" before)."""
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode

    t, g, w = targets(), torch.randn(8), torch.randn(CLASSES)
    gm = make_fx(one_hot_sum(False, per_class=False), tracing_mode="fake")(t, g, w)
    expected = gm(t, g, w)
    with tracing(TracingContext(FakeTensorMode())):
        fold_one_hot_sums(gm)
    assert aten.sum.dim_IntList not in ops(gm)
    own = {n.meta["val"].fake_mode for n in gm.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)}
    assert len(own) == 1
    assert torch.equal(gm(t, g, w), expected)
