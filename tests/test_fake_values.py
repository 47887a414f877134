"""lowering.localize.fake_values: the fake value of every node of a local program, as FakeTensorProp gives it."""
from __future__ import annotations

import operator
from unittest import mock

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from fxshard.lowering import localize
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


def _repeated_program() -> fx.GraphModule:
    """Two alike "layers" of views, ``_unsafe_view``, a matmul, a permuted copy and a two-output op."""
    graph = fx.Graph()
    h = graph.placeholder("x")
    w = graph.placeholder("w")
    for _ in range(2):
        v = graph.call_function(aten.view.default, (h, [2, 3, 8]))
        u = graph.call_function(aten._unsafe_view.default, (v, [6, 8]))
        m = graph.call_function(aten.mm.default, (u, w))
        p = graph.call_function(aten.permute.default, (m, [1, 0]))
        c = graph.call_function(aten.clone.default, (p,), {"memory_format": torch.contiguous_format})
        halves = graph.call_function(aten.split_with_sizes.default, (c, [4, 4]))
        s = graph.call_function(aten.var_mean.correction, (c, [0]), {"correction": 0, "keepdim": True})
        mean = graph.call_function(operator.getitem, (s, 1))
        first = graph.call_function(operator.getitem, (halves, 0))
        h = graph.call_function(aten.t.default, (graph.call_function(aten.sub.Tensor, (first, mean)),))
        h = graph.call_function(aten.repeat.default, (h, [1, 2]))
    graph.output((h,))
    return fx.GraphModule(torch.nn.Module(), graph)


def _values(gm: fx.GraphModule, dispatch_every_call: bool) -> list[tuple]:
    """Each node's value as (shape, strides, offset, dtype, which earlier node's storage it shares)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    x, w = gm.graph.find_nodes(op="placeholder")
    with mode:
        x.meta["val"], w.meta["val"] = torch.empty(6, 8), torch.empty(8, 8)
    if dispatch_every_call:
        with mock.patch.object(localize._Repeats, "get", lambda *args: None):
            fake_values(gm, [n for n in gm.graph.nodes if n.op != "placeholder"], mode)
    else:
        fake_values(gm, [n for n in gm.graph.nodes if n.op != "placeholder"], mode)
    owners: dict[int, str] = {}
    rows = []
    for node in gm.graph.nodes:
        for v in node.meta["val"] if isinstance(node.meta["val"], (tuple, list)) else (node.meta["val"],):
            if isinstance(v, torch.Tensor):
                owner = owners.setdefault(v.untyped_storage()._cdata, node.name)
                rows.append((node.name, tuple(v.shape), v.stride(), v.storage_offset(), v.dtype, owner))
    return rows


def test_a_repeated_call_gets_the_value_a_dispatch_would():
    """The second layer's calls repeat the first's (same op, same argument metadata): their values are
    made from the first's metadata without dispatching, and equal the dispatched ones, storage sharing
    included (a view, ``_unsafe_view`` and a split share their input's storage; a clone does not)."""
    localize.RESULT_SPECS.clear()  # the process's cache: another test's calls may have filled it
    gm = _repeated_program()
    made = []
    get = localize._Repeats.get

    def recording(self, *args):
        made.append(get(self, *args))
        return made[-1]

    with mock.patch.object(localize._Repeats, "get", recording):
        repeated = _values(gm, dispatch_every_call=False)
    calls = sum(1 for n in gm.graph.nodes if isinstance(n.target, torch._ops.OpOverload))
    assert sum(v is not None for v in made) == calls // 2  # the second layer's op calls: none dispatched
    assert repeated == _values(_repeated_program(), dispatch_every_call=True)


def test_another_programs_repeated_calls_get_the_values_a_dispatch_would():
    """``localize.RESULT_SPECS`` serves every program and fake mode of the process: a second program (its
    own fake mode) whose calls repeat the first's dispatches none of them, and its values are the
    dispatched ones, storage sharing included; the cache empties itself at its limit."""
    localize.RESULT_SPECS.clear()
    _values(_repeated_program(), dispatch_every_call=False)
    made = []
    get = localize._Repeats.get

    def recording(self, *args):
        made.append(get(self, *args))
        return made[-1]

    gm = _repeated_program()
    with mock.patch.object(localize._Repeats, "get", recording):
        again = _values(gm, dispatch_every_call=False)
    calls = sum(1 for n in gm.graph.nodes if isinstance(n.target, torch._ops.OpOverload))
    assert sum(v is not None for v in made) == calls  # every op call (not the getitems): none dispatched
    assert again == _values(_repeated_program(), dispatch_every_call=True)
    specs = localize.ResultSpecs(limit=2)
    for k in range(3):
        specs.put(k, k)
    assert (specs.get(0), specs.get(1), specs.get(2)) == (None, None, 2)
