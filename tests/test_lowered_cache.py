"""A second run loads each rank's lowered programs instead of planning again (backend/programs/lowered_cache.py).

The programs loaded must be the ones planned (the same code, signature and numerics), the key must
change with everything planning reads, and nothing may be loaded where it cannot be trusted (a torn
file). A watched program is loaded too, its watcher shown the programs loaded: tests/test_options.py.
"""
from __future__ import annotations

import pathlib
import sys
from typing import Any

import pytest
import torch
import torch.fx as fx
from torch._dynamo.utils import counters
from torch._inductor import config
from torch._inductor.utils import fresh_cache
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import fxshard
from fxshard.backend.layers.regional_program import RegionRole, program_structure
from fxshard.backend.programs.training import TrainingProgram

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from rank_programs import Blocks, shard_parameters  # noqa: E402

CACHES = {"force_disable_caches": False, "fx_graph_cache": True, "fx_graph_remote_cache": False}
DIM, HIDDEN, TOKENS = 32, 64, 64


@pytest.fixture
def cache_on(monkeypatch):
    """The cache on (conftest turns it off for every other test), in a fresh Inductor cache directory."""
    monkeypatch.setenv("FXSHARD_LOWERED_CACHE", "1")
    with fresh_cache(), config.patch(CACHES):
        counters.clear()
        yield
    torch._dynamo.reset()


def _compile_and_step(model: torch.nn.Module, x: torch.Tensor, **options) -> tuple:
    """A fresh ``fxshard.compile`` of ``model`` (as a new process would make it: nothing in memory) and one
    training step: the program, the output and the parameters' gradients, as local tensors."""
    torch._dynamo.reset()
    compiled = fxshard.compile(model, inductor=False, **options)
    out = compiled(x)
    out.sum().backward()
    grads = [p.grad.to_local().clone() for p in model.parameters()]
    model.zero_grad()
    return compiled.last, out.to_local(), grads


def _sharded_blocks(mesh, placements=(Shard(0),), layers: int = 2) -> Blocks:
    torch.manual_seed(0)
    model = Blocks(DIM, HIDDEN, layers)
    shard_parameters(model, mesh, placements)
    return model


def _replicated(mesh) -> tuple[Blocks, Blocks, torch.Tensor, torch.Tensor]:
    """Three blocks (a program is cut into regions from three alike layers: ``Options.shared_layers``) with
    replicated weights (the fake group's result is exact), the same model on one device, fresh random data
    and that data replicated."""
    model = _sharded_blocks(mesh, (Replicate(),), layers=3)
    reference = Blocks(DIM, HIDDEN, 3)
    reference.load_state_dict({k: v.full_tensor() for k, v in model.state_dict().items()})
    data = torch.randn(TOKENS, DIM)
    return model, reference, data, distribute_tensor(data, mesh, [Replicate()])


def _assert_computes_the_model(reference: torch.nn.Module, data: torch.Tensor, *results: tuple) -> None:
    """Each of ``results`` (output, gradients) is the single-device model's on ``data``."""
    out = reference(data)
    out.sum().backward()
    expected = (out, [p.grad for p in reference.parameters()])
    for result in results:
        torch.testing.assert_close(result, expected)


def test_a_second_compile_loads_the_programs_the_first_lowered(fake_mesh_4, cache_on):
    """FSDP's Blocks: the second compile plans nothing (no stage runs) and runs the same forward and backward
    programs, node for node, with the same signature; its plan is planned again only when read."""
    model = _sharded_blocks(fake_mesh_4)
    x = distribute_tensor(torch.randn(TOKENS, DIM), fake_mesh_4, [Shard(0)])
    cold, _, _ = _compile_and_step(model, x)
    assert dict(counters["fxshard"]) == {"lowered_cache_miss": 1}, dict(counters["fxshard"])
    assert "trace" in cold.reporter.times
    counters.clear()
    warm, _, _ = _compile_and_step(model, x)
    assert dict(counters["fxshard"]) == {"lowered_cache_hit": 1}, dict(counters["fxshard"])
    assert isinstance(warm, TrainingProgram) and warm is not cold
    assert not {"trace", "propagate", "refine", "plan", "localize", "lower"} & set(warm.reporter.times)
    assert warm.forward_graph.code == cold.forward_graph.code
    assert warm.backward_graph.code == cold.backward_graph.code
    for a, b in zip(warm.forward_graph.graph.nodes, cold.forward_graph.graph.nodes):  # fake values recomputed
        va, vb = a.meta.get("val"), b.meta.get("val")
        if isinstance(vb, torch.Tensor):
            assert (va.shape, va.stride(), va.dtype) == (vb.shape, vb.stride(), vb.dtype), a.format_node()
    assert (warm.positions, warm.input_layouts, warm.num_outputs, warm.grad_inputs) == \
        (cold.positions, cold.input_layouts, cold.num_outputs, cold.grad_inputs)
    assert warm.lowered.output_layouts == cold.lowered.output_layouts
    assert warm.buckets == cold.buckets
    # the planned global programs, for whoever reads them: planned again, the same plan
    assert warm.plan.forward.code == cold.plan.forward.code


def test_a_folded_steps_four_layers_are_kept_and_made_whole_when_read(fake_mesh_4, cache_on, monkeypatch):
    """Six layers of our Llama under FSDP fold (backend/programs/fold.py): the first run keeps the four layers' lowered
    programs without making them whole; a second run loads them and, when its lowered programs are read,
    unfolds them into the first run's, node for node."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
    from models.llama import Llama, LlamaConfig, fsdp_placements
    from train_llama import distribute_parameters

    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=64, dim=32, n_layers=6, n_heads=4, n_kv_heads=2, ffn_dim=64))
    distribute_parameters(model, fake_mesh_4, fsdp_placements(model))
    g = torch.Generator().manual_seed(1)
    tokens, targets = (distribute_tensor(torch.randint(0, 64, (4, 16), generator=g), fake_mesh_4, [Shard(0)])
                       for _ in range(2))

    def step():
        torch._dynamo.reset()
        compiled = fxshard.compile(model.loss, inductor=False)
        compiled(tokens, targets).backward()
        model.zero_grad()
        return compiled.last

    from fxshard.backend import driver

    kept = []
    store = driver.store_lowered
    monkeypatch.setattr(driver, "store_lowered", lambda key, lowered, *a, **k: (kept.append((lowered, k)),
                                                                                 store(key, lowered, *a, **k)))
    cold = step()
    assert cold.folded is not None and "unfold" in cold.reporter.times
    (lowered, options), = kept  # the four layers' programs, with the layers folded (template, successor)
    assert options == {"folded": (1, 4)} and lowered.forward is cold.folded.short_lowered.forward
    counters.clear()
    warm = step()
    assert dict(counters["fxshard"]) == {"lowered_cache_hit": 1}, dict(counters["fxshard"])
    assert not {"trace", "localize", "lower"} & set(warm.reporter.times)
    assert warm.forward_graph.code == cold.forward_graph.code
    assert warm.backward_graph.code == cold.backward_graph.code


def test_a_program_loaded_computes_what_the_model_does(fake_mesh_4, cache_on):
    """Replicated weights and input (the fake group's result is exact): the cold and the loaded program both
    compute the single-device output and gradients, on fresh random data."""
    model, reference, data, x = _replicated(fake_mesh_4)
    _, out_cold, grads_cold = _compile_and_step(model, x)
    _, out_warm, grads_warm = _compile_and_step(model, x)
    assert counters["fxshard"]["lowered_cache_hit"] == 1, dict(counters["fxshard"])
    _assert_computes_the_model(reference, data, (out_cold, grads_cold), (out_warm, grads_warm))


def test_an_inference_program_is_loaded_too(fake_mesh_4, cache_on):
    model, reference, data, x = _replicated(fake_mesh_4)
    outs = []
    for _ in range(2):
        torch._dynamo.reset()
        with torch.no_grad():
            compiled = fxshard.compile(model, inductor=False)
            outs.append(compiled(x).to_local())
    assert dict(counters["fxshard"]) == {"lowered_cache_miss": 1, "lowered_cache_hit": 1}, dict(counters["fxshard"])
    with torch.no_grad():
        torch.testing.assert_close(outs, [reference(data)] * 2)


def test_another_option_placement_or_shape_plans_again(fake_mesh_4, cache_on, monkeypatch):
    """What planning reads is in the key: a cost model, the weights' placements, the input's shape, whether
    repeated layers fold (backend/programs/fold.py: a rank loading a program must load what the others plan)."""
    x = distribute_tensor(torch.randn(TOKENS, DIM), fake_mesh_4, [Shard(0)])
    _compile_and_step(_sharded_blocks(fake_mesh_4), x)
    _compile_and_step(_sharded_blocks(fake_mesh_4), x, cost_model=fxshard.CostModel(default_latency=0.0))
    _compile_and_step(_sharded_blocks(fake_mesh_4, (Replicate(),)), x)
    _compile_and_step(_sharded_blocks(fake_mesh_4), distribute_tensor(torch.randn(2 * TOKENS, DIM), fake_mesh_4,
                                                                      [Shard(0)]))
    with monkeypatch.context() as patch:
        patch.setenv("FXSHARD_FOLD", "0")
        _compile_and_step(_sharded_blocks(fake_mesh_4), x)
    assert dict(counters["fxshard"]) == {"lowered_cache_miss": 5}, dict(counters["fxshard"])
    _compile_and_step(_sharded_blocks(fake_mesh_4, (Replicate(),)), x)
    assert counters["fxshard"]["lowered_cache_hit"] == 1, dict(counters["fxshard"])


def test_the_key_reads_the_program_its_constants_and_the_switches(fake_mesh_4, monkeypatch):
    """The key changes with the program's code and its constants' values; nothing is kept with Inductor's
    caches off, with ``FXSHARD_LOWERED_CACHE=0``, or for a program holding a module the key cannot read."""
    from fxshard.backend.programs.lowered_cache import lowered_key

    class Scaled(torch.nn.Module):
        def __init__(self, constant: torch.Tensor):
            super().__init__()
            self.register_buffer("constant", constant)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.constant

    ones, twos = fx.symbolic_trace(Scaled(torch.ones(8))), fx.symbolic_trace(Scaled(torch.full((8,), 2.0)))
    plus = fx.symbolic_trace(lambda x: x + 1)
    x = distribute_tensor(torch.randn(4, 8), fake_mesh_4, [Replicate()])
    options = {"training": False}
    monkeypatch.setenv("FXSHARD_LOWERED_CACHE", "1")
    with config.patch(CACHES):
        first = lowered_key(ones, [x], fake_mesh_4, options)
        assert first is not None and first == lowered_key(ones, [x], fake_mesh_4, options)
        assert first != lowered_key(twos, [x], fake_mesh_4, options)
        assert first != lowered_key(plus, [x], fake_mesh_4, options)
        assert first != lowered_key(ones, [x], fake_mesh_4, {"training": True})
        assert first != lowered_key(ones, [distribute_tensor(torch.randn(4, 8), fake_mesh_4, [Shard(0)])],
                                    fake_mesh_4, options)
        assert lowered_key(fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(8, 8))), [x], fake_mesh_4,
                           options) is None  # a module call: its code is not in the graph's
        monkeypatch.setenv("FXSHARD_LOWERED_CACHE", "0")
        assert lowered_key(ones, [x], fake_mesh_4, options) is None
    monkeypatch.setenv("FXSHARD_LOWERED_CACHE", "1")
    with config.patch({**CACHES, "force_disable_caches": True}):
        assert lowered_key(ones, [x], fake_mesh_4, options) is None


SCALE = 2.0


def _doubled(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def _scaled(x: torch.Tensor) -> torch.Tensor:
    return x * SCALE


def _tripled(x: torch.Tensor) -> torch.Tensor:
    return x * 3


def test_the_key_reads_the_body_of_a_python_function_the_program_calls(fake_mesh_4, monkeypatch):
    """A graph calls a user's function by name (``allow_in_graph``): its code is the same when the function's
    body changes, the key is not; a closure over something other than plain values keeps nothing."""
    from fxshard.backend.programs.lowered_cache import lowered_key

    def calling(fn) -> fx.GraphModule:
        graph = fx.Graph()
        graph.output(graph.call_function(fn, (graph.placeholder("x"),)))
        return fx.GraphModule(torch.nn.Module(), graph)

    x = distribute_tensor(torch.randn(4, 8), fake_mesh_4, [Replicate()])
    monkeypatch.setenv("FXSHARD_LOWERED_CACHE", "1")
    with config.patch(CACHES):
        doubled = calling(_doubled)
        edited = calling(_doubled)
        monkeypatch.setattr(_doubled, "__code__", _tripled.__code__)  # the same name, another body
        assert doubled.code == edited.code
        assert lowered_key(edited, [x], fake_mesh_4, {}) != lowered_key(calling(_tripled), [x], fake_mesh_4, {})
        monkeypatch.undo()
        monkeypatch.setenv("FXSHARD_LOWERED_CACHE", "1")
        before = lowered_key(doubled, [x], fake_mesh_4, {})
        monkeypatch.setattr(_doubled, "__code__", _tripled.__code__)
        assert lowered_key(doubled, [x], fake_mesh_4, {}) != before
        scaled = lowered_key(calling(_scaled), [x], fake_mesh_4, {})
        monkeypatch.setitem(globals(), "SCALE", 3.0)  # a module constant the function reads
        assert lowered_key(calling(_scaled), [x], fake_mesh_4, {}) != scaled
        scale = torch.ones(1)
        assert lowered_key(calling(lambda t: t * scale), [x], fake_mesh_4, {}) is None


def test_a_torn_entry_is_planned_again_and_stored_over(fake_mesh_4, cache_on):
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    model = _sharded_blocks(fake_mesh_4)
    x = distribute_tensor(torch.randn(TOKENS, DIM), fake_mesh_4, [Shard(0)])
    cold, _, _ = _compile_and_step(model, x)
    (entry,) = (pathlib.Path(cache_dir()) / "fxshard_lowered").iterdir()
    entry.write_bytes(entry.read_bytes()[:100])
    torn, _, _ = _compile_and_step(model, x)
    assert dict(counters["fxshard"]) == {"lowered_cache_miss": 2}, dict(counters["fxshard"])
    assert "trace" in torn.reporter.times and torn.backward_graph.code == cold.backward_graph.code
    warm, _, _ = _compile_and_step(model, x)
    assert counters["fxshard"]["lowered_cache_hit"] == 1 and warm.backward_graph.code == cold.backward_graph.code


def test_a_loaded_programs_plan_is_planned_again_from_fake_inputs_only():
    """``TrainingProgram.plan`` of a loaded program plans again from ``fxshard.compile``'s fake stand-ins; the
    backend's real inputs are not kept alive for that, and reading the plan says how to have it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fxshard.backend.driver import _planner

    gm = fx.symbolic_trace(lambda x: x + 1)
    with pytest.raises(RuntimeError, match="FXSHARD_LOWERED_CACHE=0"):
        _planner(gm, [torch.randn(4)], {})()
    fake = FakeTensorMode().from_tensor(torch.randn(4))
    assert _planner(gm, [fake], {}).__name__ == "plan_again"


def test_a_graph_kept_as_records_comes_back_the_same():
    """``graph_records``: every node (names, operators, arguments and keyword arguments, getitem of a
    multi-output op), the metadata asked for, and tensor constants by value, through ``pickle``."""
    import pickle

    from torch.fx.experimental.proxy_tensor import make_fx

    from fxshard.backend.programs.graph_records import graph_from_records, graph_records

    three = torch.full((8,), 3.0)

    def program(x: torch.Tensor, n: torch.Tensor) -> tuple:
        values, indices = torch.topk(x * three, 2, dim=-1)
        return (values.sum(dim=0, keepdim=True), indices, torch.nn.functional.gelu(x, approximate="tanh") + n)

    x, n = torch.randn(4, 8), torch.randn(8)
    gm = make_fx(program)(x, n)
    gm.graph._codegen = fx.graph.CodeGen()  # positional inputs, as a lowered program's (no pytree flattening)
    gm.recompile()
    for k, node in enumerate(gm.graph.nodes):
        node.meta.update({"kept": k, "dropped": k})
    assert gm.graph.find_nodes(op="get_attr")  # the constant
    back = graph_from_records(*pickle.loads(pickle.dumps(graph_records(gm, ["kept"]))))
    assert back.code == gm.code
    assert [n.meta for n in back.graph.nodes] == [{"kept": k} for k in range(len(gm.graph.nodes))]
    torch.testing.assert_close(back(x, n), gm(x, n))


def _regional_step(model: torch.nn.Module, x: torch.Tensor) -> tuple:
    """``_compile_and_step`` through Inductor, regionally (the step's regions cut at its first call)."""
    torch._dynamo.reset()
    compiled = fxshard.compile(model)
    out = compiled(x)
    out.sum().backward()
    grads = [p.grad.to_local().clone() for p in model.parameters()]
    model.zero_grad()
    return compiled.last, out.to_local(), grads


def test_a_second_run_loads_the_regions_too_and_computes_what_the_model_does(fake_mesh_4, cache_on):
    """Through Inductor the first call cuts the step into regions and keeps them: the second run neither
    plans nor cuts, runs the same schedule and the same region programs, and both runs compute the
    single-device output and gradients (replicated weights and input: the fake group's result is exact)."""
    model, reference, data, x = _replicated(fake_mesh_4)
    cold, out_cold, grads_cold = _regional_step(model, x)
    assert cold._region_split[0] and cold._region_split[1], "the step is cut into regions"
    assert "regions" in cold.reporter.times
    counters.clear()
    warm, out_warm, grads_warm = _regional_step(model, x)
    assert counters["fxshard"]["regions_cache_hit"] == 1, dict(counters["fxshard"])
    assert not {"trace", "localize", "lower", "regions"} & set(warm.reporter.times), warm.reporter.times
    assert warm.lowered.forward is None  # the lowered programs were not even read, until someone asks:
    assert warm.forward_graph.code == cold.forward_graph.code and warm.backward_graph.code == cold.backward_graph.code
    for k, which in enumerate(("forward", "backward")):
        assert warm._schedules[which].steps == cold._schedules[which].steps
        assert [(r.role, r.index, r.structure) for r in warm._region_split[k]] == \
            [(r.role, r.index, program_structure(r.graph.graph)) for r in cold._region_split[k]]
    _assert_computes_the_model(reference, data, (out_cold, grads_cold), (out_warm, grads_warm))


def test_loaded_regions_come_without_fake_values_and_their_compiles_compute_them(fake_mesh_4, cache_on, monkeypatch):
    """A second run's regions are loaded without their values' fake tensors (a layer's compile makes its own);
    compiled through ``compile_fx`` instead (a region Inductor's direct path does not take), and bucketed
    uncompiled, they are computed where read, and the step computes the single-device result."""
    from fxshard.backend.inductor import compile_local
    from fxshard.backend.programs import training
    from fxshard.lowering.localize import complete_fake_values

    model, reference, data, x = _replicated(fake_mesh_4)
    _regional_step(model, x)
    completed = []

    def spy(gm, inputs):  # a graph's first completion finds values missing (an end's: deciding its compile)
        missing = [n for n in gm.graph.nodes if n.op == "call_function" and "val" not in n.meta]
        complete_fake_values(gm, inputs)
        if all(gm is not seen for seen, _, _ in completed):
            completed.append((gm, bool(missing), all("val" in n.meta for n in missing)))

    monkeypatch.setattr(compile_local, "takes_directly", lambda gm, inputs: False)
    monkeypatch.setattr(compile_local, "complete_fake_values", spy)
    monkeypatch.setattr(training, "complete_fake_values", spy)
    warm, out, grads = _regional_step(model, x)
    assert warm._region_split[0] and warm._region_split[1]
    loaded = {id(r.graph) for r in warm._forward.regions + warm._backward.regions}  # not the copies run uncompiled
    firsts = [(missing, done) for gm, missing, done in completed if id(gm) in loaded]
    assert firsts and all(missing and done for missing, done in firsts), completed
    assert all(done for *_, done in completed), completed
    _assert_computes_the_model(reference, data, (out, grads))


def test_an_fsdp_steps_regions_are_loaded_with_their_buckets(fake_mesh_4, cache_on):
    """FSDP's Blocks through Inductor: the loaded regions run the cold run's schedule, and every layer's
    region its gathers and reductions with their block tags (what bucketing reads), one graph per key."""
    model = _sharded_blocks(fake_mesh_4, layers=4)
    x = distribute_tensor(torch.randn(TOKENS, DIM), fake_mesh_4, [Shard(0)])
    cold, _, _ = _regional_step(model, x)
    counters.clear()
    warm, _, _ = _regional_step(model, x)
    assert counters["fxshard"]["regions_cache_hit"] == 1, dict(counters["fxshard"])
    # each graph kept once per key, as the cold run's first region of that key, forward then backward (the
    # two share their compiled regions: a backward's regather runs the forward's gather region of that key)
    first: dict[int, Any] = {}
    for k, which in enumerate(("forward", "backward")):
        assert warm._schedules[which].steps == cold._schedules[which].steps
        assert [(r.role, r.index) for r in warm._region_split[k]] == [(r.role, r.index) for r in cold._region_split[k]]
        for w, c in zip(warm._region_split[k], cold._region_split[k]):
            first.setdefault(id(w.graph), (w, c))
            assert w.structure == program_structure(c.graph.graph)  # as cut (bucketing rewrites a copy)
        others = [w for w in warm._region_split[k] if w.role is not RegionRole.LAYER]  # between layers repeat too
        assert len({id(w.graph) for w in others}) == len({w.structure for w in others}) < len(others), \
            [(w.role, id(w.graph)) for w in others]
    for w, c in first.values():
        assert [(str(n.target), n.meta.get("custom")) for n in w.graph.graph.nodes] == \
            [(str(n.target), n.meta.get("custom")) for n in c.graph.graph.nodes]
    assert len(first) < len(warm._region_split[0]) + len(warm._region_split[1])


def test_an_operator_a_module_registers_on_import_is_found_in_a_fresh_process():
    """A merged region holds Inductor's ``bucketing::`` ops, registered when Inductor's bucketing passes are
    imported: a second run reading it has not imported them yet."""
    import subprocess

    code = ("import torch, fxshard.backend.programs.graph_records as g\n"
            "assert not hasattr(torch.ops.bucketing, '_pre_bucket_all_gather')\n"
            "print(g._Op('bucketing', '_pre_bucket_all_gather', 'default').resolve())")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "bucketing._pre_bucket_all_gather.default" in run.stdout, run.stderr[-2000:]


def test_the_key_reads_the_state_a_program_is_traced_under(fake_mesh_4, monkeypatch, caplog):
    """Each process-wide state tracing reads (tests/cache_states.py: autocast per dtype, default dtype, SDPA's
    backends, deterministic algorithms, grad mode) gives the same graph another key; where the state cannot
    be read, nothing is kept and a warning says so once."""
    from fxshard.backend.inductor import cache_files
    from fxshard.backend.programs.lowered_cache import lowered_key

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    from cache_states import STATES

    plus = fx.symbolic_trace(lambda x: x + 1)
    x = distribute_tensor(torch.randn(4, 8), fake_mesh_4, [Replicate()])
    monkeypatch.setenv("FXSHARD_LOWERED_CACHE", "1")
    with config.patch(CACHES):
        plain = lowered_key(plus, [x], fake_mesh_4, {})
        keys = {}
        for name, state in STATES.items():
            with state():
                keys[name] = lowered_key(plus, [x], fake_mesh_4, {})
        assert lowered_key(plus, [x], fake_mesh_4, {}) == plain
        assert keys["plain"] == keys["inductor"] == plain  # the option is the backend's, not a state
        flipped = {k: v for k, v in keys.items() if k not in ("plain", "inductor")}
        assert plain not in flipped.values() and len(set(flipped.values())) == len(flipped), keys

        def unreadable() -> str:
            raise RuntimeError("no such flag")

        monkeypatch.setattr(cache_files, "_SWITCHES", (("a flag", unreadable),))
        cache_files._say_unreadable.cache_clear()
        with caplog.at_level("WARNING", logger="fxshard"):
            assert lowered_key(plus, [x], fake_mesh_4, {}) is None
            assert lowered_key(plus, [x], fake_mesh_4, {}) is None
        said = [r.getMessage() for r in caplog.records if "keeps no program on disk" in r.getMessage()]
        assert len(said) == 1 and "no such flag" in said[0], said


def test_a_second_process_under_another_state_computes_what_a_cold_compile_does(tmp_path):
    """Issue 63's silent bf16: one process compiles and steps the model with no state set (with and without
    Inductor), keeping its programs; a second process sharing the cache directory steps under each other state,
    with every cache off, then with them on. Both steps of each state agree bit for bit, and the second loads
    the first's programs where the state is the same (the test would pass by never loading)."""
    import os
    import subprocess

    here = pathlib.Path(__file__).resolve().parent
    env = {**os.environ, "FXSHARD_LOWERED_CACHE": "1", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache")}
    first = [sys.executable, str(here / "cache_states.py"), str(tmp_path / "first.pt"), "plain", "inductor"]
    states = ["plain", "inductor", "inductor_autocast_bf16", "inductor_autocast_fp16", "default_float64",
              "math_sdpa", "deterministic", "no_grad"]
    second = [sys.executable, str(here / "cache_states.py"), str(tmp_path / "second.pt"), "--cold", *states]
    for command in (first, second):
        run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]
    results = torch.load(tmp_path / "second.pt")
    for state, ((cold_out, cold_grads, _), (out, grads, counted)) in results.items():
        assert out.dtype == cold_out.dtype and torch.equal(out, cold_out), state
        assert len(grads) == len(cold_grads) and all(map(torch.equal, grads, cold_grads)), state
        assert counted == ({"lowered_cache_hit": 1} if state in ("plain", "inductor") else
                           {"lowered_cache_miss": 1}), (state, counted)
    assert results["inductor_autocast_bf16"][1][0].dtype == torch.bfloat16


def test_the_key_digests_every_module_of_the_package_its_sub_packages_included():
    """A module moved into a sub-package, or changed there, is a changed source (issue 66's trap): every fxshard
    module imported in this process is among the files the key digests."""
    import importlib
    import pkgutil

    import fxshard.backend
    from fxshard.backend.programs.lowered_cache import source_files

    for module in pkgutil.walk_packages(fxshard.backend.__path__, "fxshard.backend."):
        importlib.import_module(module.name)
    digested = {path.resolve() for _, path in source_files()}
    modules = {pathlib.Path(m.__file__).resolve() for name, m in list(sys.modules.items())
               if name.split(".")[0] == "fxshard" and getattr(m, "__file__", None)}
    assert any("layers" in p.parts for p in modules), "the sub-packages are imported"
    assert modules <= digested, sorted(str(p) for p in modules - digested)
