"""Activation checkpointing through every door: a checkpointed block is recomputed in the backward.

``torch.utils.checkpoint`` (non-reentrant) around blocks whose attention is SDPA, and Hugging Face's
``gradient_checkpointing_enable()``, under ``fxshard.simulate(grad=True)``, ``fxshard.compile`` and
``torch.compile(backend="fxshard")`` (a fake process group here, two gloo ranks for the numerics), in
Megatron TP and TP+SP layouts. A multi-output op (SDPA's ``(out, logsumexp)``) crosses from the forward to
the backward through its outputs, never as its tuple (backend/programs/joint.py: ``recomputed``).
"""
from __future__ import annotations

import operator
import pathlib
import sys
import warnings
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as checkpoint
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import fxshard
from fxshard.backend.simulate import lowered_graphs

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from rank_programs import CheckpointedBlocks, parallelize_attention  # noqa: E402
from test_e2e_gloo import run_program  # noqa: E402

SEQUENCE = [Shard(1)]  # the residual stream [batch, seq, dim] on sequence shards
LAYOUTS = {"tp": False, "tp+sp": True}


def attention_placements(sequence_parallel: bool) -> dict:
    """Megatron's placements of ``CheckpointedBlocks`` as simulate takes them; with sequence parallelism the
    input on sequence shards too."""
    out: dict[Any, Any] = {f"blocks.{i}.{p}.weight": (Shard(0),) for i in range(2) for p in "qkv"}
    out.update({f"blocks.{i}.o.weight": (Shard(1),) for i in range(2)})
    return {**out, 0: SEQUENCE} if sequence_parallel else out


def pin_outputs(modules: list[torch.nn.Module]) -> list:
    """Forward hooks pinning each module's output to sequence shards (sequence parallelism, model untouched)."""
    def hook(module: torch.nn.Module, args: Any, output: Any) -> Any:
        if isinstance(output, tuple):
            return (fxshard.constrain(output[0], SEQUENCE),) + output[1:]
        return fxshard.constrain(output, SEQUENCE)
    return [m.register_forward_hook(hook) for m in modules]


def simulate_against_one_device(model: torch.nn.Module, fn: Any, x: torch.Tensor, placements: dict,
                                pinned: list[torch.nn.Module], input_grad: bool, tol: float) -> None:
    """``fn(x)``'s output and gradients (seeded with ones) on 2 simulated ranks against one device."""
    hooks = pin_outputs(pinned)
    try:
        out, grads = fxshard.simulate(fn, x, mesh=fxshard.MeshSpec(tp=2), placements=placements, grad=True)
    finally:
        for h in hooks:
            h.remove()
    ref = fn(x)
    ref.backward(torch.ones_like(ref))
    want = {name: p.grad for name, p in model.named_parameters()}
    if input_grad:
        want[0] = x.grad
    torch.testing.assert_close((out, grads), (ref, want), rtol=tol, atol=tol)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_simulated_checkpointed_attention_matches_one_device(layout):
    torch.manual_seed(1)
    model = CheckpointedBlocks()
    x = torch.randn(2, 8, 32, requires_grad=True)
    sp = LAYOUTS[layout]
    simulate_against_one_device(model, model, x, attention_placements(sp), list(model.blocks) if sp else [],
                                input_grad=True, tol=1e-5)


def hf_llama() -> torch.nn.Module:
    """A tiny Hugging Face Llama from a config (SDPA attention), in training mode with gradient checkpointing
    (which it applies in training only)."""
    transformers = pytest.importorskip("transformers")
    from zoo import DECODER

    config = transformers.LlamaConfig(attn_implementation="sdpa", **DECODER)
    model = transformers.LlamaForCausalLM(config).train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers 5 renames it activation_checkpointing_enable
        model.gradient_checkpointing_enable()  # non-reentrant torch.utils.checkpoint around each layer
    return model


@pytest.mark.parametrize("layout", LAYOUTS)
def test_simulated_hf_llama_with_gradient_checkpointing_matches_one_device(layout):
    from zoo import ZOO

    torch.manual_seed(2)
    model = hf_llama()
    ids = torch.randint(0, 256, (2, 8))
    arch = ZOO["llama"]
    pinned = [model.get_submodule(name) for name in arch.stream] if LAYOUTS[layout] else []
    simulate_against_one_device(model, lambda ids: model(input_ids=ids, use_cache=False).logits, ids,
                                arch.plan(model), pinned, input_grad=False, tol=1e-4)


def saved_values(forward: torch.fx.GraphModule, num_outputs: int = 1) -> list[torch.fx.Node]:
    """What a lowered forward returns for its backward (after its outputs)."""
    return list(forward.graph.find_nodes(op="output")[0].args[0][num_outputs:])


def test_a_checkpointed_attention_is_recomputed_not_saved(fake_mesh_4):
    """SDPA without dropout recomputes exactly: the forward keeps each block's input and the parameters
    only, as ``checkpoint`` does; unchecked, it keeps SDPA's output and logsumexp, each a tensor."""
    torch.manual_seed(0)
    model, x = CheckpointedBlocks(), torch.randn(2, 8, 32, requires_grad=True)
    unchecked = CheckpointedBlocks()
    unchecked.forward = lambda x: unchecked.blocks[1](unchecked.blocks[0](x))
    kept = {}  # (values the forward made, of which SDPA's outputs), each a tensor
    for name, m in {"checkpointed": model, "unchecked": unchecked}.items():
        forward, _ = lowered_graphs(m, x, device_mesh=fake_mesh_4, placements=attention_placements(False),
                                    grad=True)[(0,)]
        made = [n for n in saved_values(forward) if n.op != "placeholder"]
        assert all(isinstance(n.meta["val"], torch.Tensor) for n in made), name
        kept[name] = (len(made), sum(n.target is operator.getitem for n in made))
    assert kept["checkpointed"] == (1, 0)  # block 0's output (block 1's input)
    assert kept["unchecked"][1] == 4  # per block SDPA's out and logsumexp


# A two-output op tagged as drawing random numbers (as SDPA and dropout are): a checkpoint cannot recompute it,
# so the forward saves it. Its values are deterministic, so the gradients are checked against one device.
@torch.library.custom_op("fxshard_test::seeded_pair", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,))
def seeded_pair(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.sin(x), torch.cos(x)


@seeded_pair.register_fake
def _(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(x)


def _seeded_pair_backward(ctx: Any, d_sin: torch.Tensor, d_cos: torch.Tensor) -> torch.Tensor:
    sin, cos = ctx.saved_tensors
    return d_sin * cos - d_cos * sin


seeded_pair.register_autograd(_seeded_pair_backward,
                              setup_context=lambda ctx, inputs, output: ctx.save_for_backward(*output))


def seeded_block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    sin, cos = seeded_pair(x @ w)
    return sin * cos


def checkpointed_seeded(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return checkpoint.checkpoint(seeded_block, x, w, use_reentrant=False)


def test_a_checkpointed_op_that_draws_random_numbers_is_saved_as_its_outputs(fake_mesh_4):
    x, w = torch.randn(8, 6, requires_grad=True), torch.randn(6, 12, requires_grad=True)
    placements = {0: (Shard(0),)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # no sharding rule for the test's op: it runs replicated
        forward, _ = lowered_graphs(checkpointed_seeded, x, w, device_mesh=fake_mesh_4, placements=placements,
                                    grad=True)[(0,)]
        out, grads = fxshard.simulate(checkpointed_seeded, x, w, mesh=fxshard.MeshSpec(tp=4),
                                      placements=placements, grad=True)
    saved = [n for n in saved_values(forward) if n.op != "placeholder"]
    assert [(str(n.target), n.args[1]) for n in saved] == [("<built-in function getitem>", 0),
                                                           ("<built-in function getitem>", 1)]
    ref = checkpointed_seeded(x, w)
    ref.backward(torch.ones_like(ref))
    torch.testing.assert_close((out, grads), (ref, {0: x.grad, 1: w.grad}))


def parallelized_attention(mesh: Any, sequence_parallel: bool) -> tuple[torch.nn.Module, torch.Tensor]:
    """``CheckpointedBlocks`` under ``parallelize_module`` and its input (a DTensor on sequence shards with SP)."""
    torch.manual_seed(0)
    model = CheckpointedBlocks()
    parallelize_attention(model, mesh, sequence_parallel)
    x = torch.randn(2, 8, 32)
    return model, (distribute_tensor(x, mesh, SEQUENCE) if sequence_parallel else x).requires_grad_()


def gradient_placements(model: torch.nn.Module) -> dict[str, bool]:
    """Whether each parameter's gradient arrived, in the parameter's placements where it is a DTensor."""
    return {name: p.grad is not None and (not isinstance(p, DTensor) or p.grad.placements == p.placements)
            for name, p in model.named_parameters()}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_torch_compile_trains_checkpointed_attention(layout, fake_mesh_4):
    """On the fake group the numbers mean nothing (tests/test_e2e_gloo.py's ranks check them): the step
    compiles and runs, and every gradient lands in its parameter's placements."""
    model, x = parallelized_attention(fake_mesh_4, LAYOUTS[layout])
    out = torch.compile(model, backend="fxshard", options={"inductor": False})(x)
    torch._dynamo.reset()
    out.sum().backward()
    assert all(gradient_placements(model).values()) and x.grad is not None


def test_fxshard_compile_trains_checkpointed_attention(fake_mesh_4):
    torch.manual_seed(0)
    model = CheckpointedBlocks()
    for name, placements in attention_placements(False).items():
        owner, _, leaf = name.rpartition(".")
        param = model.get_submodule(owner).get_parameter(leaf)
        model.get_submodule(owner).register_parameter(
            leaf, torch.nn.Parameter(distribute_tensor(param.detach(), fake_mesh_4, list(placements))))
    fxshard.compile(model, inductor=False)(torch.randn(2, 8, 32)).sum().backward()
    assert all(gradient_placements(model).values())


def test_torch_compile_trains_hf_llama_with_gradient_checkpointing(fake_mesh_4):
    """The plan transformers ships with the model (examples/generate.py), the layers checkpointed."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
    try:
        from generate import tensor_parallel_plan
    finally:
        sys.path.pop(0)
    from torch.distributed.tensor.experimental import implicit_replication
    from torch.distributed.tensor.parallel import parallelize_module

    torch.manual_seed(0)
    model = hf_llama()
    parallelize_module(model, fake_mesh_4, tensor_parallel_plan(model))
    compiled = torch.compile(lambda ids: model(input_ids=ids, use_cache=False).logits, backend="fxshard",
                             options={"inductor": False})
    with implicit_replication():  # the norms' weights and the rotary tables are plain tensors: replicated
        out = compiled(torch.randint(0, 256, (2, 8)))
        torch._dynamo.reset()
        out.sum().backward()
    assert all(gradient_placements(model).values())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_checkpointed_attention_trains_on_two_gloo_ranks(layout):
    """torch.compile(backend="fxshard") with Inductor: two SGD steps on fresh random data, the loss, the
    input's gradient and every parameter's against one device (tests/rank_programs.py)."""
    results = run_program("checkpointed_attention", 2, timeout=600.0, sequence_parallel=LAYOUTS[layout])
    for rank, errors in sorted(results.items()):
        assert max(errors.values()) <= 1e-5, (rank, errors)
