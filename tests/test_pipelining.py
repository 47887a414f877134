"""Pipeline parallelism (backend/pipelining.py): stages on sub-meshes, their boundaries, their numerics.

Loss and every gradient are checked against one device on fresh random data: on 4 real gloo
ranks under torch.distributed.pipelining (2 stages x TP 2, GPipe and 1F1B), and for pipeline x
data x tensor parallelism (pp 2 x dp 2 x tp 2) on simulated ranks, the blocks crossing each
boundary being the ones the stage before returned on the same rank.
"""
from __future__ import annotations

import pathlib
import sys
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

import fxshard
from fxshard.backend.capture.inputs import InputError
from fxshard.backend.pipelining import PassThrough, PipelineRank, explain_pipeline, simulate_pipeline, split_model
from fxshard.backend.simulate import fake_world

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"
sys.path.insert(0, str(EXAMPLES))  # spawned ranks inherit sys.path and import the example by name
import train_llama_pp  # noqa: E402
from models.llama import Llama  # noqa: E402

BANDWIDTH_BOUND = fxshard.CostModel(default_latency=0.0)


class Block(nn.Module):
    """A residual Megatron MLP block: column-parallel up, row-parallel down."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.up, self.down = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


class Stack(nn.Module):
    def __init__(self, dim: int = 16, hidden: int = 32, n: int = 4):
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim, hidden) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


@dataclass
class Case:
    """A model split into stages, its placements on (dp, tp), a batch, and its single-device loss."""

    model: nn.Module
    stages: list
    x: torch.Tensor
    y: torch.Tensor
    params: dict
    inputs: tuple
    loss_fn: Callable
    single: Callable[[], torch.Tensor]
    activation: int  # bytes of one microbatch's activation at the boundary, fp32


def stack_case() -> Case:
    """A 4-block MLP stack in 2 stages; Megatron on tp, replicated on dp; rows sharded on dp; MSE."""
    model = Stack()
    params = {}
    for name, _ in model.named_parameters():
        tp = Shard(0) if ".up." in name else Shard(1) if name.endswith("down.weight") else Replicate()
        params[name] = (Replicate(), tp)
    rows = (Shard(0), Replicate())
    x, y = torch.randn(8, 4, 16), torch.randn(8, 4, 16)
    stages = [["blocks.0", "blocks.1"], ["blocks.2", "blocks.3"]]
    activation = 4 * 4 * 16 * 4  # a microbatch of the residual stream, fp32
    return Case(model, stages, x, y, params, (rows, rows), F.mse_loss, lambda: F.mse_loss(model(x), y), activation)


def llama_case() -> Case:
    """examples/train_llama_pp.py's split and placements at pp 2 x dp 2 x tp 2."""
    cfg = train_llama_pp.CONFIG
    model = Llama(cfg)
    params, inputs = train_llama_pp.placements(model, {"pp": 2, "dp": 2, "tp": 2})
    x, y = (torch.randint(0, cfg.vocab_size, (8, 16)) for _ in range(2))
    activation = 4 * 16 * cfg.dim * 4
    return Case(model, train_llama_pp.STAGES, x, y, params, inputs, train_llama_pp.loss_fn,
                lambda: model.loss(x, y), activation)


@pytest.fixture(scope="module", params=[pytest.param(stack_case, id="mlp-stack"),
                                        pytest.param(llama_case, id="llama", marks=pytest.mark.slow)])
def three_d(request) -> tuple:
    """A case planned at pp 2 x dp 2 x tp 2 with two microbatches: (case, plan)."""
    torch.manual_seed(0)
    c = request.param()
    plan = explain_pipeline(c.model, c.stages, [c.x], [c.y], mesh={"pp": 2, "dp": 2, "tp": 2}, placements=c.params,
                            input_placements=c.inputs, loss_fn=c.loss_fn, n_microbatches=2,
                            cost_model=BANDWIDTH_BOUND)
    return c, plan


def test_pipeline_x_data_x_tensor_parallel_is_exact(three_d):
    """The mean loss of the microbatches and every gradient equal one device's."""
    c, plan = three_d
    loss, grads = simulate_pipeline(plan, [c.x], [c.y])
    c.model.zero_grad()
    want = c.single()
    want.backward()
    errors = {name: ((grads[name] - p.grad).abs().max() / p.grad.abs().max()).item()
              for name, p in c.model.named_parameters()}
    assert torch.allclose(loss, want, rtol=1e-5) and max(errors.values()) <= 1e-5, (loss, want, errors)


def test_the_boundary_carries_the_local_block(three_d):
    """What stage 0 hands on stays sharded as its plan leaves it (rows on dp, nothing gathered):
    each rank sends 1/dp of a microbatch's activation, and the report says so."""
    c, plan = three_d
    assert plan.boundary_bytes == [c.activation // 2], str(plan)
    assert f"to stage 1: {c.activation // 2} B per rank per microbatch" in str(plan)


SPLITS = [  # stage modules -> the parameters the stage keeps
    (["tok_embeddings", "layers.0"], {"tok_embeddings", "layers.0"}),
    (["layers.1", "norm", "output"], {"layers.1", "norm", "output"}),
]


def owner(name: str) -> str:
    """The top-level module a parameter belongs to (``layers.N`` for a layer)."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "layers" else parts[0]


@pytest.mark.parametrize("modules,kept", SPLITS)
def test_split_model_keeps_its_modules_under_their_names(modules, kept):
    stage = split_model(Llama(train_llama_pp.CONFIG), modules)
    assert {owner(n) for n, _ in stage.named_parameters()} == kept


def test_stages_in_turn_are_the_model():
    """Modules of other stages pass the activation through, so the stages composed run the model."""
    torch.manual_seed(0)
    model = Llama(train_llama_pp.CONFIG)
    first, second = (split_model(model, m) for m, _ in SPLITS)
    tokens = torch.randint(0, train_llama_pp.CONFIG.vocab_size, (2, 8))
    assert isinstance(first.output, PassThrough) and isinstance(second.tok_embeddings, PassThrough)
    assert torch.equal(second(first(tokens)), model(tokens))


def test_a_program_on_two_meshes_names_both():
    """A parameter on one stage's sub-mesh, the argument on another mesh: the error names both
    meshes (their axes and ranks) and a tensor on each."""
    with fake_world(fxshard.MeshSpec(pp=2, tp=2)) as mesh:
        stage_mesh = mesh["tp"]
        other = mesh["pp"]
        layer = nn.Linear(4, 4, bias=False)
        layer.weight = nn.Parameter(DTensor.from_local(torch.ones(2, 4), stage_mesh, [Shard(0)], run_check=False))
        x = DTensor.from_local(torch.ones(2, 4), other, [Replicate()], run_check=False)
        with pytest.raises(InputError) as error:
            fxshard.compile(layer, inductor=False)(x)
    message = str(error.value)
    for part in ("DeviceMesh(tp=2; ranks [0, 1])", "parameter 'weight'", "DeviceMesh(pp=2; ranks [0, 2])",
                 "argument 0"):
        assert part in message, message


def test_a_batch_that_is_not_the_planned_one_is_refused():
    """This rank's batch must be n_microbatches x its planned block; the error gives both shapes."""
    torch.manual_seed(0)
    model = Stack(n=2)
    params = {n: (Shard(0),) if ".up." in n else (Shard(1),) if n.endswith("down.weight") else (Replicate(),)
              for n, _ in model.named_parameters()}
    x, y = torch.randn(4, 16), torch.randn(4, 16)
    plan = explain_pipeline(model, [["blocks.0"], ["blocks.1"]], [x], [y], mesh={"pp": 2, "tp": 2}, placements=params,
                            input_placements=((Replicate(),), (Replicate(),)), loss_fn=F.mse_loss, n_microbatches=2)
    with fake_world(fxshard.MeshSpec(pp=2, tp=2)) as mesh:  # this process is rank 0: stage 0
        me = PipelineRank(plan, model, mesh, inductor=False)
        with pytest.raises(ValueError, match=r"input 0 has shape \(6, 16\).*splits \(4, 16\) into 2 microbatches"):
            me.step(None, [torch.randn(6, 16)])


def test_two_stages_x_tp2_on_four_gloo_ranks():
    """examples/train_llama_pp.py at a small size, the boundary pinned to sequence shards: one step
    under GPipe and one under 1F1B give the single-device loss and gradients, and each rank sends
    (and gets back) exactly its local block of each microbatch's activation: 1/tp of it."""
    batch, seq, microbatches = 4, 16, 2
    results = train_llama_pp.spawn(4, timeout=600.0, batch=batch, seq=seq, n_microbatches=microbatches, steps=0,
                                   inductor=False, sequence_boundary=True)
    block = batch // microbatches * seq * train_llama_pp.CONFIG.dim * 4 // 2  # fp32, the sequence halved on tp
    for rank, r in sorted(results.items()):
        for schedule, check in r["checks"].items():
            assert check["grad_error"] <= 1e-5, (rank, schedule, check)
            if r["stage"] == 1:  # the last stage has the loss
                assert abs(check["loss"] - r["first_loss"]) <= 1e-5 * abs(r["first_loss"]), (rank, schedule, check)
        direction = "forward" if r["stage"] == 0 else "backward"
        assert r["sent"] == [(direction, m, block) for _ in r["checks"] for m in range(microbatches)], (rank, r["sent"])
        assert r["planned_bytes"] == [block]


@pytest.mark.slow
def test_the_example_trains_with_inductor():
    """The example as it runs: Inductor, AdamW steps under 1F1B tracking one device's losses."""
    results = train_llama_pp.spawn(4, timeout=900.0, steps=3)
    for rank, r in sorted(results.items()):
        if r["losses"] and r["losses"][0] is not None:
            for a, b in zip(r["losses"], r["ref_losses"]):
                assert abs(a - b) <= 1e-4 * abs(b), (rank, r["losses"], r["ref_losses"])
