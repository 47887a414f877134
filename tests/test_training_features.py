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
import sys

import pytest
import torch

import fxshard

pytest.importorskip("transformers")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import training_features_programs as programs  # noqa: E402


def test_fxshard_compile_feeds_a_tied_weight_to_both_its_uses(fake_mesh_4):
    """The head shares the embedding's weight: one parameter that ``named_parameters()`` lists once. Dynamo traces
    on stand-ins of the parameters; the alias gets the embedding's (before, it kept the real DTensor: 'aten.mm got
    mixed torch.Tensor and DTensor' at the head). The program reads the weight once and its gradient, both uses
    summed, lands in the weight's placements."""
    model = programs.tiny_qwen3(checkpointing=False)
    model.config.num_hidden_layers = 1
    model.model.layers = model.model.layers[:1]
    model = programs.distributed(model, fake_mesh_4, programs.tp_placements(model))
    compiled = fxshard.compile(programs.LossModule(model), inductor=False)
    compiled(programs.micro_batch(0, 0)).backward()
    names = [name for kind, name in compiled._programs[next(iter(compiled._programs))][1] if kind == "state"]
    assert names.count("model.model.embed_tokens.weight") == 1 and "model.lm_head.weight" not in names
    weight = model.model.embed_tokens.weight
    assert weight.grad is not None and weight.grad.placements == weight.placements
