"""fxshard's local programs go through Inductor's FX graph cache.

A user who runs a training script a second time finds DTensor + ``torch.compile``'s kernels in
Inductor's on-disk cache. fxshard hands Inductor its lowered programs with real tensors as example
inputs, for which ``compile_fx`` made a fake mode without a shape environment, and both caches
bypassed every program ("No shape env"): every run compiled every region again.
``compile_local.cacheable_inputs`` gives Inductor fake inputs of a mode with one. (The programs
skip AOTAutograd, ``backend/inductor/compile_inner.py``, and so its cache; each program's preparation for
Inductor is kept instead, ``backend/inductor/prepared_cache.py``.)
"""
from __future__ import annotations

import pathlib
import sys

import torch
from torch._dynamo.utils import counters
from torch._functorch import config as functorch_config
from torch._inductor import config
from torch._inductor.utils import fresh_cache
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import fxshard

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from rank_programs import Blocks, shard_parameters  # noqa: E402

COST = fxshard.CostModel(default_latency=0.0)  # bytes decide: weights are gathered (a bucket a block)
DIM, HIDDEN, TOKENS = 32, 64, 256
CACHES = {"force_disable_caches": False, "fx_graph_cache": True, "fx_graph_remote_cache": False}


def _step(model: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A training step of ``model`` through the fxshard backend (bucketed, regional): the output and the
    gradients, as local tensors."""
    compiled = torch.compile(model, backend="fxshard", options={"cost_model": COST})
    out = compiled(x)
    out.sum().backward()
    grads = [p.grad.to_local() for p in model.parameters()]
    model.zero_grad()
    return out.to_local(), grads


def _compiled_twice(model: torch.nn.Module, x: torch.Tensor) -> tuple:
    """The step compiled in a fresh Inductor cache, then again with Dynamo reset (as a new process
    would): the two results. Every program the first compile gave Inductor, the second reads from its caches."""
    with fresh_cache(), config.patch(CACHES), functorch_config.patch(enable_autograd_cache=True):
        torch._dynamo.reset()
        counters.clear()
        first = _step(model, x)
        compiled = counters["inductor"]["fxgraph_cache_miss"]
        assert compiled > 0 and counters["inductor"]["fxgraph_cache_bypass"] == 0, dict(counters["inductor"])
        # each program prepared for Inductor once and kept (backend/inductor/prepared_cache.py)
        assert counters["fxshard"]["prepared_cache_miss"] == compiled, dict(counters["fxshard"])
        assert counters["fxshard"]["prepared_cache_hit"] == 0, dict(counters["fxshard"])
        torch._dynamo.reset()
        counters.clear()
        second = _step(model, x)
        assert counters["inductor"]["fxgraph_cache_miss"] == 0, dict(counters["inductor"])
        assert counters["inductor"]["fxgraph_cache_hit"] == compiled, dict(counters["inductor"])
        # read back prepared: the same program (code, names) that Inductor's cache keyed the first time
        assert counters["fxshard"]["prepared_cache_hit"] == compiled, dict(counters["fxshard"])
        assert counters["fxshard"]["prepared_cache_miss"] == 0, dict(counters["fxshard"])
        # the regions go to Inductor without AOTAutograd (backend/inductor/compile_inner.py): none is traced again
        assert not counters["aot_autograd"], dict(counters["aot_autograd"])
    torch._dynamo.reset()
    return first, second


def test_an_fsdp_step_compiled_again_is_read_from_inductors_caches(fake_mesh_4):
    """Every weight Shard(0): a region per block, each with its bucketed gathers and reduce_scatters
    (the bucketing pass is part of Inductor's config, and of its cache key). The second compile reads
    every program from the caches. (A fake process group moves no data: no numerics here.)"""
    torch.manual_seed(0)
    model = Blocks(DIM, HIDDEN)
    shard_parameters(model, fake_mesh_4)
    _compiled_twice(model, distribute_tensor(torch.randn(TOKENS, DIM), fake_mesh_4, [Shard(0)]))


def test_a_step_read_from_the_caches_computes_what_the_model_does(fake_mesh_4):
    """Replicated weights and a replicated input (no collective: the fake group's result is exact):
    both compiles compute the single-device forward and gradients, on fresh random data."""
    model = Blocks(DIM, HIDDEN)
    reference = Blocks(DIM, HIDDEN)
    reference.load_state_dict(model.state_dict())
    shard_parameters(model, fake_mesh_4, (Replicate(),))
    x = torch.randn(TOKENS, DIM)
    first, second = _compiled_twice(model, distribute_tensor(x, fake_mesh_4, [Replicate()]))
    out = reference(x)
    out.sum().backward()
    expected = (out, [p.grad for p in reference.parameters()])
    torch.testing.assert_close(first, expected)
    torch.testing.assert_close(second, expected)


class _WithConstant(torch.nn.Module):
    def __init__(self, constant: torch.Tensor):
        super().__init__()
        self.register_buffer("constant", constant)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (x * self.constant,)


def test_a_prepared_programs_key_reads_what_its_preparation_reads():
    """backend/inductor/prepared_cache.py keeps a program prepared for Inductor under a key of its code, constants
    and inputs' metadata (not their values), and keeps nothing where Inductor's cache is off or a custom
    joint pass would run."""
    import torch.fx as fx

    from fxshard.backend.inductor.compile_local import cacheable_inputs
    from fxshard.backend.inductor.prepared_cache import prepared_key

    ones, twos = fx.symbolic_trace(_WithConstant(torch.ones(8))), fx.symbolic_trace(_WithConstant(torch.full((8,), 2.0)))

    def key(gm: fx.GraphModule, x: torch.Tensor) -> str | None:
        return prepared_key(gm, cacheable_inputs([x]))

    with config.patch(CACHES):
        first = key(ones, torch.randn(4, 8))
        assert first is not None and first == key(ones, torch.randn(4, 8))  # other values, the same program
        assert first != key(twos, torch.randn(4, 8))  # another constant
        assert first != key(ones, torch.randn(2, 8))  # another shape
        assert first != key(ones, torch.randn(8, 4).t())  # other strides
        with config.patch(joint_custom_pre_pass=lambda graph: None):
            assert key(ones, torch.randn(4, 8)) is None
    with config.patch({**CACHES, "fx_graph_cache": False}):
        assert key(ones, torch.randn(4, 8)) is None
    with config.patch({**CACHES, "force_disable_caches": True}):
        assert key(ones, torch.randn(4, 8)) is None


def test_a_cache_directory_that_cannot_be_written_keeps_nothing_and_compiles(tmp_path, monkeypatch):
    """A prepared program that cannot be stored (a read-only or full disk) is not kept; the program is
    compiled and computes what it computes."""
    from fxshard.backend.inductor import prepared_cache
    from fxshard.backend.inductor.compile_local import compile_local

    blocked = tmp_path / "file"
    blocked.write_text("")  # a file where the store's directory would go: mkdir fails
    monkeypatch.setattr(prepared_cache, "_path", lambda key: blocked / "fxshard_prepared" / key)
    from torch.fx.experimental.proxy_tensor import make_fx

    three = torch.full((8,), 3.0)
    gm = make_fx(lambda x: (x * three,))(torch.randn(4, 8))  # ATen calls: compile_local takes it directly
    x = torch.randn(4, 8)
    with fresh_cache(), config.patch(CACHES):
        counters.clear()
        out = compile_local(gm, [x], None)(x)
        assert counters["fxshard"]["prepared_cache_miss"] == 1
    torch.testing.assert_close(tuple(out), (x * 3.0,))
    assert not (blocked / "fxshard_prepared").exists()
