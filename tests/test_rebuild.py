"""A value made of small ones by pointwise ops is computed again where its consumer wants it
(fxshard/rebuild.py), and plans are priced so (propagation's and refinement's costs).

The case it was built for: a vocab-parallel loss's backward under FSDP. The one-hot targets
are as large as the logits, made of batch-sharded token ids; the logits' gradient is
vocab-sharded. Moving the one-hot is an all_to_all of the logits' size; building it again
vocab-sharded gathers the token ids alone.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import Shard

import fxshard
from fxshard.backend.driver import plan_function
from fxshard.backend.explain import collectives_of
from fxshard.graph import LAYOUT, SRC_LAYOUT

MESH = fxshard.MeshSpec(dp=4)
BANDWIDTH_BOUND = fxshard.CostModel(default_latency=0.0)  # bytes decide, as in tests/test_training.py
ROWS, VOCAB = 64, 512


def minus_one_hot(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A cross entropy's gradient in the form its decomposition takes: where(ids == target & valid)."""
    hot = (torch.arange(VOCAB).view(-1) == targets.unsqueeze(1)) & (targets.unsqueeze(1) != -100)
    return logits - torch.where(hot, 2.0, 0.0)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    targets = torch.randint(0, VOCAB, (ROWS,))
    targets[::7] = -100  # ignored rows
    return torch.randn(ROWS, VOCAB), targets


def test_one_hot_is_built_in_the_wanted_layout():
    torch.manual_seed(0)
    logits, targets = _data()
    placements = {0: (Shard(1),), 1: (Shard(0),)}
    out = fxshard.simulate(minus_one_hot, logits, targets, mesh=MESH, placements=placements,
                           cost_model=BANDWIDTH_BOUND)
    torch.testing.assert_close(out, minus_one_hot(logits, targets))
    explained = fxshard.explain(minus_one_hot, logits, targets, mesh=MESH, placements=placements,
                                cost_model=BANDWIDTH_BOUND)
    ids_bytes = ROWS * 8 * 3 // 4  # the token ids, gathered: what each rank receives
    assert [(c.kind, c.bytes_per_rank) for c in explained.collectives] == [("all_gather", ids_bytes)]


def test_rebuilt_only_where_cheaper_than_moving():
    """A value wanted in another layout: made of token ids, it is built there (the ids gathered); made
    of an input as large as itself, it is moved (moving the input and replaying costs more)."""
    def one_hot(ids):
        return fxshard.constrain((torch.arange(VOCAB) == ids.unsqueeze(1)).float(), (Shard(1),))

    def scaled(x):
        return fxshard.constrain(x * 2.0 + 1.0, (Shard(1),))

    ids, x = torch.randint(0, VOCAB, (ROWS,)), torch.randn(ROWS, VOCAB)
    for fn, arg, expected in [(one_hot, ids, [("all_gather", ROWS * 8 * 3 // 4)]),
                              (scaled, x, [("all_to_all", ROWS * VOCAB * 4 * 3 // 16)])]:
        explained = fxshard.explain(fn, arg, mesh=MESH, placements={0: (Shard(0),)}, cost_model=BANDWIDTH_BOUND)
        assert [(c.kind, c.bytes_per_rank) for c in explained.collectives] == expected, fn.__name__
        out = fxshard.simulate(fn, arg, mesh=MESH, placements={0: (Shard(0),)}, cost_model=BANDWIDTH_BOUND)
        torch.testing.assert_close(out, fn(arg))


class VocabParallelHead(nn.Module):
    """A norm, an output projection and a cross entropy: the end of a language model."""

    def __init__(self, dim: int = 32, vocab: int = VOCAB):
        super().__init__()
        self.norm = nn.RMSNorm(dim)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.output = nn.Linear(dim, vocab, bias=False)

    def loss(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.output(self.norm(torch.relu(self.proj(h))))
        return nn.functional.cross_entropy(logits.float(), targets)


def test_vocab_parallel_loss_under_fsdp():
    """FSDP (every parameter Shard(0), batch Shard(0)) where the output weight is larger than the
    hidden states: the plan keeps it vocab-sharded and gathers the hidden states; its backward
    neither moves the one-hot targets nor the logits' gradient by all_to_all, nor gathers the output
    weight, whose gradient needs no reduce_scatter; the gradients are the single device's."""
    torch.manual_seed(2)
    model = VocabParallelHead()
    h, targets = torch.randn(ROWS, 32), torch.randint(0, VOCAB, (ROWS,))
    placements = {**{name: (Shard(0),) for name, _ in model.named_parameters()}, 0: (Shard(0),), 1: (Shard(0),)}
    ref = torch.autograd.grad(model.loss(h, targets), list(model.parameters()))
    _, grads = fxshard.simulate(model.loss, h, targets, mesh=MESH, placements=placements, grad=True,
                                cost_model=BANDWIDTH_BOUND)
    for (name, _), g in zip(model.named_parameters(), ref):
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6)
    _, planned = plan_function(model.loss, (h, targets), mesh=MESH, placements=placements, training=True,
                               cost_model=BANDWIDTH_BOUND)
    moved = {(gm_name, c.kind, str(c.node.meta[SRC_LAYOUT]), str(c.node.meta[LAYOUT]))
             for gm_name, gm in (("forward", planned.training.forward), ("backward", planned.training.backward))
             for c in collectives_of(gm)}
    output_weight = f"[4@dp {VOCAB // 4}] [32]"
    assert [m for m in moved if m[1] == "all_to_all" or output_weight in m[2:]] == []
    assert ("forward", "all_gather", "[4@dp 16] [32]", "[64] [32]") in moved  # the hidden states


def test_token_ids_read_by_several_values_are_gathered_once():
    """A vocab-parallel cross entropy over batch-sharded targets, the logits' rows whole: the ignore mask
    (bool) and the clamped targets (int64) are wanted whole in the forward, the targets again in the
    backward's one-hot. Moved one by one, that is a gather per value (bucketed: a call per dtype, and
    one more in the backward); the token ids gathered once, each is computed from them where it is
    read, and the backward reads the gathered ids the forward keeps (``rebuild.shared_leaves``)."""
    torch.manual_seed(1)
    logits, targets = _data()
    logits.requires_grad_(True)
    placements = {0: (Shard(1),), 1: (Shard(0),)}
    loss = torch.nn.functional.cross_entropy
    _, planned = plan_function(loss, (logits, targets), mesh=MESH, placements=placements, training=True,
                               cost_model=BANDWIDTH_BOUND)

    def of_targets(gm: torch.fx.GraphModule) -> list[tuple]:
        return [(c.kind, c.node.meta["val"].dtype, c.bytes_per_rank) for c in collectives_of(gm)
                if c.node.meta["val"].dtype in (torch.int64, torch.bool)]

    assert of_targets(planned.training.forward) == [("all_gather", torch.int64, ROWS * 8 * 3 // 4)]
    # the backward's masks of valid rows (the ignore mask, and the in-range mask of log-softmax's row sums,
    # decompose.fold_one_hot_sums): 48 bytes each moved cost less than copying the kept ids' 512 (a
    # bandwidth-only model's choice); the ids themselves are not gathered again, nor the row sums (192
    # bytes of float32 before the fold)
    backward = collectives_of(planned.training.backward)
    assert [dtype for _, dtype, _ in of_targets(planned.training.backward)] == [torch.bool, torch.bool]
    assert [c.node.meta["val"].dtype for c in backward] == [torch.bool, torch.bool]
    run = fxshard.backend.simulate.simulate_ranks(loss, logits, targets, mesh=MESH, placements=placements, grad=True,
                                                  cost_model=BANDWIDTH_BOUND)
    expected = loss(logits, targets)
    expected.backward()
    torch.testing.assert_close(run.full()[0], expected.detach())
    torch.testing.assert_close(run.full_grads()[0], logits.grad)
