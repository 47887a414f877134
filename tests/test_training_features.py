"""Training as users combine its features: tied embeddings, bf16 parameters, activation checkpointing, gradient
accumulation and gradient clipping, on a tiny Hugging Face Qwen3 (tests/training_features_programs.py), against
one device on fresh random data: fp32 exact, bf16 within one device's own bf16-vs-fp32 error on the same data.

Where fxshard reduces in bf16 (issue 65.6): exactly where DTensor and Megatron's TP do, the partial sums of a
matmul whose K dim the ranks split (row-parallel outputs forward, column-parallel input gradients and the
replicated q/k norms' weight gradients backward), each rank's partial rounded to bf16 by its own matmul; what
transformers computes in fp32 (the cross entropy on upcast logits, the final norm's upcast input) fxshard
reduces in fp32. Kept in bf16: at TP=2 a sum of two bf16 values rounds once whichever dtype it is summed in
(an fp32 reduction measured bit-identical), the partials' own rounding no reduction dtype undoes, and fp32 would
double the bytes; the bf16 test asserts the bound.
"""
from __future__ import annotations

import pathlib
from collections import Counter
import sys

import pytest
import torch

import fxshard

pytest.importorskip("transformers")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import training_features_programs as programs  # noqa: E402


BF16_HALF_ULP = 2.0 ** -9  # a bf16 value's relative rounding, at most


def assert_as_accurate_as_one_device(errors: dict[str, dict[str, float]]) -> None:
    """A sharded bf16 run within one device's own bf16 rounding: its gradients and what its steps moved the
    parameters by as far from the fp32 run as one device's bf16 run's are (a quarter's slack: two roundings alike
    in size, drawn differently), and so from one device's bf16 run at most twice that. The loss, an fp32 mean of
    the cross entropy over bf16 logits, differs from one device's by 1e-5 (relative) where one device's own error
    is 0.3-3 times that from one model size to the next: it is held to rounding to the same bf16 number."""
    own, from_fp32, from_bf16 = errors["own"], errors["fp32"], errors["one_device"]
    for metric in ("grad", "update"):
        assert from_fp32[metric] <= 1.25 * own[metric] and from_bf16[metric] <= 2 * own[metric], \
            (metric, from_fp32, from_bf16, own)
    assert from_bf16["loss"] <= BF16_HALF_ULP, (from_bf16, own)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_simulated_training_features_match_one_device(dtype):
    """Two SGD steps of two accumulated micro-batches each, clipped, the layers checkpointed, the head tied,
    on 2 simulated ranks (``fxshard.simulate(grad=True)`` per micro-batch)."""
    fp32 = programs.one_device(torch.float32, layers=1)
    run = programs.simulated(getattr(torch, dtype), layers=1)
    assert all(norm > programs.RECIPE.max_norm for norm in run.norms), run.norms  # clipping scaled every step
    if dtype == "float32":
        assert max(programs.relative_errors(run, fp32).values()) <= 1e-5
    else:
        assert_as_accurate_as_one_device(programs.errors(run, programs.one_device(torch.bfloat16, layers=1), fp32))


# fxshard.compile's bf16 run by default (~1-3 minutes: Inductor compiles the joint program on each rank); with
# --slow its fp32 run and torch.compile's door (the model's tp plan as parallelize_module styles) in both dtypes
GLOO_RUNS = [("fxshard.compile", "bfloat16"), pytest.param("fxshard.compile", "float32", marks=pytest.mark.slow),
             pytest.param("torch.compile", "bfloat16", marks=pytest.mark.slow),
             pytest.param("torch.compile", "float32", marks=pytest.mark.slow)]


@pytest.mark.parametrize("door, dtype", GLOO_RUNS)
def test_training_features_on_two_gloo_ranks(door, dtype):
    """The same recipe compiled with Inductor on two gloo ranks, ``.grad`` accumulated by backward itself and
    clipped by ``clip_grad_norm_`` on the DTensor gradients: every rank against one device."""
    from test_e2e_gloo import examples_and_tests_on_path

    with examples_and_tests_on_path():  # spawned ranks import tests/training_features_programs.py by name
        from ranks import spawn

        results = spawn(programs.training_features, 2, timeout=900.0, door=door, dtype=dtype)
    for rank, r in sorted(results.items()):
        assert all(norm > programs.RECIPE.max_norm for norm in r["norms"]), (rank, r["norms"])
        if dtype == "float32":
            assert max(r["errors"]["fp32"].values()) <= 1e-5, (rank, r["errors"])
        else:
            assert_as_accurate_as_one_device(r["errors"])


# on the fake process group of 4 ranks (module-scoped: after the simulated tests, which make their own)
def test_fxshard_compile_feeds_a_tied_weight_to_both_its_uses(fake_mesh_4):
    """The head shares the embedding's weight: one parameter that ``named_parameters()`` lists once. Dynamo traces
    on stand-ins of the parameters; the alias gets the embedding's (before, it kept the real DTensor: 'aten.mm got
    mixed torch.Tensor and DTensor' at the head). The program reads the weight once and its gradient, both uses
    summed, lands in the weight's placements."""
    model = programs.tiny_qwen3(checkpointing=False, layers=1)
    model = programs.distributed(model, fake_mesh_4, programs.tp_placements(model))
    compiled = fxshard.compile(programs.LossModule(model), inductor=False)
    compiled(programs.micro_batch(0, 0)).backward()
    names = [name for kind, name in compiled._programs[next(iter(compiled._programs))][1] if kind == "state"]
    assert names.count("model.model.embed_tokens.weight") == 1 and "model.lm_head.weight" not in names
    weight = model.model.embed_tokens.weight
    assert weight.grad is not None and weight.grad.placements == weight.placements


def collectives(gm: torch.fx.GraphModule) -> Counter:
    """(collective, dtype, shape) of every collective a lowered local program issues, counted."""
    return Counter((str(n.target).split(".")[1], n.args[0].meta["val"].dtype, tuple(n.args[0].meta["val"].shape))
                   for n in gm.graph.nodes if n.op == "call_function"
                   and str(n.target).startswith("_c10d_functional.") and "wait" not in str(n.target))


BF, F32, STREAM = torch.bfloat16, torch.float32, (2, 16, 64)  # the residual stream [batch, seq, hidden]
# one layer on 4 ranks, the model's own tp plan, transformers' loss (the logits upcast to fp32 inside it)
REDUCED = {
    "forward": {("all_reduce", BF, STREAM): 2,  # the vocab-parallel lookup; attention's o_proj partial sums
                # the MLP's down_proj partial sums, summed past the final norm's upcast (fxshard moves a sum to
                # where it is cheapest; one device rounds that value to bf16 first)
                ("all_reduce", F32, STREAM): 1,
                ("all_gather_into_tensor", F32, (32, 1, 2)): 1,  # cross entropy: softmax statistics
                ("all_reduce", F32, ()): 1},  # cross entropy: the target logits, picked on their vocab shard
    "backward": {("all_reduce", BF, STREAM): 3,  # input gradients of the head, of q|k|v and of gate|up
                 ("all_reduce", BF, (8,)): 2},  # q_norm's and k_norm's weight gradients, summed over heads
}


def test_bf16_is_reduced_where_dtensor_reduces_it_and_the_loss_in_fp32(fake_mesh_4):
    """Issue 65.6, read off the lowered local programs: in bf16 only the partial sums of matmuls whose K dim
    the ranks split (each rank's partial already rounded to bf16 by its matmul, as under DTensor and Megatron's
    TP); what transformers computes in fp32 (the cross entropy) is reduced in fp32."""
    from fxshard.backend.simulate import lowered_graphs

    model = programs.tiny_qwen3(torch.bfloat16, layers=1)
    forward, backward = lowered_graphs(programs.causal_lm_loss(model), programs.micro_batch(0, 0),
                                       device_mesh=fake_mesh_4, placements=programs.tp_placements(model),
                                       grad=True)[(0,)]
    assert {"forward": collectives(forward), "backward": collectives(backward)} == REDUCED
