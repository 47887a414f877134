"""A training step's memory estimate (``fxshard.memory.step_memory``) is the sum its plan implies: for
small FSDP and Megatron programs on 4 ranks, each figure written out from the local values the plan
holds at its peak (fp32, bytes per rank). bench/memory.py compares the estimate with measured peaks."""
from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import fxshard
from fxshard.backend.capture.capture import capture
from fxshard.backend.capture.inputs import input_layouts, named_inputs
from fxshard.backend.programs.joint import plan_training
from fxshard.memory import step_memory

F32 = 4  # bytes of an fp32 element (a bool is 1)
B, D, H = 256, 16, 32  # batch, model dim, hidden dim; x [B, D], w1 [H, D], w2 [D, H]: weights smaller than x


def mlp_loss(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return (torch.relu(x @ w1.t()) @ w2.t()).sum()


def _step_memory(axis: str, placements: dict) -> tuple[int, int, int, int]:
    """(forward peak, kept, backward peak, step peak) of ``mlp_loss``'s training plan on 4 ranks."""
    args = (torch.randn(B, D), torch.randn(H, D, requires_grad=True), torch.randn(D, H, requires_grad=True))
    captured = capture(mlp_loss, args)
    names = named_inputs(mlp_loss, args, captured.objects)
    mesh = fxshard.MeshSpec({axis: 4})
    layouts = input_layouts(captured.objects, mesh, [k for _, k in names], placements)
    plan = plan_training(captured.gm, captured.example_inputs, mesh=mesh, layouts=layouts,
                         names=[n for n, _ in names], cost_model=fxshard.CostModel(default_latency=0.0))
    m = step_memory(plan.forward, plan.backward)
    return m.forward_peak, m.kept, m.backward_peak, m.peak


ROWS = B // 4  # FSDP: one rank's rows of the batch
LOSS = F32  # the replicated scalar loss
CASES = {
    # FSDP: the forward gathers w1 [H, D] and w2 [D, H]; its peak is h = x w1^T and relu(h), [ROWS, H]
    # each; it keeps relu(h), the loss and gathered w2 (the backward's first gather: policies.TrainingSplit).
    # The backward's peak: dh = dy w2 computed for the whole batch [B, H] (dy, an expanded scalar, is
    # replicated), its rows [ROWS, H] sliced out, beside dw2 [D, H] before its reduce-scatter.
    "fsdp": ("dp", {0: (Shard(0),), 1: (Shard(0),), 2: (Shard(0),)},
             (2 * ROWS * H * F32, ROWS * H * F32 + LOSS + D * H * F32,
              B * H * F32 + ROWS * H * F32 + D * H * F32, None)),
    # Megatron: w1 column-, w2 row-parallel, nothing gathered. Forward peak: relu(h) [B, H/4] beside the
    # partial y [B, D] and its sum; kept: relu(h) and the loss. Backward peak: dw2's shard [D, H/4] and
    # dh [B, H/4] with relu's mask (bool), the 0 it selects and the masked dh.
    "megatron": ("tp", {0: (Replicate(),), 1: (Shard(0),), 2: (Shard(1),)},
                 (B * H // 4 * F32 + B * D * F32 + F32, B * H // 4 * F32 + LOSS,
                  D * H // 4 * F32 + 2 * B * H // 4 * F32 + B * H // 4 + F32, None)),
}


@pytest.mark.parametrize("style", CASES)
def test_step_memory_is_the_sum_the_plan_implies(style):
    axis, placements, (forward, kept, backward, _) = CASES[style]
    assert _step_memory(axis, placements) == (forward, kept, backward, max(forward, kept + backward))


def test_a_symbolic_peak_keeps_only_the_sums_no_other_one_bounds():
    """The peak over a symbolic mesh is one ``Max`` of the live sums that no other bounds term by term (what
    sympy would otherwise compare pairwise through its assumptions); sums it cannot read so stay."""
    import sympy

    from fxshard.memory import _max

    tp = sympy.Symbol("tp", integer=True, positive=True)
    peak = _max(0, 16, 8192 + 51200 / tp, 9216 + 50176 / tp, 100 + 1 / tp, 8192 + 51200 / tp, 8000 + 51200 / tp)
    assert peak == sympy.Max(8192 + 51200 / tp, 9216 + 50176 / tp)
    for n in (1, 2, 4, 8, 64):  # the value of the Max of all of them
        assert peak.subs(tp, n) == max(v.subs(tp, n) if isinstance(v, sympy.Expr) else v for v in (
            16, 8192 + 51200 / tp, 9216 + 50176 / tp, 100 + 1 / tp, 8000 + 51200 / tp))
    assert _max(8, 4 * sympy.ceiling(16 / tp)) == sympy.Max(8, 4 * sympy.ceiling(16 / tp))
    assert _max(3, 0, 2) == 3
