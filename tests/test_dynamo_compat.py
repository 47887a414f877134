"""torch 2.11's Dynamo graphs (backend/capture/dynamo_compat.py): DTensor API calls as closures that hold their
mesh and placements. fxshard must read them as the calls torch 2.13 records.

CI runs torch 2.13, whose Dynamo records the calls themselves; these tests rewrite its graphs into
2.11's form (closures built the way torch 2.11's ``torch/_dynamo/variables/{torch,tensor}.py`` build
them) and check that the plan, its collectives and the numbers are the ones of the 2.13 form. On
torch 2.11 the graphs come in that form already and the rewrite finds nothing to do.
"""
from __future__ import annotations

import copy
from typing import Any, Callable

import torch
import torch.fx as fx
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import fxshard
from fxshard.backend.capture import capture as capture_module
from fxshard.backend import fxshard_backend
from fxshard.backend.capture.dynamo_compat import dtensor_prim, prim_arguments
from fxshard.backend.capture.inputs import is_from_local
from fxshard.backend.simulate import fake_world
from fxshard.backend.reports.traffic import collective_calls

RECORDS_CALLS = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 12)  # Dynamo's 2.13 form


def prim(name: str, call: Callable, args_as_value: list, kwargs_as_value: dict) -> Callable:
    """A closure as torch 2.11's Dynamo makes one: the tensor (and shape/stride) as arguments, the rest held."""
    def fn_with_prim_types(x: Any, **proxied: Any) -> Any:
        return call(x, *args_as_value, **kwargs_as_value, **proxied)

    fn_with_prim_types.__name__ = name
    return fn_with_prim_types


def as_torch_2_11(gm: fx.GraphModule, example_inputs: list) -> int:
    """Rewrite ``gm``'s from_local / redistribute / to_local calls into torch 2.11's closures (the mesh, a
    graph input in 2.13's form, becomes a held value); returns how many calls it rewrote."""
    values = dict(zip([n for n in gm.graph.nodes if n.op == "placeholder"], example_inputs))
    held = lambda a: values.get(a, a) if isinstance(a, fx.Node) else a  # noqa: E731
    count = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and is_from_local(node.target) and dtensor_prim(node.target) is None:
            name, call = "prim from_local", DTensor.from_local
        elif node.op == "call_method" and node.target in ("redistribute", "to_local"):
            name, call = f"prim_{node.target}", getattr(DTensor, node.target)
        else:
            continue
        target = prim(name, call, [held(a) for a in node.args[1:]], {k: held(v) for k, v in node.kwargs.items()})
        node.op, node.target, node.args, node.kwargs = "call_function", target, (node.args[0],), {}
        count += 1
    gm.recompile()
    return count


def test_a_closure_reads_as_the_call_it_stands_for():
    mesh, placements = object(), [Shard(0)]
    x = torch.randn(2)
    from_local = prim("prim from_local", DTensor.from_local, [mesh, placements], {"run_check": False})
    assert dtensor_prim(from_local) == "from_local" and is_from_local(from_local)
    assert prim_arguments(from_local, (x,), {"shape": None}) == ((x, mesh, placements), {"run_check": False,
                                                                                      "shape": None})
    redistribute = prim("prim_redistribute", DTensor.redistribute, [], {"placements": [Replicate()]})
    assert dtensor_prim(redistribute) == "redistribute" and not is_from_local(redistribute)
    assert prim_arguments(redistribute, (x,), {}) == ((x,), {"placements": [Replicate()]})
    assert dtensor_prim(DTensor.from_local) is None and dtensor_prim(torch.add) is None
    assert dtensor_prim(lambda x: x) is None  # a closure-less function of no such name


def megatron_mlp(make_mlp: Callable, mesh: Any) -> torch.nn.Module:
    """Colwise from_local()s its input, Rowwise redistribute()s its output and hands it on to_local()."""
    model = make_mlp(8, 16)
    parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return model


def test_the_backend_plans_a_torch_2_11_graph_as_a_torch_2_13_one(fake_mesh_4, make_mlp):
    """torch.compile(backend="fxshard") on a graph in 2.11's form: the same one all_reduce, eager's output type."""
    torch.manual_seed(0)
    model = megatron_mlp(make_mlp, fake_mesh_4)
    x = torch.randn(4, 8)
    lowered: dict[str, list] = {}
    rewritten: list[int] = []
    on_graph = lambda stage, gm: lowered.setdefault(stage, collective_calls(gm)) if stage == "lower" else None  # noqa: E731

    def backend(gm: fx.GraphModule, example_inputs: list) -> Callable:
        rewritten.append(as_torch_2_11(gm, example_inputs))
        return fxshard_backend(gm, example_inputs, options={"inductor": False, "on_graph": on_graph})

    out = torch.compile(model, backend=backend)(x)
    # each style: from_local of its input, redistribute of its output (Shard(-1), Replicate()), to_local
    assert rewritten[0] == 6 or not RECORDS_CALLS
    assert [c.kind for c in lowered["lower"]] == ["all_reduce"]
    assert type(out) is torch.Tensor and out.shape == (4, 8)


def test_simulate_and_explain_read_a_torch_2_11_graph(make_mlp, monkeypatch):
    """Every rank's program from a graph in 2.11's form computes the single-device result."""
    rewritten: list[int] = []

    class Captured211(capture_module.Captured):
        def __post_init__(self) -> None:
            rewritten.append(as_torch_2_11(self.gm, self.example_inputs))

    monkeypatch.setattr(capture_module, "Captured", Captured211)
    torch.manual_seed(1)
    reference = make_mlp(8, 16)
    x = torch.randn(4, 8)
    want = reference(x).detach()
    with fake_world(fxshard.MeshSpec(tp=4)) as mesh:
        with LocalTensorMode(4):
            model = megatron_mlp(lambda *a: copy.deepcopy(reference), mesh)
        out = fxshard.simulate(model, x)
        e = fxshard.explain(model, x)
    assert all(n == 3 for n in rewritten) or not RECORDS_CALLS
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    assert [c.kind for c in e.collectives] == ["all_reduce"]
