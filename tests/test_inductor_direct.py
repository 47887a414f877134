"""backend/inductor/compile_inner.py: fxshard's local programs reach Inductor without AOTAutograd's second trace.

A program is decomposed as AOTAutograd's trace would decompose it (Inductor's table, composite ops),
then compiled by Inductor's inner compiler: the compiled program computes what the graph computes, on
fresh random data; programs it cannot take (a mutating op, an output that is no tuple) go through
``compile_fx`` as before.
"""
from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch._inductor.decomposition import select_decomp_table
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from fxshard.backend.inductor.compile_local import cacheable_inputs, compile_local
from fxshard.backend.inductor.compile_inner import decompose_for_inductor, takes_directly
from fxshard.lowering.localize import fake_values

aten = torch.ops.aten


def _views_and_decompositions(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A lowered program's mix: transposes of weights, views and copies of activations, a silu, an
    rsub, zeros made like a value, a detach, a split (several results), matmuls."""
    h = aten.mm.default(x, aten.t.default(w))                          # t -> permute
    g = aten.silu.default(h)                                            # decomposed into pointwise ops
    v = aten.reshape.default(g, [4, 2, 16])                             # a view
    p = aten.transpose.int(v, 0, 1)                                     # -> permute
    c = aten.reshape.default(p, [8, 16])                              # not viewable: a copy
    u = aten._unsafe_view.default(aten.clone.default(c), [16, 8])       # -> view
    r = aten.rsub.Scalar(u, 1.0)
    z = aten.new_zeros.default(b, [3])
    d = aten.detach.default(b)
    first, second = aten.split.Tensor(r, 8)
    return aten.add.Tensor(first, second), z, d, aten.mm.default(aten.t.default(u), r)


def _inputs() -> list[torch.Tensor]:
    return [torch.randn(8, 16), torch.randn(16, 16), torch.randn(5)]


def _program(fn, inputs: list[torch.Tensor]) -> fx.GraphModule:
    return fx.symbolic_trace(fn)


def test_a_decomposed_program_holds_no_call_inductor_would_decompose():
    gm = _program(_views_and_decompositions, _inputs())
    mode = FakeTensorMode()
    fakes = [mode.from_tensor(x) for x in _inputs()]
    for placeholder, x in zip(gm.graph.find_nodes(op="placeholder"), fakes):
        placeholder.meta["val"] = x
    fake_values(gm, [n for n in gm.graph.nodes if n.op != "placeholder"], mode)
    decompose_for_inductor(gm, mode)
    table = select_decomp_table()
    implicit = torch._C.DispatchKey.CompositeImplicitAutograd
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        assert not node.target.has_kernel_for_dispatch_key(implicit), node.format_node()
        if node.target in table:
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: a.meta["val"])
            with mode:
                assert table[node.target](*args, **kwargs) is NotImplemented, node.format_node()
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert aten.permute.default in targets and aten.view.default in targets and aten.alias.default in targets
    assert not targets & {aten.t.default, aten.transpose.int, aten.reshape.default, aten._unsafe_view.default,
                          aten.silu.default, aten.rsub.Scalar, aten.new_zeros.default, aten.detach.default}
    inputs = _inputs()
    torch.testing.assert_close(gm(*inputs), _views_and_decompositions(*inputs))


def test_a_program_compiled_directly_computes_what_it_computes():
    gm = _program(_views_and_decompositions, _inputs())
    inputs = _inputs()
    assert takes_directly(gm, cacheable_inputs(inputs))
    compiled = compile_local(gm, inputs, None)
    fresh = _inputs()
    torch.testing.assert_close(tuple(compiled(*fresh)), _views_and_decompositions(*fresh))


def test_programs_it_cannot_take_go_through_aotautograd():
    def mutating(x: torch.Tensor) -> tuple[torch.Tensor]:
        y = aten.clone.default(x)
        aten.add_.Tensor(y, 1.0)
        return (y,)

    x = torch.randn(4)
    mutates = fx.symbolic_trace(mutating)
    for node in mutates.graph.nodes:
        if node.op == "call_function":
            node.meta["val"] = None
    assert not takes_directly(mutates, cacheable_inputs([x]))
    single = _program(lambda x: aten.mul.Tensor(x, 2.0), [x])  # one output, no tuple
    assert not takes_directly(single, cacheable_inputs([x]))
    assert not takes_directly(_program(lambda x: (x * 2,), [x]), [x])  # real inputs: no fake mode to read
    torch.testing.assert_close(compile_local(single, [x], None)(x), x * 2)
    torch.testing.assert_close(tuple(compile_local(mutates, [x], None)(x)), (x + 1,))


class _Stopped(Exception):
    """Raised in place of planning: the test needs only what ran before it."""


@pytest.mark.parametrize("entry", ["fxshard.compile", "backend"])
@pytest.mark.parametrize("inductor", [True, False])
def test_inductor_compile_workers_start_before_planning(fake_mesh_4, make_mlp, monkeypatch, entry, inductor):
    """Inductor compiles Triton kernels in its worker pool only once the pool is up; torch.compile's own
    backend starts it when Dynamo first calls it. fxshard's entry points start it before stage 1, so it
    comes up while they plan (on this CPU build Inductor's switch makes the call a no-op: recorded here)."""
    import torch._inductor.async_compile as async_compile
    from torch.distributed.tensor import Shard, distribute_tensor

    import fxshard
    import fxshard.backend.driver as driver

    events: list[str] = []
    monkeypatch.setattr(async_compile, "maybe_warm_pool", lambda: events.append("workers"))

    def plan(*args, **kwargs):
        events.append("plan")
        raise _Stopped

    monkeypatch.setattr(driver, "plan_program", plan)
    torch._dynamo.reset()
    x = distribute_tensor(torch.randn(8, 8), fake_mesh_4, [Shard(0)])
    with pytest.raises((_Stopped, torch._dynamo.exc.BackendCompilerFailed), match="_Stopped|^$"):
        if entry == "fxshard.compile":
            fxshard.compile(make_mlp(8, 16), device_mesh=fake_mesh_4, inductor=inductor)(x)
        else:
            torch.compile(lambda t: t * 2, backend="fxshard", options={"inductor": inductor})(x)
    torch._dynamo.reset()
    assert events[-1] == "plan"
    assert set(events[:-1]) == ({"workers"} if inductor else set()), events
