"""Messages whose fix the user can apply, each followed and run: torchtitan's sequence-parallel plan on a
block given a local sequence shard, and a model parallelized by transformers' own tensor parallelism.
(A checkpoint whose keys carry a prefix: tests/test_load.py.)"""
from __future__ import annotations

import copy
import sys

import pytest
import torch
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

import fxshard
from fxshard.backend.simulate import fake_world

from test_e2e_gloo import EXAMPLES

sys.path.insert(0, str(EXAMPLES))
from models.llama import LlamaConfig, TransformerBlock, rope_angles  # noqa: E402

sys.path.remove(str(EXAMPLES))

CFG = LlamaConfig(dim=64, n_heads=8, n_kv_heads=4, ffn_dim=128)
WORLD, BATCH, SEQ = 4, 2, 16


def torchtitan_layer_plan(row_output_local: bool = True) -> dict:
    """torchtitan llama3's ``apply_tp`` plan for one block, its styles' defaults as torchtitan leaves them."""
    def rowwise() -> RowwiseParallel:
        return RowwiseParallel(output_layouts=Shard(1)) if row_output_local else RowwiseParallel(
            output_layouts=Shard(1), use_local_output=False)

    return {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
        "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
        "attention.wo": rowwise(),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": rowwise(),
    }


def fresh_block() -> TransformerBlock:
    torch.manual_seed(0)
    return TransformerBlock(CFG)


def test_a_local_sequence_shard_input_names_every_change():
    """A block under torchtitan's plan given this rank's sequence shard (as the previous stage hands it): the
    message says to pass it as a DTensor and names both row-parallel styles whose local outputs meet it."""
    block = fresh_block()
    rope = rope_angles(SEQ, CFG.head_dim, CFG.rope_theta)
    with fake_world(fxshard.MeshSpec(tp=WORLD)) as mesh:
        parallelize_module(block, mesh, torchtitan_layer_plan())
        with pytest.raises(Exception) as caught:
            torch.compile(block, backend="fxshard")(torch.randn(BATCH, SEQ // WORLD, CFG.dim), rope)
        torch._dynamo.reset()
    message = str(caught.value)
    for needed in ("Pass the input as a DTensor, x = DTensor.from_local(x, mesh, [Shard(dim=1)])",
                   "use_local_output=False in the parallel styles of 'attention.wo', 'feed_forward.w2'"):
        assert needed in message, message


def test_following_the_local_shard_message_runs_as_one_device():
    """The message followed: x a DTensor sharded on the sequence, the two row-parallel styles keeping
    DTensors; the simulated ranks' output equals the single-device block's on fresh random data."""
    reference = fresh_block()
    block = copy.deepcopy(reference)
    x = torch.randn(BATCH, SEQ, CFG.dim, generator=torch.Generator().manual_seed(7))
    rope = rope_angles(SEQ, CFG.head_dim, CFG.rope_theta)
    with fake_world(fxshard.MeshSpec(tp=WORLD)) as mesh:
        with LocalTensorMode(WORLD):
            parallelize_module(block, mesh, torchtitan_layer_plan(row_output_local=False))
            sharded = distribute_tensor(x, mesh, [Shard(1)])
        out = fxshard.simulate(block, sharded, rope)
    with torch.no_grad():
        torch.testing.assert_close(out, reference(x, rope), rtol=1e-4, atol=1e-5)


def test_transformers_tensor_parallelism_says_what_to_write_instead_and_that_runs():
    """transformers' TP hands Dynamo local tensors and its own all_reduce: the message names the collective and
    transformers' wrapping, and gives the program to write; that program, on 2 gloo ranks, matches one device."""
    pytest.importorskip("transformers")
    results = run_program_from_hints("transformers_tp_then_the_fix", 2, timeout=600.0)
    for rank, r in sorted(results.items()):
        message = r["message"] or ""
        for needed in ("_c10d_functional.all_reduce", "transformers' tensor parallelism",
                       "plan=fxshard.ShardPlan.from_tp_plan(model.tp_plan)", "fxshard.compile(Logits(model))"):
            assert needed in message, (rank, message)
        assert r["error"] <= 1e-5, (rank, r["error"])


def run_program_from_hints(name: str, world_size: int, timeout: float) -> dict:
    """tests/hint_programs.py's ``name`` on spawned gloo ranks; {rank: result}."""
    from test_e2e_gloo import examples_and_tests_on_path

    with examples_and_tests_on_path():
        import hint_programs
        from ranks import spawn

        return spawn(getattr(hint_programs, name), world_size, timeout=timeout)
