"""lowering.localize.fake_values: the fake value of every node of a local program, as FakeTensorProp gives it."""
from __future__ import annotations

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from fxshard.lowering.localize import fake_values

aten = torch.ops.aten


def _program() -> fx.GraphModule:
    """x -> (x @ sub.w + 1).t(), with the constant in a submodule and an in-place add on the way."""
    root = torch.nn.Module()
    root.sub = torch.nn.Module()
    root.sub.register_buffer("w", torch.randn(8, 4))
    graph = fx.Graph()
    x = graph.placeholder("x")
    w = graph.get_attr("sub.w")
    y = graph.call_function(aten.mm.default, (x, w))
    z = graph.call_function(aten.add_.Tensor, (y, 1.0))
    graph.output((graph.call_function(aten.t.default, (z,)), y))
    return fx.GraphModule(root, graph)


def _program_with_fake_values() -> fx.GraphModule:
    """``_program`` with ``fake_values`` on a (3, 8) input."""
    gm = _program()
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    x = gm.graph.find_nodes(op="placeholder")[0]
    with mode:
        x.meta["val"] = torch.empty(3, 8)
    fake_values(gm, [n for n in gm.graph.nodes if n.op != "placeholder"], mode)
    return gm


def test_fake_values_are_fake_tensor_props():
    """Shapes, strides and dtypes of every node as FakeTensorProp's, a submodule's constant included."""
    gm = _program_with_fake_values()
    ours = {n.name: n.meta["val"] for n in gm.graph.nodes if n.op == "call_function" or n.op == "get_attr"}

    expected = _program()
    FakeTensorProp(expected, FakeTensorMode(allow_non_fake_inputs=True)).propagate(torch.empty(3, 8))
    theirs = {n.name: n.meta["val"] for n in expected.graph.nodes if n.op == "call_function" or n.op == "get_attr"}
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert isinstance(ours[name], FakeTensor), name
        assert (ours[name].shape, ours[name].stride(), ours[name].dtype) == \
            (theirs[name].shape, theirs[name].stride(), theirs[name].dtype), name


def test_a_mutating_ops_value_is_a_copy():
    """The value of an in-place op is not its input's tensor object: a later in-place op cannot change a
    value recorded before it (the values are what each node computed, as FakeTensorProp snapshots them)."""
    gm = _program_with_fake_values()
    mm, add = (n for n in gm.graph.nodes if n.target in (aten.mm.default, aten.add_.Tensor))
    assert add.meta["val"] is not mm.meta["val"]
