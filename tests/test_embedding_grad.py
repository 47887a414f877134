"""The embedding's gradient on the rank's own vocab rows (issue 20).

A table sharded on its vocab rows gets its gradient in that layout directly: each rank accumulates
the token gradients whose ids fall in its rows (``index_put(accumulate=True)`` with the ids masked
and shifted, ``localization.MaskedAccumulate``), so no rank builds the full [vocab, dim] gradient.
With the ids replicated on the table's axis (TP) that needs no collective; with batch-sharded ids
(FSDP) the cost model chooses between gathering the tokens' ids and gradients and reduce-scattering
a full-size partial gradient. Each case is checked against one device on fresh random data.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

import fxshard
from fxshard.backend.driver import plan_function
from fxshard.graph import PLAN
from fxshard.memory import step_memory
from fxshard.ops import REDISTRIBUTE

DIM = 8
F32 = 4


def embed_loss(ids: torch.Tensor, table: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Its backward: ``_unsafe_masked_index_put_accumulate`` into ``new_zeros`` (embedding_dense_backward)."""
    return (F.embedding(ids, table).tanh() * weights).sum()


def index_loss(ids: torch.Tensor, table: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Its backward: ``index_put(accumulate=True)`` into ``new_zeros`` (no mask of its own)."""
    return (table[ids].tanh() * weights).sum()


class Case(NamedTuple):
    mesh: fxshard.MeshSpec
    placements: dict  # ids (0), table (1), weights (2)
    tokens: tuple[int, int]
    vocab: int
    backward: dict[str, int]  # the collectives of the planned backward, by kind
    cost_model: fxshard.CostModel = fxshard.CostModel(default_latency=0.0)  # bytes decide, not latency
    fn: Callable = embed_loss


BATCH = (Shard(0),)
FSDP = {0: BATCH, 1: BATCH, 2: BATCH}
CASES = {
    # vocab-parallel (Megatron): ids and token gradients on every rank, each rank its rows (8, 8, 8, 6)
    "tp vocab 30 on 4": Case(fxshard.MeshSpec(tp=4), {1: (Shard(0),)}, (4, 6), 30, {}),
    "tp vocab 4094 on 4": Case(fxshard.MeshSpec(tp=4), {1: (Shard(0),)}, (4, 6), 4094, {}),
    "tp vocab 3 on 4: a rank without rows": Case(fxshard.MeshSpec(tp=4), {1: (Shard(0),)}, (4, 6), 3, {}),
    "tp table[ids], vocab 30 on 4": Case(fxshard.MeshSpec(tp=4), {1: (Shard(0),)}, (4, 6), 30, {}, fn=index_loss),
    # FSDP, few tokens and a large table: gathering 24 tokens' ids and masks (the forward gathered their
    # gradients' inputs already; ~200 B) beats reduce-scattering a partial [4094, 8] gradient (96 KiB)
    "fsdp vocab 4094, 24 tokens": Case(fxshard.MeshSpec(dp=4), FSDP, (4, 6), 4094, {"all_gather": 2}),
    # ... unless each collective costs 10 us (the default model): one reduce_scatter beats two gathers
    "fsdp vocab 4094, 24 tokens, 10 us latency": Case(fxshard.MeshSpec(dp=4), FSDP, (4, 6), 4094,
                                                      {"reduce_scatter": 1}, fxshard.CostModel()),
    # FSDP, many tokens and a small table: the partial [30, 8] gradient reduce-scattered (1 KiB) beats
    # gathering 2048 tokens (72 KiB)
    "fsdp vocab 30, 2048 tokens": Case(fxshard.MeshSpec(dp=4), FSDP, (64, 32), 30, {"reduce_scatter": 1}),
    # tokens on dp, vocab on tp: each rank accumulates its tp rows of its dp tokens, then sums them over dp
    # (an all_reduce of [15, 8]: 480 B, against 10 KiB to gather 256 tokens' ids, masks and gradients)
    "dp x tp: tokens on dp, vocab on tp": Case(
        fxshard.MeshSpec(dp=2, tp=2), {0: (Shard(0), Replicate()), 1: (Replicate(), Shard(0)),
                                       2: (Shard(0), Replicate())}, (16, 32), 30, {"all_reduce": 1}),
}


def _args(case: Case, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, case.vocab, case.tokens, generator=g)
    return ids, torch.randn(case.vocab, DIM, generator=g, requires_grad=True), torch.randn(*case.tokens, DIM, generator=g)


def _training_plan(case: Case):
    _, planned = plan_function(case.fn, _args(case, 0), mesh=case.mesh, placements=case.placements, training=True,
                               cost_model=case.cost_model)
    return planned.training


@pytest.mark.parametrize("name", CASES)
def test_gradient_matches_one_device(name):
    case = CASES[name]
    ids, table, weights = _args(case, seed=len(name))
    loss, grads = fxshard.simulate(case.fn, ids, table, weights, mesh=case.mesh, placements=case.placements,
                                   grad=True, cost_model=case.cost_model)
    case.fn(ids, table, weights).backward()
    torch.testing.assert_close((loss, grads[1]), (case.fn(ids, table, weights).detach(), table.grad))


@pytest.mark.parametrize("name", CASES)
def test_backward_collectives(name):
    case = CASES[name]
    counts: dict[str, int] = {}
    for node in _training_plan(case).backward.graph.find_nodes(op="call_function", target=REDISTRIBUTE):
        for step in node.meta[PLAN].steps:
            if not step.is_local:
                counts[step.kind] = counts.get(step.kind, 0) + 1
    assert counts == case.backward


@pytest.mark.parametrize("name", ["tp vocab 4094 on 4", "fsdp vocab 4094, 24 tokens"])
def test_backward_peak_holds_the_gradient_at_shard_size(name):
    """The backward's largest values are the rank's rows of the gradient: the zeros it starts from and
    the accumulated rows (one buffer once Inductor accumulates in place), [ceil(vocab/4), DIM] each; the
    rest is token-sized. The full [vocab, DIM] gradient is never built."""
    case = CASES[name]
    plan = _training_plan(case)
    shard = -(-case.vocab // 4) * DIM * F32
    tokens = case.tokens[0] * case.tokens[1]
    token_values = 4 * tokens * DIM * F32 + 8 * tokens * 8  # a few [tokens, DIM] gradients, ids and masks
    assert 2 * shard <= step_memory(plan.forward, plan.backward).backward_peak <= 2 * shard + token_values
