"""Collectives bucketed and waits overlapped by Inductor's own passes (backend/inductor_config.py).

FSDP in miniature (``rank_programs.Blocks``: two residual MLP blocks, every weight Shard(0) on 4
ranks): fxshard lowers one all_gather per weight and one reduce_scatter per gradient, each wait
right behind its collective; Inductor merges each block's into one and moves waits below compute.
Counts are read from the code Inductor generates, on a fake process group (rank 0).
"""
from __future__ import annotations

import pathlib
import re
import sys

import pytest
import torch
from torch.distributed.tensor import Shard, distribute_tensor

import fxshard
from fxshard.backend.inductor_config import block_bytes, inductor_patches
from fxshard.backend.simulate import fake_world, lowered_graphs

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from rank_programs import Blocks, shard_parameters  # noqa: E402

COST = fxshard.CostModel(default_latency=0.0)  # bytes decide: weights are gathered, not activations
DIM, HIDDEN, TOKENS = 32, 64, 256

_COLLECTIVE = re.compile(r"_c10d_functional\.(all_gather_into_tensor|reduce_scatter_tensor|all_reduce)\w*\.default\(")
_KIND = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter", "all_reduce": "all_reduce"}


def statements(code: str) -> list[str]:
    """The statements of Inductor's ``call``: no comments, shape asserts or dels."""
    body = code[code.index("def call(self, args):"):]
    body = body[:body.index("\n        return ")]
    return [s for line in body.splitlines()[1:]
            if (s := line.strip()) and not s.startswith(("#", "assert_", "del "))]


def collectives(lines: list[str]) -> list[tuple[str, int]]:
    """(kind, statements of compute between its start and its wait) for each collective, in order.

    Compute: an extern kernel (the matmuls; fused C++ kernels also copy into and out of buckets). The wait is the ``wait_tensor`` of the
    collective's buffer (its result, its ``out=``, or the in-place all_reduce's argument)."""
    found = []
    for i, line in enumerate(lines):
        match = _COLLECTIVE.search(line)
        if match is None:
            continue
        buffer = (re.search(r"out=(\w+)\)", line) or re.match(r"(\w+) = ", line)
                  or re.search(r"\.default\((\w+),", line)).group(1)
        wait = next(j for j in range(i + 1, len(lines)) if f"wait_tensor.default({buffer})" in lines[j])
        compute = sum(1 for s in lines[i + 1:wait] if s.startswith("extern_kernels."))
        found.append((_KIND[match.group(1)], compute))
    return found


def lowered_collectives(gm: torch.fx.GraphModule) -> list[tuple[str, int]]:
    """The same for fxshard's lowered program (stage 5): FX nodes, compute being any other op."""
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    found = []
    for i, node in enumerate(nodes):
        name = node.target.__name__.split(".")[0]
        if name in _KIND:
            wait = next(j for j in range(i + 1, len(nodes)) if nodes[j].args and nodes[j].args[0] is node)
            found.append((_KIND[name], wait - i - 1))
    return found


@pytest.fixture(scope="module")
def training_step(fake_mesh_4):
    """{program: (fxshard's lowered collectives, Inductor's)} of one compiled training step."""
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    model = Blocks(DIM, HIDDEN)
    shard_parameters(model, fake_mesh_4)
    lowered: dict = {}  # read when reported: Inductor may rewrite the graph it compiles
    options = {"cost_model": COST, "on_graph": lambda stage, gm: lowered.setdefault(stage, lowered_collectives(gm))
               if stage.startswith("lower") else None}
    compiled = torch.compile(model, backend="fxshard", options=options)
    x = distribute_tensor(torch.randn(TOKENS, DIM), fake_mesh_4, [Shard(0)])

    def step() -> torch.Tensor:
        loss = compiled(x)
        loss.backward()
        return loss
    _, (forward, backward) = run_and_get_code(step)
    return {"forward": (lowered["lower"], collectives(statements(forward))),
            "backward": (lowered["lower_backward"], collectives(statements(backward)))}


def counts(found: list[tuple[str, int]]) -> dict[str, int]:
    result: dict[str, int] = {}
    for kind, _ in found:
        result[kind] = result.get(kind, 0) + 1
    return result


@pytest.mark.parametrize("program, lowered, compiled", [
    # one all_gather per weight (4), the loss summed; Inductor: one bucket per block
    ("forward", {"all_gather": 4, "all_reduce": 1}, {"all_gather": 2, "all_reduce": 1}),
    # the two weights the input gradients need, regathered; one reduce_scatter per gradient
    ("backward", {"all_gather": 2, "reduce_scatter": 4}, {"all_gather": 1, "reduce_scatter": 2}),
])
def test_each_block_is_one_bucket(training_step, program, lowered, compiled):
    fxshard_lowered, inductor = training_step[program]
    assert (counts(fxshard_lowered), counts(inductor)) == (lowered, compiled)


@pytest.mark.parametrize("program, overlapped", [
    ("forward", ["all_gather"]),       # the second block's weights arrive while the first block computes
    ("backward", ["reduce_scatter"]),  # the last block's gradients are reduced while the others compute
])
def test_waits_move_below_compute(training_step, program, overlapped):
    """fxshard lowers every wait right behind its collective; Inductor's scheduler moves it below the
    compute that does not need the result (the first gather and the last reductions have none left)."""
    fxshard_lowered, inductor = training_step[program]
    assert all(compute == 0 for _, compute in fxshard_lowered), fxshard_lowered
    assert [kind for kind, compute in inductor if compute > 0] == overlapped, inductor
