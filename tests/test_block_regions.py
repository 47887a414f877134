"""Repeated blocks captured once (backend/layers/block_regions.py): Dynamo traces a block class's forward
once and calls its body for every block; stage 1 reads the calls inline, so the traced program is
the one Dynamo gives without regions. The user's classes are left as they were, blocks that differ
(Python attributes, buffers, branches) compute what they do, and a block Dynamo cannot take as a
region (a Python side effect) is captured as before."""
from __future__ import annotations

import os
import sys

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Shard

import fxshard
from fxshard.backend.layers.block_regions import blocks_as_regions, captured_with_regions, repeated_blocks
from fxshard.backend.capture.capture import capture
from fxshard.backend.capture.inputs import input_layouts, named_inputs
from fxshard.backend.layers.regional_program import program_structure
from fxshard.backend.capture.trace import _GlobalInterpreter, trace_global

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from models.llama import Llama, LlamaConfig, fsdp_placements  # noqa: E402
from train_llama import distribute_parameters  # noqa: E402

INVOKE = torch.ops.higher_order.invoke_subgraph


def _calls(captured) -> list[torch.fx.Node]:
    return [n for n in captured.gm.graph.nodes if n.target is INVOKE]


def _traced_code(model: nn.Module, x: torch.Tensor, captured) -> tuple:
    """Stage 1's program, its nodes named by position (a stamped layer's are named apart: block_joint.py)."""
    mesh = fxshard.MeshSpec(dp=4)
    names = named_inputs(model, (x,), captured.objects)
    layouts = input_layouts(captured.objects, mesh, [k for _, k in names], {**fsdp_placements(model), 0: (Shard(0),)})
    return program_structure(trace_global(captured.gm, captured.example_inputs, mesh=mesh, layouts=layouts).gm.graph)


def test_a_repeated_block_is_traced_once_and_read_inline():
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=64, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=64))
    x = torch.randint(0, 64, (8, 16))
    plain = capture(model, (x,))
    with blocks_as_regions(repeated_blocks(model)):
        regions = capture(model, (x,))
    calls = _calls(regions)
    assert (len(_calls(plain)), len(calls), len({n.args[1] for n in calls})) == (0, 3, 1)  # one body, 3 calls
    assert [id(o) for o in regions.objects] == [id(o) for o in plain.objects]  # every layer's own weights
    assert _traced_code(model, x, regions) == _traced_code(model, x, plain)


class _Block(nn.Module):
    def __init__(self, i: int) -> None:
        super().__init__()
        self.linear, self.scale, self.relu = nn.Linear(8, 8), i, i % 2 == 0
        self.register_buffer("shift", torch.full((8,), float(i)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x) * self.scale + self.shift
        return y.relu() if self.relu else y


class _Stack(nn.Module):
    def __init__(self, block: type = _Block) -> None:
        super().__init__()
        self.layers = nn.ModuleList(block(i) for i in range(4))

    def forward(self, x: torch.Tensor, *extra: object) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, *extra)
        return x


def test_blocks_that_differ_compute_what_they_do_and_the_class_is_left_as_it_was():
    torch.manual_seed(0)
    model, x = _Stack(), torch.randn(2, 8)
    forward = _Block.forward
    captured = captured_with_regions(lambda: capture(model, (x,)), repeated_blocks(model))
    torch.testing.assert_close(captured.gm(*captured.objects)[0], model(x))
    assert _Block.forward is forward and not [k for k in vars(forward) if "compile_region" in k]
    assert not any("forward" in vars(block) for block in model.layers)


class _Cache:
    def __init__(self) -> None:
        self.values: list[torch.Tensor] = []


class _CachingBlock(nn.Module):
    def __init__(self, i: int) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, cache: _Cache) -> torch.Tensor:
        y = self.linear(x)
        cache.values.append(y)  # a Python side effect: no region
        return y + len(cache.values)


def test_a_block_with_a_side_effect_is_captured_as_before():
    torch.manual_seed(0)
    model, x = _Stack(_CachingBlock), torch.randn(2, 8)

    def run(x: torch.Tensor) -> torch.Tensor:
        return model(x, _Cache())

    captured = captured_with_regions(lambda: capture(run, (x,)), repeated_blocks(model))
    assert not _calls(captured)
    torch.testing.assert_close(captured.gm(*captured.objects)[0], run(x))


def test_fxshard_compile_reads_every_layer_as_a_call_of_one_region(fake_mesh_4, monkeypatch):
    """fxshard.compile captures a model's layers as regions (stage 1 reads one body per layer call)."""
    from torch.distributed.tensor import distribute_tensor

    bodies: list[str] = []
    read = _GlobalInterpreter._inlined
    monkeypatch.setattr(_GlobalInterpreter, "_inlined",
                        lambda self, body, identifier, *operands: bodies.append(identifier) or read(
                            self, body, identifier, *operands))
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=64, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=64))
    distribute_parameters(model, fake_mesh_4, fsdp_placements(model))
    tokens, targets = (distribute_tensor(torch.randint(0, 64, (8, 16)), fake_mesh_4, (Shard(0),)) for _ in range(2))
    fxshard.compile(model.loss, inductor=False)(tokens, targets).backward()
    assert len(bodies) == 3 and len(set(bodies)) == 1, bodies


def test_a_capture_dynamo_refuses_with_regions_is_made_without_them():
    model = _Stack()
    forward = _Block.forward

    def capture_refusing_regions() -> str:
        if _Block.forward is not forward:
            raise RuntimeError("Dynamo refuses the region")
        return "captured without regions"

    assert captured_with_regions(capture_refusing_regions, repeated_blocks(model)) == "captured without regions"
    assert _Block.forward is forward


def test_only_the_users_repeated_blocks_are_regions():
    """torch's own classes are never marked (nn.Linear is every model's), nor a class occurring once."""
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), _Stack(), _Block(9))
    assert repeated_blocks(model) == list(model[3].layers)


def test_a_hugging_face_model_with_its_kv_cache_captures_as_without_regions():
    """Hugging Face decoder layers as regions, called as users call them (the cache on by default):
    a prefill and a decode step, the cache made and read inside the function; one body per shape."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(config).eval()

    def prefill_and_decode(ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = model(ids)
        step = model(ids[:, -1:], past_key_values=out.past_key_values).logits
        return (out.logits, step, *[layer.keys for layer in out.past_key_values.layers])

    ids = torch.randint(0, 128, (2, 16))
    with blocks_as_regions(repeated_blocks(model)):
        captured = capture(prefill_and_decode, (ids,))
    calls = _calls(captured)
    assert (len(calls), len({n.args[1] for n in calls})) == (6, 2)
    for got, want in zip(captured.gm(*captured.objects), prefill_and_decode(ids), strict=True):
        torch.testing.assert_close(got, want)
