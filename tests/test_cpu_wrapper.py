"""fxshard's CPU programs compile with Inductor's C++ wrapper (backend/inductor/cpu_wrapper.py): two C++ compiles per
program (its calling code, its kernels), the same calls in the same order as the Python wrapper's, and the
Python wrapper where the C++ one fails or is switched off. FSDP in miniature (``rank_programs.Blocks``, every
weight Shard(0) on a fake group of 4): its forward and backward hold every kind of call the mends are for
(bucketed gathers written into their buffer, reduce_scatter buckets packed, functional collectives named by
their group); each mend is made where the installed torch needs it, and where it does not, torch's own wrapper
computes the step. Numerics on real ranks: tests/test_e2e_gloo.py, whose compiled programs run in the C++ wrapper."""
from __future__ import annotations

import logging
import pathlib
import sys
from dataclasses import replace

import pytest
import torch
from torch.distributed.tensor import Shard, distribute_tensor

import fxshard
from fxshard.backend import options
from fxshard.backend.inductor import cpu_wrapper

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from inductor_code import calls, collective_kinds, is_cpp, kernels  # noqa: E402
from rank_programs import Blocks, shard_parameters  # noqa: E402

COST = fxshard.CostModel(default_latency=0.0)


# the mends each torch checked needs (docs/torch-versions.md): 2.15's wrapper fixed two of 2.13's bugs
_NEEDED = {"2.13": set(cpu_wrapper.MENDS), "2.15": {cpu_wrapper.THROUGH_PYTHON}}


def _step(mesh, monkeypatch, wrapper: str, dim: int = 32) -> tuple[torch.Tensor, dict, list[str]]:
    """One training step of ``Blocks`` under ``FXSHARD_CPU_WRAPPER=wrapper``: (loss, gradients' local shards,
    the code Inductor generated)."""
    from torch._inductor.utils import run_and_get_code

    monkeypatch.setenv("FXSHARD_CPU_WRAPPER", wrapper)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Blocks(dim, 2 * dim)
    shard_parameters(model, mesh)
    compiled = torch.compile(model, backend="fxshard", options={"cost_model": COST, "regional": False})
    x = distribute_tensor(torch.randn(256, dim), mesh, [Shard(0)])

    def step() -> torch.Tensor:
        loss = compiled(x)
        loss.backward()
        return loss.to_local().detach()
    with torch._inductor.config.patch(force_disable_caches=True):  # compiled here, not read from a cache
        loss, codes = run_and_get_code(step)
    return loss, {n: p.grad.to_local() for n, p in model.named_parameters()}, codes


@pytest.fixture(scope="module")
def steps(fake_mesh_4) -> dict[str, tuple[torch.Tensor, dict, list[str]]]:
    """``Blocks``' step with each wrapper, every program taken by the C++ wrapper here, however few its kernels
    (``min_kernels``), and with its graphs run as they are (``uncompiled``)."""
    from fxshard.backend.programs import training

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(options, "DEFAULTS", replace(options.DEFAULTS, min_kernels=1))
        runs = {wrapper: _step(fake_mesh_4, patch, wrapper) for wrapper in ("1", "0")}
        patch.setattr(training, "compile_local", lambda gm, inputs, policy, **_: gm)
        return {**runs, "uncompiled": _step(fake_mesh_4, patch, "1")}


@pytest.fixture(scope="module")
def codes(steps) -> dict[str, list[str]]:
    return {wrapper: steps[wrapper][2] for wrapper in ("1", "0")}


def test_a_cpu_program_compiles_with_the_cpp_wrapper(codes):
    assert [is_cpp(code) for code in codes["1"]] == [True, True]
    assert [is_cpp(code) for code in codes["0"]] == [False, False]


def test_the_cpp_wrapper_makes_the_python_wrappers_calls_in_its_order(codes):
    """Collectives, waits, library and generated kernels: one sequence in both (forward, backward)."""
    assert [calls(code) for code in codes["1"]] == [calls(code) for code in codes["0"]]
    assert [collective_kinds(code) for code in codes["1"]] == [
        ["all_gather", "all_gather", "all_reduce"], ["all_gather", "all_gather", "reduce_scatter", "reduce_scatter"]]
    assert [kernels(code) for code in codes["1"]] == [kernels(code) for code in codes["0"]]


def test_each_mend_is_made_where_this_torch_needs_it():
    """The mended wrapper overrides what ``needed_mends`` finds this torch needs, and inherits torch's own
    methods elsewhere; in each torch checked the probes find what its source says."""
    needed = cpu_wrapper.needed_mends()
    assert (set(vars(cpu_wrapper._mended_class())) & set(cpu_wrapper.MENDS), needed) == (
        needed, _NEEDED.get(".".join(torch.__version__.split(".")[:2]), needed))


def test_the_mended_calls_are_made_through_python(codes):
    """The reduce_scatter bucket's pack (a ``Tensor[]``: through Python, not the dispatcher, whose headers cost
    seconds of compile) and the bucketed gather written into its buffer (``all_gather_into_tensor_out``) are
    calls back into Python. The one tensor the gather returns is never read as a list: mended, its buffer takes
    the handle back; where torch fixed it (2.15), torch's wrapper reads no handle for a buffer it only writes."""
    forward, backward = codes["1"]
    assert 'PyUnicode_FromString("torch.ops._c10d_functional.all_gather_into_tensor_out.default")' in forward
    assert 'PyUnicode_FromString("torch.ops.bucketing._pre_bucket_reduce_scatter.default")' in backward
    assert "c10::Dispatcher" not in backward
    gather = forward.split('all_gather_into_tensor_out.default")')[1].split("// Topologically Sorted")[0]
    mended = cpu_wrapper.RETURNED_HANDLE in cpu_wrapper.needed_mends()
    assert ("PyList_GET_ITEM" in gather, "PyCapsule_GetPointer(py_" in gather) == (False, mended), gather


def test_a_cpp_wrapped_step_computes_what_its_graphs_do(steps):
    """Mended or, where torch fixed what the mends are for, as torch's wrapper has it: the step's loss and
    gradients are those of its graphs run uncompiled."""
    torch.testing.assert_close(steps["1"][:2], steps["uncompiled"][:2])


def test_a_program_the_cpp_wrapper_cannot_compile_gets_the_python_wrapper(fake_mesh_4, monkeypatch, caplog):
    def fails(*args, **kwargs):
        raise NotImplementedError("an argument this wrapper cannot pass")

    monkeypatch.setattr(cpu_wrapper._mended_class(), "generate_py_arg", fails)
    monkeypatch.setattr(options, "DEFAULTS", replace(options.DEFAULTS, min_kernels=1))
    with caplog.at_level(logging.WARNING, logger="fxshard"):
        step = _step(fake_mesh_4, monkeypatch, "1", dim=16)[2]
    assert [is_cpp(code) for code in step] == [False, False]
    warnings = [r.getMessage() for r in caplog.records if "C++ wrapper could not compile" in r.getMessage()]
    assert len(warnings) == 2 and "an argument this wrapper cannot pass" in warnings[0], warnings


def _runs(x: torch.Tensor, w: torch.Tensor, runs: int) -> torch.Tensor:
    """``runs`` pointwise runs, each ended by a matmul."""
    for _ in range(runs):
        x = (torch.sigmoid(x) * 2).t() @ w
    return x


@pytest.mark.parametrize("runs", [options.DEFAULTS.min_kernels - 1, options.DEFAULTS.min_kernels])
def test_a_program_of_as_many_kernels_as_the_cpp_wrapper_pays_off_at_takes_it(monkeypatch, runs):
    """``expected_kernels`` counts the runs of generated ops between library calls: Inductor's kernel launches here,
    and the C++ wrapper is taken from ``min_kernels`` on; the result is the Python wrapper's."""
    from torch._inductor.utils import run_and_get_code
    from torch.fx.experimental.proxy_tensor import make_fx

    from fxshard.backend.inductor.compile_local import compile_local

    monkeypatch.delenv("FXSHARD_CPU_WRAPPER", raising=False)
    args = [torch.randn(16, 16), torch.randn(16, 16) / 4]
    gm = make_fx(lambda x, w: _runs(x, w, runs))(*args)
    assert cpu_wrapper.expected_kernels(gm) == runs
    torch._dynamo.reset()
    with torch._inductor.config.patch(force_disable_caches=True):
        run, (code,) = run_and_get_code(lambda: compile_local(gm, args, None))
    launches = [call for call in calls(code) if call.startswith("cpp_fused")]  # runs alike share a kernel
    assert len(launches) == runs and is_cpp(code) == (runs >= options.DEFAULTS.min_kernels), launches
    out = run(*args)
    torch.testing.assert_close(out[0] if isinstance(out, (tuple, list)) else out, _runs(*args, runs))


def test_where_the_cpp_wrapper_applies(monkeypatch):
    cpu, meta = torch.empty(2, 2), torch.empty(2, 2, device="meta")
    gm = torch.fx.symbolic_trace(lambda x: x)
    monkeypatch.delenv("FXSHARD_CPU_WRAPPER", raising=False)
    monkeypatch.setattr(options, "DEFAULTS", replace(options.DEFAULTS, min_kernels=0))
    assert cpu_wrapper.use_cpu_wrapper(gm, [cpu, 3]) and not cpu_wrapper.use_cpu_wrapper(gm, [cpu, meta])
    assert not cpu_wrapper.use_cpu_wrapper(gm, [])
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    with FakeTensorMode(shape_env=ShapeEnv()) as mode:
        symbolic = mode.from_tensor(cpu, static_shapes=False)
    assert not cpu_wrapper.use_cpu_wrapper(gm, [symbolic])  # sizes as symbols: the Python wrapper
    monkeypatch.setenv("FXSHARD_CPU_WRAPPER", "0")
    assert not cpu_wrapper.use_cpu_wrapper(gm, [cpu])


def test_the_mended_wrapper_keys_inductors_cache_apart_and_is_put_back():
    """Inside ``cpu_wrapper_mended`` the CPU's code generator is the mended one and a pass that changes
    nothing carries this module's hash into Inductor's FX graph cache key; outside, both are torch's."""
    from torch._inductor.codegen import common
    from torch._inductor.custom_graph_pass import get_hash_for_files

    common.init_backend_registration()
    before = (common.device_codegens["cpu"], common.custom_backend_passes.get("cpu"))
    with cpu_wrapper.cpu_wrapper_mended():
        assert common.device_codegens["cpu"].cpp_wrapper_codegen is cpu_wrapper._mended_class()
        marker = common.custom_backend_passes["cpu"]
        assert marker.uuid()[0] == get_hash_for_files((cpu_wrapper.__file__,)).hex()
        graph = torch.fx.symbolic_trace(lambda x: x + 1)
        code = graph.code
        marker(graph)
        assert graph.code == code
    assert (common.device_codegens["cpu"], common.custom_backend_passes.get("cpu")) == before


def _regional_fsdp_step(mesh, monkeypatch) -> tuple[torch.Tensor, dict, list[str]]:
    """One FSDP training step of a 3-layer Llama cut into regions: (loss, gradients' local shards, the code
    Inductor generated for each region)."""
    from torch._inductor.utils import run_and_get_code

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
    from models.llama import Llama, LlamaConfig, fsdp_placements
    from train_llama import distribute_parameters

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=64, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=64))
    distribute_parameters(model, mesh, fsdp_placements(model))
    step = fxshard.compile(model.loss, cost_model=COST, regional=True)
    tokens = distribute_tensor(torch.randint(0, 64, (4, 16)), mesh, [Shard(0)])

    def run() -> torch.Tensor:
        loss = step(tokens, tokens)
        loss.backward()
        return loss.to_local().detach()
    with torch._inductor.config.patch(force_disable_caches=True):  # compiled here, not read from a cache
        loss, codes = run_and_get_code(run)
    return loss, {n: p.grad.to_local() for n, p in model.named_parameters()}, codes


def test_a_gather_into_a_buffer_of_its_own_hands_back_one_handle(fake_mesh_4, monkeypatch):
    """A regional FSDP step's prologue gathers the root's parameters (embedding, norm, output projection) for
    later regions too: Inductor gathers them into a buffer of their own, not in place, and lists the
    bucket's input and that buffer as the outputs of a call that returns one tensor. torch 2.13's C++ wrapper
    read that one handle as a list of two (a read past its end: the step crashed); the mend keeps the handle
    for the buffer the call returns (``out``), and torch 2.15's wrapper reads none. Every region runs in the
    C++ wrapper (however few its kernels) and the step computes what its regions' graphs do run as they are."""
    from fxshard.backend.programs import training

    listed: list[list[str | None]] = []
    wrapper = cpu_wrapper._mended_class()
    call_through_python = wrapper.generate_fallback_kernel_with_runtime_lookup_python  # mended or torch's

    def spy(self, buf_name, python_kernel_name, op_overload, raw_args, output_args, raw_outputs):
        if "all_gather_into_tensor_out" in python_kernel_name:
            listed.append(list(output_args))
        return call_through_python(self, buf_name, python_kernel_name, op_overload, raw_args, output_args,
                                   raw_outputs)
    monkeypatch.setattr(wrapper, "generate_fallback_kernel_with_runtime_lookup_python", spy)
    # every end compiled: toy sizes
    monkeypatch.setattr(options, "DEFAULTS", replace(options.DEFAULTS, min_kernels=1, worth_seconds=0.0))
    monkeypatch.delenv("FXSHARD_CPU_WRAPPER", raising=False)
    loss, grads, codes = _regional_fsdp_step(fake_mesh_4, monkeypatch)
    assert len(codes) == 6 and all(is_cpp(code) for code in codes)  # prologue, layer, epilogue; each way
    assert any(len(set(outputs) - {None}) > 1 for outputs in listed), listed  # the gather not in place
    monkeypatch.setattr(training, "compile_local", lambda gm, inputs, policy, **_: gm)
    uncompiled_loss, uncompiled_grads, uncompiled_codes = _regional_fsdp_step(fake_mesh_4, monkeypatch)
    assert not uncompiled_codes
    torch.testing.assert_close((loss, grads), (uncompiled_loss, uncompiled_grads))


def test_the_calling_code_is_compiled_at_its_own_level_and_the_kernels_at_O3(monkeypatch):
    """The C++ wrapper's two sources: the calling code at ``CALLS_OPT_LEVEL`` (-O0: it only calls), the
    kernels at -O3."""
    import torch._inductor.cpp_builder as cpp_builder
    from torch.fx.experimental.proxy_tensor import make_fx

    from fxshard.backend.inductor.compile_local import compile_local

    built: list[str] = []
    build = cpp_builder.CppBuilder.build

    def spy(self, *args, **kwargs):
        built.append(self.get_command_line())
        return build(self, *args, **kwargs)
    monkeypatch.setattr(cpp_builder.CppBuilder, "build", spy)
    monkeypatch.setattr(options, "DEFAULTS", replace(options.DEFAULTS, min_kernels=1))
    monkeypatch.delenv("FXSHARD_CPU_WRAPPER", raising=False)
    args = [torch.randn(8, 8), torch.randn(8, 8)]
    gm = make_fx(lambda x, w: _runs(x, w, 2))(*args)
    torch._dynamo.reset()
    with torch._inductor.config.patch(force_disable_caches=True):
        run = compile_local(gm, args, None)
    out = run(*args)
    torch.testing.assert_close(out[0] if isinstance(out, (tuple, list)) else out, _runs(*args, 2))
    levels = {source: [word for word in command.split() if word.startswith("-O")]
              for command in built for source in ("main.cpp", "optimized.cpp") if f".{source}" in command}
    assert levels == {"main.cpp": [f"-{cpu_wrapper.CALLS_OPT_LEVEL}"], "optimized.cpp": ["-O3"]}, built
