"""Every knob in one ``Options`` (backend/options.py), read from the environment in one place and part of the
lowered cache's key; and watching the stages (``on_graph``) shows the program that runs, folded or loaded from
the cache, without changing it."""
from __future__ import annotations

import dataclasses
import pathlib
import sys

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import fxshard
from fxshard.backend import options
from fxshard.backend.options import Options

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from rank_programs import Blocks, shard_parameters  # noqa: E402

DIM, HIDDEN, TOKENS = 32, 64, 64


def test_an_unknown_backend_option_is_refused_with_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown fxshard options \['bucket'\]; known: \['bucketing', "):
        Options.from_backend({"bucket": False})
    with pytest.raises(ValueError, match="unknown fxshard options"):  # a threshold is no backend option
        Options.from_backend({"min_layers": 8})
    with pytest.raises(TypeError, match="expected a fxshard.TrainingSplit"):
        Options.from_backend({"training_split": True})
    assert Options.from_backend({"bucketing": False}) == dataclasses.replace(options.in_force(), bucketing=False)


@pytest.mark.parametrize("variable, field", [
    ("FXSHARD_FOLD", "fold"),
    ("FXSHARD_LOWERED_CACHE", "lowered_cache"),
    ("FXSHARD_CPU_WRAPPER", "cpu_wrapper"),
])
def test_the_environment_turns_a_switch_off_with_0(monkeypatch, variable, field):
    monkeypatch.setenv(variable, "0")
    assert getattr(options.in_force(), field) is False
    assert getattr(Options.from_backend({}), field) is False
    monkeypatch.setenv(variable, "1")
    assert getattr(options.in_force(), field) is True


# every field that changes what is planned, lowered or compiled changes the key's text; the watchers do not
CHANGED = {"strict": True, "inductor": False, "bucketing": False, "regional": False,
           "cost_model": fxshard.CostModel(default_latency=0.0),
           "training_split": fxshard.TrainingSplit(keep_gathered_activations=False), "fold": False,
           "cpu_wrapper": False, "min_layers": 6, "shared_layers": 4, "op_seconds": 1e-6, "bytes_per_second": 1e9,
           "worth_seconds": 0.0, "min_kernels": 3,
           "mixed_precision": fxshard.MixedPrecision(param_dtype=torch.bfloat16), "placements": "auto",
           "memory_budget": 1e6, "mesh": "a DeviceMesh"}
UNKEYED = {"on_graph": print, "debug_dir": "/tmp/graphs", "lowered_cache": False, "many_sizes": 2}


def test_every_field_is_keyed_or_said_not_to_be():
    assert set(CHANGED) | set(UNKEYED) == {f.name for f in dataclasses.fields(Options)}


@pytest.mark.parametrize("field", sorted(CHANGED))
def test_a_field_that_changes_the_program_changes_the_cache_text(field):
    assert dataclasses.replace(Options(), **{field: CHANGED[field]}).cache_text() != Options().cache_text()


@pytest.mark.parametrize("field", sorted(UNKEYED))
def test_a_watcher_or_a_limit_leaves_the_cache_text(field):
    assert dataclasses.replace(Options(), **{field: UNKEYED[field]}).cache_text() == Options().cache_text()


@pytest.fixture
def cache_on(monkeypatch):
    """The lowered cache on (conftest turns it off), in a fresh Inductor cache directory."""
    from torch._dynamo.utils import counters
    from torch._inductor import config
    from torch._inductor.utils import fresh_cache

    monkeypatch.setenv("FXSHARD_LOWERED_CACHE", "1")
    with fresh_cache(), config.patch({"force_disable_caches": False, "fx_graph_cache": True,
                                      "fx_graph_remote_cache": False}):
        counters.clear()
        yield counters
    torch._dynamo.reset()


def test_a_tuned_threshold_is_in_the_lowered_key(fake_mesh_4, cache_on, monkeypatch):
    """The backend passes its Options' cache text to the lowered cache's key: a process whose thresholds
    differ (``DEFAULTS`` replaced) plans again rather than load another process's program."""
    model = _blocks(fake_mesh_4, layers=2)
    x = distribute_tensor(torch.randn(TOKENS, DIM), fake_mesh_4, [Shard(0)])
    _step(fxshard.compile(model, inductor=False), model, x)
    monkeypatch.setattr(options, "DEFAULTS", dataclasses.replace(options.DEFAULTS, shared_layers=4))
    _step(fxshard.compile(model, inductor=False), model, x)
    assert dict(cache_on["fxshard"]) == {"lowered_cache_miss": 2}, dict(cache_on["fxshard"])


def _blocks(mesh, layers: int) -> Blocks:
    torch.manual_seed(0)
    model = Blocks(DIM, HIDDEN, layers)
    shard_parameters(model, mesh, (Shard(0),))
    return model


def _step(compiled, model: torch.nn.Module, x: torch.Tensor):
    """One training step of a fresh ``fxshard.compile`` (nothing of an earlier one in memory): its program."""
    torch._dynamo.reset()
    compiled(x).backward()
    model.zero_grad()
    return compiled.last


def _watched(model: torch.nn.Module, x: torch.Tensor) -> tuple:
    """One step of ``fxshard.compile(model)`` with ``on_graph``: the program and the graphs each stage showed."""
    seen: dict = {}
    program = _step(fxshard.compile(model, inductor=False, on_graph=seen.__setitem__), model, x)
    return program, seen


def test_watching_a_folded_step_shows_the_program_that_runs(fake_mesh_4):
    """Six blocks fold (backend/programs/fold.py) whether or not someone watches: the plan shown is the four
    layers stage 3 planned, and ``lower`` the whole lowered program the step runs, the unwatched step's."""
    x = distribute_tensor(torch.randn(TOKENS, DIM), fake_mesh_4, [Replicate()])
    model = _blocks(fake_mesh_4, layers=6)
    unwatched = _step(fxshard.compile(model, inductor=False), model, x)
    watched, seen = _watched(model, x)
    assert watched.folded is not None and unwatched.folded is not None
    assert list(seen) == ["plan", "plan_forward", "plan_backward", "lower", "lower_backward"]
    assert len(seen["plan_forward"].graph.nodes) < len(watched.plan.forward.graph.nodes)  # four layers of six
    assert seen["lower"] is watched.forward_graph and seen["lower_backward"] is watched.backward_graph
    assert seen["lower"].code == unwatched.forward_graph.code
    assert seen["lower_backward"].code == unwatched.backward_graph.code


def test_watching_a_loaded_program_shows_the_programs_loaded(fake_mesh_4, cache_on):
    """A watched program is kept and loaded as any other: on a cache hit no trace or plan ran, and the
    watcher sees the lowered forward and backward loaded from disk, the ones the step runs."""
    x = distribute_tensor(torch.randn(TOKENS, DIM), fake_mesh_4, [Shard(0)])
    model = _blocks(fake_mesh_4, layers=2)
    cold, planned = _watched(model, x)
    assert "plan" in planned and "lower" in planned
    warm, loaded = _watched(model, x)
    assert dict(cache_on["fxshard"]) == {"lowered_cache_miss": 1, "lowered_cache_hit": 1}, dict(cache_on["fxshard"])
    assert list(loaded) == ["lower", "lower_backward"]
    assert loaded["lower"] is warm.forward_graph and loaded["lower_backward"] is warm.backward_graph
    assert loaded["lower"].code == cold.forward_graph.code
    assert loaded["lower_backward"].code == cold.backward_graph.code
