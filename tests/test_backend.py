"""The backend and explain as a user meets them: results, collective counts, and errors that say what to do."""
from __future__ import annotations

import sys
import warnings

import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import fxshard
from fxshard.backend.explain import explain
from fxshard.backend.simulate import simulate
from fxshard.backend.capture.trace import TensorMap, TraceError
from fxshard.layout import LayoutError
from fxshard.placements import placements_from_layout
from fxshard.propagate import UnsupportedOpError


def test_tensor_map_never_confuses_a_new_tensor_with_a_freed_one():
    m = TensorMap()
    for _ in range(100):
        t = torch.empty(3)
        m[t] = "layout"
        del t  # a plain id-keyed dict would now hand t's entry to the next tensor, which reuses t's id
        fresh = torch.empty(3)
        assert fresh not in m and m.get(fresh) is None


def test_megatron_mlp_has_exactly_one_all_reduce(fake_mesh_4, make_mlp):
    model = make_mlp()
    parallelize_module(model, fake_mesh_4, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    e = explain(model, torch.randn(4, 8), mesh=fake_mesh_4)
    assert [(c.kind, str(c.axes[0])) for c in e.collectives] == [("all_reduce", "tp")]
    assert e.output_layouts[0].is_replicated


def test_explain_needs_no_process_group(make_mlp):
    e = explain(make_mlp(), torch.randn(4, 8), mesh=fxshard.MeshSpec(tp=4),
                placements={"up.weight": (Shard(0),), "up.bias": (Shard(0),), "down.weight": (Shard(1),)})
    assert e.collectives == []  # the output may stay a partial sum: nothing has to move
    assert str(e.output_layouts[0]) == "[4] [8] P(sum@tp)"
    assert placements_from_layout(e.output_layouts[0])[0].is_partial()


def test_strict_names_the_op_and_its_layouts():
    def f(x):
        return torch.cumprod(x, 0)  # cumprod has no sharding rule

    with pytest.raises(UnsupportedOpError, match=r"aten\.cumprod.*\[4@tp 2\]"):
        explain(f, torch.randn(8, 3), mesh=fxshard.MeshSpec(tp=4), placements={0: (Shard(0),)}, strict=True)


def test_op_without_rule_is_replicated_with_a_warning_and_stays_correct():
    def f(x):
        return torch.cumprod(x, 0) * 2

    x = torch.randn(8, 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = simulate(f, x, mesh=fxshard.MeshSpec(tp=4), placements={0: (Shard(0),)})
    torch.testing.assert_close(out, f(x))
    assert sum("no sharding rule for aten.cumprod.default" in str(w.message) for w in caught) == 1


@pytest.mark.parametrize("placements, mesh, message", [
    ({0: (Shard(0), Replicate())}, {"tp": 4}, r"argument 0 \(shape \[8, 4\]\).*2 placements .* with 1 axes"),
    ({0: (Shard(2),)}, {"tp": 4}, r"argument 0 \(shape \[8, 4\]\).*Shard\(2\) is out of range"),
    ({"nope": (Shard(0),)}, {"tp": 4}, "not inputs of the function"),
    ({0: Shard(0)}, {"dp": 2, "tp": 2}, r"argument 0 .* bare placement .* e\.g\. \(Shard\(dim=0\), Replicate\(\)\)"),
    ({0: [0]}, {"tp": 4}, r"argument 0 .* expected DTensor placements"),
])
def test_bad_placements_say_what_is_wrong(placements, mesh, message):
    with pytest.raises((LayoutError, KeyError), match=message):
        explain(lambda x: x * 2, torch.randn(8, 4), mesh=fxshard.MeshSpec(mesh), placements=placements)


def test_a_parameter_with_bad_placements_is_named():
    model = torch.nn.Linear(4, 8)
    with pytest.raises(LayoutError, match=r"parameter 'weight' \(shape \[8, 4\]\).*Shard\(2\) is out of range"):
        explain(model, torch.randn(2, 4), mesh=fxshard.MeshSpec(tp=4), placements={"weight": (Shard(2),)})


def test_a_bare_placement_on_a_one_axis_mesh_is_that_placement():
    def f(x):
        return fxshard.constrain(x * 2, Shard(1)).sum()  # a bare placement here too

    for given in (Shard(0), (Shard(0),), "S(0)"):
        e = explain(f, torch.randn(8, 4), mesh=fxshard.MeshSpec(tp=4), placements={0: given})
        assert str(e.input_layouts["arg0"]) == "[4@tp 2] [4]"
    torch.testing.assert_close(simulate(f, x := torch.randn(8, 4), mesh=fxshard.MeshSpec(tp=4),
                                        placements={0: Shard(0)}), f(x))


def test_from_local_of_a_plain_shard_is_refused_with_advice(fake_mesh_4):
    def f(x):
        return DTensor.from_local(x, fake_mesh_4, [Shard(0)]).redistribute(fake_mesh_4, [Replicate()])

    with pytest.raises(TraceError, match="Pass the input as a DTensor"):
        explain(f, torch.randn(2, 4), mesh=fake_mesh_4)


def test_dtensor_inputs_bring_their_placements(fake_mesh_4):
    x = distribute_tensor(torch.randn(8, 4), fake_mesh_4, [Shard(0)])
    e = explain(lambda t: (t * 2).sum(0), x, mesh=fake_mesh_4)
    assert str(e.input_layouts["arg0"]) == "[4@tp 2] [4]"
    assert str(e.output_layouts[0]) == "[4] P(sum@tp)"


def test_unknown_backend_option_is_an_error():
    from fxshard.backend import fxshard_backend

    with pytest.raises(ValueError, match="unknown fxshard options"):
        fxshard_backend(None, [], options={"stirct": True})


def test_traffic_of_the_lowered_program_is_what_explain_planned():
    """backend/reports/traffic.py reads the collectives back from every rank's lowered program."""
    from fxshard.backend.simulate import fake_world, lowered_graphs
    from fxshard.backend.reports.traffic import collective_calls, summarize

    def f(x, w1, w2):
        return torch.relu(x @ w1) @ w2

    x, w1, w2 = torch.randn(8, 16), torch.randn(16, 32), torch.randn(32, 16)
    mesh, pl = fxshard.MeshSpec(tp=4), {1: (Shard(1),), 2: (Shard(0),), 0: (Shard(0),)}
    e = explain(f, x, w1, w2, mesh=mesh, placements=pl)
    with fake_world(mesh) as device_mesh:
        graphs = lowered_graphs(f, x, w1, w2, device_mesh=device_mesh, placements=pl)
        per_rank = [summarize(collective_calls(g)) for g in graphs.values()]
    kinds: dict = {}
    for c in e.collectives:
        kinds[c.kind] = kinds.get(c.kind, 0) + 1
    assert len(graphs) == 4 and kinds
    assert all(counts == kinds and nbytes == e.bytes_per_rank for counts, nbytes in per_rank), (per_rank, kinds)


def test_stage_graphs_reach_debug_dir_and_torch_logs(tmp_path, capfd):
    """backend option debug_dir writes every stage; TORCH_LOGS="+fxshard" (set_logs here) logs them
    and a per-graph summary of communication and memory."""
    import logging

    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from fxshard.backend.simulate import fake_world

    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

        def forward(self, x):
            return self.down(torch.relu(self.up(x)))

    torch._dynamo.reset()
    torch._logging.set_logs(modules={"fxshard": logging.DEBUG})
    try:
        with fake_world(fxshard.MeshSpec(tp=4)) as mesh:
            model = parallelize_module(MLP(), mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
            compiled = torch.compile(model, backend="fxshard", options={"inductor": False, "debug_dir": str(tmp_path)})
            with torch.no_grad():
                compiled(torch.randn(4, 8))
    finally:
        torch._logging.set_logs()
        torch._dynamo.reset()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert [f.split("_", 2)[2] for f in files] == ["trace.txt", "plan.txt", "lower.txt"], files
    assert "redistribute" in (tmp_path / files[1]).read_text() and "all_reduce" in (tmp_path / files[2]).read_text()
    err = capfd.readouterr().err
    assert "communication 1 x all_reduce(tp)" in err and "memory per rank" in err, err[-2000:]
    assert "stage plan" in err and "stage lower" in err


TRACE_SCRIPT = """
import torch, fxshard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from fxshard.backend.simulate import fake_world

model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
with fake_world(fxshard.MeshSpec(tp=2)) as mesh:
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    with torch.no_grad():
        torch.compile(model, backend="fxshard", options={"inductor": False})(torch.randn(4, 8))
"""


def test_torch_logs_and_torch_trace_from_the_environment(tmp_path):
    """TORCH_LOGS="+fxshard" prints the summary and every stage; TORCH_TRACE (what tlparse reads)
    receives fxshard_trace, fxshard_plan and fxshard_lower as artifacts."""
    import os
    import subprocess

    env = {**os.environ, "TORCH_TRACE": str(tmp_path), "TORCH_LOGS": "+fxshard"}
    run = subprocess.run([sys.executable, "-c", TRACE_SCRIPT], env=env, check=True, timeout=180,
                         capture_output=True, text=True)
    assert "communication 1 x all_reduce(tp)" in run.stderr and "stage lower" in run.stderr, run.stderr[-2000:]
    logs = "".join(p.read_text() for p in tmp_path.iterdir())
    for stage in ("trace", "plan", "lower"):
        assert f'"name": "fxshard_{stage}"' in logs, stage


def test_uneven_dims_under_default_local_outputs_get_a_hint(fake_mesh_4):
    """parallelize_module's styles hand plain local shards on by default; DTensor.from_local then assumes
    even shards, so a hidden size of 30 on 4 ranks fails inside DTensor. The error says what avoids it."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from conftest import MLP

    def parallel_mlp(use_local_output: bool) -> torch.nn.Module:
        model = MLP(dim=8, hidden=30)
        parallelize_module(model, fake_mesh_4, {"up": ColwiseParallel(use_local_output=use_local_output),
                                                "down": RowwiseParallel(use_local_output=use_local_output)})
        return model

    with pytest.raises(RuntimeError, match="use_local_output=False"):
        explain(parallel_mlp(True), torch.randn(2, 8), mesh=fake_mesh_4)
    e = explain(parallel_mlp(False), torch.randn(2, 8), mesh=fake_mesh_4)  # global shapes: uneven shards are fine
    assert str(e.input_layouts["up_weight"]) == "[~30@tp] [8]"


@pytest.mark.parametrize("style, local_shape", [
    (lambda: ColwiseParallel(), (4, 4)),  # to_local() of the column shard: each rank's block
    (lambda: ColwiseParallel(output_layouts=Replicate()), (4, 16)),  # to_local() of a replicated DTensor: whole
    (lambda: ColwiseParallel(use_local_output=False), None),  # a DTensor stays one
], ids=["local-shard", "replicated", "dtensor"])
@pytest.mark.parametrize("grad", [True, False], ids=["training", "inference"])
def test_outputs_have_the_type_and_block_eager_gives(fake_mesh_4, style, local_shape, grad):
    """What the user's program returns as a plain tensor (parallel styles' default use_local_output=True:
    logits a generate() loop reads) comes back plain, with the block eager holds on this rank; a DTensor
    output stays a DTensor. The local shard needs no collective, so even on a fake process group its
    values are eager's."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 16)
    parallelize_module(layer, fake_mesh_4, style())
    x = torch.randn(4, 8)
    with torch.set_grad_enabled(grad):
        eager = layer(x)
        out = torch.compile(layer, backend="fxshard", options={"inductor": False})(x)
    assert type(out) is type(eager)
    if local_shape is None:
        assert out.placements == eager.placements and out.shape == eager.shape
        return
    assert tuple(out.shape) == tuple(eager.shape) == local_shape
    if local_shape == (4, 4):
        torch.testing.assert_close(out, eager, rtol=0, atol=0)


@pytest.mark.parametrize("style, exact", [
    (lambda: ColwiseParallel(use_local_output=False), True),  # Shard(1): each rank's block, no collective
    (lambda: ColwiseParallel(output_layouts=Replicate(), use_local_output=False), False),  # all_gather
    (lambda: RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0), use_local_output=False), False),
], ids=["shard", "replicate", "reduce-scatter"])
def test_output_dtensors_of_later_calls_reuse_the_first_calls_spec(fake_mesh_4, style, exact):
    """A DTensor output is built by DTensor.from_local on the first call and on that call's DTensorSpec
    afterwards (backend/capture/outputs.py: nothing that depends only on the program is worked out per call):
    eager's spec, around the later call's block (exact where no collective runs on the fake group)."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 16)
    parallelize_module(layer, fake_mesh_4, style())
    compiled = torch.compile(layer, backend="fxshard", options={"inductor": False})
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    with torch.no_grad():
        first, second, eager = compiled(x), compiled(y), layer(y)
    assert second._spec is first._spec and second._spec == eager._spec
    # read: DTensor's eager reduce_scatter is async (an op on its block waits it; unwaited, c10d warns at exit)
    eager_block = eager.to_local().clone()
    if exact:
        torch.testing.assert_close(second.to_local(), eager_block, rtol=0, atol=0)


def test_parameter_gradients_are_dtensors_with_the_parameters_placements(fake_mesh_4):
    """Training: each parameter's gradient is a DTensor with its placements, global shape and strides,
    its block eager's (column-parallel: no collective runs), step after step."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 16)
    parallelize_module(layer, fake_mesh_4, ColwiseParallel(use_local_output=False))
    compiled = torch.compile(layer, backend="fxshard", options={"inductor": False})
    x = torch.randn(4, 8)
    steps = []
    for _ in range(2):
        compiled(x).to_local().sum().backward()
        steps.append({n: (p.grad._spec, p.grad.to_local().clone()) for n, p in layer.named_parameters()})
        layer.zero_grad(set_to_none=True)
    layer(x).to_local().sum().backward()
    for name, p in layer.named_parameters():
        for spec, block in (step[name] for step in steps):
            assert spec == p._spec  # mesh, placements, global shape and strides
            torch.testing.assert_close(block, p.grad.to_local(), rtol=1e-6, atol=1e-6)


def test_a_partial_inputs_gradient_is_replicated_and_takes_its_blocks_strides(fake_mesh_4):
    """As to_local()'s backward: a Partial input's gradient is Replicate; a gradient block with other
    strides than the input's block is copied into them (the spec's global strides say so). The spec is
    made once per input spec: later gradients share it (it is never the input's own object)."""
    from torch.distributed.tensor import Partial

    from fxshard.backend.capture.inputs import DTensorGradients

    x = DTensor.from_local(torch.randn(4, 6), fake_mesh_4, [Partial()], run_check=False)
    gradients = DTensorGradients()
    like = (x._spec, x._local_tensor.stride())
    g = gradients(torch.randn(6, 4).t(), like)
    assert g.placements == (Replicate(),) and g.shape == x.shape and g.to_local().stride() == (6, 1)
    assert gradients(torch.randn(4, 6), like)._spec is g._spec and g._spec is not x._spec
    assert gradients(None, like) is None
