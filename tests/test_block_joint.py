"""A repeated block's joint traced once and stamped out per call (backend/capture/block_joint.py): the joint
program is the one the inline trace gives, node for node; training through it matches one device (our
Llama under FSDP and FSDP x TP, Hugging Face's architectures under Megatron TP); a block the template
cannot stand for (a pin inside it, a write into an operand) is read inline."""
from __future__ import annotations

import os
import sys
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard

import fxshard
from fxshard.backend.capture import block_joint
from fxshard.backend.layers.block_regions import blocks_as_regions, repeated_blocks
from fxshard.backend.capture.capture import capture
from fxshard.backend.capture.inputs import input_layouts, named_inputs
from fxshard.backend.layers.regional_program import program_structure
from fxshard.backend.simulate import simulate_ranks
from fxshard.backend.capture.trace import trace_global

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from models.llama import Llama, LlamaConfig, fsdp_placements, fsdp_tp_placements  # noqa: E402

CFG = LlamaConfig(vocab_size=64, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=64)


def _joint(model: nn.Module, args: tuple, placements: dict, mesh: fxshard.MeshSpec, regions: bool,
           forward_only: bool = False):
    """Stage 1's joint program of ``model.loss(*args)`` (its forward alone: ``forward_only``)."""
    with blocks_as_regions(repeated_blocks(model) if regions else []):
        captured = capture(model.loss, args)
    names = named_inputs(model.loss, args, captured.objects)
    layouts = input_layouts(captured.objects, mesh, [k for _, k in names], placements)
    tangents = None if forward_only else [torch.ones(())]
    return trace_global(captured.gm, captured.example_inputs, mesh=mesh, layouts=layouts, tangents=tangents).gm


def _counting_templates(monkeypatch) -> list:
    traced: list = []
    trace = block_joint.trace_template

    def counting(*args: Any, **kwargs: Any) -> Any:
        template = trace(*args, **kwargs)
        traced.append(template)
        return template
    monkeypatch.setattr(block_joint, "trace_template", counting)
    return traced


def _one_device(model: nn.Module, loss_of: Any, *args: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss and every gradient on one device (the model's gradients left cleared)."""
    loss = loss_of(*args)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return loss.detach(), grads


def _trained_on_two_ranks(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss and gradients of ``model.loss(x)``, its layers as regions, on two simulated ranks (x on dp)."""
    with blocks_as_regions(repeated_blocks(model)):
        run = simulate_ranks(model.loss, x, mesh=fxshard.MeshSpec(dp=2), placements={0: (Shard(0),)}, grad=True)
    return run.full()[0], run.full_grads()


@pytest.mark.parametrize("forward_only", [False, True], ids=["joint", "forward"])
def test_a_program_stamped_from_one_template_is_the_program_traced_inline(forward_only, monkeypatch):
    torch.manual_seed(0)
    model = Llama(CFG)
    args = (torch.randint(0, 64, (8, 16)), torch.randint(0, 64, (8, 16)))
    mesh = fxshard.MeshSpec(dp=4)
    placements = {**fsdp_placements(model), 0: (Shard(0),), 1: (Shard(0),)}
    traced = _counting_templates(monkeypatch)
    stamped = _joint(model, args, placements, mesh, regions=True, forward_only=forward_only)
    assert len(traced) == 1 and traced[0] is not None  # one body, three calls, one template
    assert bool(traced[0].backward) != forward_only
    assert not [n for n in stamped.graph.nodes if n.target in (block_joint.BLOCK_FORWARD, block_joint.BLOCK_BACKWARD)]
    inline = _joint(model, args, placements, mesh, regions=False, forward_only=forward_only)
    assert program_structure(stamped.graph) == program_structure(inline.graph)


@pytest.mark.parametrize("mesh, placements", [
    (fxshard.MeshSpec(dp=4), fsdp_placements),
    (fxshard.MeshSpec(dp=2, tp=2), fsdp_tp_placements),
], ids=["fsdp", "fsdp-tp"])
def test_training_through_stamped_blocks_matches_one_device(mesh, placements, monkeypatch):
    torch.manual_seed(len(mesh.names))
    model = Llama(CFG)
    x, y = torch.randint(0, 64, (4, 16)), torch.randint(0, 64, (4, 16))
    want = _one_device(model, model.loss, x, y)
    sharded = (Shard(0),) + (Replicate(),) * (len(mesh.names) - 1)
    traced = _counting_templates(monkeypatch)
    with blocks_as_regions(repeated_blocks(model)):
        run = simulate_ranks(model.loss, x, y, mesh=mesh, placements=placements(model) | {0: sharded, 1: sharded},
                             grad=True, cost_model=fxshard.CostModel(default_latency=0.0))
    assert [t is not None for t in traced] == [True]
    torch.testing.assert_close((run.full()[0], run.full_grads()), want, rtol=1e-4, atol=1e-6)


class _TwoOutputs(nn.Module):
    """A block returning a value only the last block's caller reads: the others' get no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.proj(x)) + x
        return h, (h * h).mean(-1)


class _Blocks(nn.Module):
    def __init__(self, pinned: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_PinnedBlock() if pinned else _TwoOutputs() for _ in range(3))

    def loss(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x, aux = layer(x)
        return x.sum() + aux.sum()


class _PinnedBlock(_TwoOutputs):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, aux = super().forward(x)
        return fxshard.constrain(h, (Replicate(),)), aux


def test_outputs_without_gradients_train_as_one_device(monkeypatch):
    torch.manual_seed(0)
    model = _Blocks()
    x = torch.randn(16, 8)
    want = _one_device(model, model.loss, x)
    traced = _counting_templates(monkeypatch)
    got = _trained_on_two_ranks(model, x)
    assert [t is not None for t in traced] == [True]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_block_holding_a_pin_is_read_inline(monkeypatch):
    torch.manual_seed(0)
    model = _Blocks(pinned=True)
    x = torch.randn(16, 8)
    mesh = fxshard.MeshSpec(dp=2)
    want = _one_device(model, model.loss, x)
    traced = _counting_templates(monkeypatch)
    got = _trained_on_two_ranks(model, x)
    assert traced == [None]  # tried once, read inline at every call
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    with blocks_as_regions(repeated_blocks(model)):
        captured = capture(model.loss, (x,))
    assert any(n.target is torch.ops.higher_order.invoke_subgraph for n in captured.gm.graph.nodes)
    names = named_inputs(model.loss, (x,), captured.objects)
    layouts = input_layouts(captured.objects, mesh, [k for _, k in names], {0: (Shard(0),)})
    joint = trace_global(captured.gm, captured.example_inputs, mesh=mesh, layouts=layouts, tangents=[torch.ones(())])
    assert sum(n.target is fxshard.ops.CONSTRAIN for n in joint.gm.graph.nodes) == 3  # each layer's pin


class _Dropping(_TwoOutputs):
    """A block drawing a dropout mask: each stamped layer draws its own, in the one device's order."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, aux = super().forward(x)
        return torch.nn.functional.dropout(h, p=0.5, training=True), aux


def test_stamped_layers_draw_the_one_devices_random_values(monkeypatch):
    torch.manual_seed(0)
    model = _Blocks()
    model.layers = nn.ModuleList(_Dropping() for _ in range(3))
    x = torch.randn(16, 8)
    torch.manual_seed(1)
    want = _one_device(model, model.loss, x)
    traced = _counting_templates(monkeypatch)
    torch.manual_seed(1)
    got = _trained_on_two_ranks(model, x)
    assert [t is not None for t in traced] == [True]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)

class _Accumulating(nn.Module):
    """A block writing into its operand (a running sum of its outputs' values, kept in place)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.proj(x))
        total.add_(h.detach())
        return h


class _AccumulatingBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Accumulating() for _ in range(3))

    def loss(self, x: torch.Tensor) -> torch.Tensor:
        total = torch.zeros_like(x)
        for layer in self.layers:
            x = layer(x, total)
        return x.sum() + (total * x).sum()


def test_a_block_writing_into_an_operand_trains_as_one_device(monkeypatch):
    torch.manual_seed(0)
    model = _AccumulatingBlocks()
    x = torch.randn(16, 8)
    want = _one_device(model, model.loss, x)
    traced = _counting_templates(monkeypatch)
    got = _trained_on_two_ranks(model, x)
    assert traced == [None]  # its write goes into the program around it: read inline
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    with blocks_as_regions(repeated_blocks(model)):
        captured = capture(model.loss, (x,))
    assert any(n.target is torch.ops.higher_order.invoke_subgraph for n in captured.gm.graph.nodes)


# Hugging Face's architectures through their layers' templates under Megatron TP (tests/zoo.py), called as
# their users call them (decoders with their KV cache), trained and forward only: llama (both) and bart
# (encoder and decoder: two bodies; trained) by default, the others with --slow. T5's layers Dynamo refuses
# as regions (an aliasing output): fxshard.compile captures it without them (captured_with_regions).
ZOO_DEFAULT = {("llama", True), ("llama", False), ("bart", True)}


def _zoo_cases() -> list:
    try:
        from zoo import ZOO
    except ImportError:  # transformers is the models extra
        return []
    return [(name, grad) if (name, grad) in ZOO_DEFAULT else pytest.param(name, grad, marks=pytest.mark.slow)
            for grad in (True, False) for name in ZOO if name != "t5"]


@pytest.mark.parametrize("name, grad", _zoo_cases())
def test_hugging_face_layers_run_through_their_templates(name, grad, monkeypatch):
    import types

    pytest.importorskip("transformers")
    from zoo import ZOO

    arch = ZOO[name]
    torch.manual_seed(0)
    model = arch.build()
    args = arch.example(2, 8)
    fn = arch.call(model)
    if grad:
        run_of = types.MethodType(lambda self, *a: fn(*a).float().pow(2).mean(), model)  # its parameters by name
        want = _one_device(model, run_of, *args)
    else:
        run_of = fn
        with torch.no_grad():
            want = (fn(*args), {})
    traced = _counting_templates(monkeypatch)
    with blocks_as_regions(repeated_blocks(model)):
        run = simulate_ranks(run_of, *args, mesh=fxshard.MeshSpec(tp=2), placements=arch.plan(model), grad=grad)
    assert traced and None not in traced  # every body stamped
    got = run.full_grads() if grad else {}
    torch.testing.assert_close((run.full()[0], {n: got[n] for n in want[1]}), want, rtol=1e-4, atol=1e-5)


def test_a_stamp_that_fails_leaves_the_program_traced_inline(monkeypatch):
    """Stamping saves time and never costs a program: should it fail, stage 1 traces the blocks inline."""
    from fxshard.backend.capture import trace

    def failing(gm: torch.fx.GraphModule) -> None:
        raise RuntimeError("a stamp gone wrong")

    torch.manual_seed(0)
    model = Llama(CFG)
    args = (torch.randint(0, 64, (8, 16)), torch.randint(0, 64, (8, 16)))
    mesh = fxshard.MeshSpec(dp=4)
    placements = {**fsdp_placements(model), 0: (Shard(0),), 1: (Shard(0),)}
    monkeypatch.setattr(trace, "stamp", failing)
    joint = _joint(model, args, placements, mesh, regions=True)
    assert not [n for n in joint.graph.nodes if n.target in (block_joint.BLOCK_FORWARD, block_joint.BLOCK_BACKWARD)]
    monkeypatch.undo()
    assert program_structure(joint.graph) == program_structure(_joint(model, args, placements, mesh, regions=True).graph)


@pytest.mark.parametrize("forward_only", [False, True], ids=["joint", "forward"])
def test_inputs_a_folded_program_never_reads_are_added_after_its_trace_as_if_traced(forward_only, monkeypatch):
    """A folded model's Dynamo graph keeps its dropped layers' parameters as inputs no node reads
    (``fold.shorten``): stage 1 traces without them and adds each as a placeholder where it stands, its
    gradient a ``zeros_like`` of it. The program is the one tracing them gives, node for node and by name."""
    from fxshard.backend.capture import trace
    from fxshard.backend.programs.fold import shorten

    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=64, dim=32, n_layers=6, n_heads=4, n_kv_heads=2, ffn_dim=64))
    args = (torch.randint(0, 64, (8, 16)), torch.randint(0, 64, (8, 16)))
    mesh = fxshard.MeshSpec(dp=4)
    with blocks_as_regions(repeated_blocks(model)):
        captured = capture(model.loss, args)
    short = shorten(captured.gm)
    assert short is not None
    names = named_inputs(model.loss, args, captured.objects)
    layouts = input_layouts(captured.objects, mesh, [k for _, k in names],
                            {**fsdp_placements(model), 0: (Shard(0),), 1: (Shard(0),)})
    unread = trace.unread_inputs(short.gm)
    assert len(unread) == 18  # layers 2 and 3: nine parameters each

    traced_inputs: list[int] = []
    make_fx = trace.make_fx

    def counting(*a: Any, **k: Any) -> Any:
        run = make_fx(*a, **k)
        return lambda *inputs: (traced_inputs.append(len(inputs)), run(*inputs))[1]

    def program() -> torch.fx.GraphModule:
        return trace_global(short.gm, captured.example_inputs, mesh=mesh, layouts=layouts,
                            tangents=None if forward_only else [torch.ones(())]).gm

    monkeypatch.setattr(trace, "make_fx", counting)
    added = program()
    monkeypatch.setattr(trace, "unread_inputs", lambda gm: set())
    traced = program()
    assert traced_inputs[0] == traced_inputs[1] - 18
    assert added.code == traced.code
    assert program_structure(added.graph) == program_structure(traced.graph)
    placeholders = list(added.graph.find_nodes(op="placeholder"))
    for i in unread:
        users = list(placeholders[i].users)
        assert [u.target for u in users] == ([] if forward_only else [torch.ops.aten.zeros_like.default])
