"""FlexAttention (torchtitan's default attention) sharded by heads, Megatron's attention (issue 65.4).

A small attention module calls ``torch.nn.attention.flex_attention.flex_attention`` with a
``create_block_mask`` block mask and a score_mod, its q/k/v projections column-parallel and its
output projection row-parallel. On simulated ranks the result is one device's (on fresh random
data), and the heads never move: no all_gather of q, k or v. The score_mods and mask_mods read the
head index (ALiBi-like slopes, a window per head), which only comes out right if each rank's
subgraphs see global heads (fxshard/flex_attention.py says why). Training: torch refuses flex
attention's backward on CPU (``test_torch_has_no_flex_backward_on_cpu``), so these are forward programs.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import fxshard
from fxshard.backend.simulate import simulate_ranks
from fxshard.backend.reports.traffic import collective_calls, summarize

B, S, D = 2, 16, 8


def causal(b, h, q, k):
    return q >= k


def window_per_head(b, h, q, k):  # head h sees the last h + 2 keys: the mask differs by head
    return (q >= k) & (q - k <= h + 2)


def alibi(score, b, h, q, k):
    return score - (h + 1) * 0.25 * (q - k)


class Attention(torch.nn.Module):
    """q/k/v and output projections around one flex_attention call (``kv_heads`` < ``heads``: grouped-query)."""

    def __init__(self, heads: int, kv_heads: int, score_mod: Callable | None, mask_mod: Callable,
                 mask_heads: int | None, slopes: bool):
        super().__init__()
        self.heads, self.kv_heads = heads, kv_heads
        self.q = torch.nn.Linear(heads * D, heads * D, bias=False)
        self.k = torch.nn.Linear(heads * D, kv_heads * D, bias=False)
        self.v = torch.nn.Linear(heads * D, kv_heads * D, bias=False)
        self.o = torch.nn.Linear(heads * D, heads * D, bias=False)
        self.block_mask = create_block_mask(mask_mod, None, mask_heads, S, S, device="cpu")
        self.register_buffer("slopes", torch.rand(heads) + 0.1 if slopes else None)  # the score_mod captures it
        self.score_mod = score_mod

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # contiguous heads: Inductor's CPU flex template wants 4-d buffers (a transposed view of a 2-d one fails
        # in torch 2.13 and 2.15 alike, with or without fxshard)
        q = self.q(x).view(b, s, -1, D).transpose(1, 2).contiguous()
        k = self.k(x).view(b, s, -1, D).transpose(1, 2).contiguous()
        v = self.v(x).view(b, s, -1, D).transpose(1, 2).contiguous()
        score_mod = self.score_mod
        if self.slopes is not None:
            slopes = self.slopes

            def score_mod(score, b, h, q_idx, kv_idx):
                return score - slopes[h] * (q_idx - kv_idx)
        out = flex_attention(q, k, v, score_mod=score_mod, block_mask=self.block_mask,
                             enable_gqa=self.kv_heads != self.heads)
        return self.o(out.transpose(1, 2).reshape(b, s, -1))


@dataclass(frozen=True)
class Case:
    tp: int
    heads: int = 4
    kv_heads: int = 4
    score_mod: Callable | None = alibi
    mask_mod: Callable = causal
    mask_heads: int | None = None  # None: one block mask for every head; else its [1, heads, ...] tensors
    slopes: bool = False  # the score_mod indexes a captured [heads] tensor by the head index


CASES = {
    "causal alibi tp2": Case(2),
    "causal alibi tp4": Case(4),
    "window per head tp2": Case(2, mask_mod=window_per_head, mask_heads=4),
    "window per head tp4": Case(4, score_mod=None, mask_mod=window_per_head, mask_heads=4),
    "gqa causal alibi tp2": Case(2, heads=4, kv_heads=2),
    "causal, no score_mod tp2": Case(2, score_mod=None),
}

# Megatron's attention: ColwiseParallel q/k/v (weights Shard(0)), RowwiseParallel o (Shard(1))
MEGATRON = {"q.weight": (Shard(0),), "k.weight": (Shard(0),), "v.weight": (Shard(0),), "o.weight": (Shard(1),)}


def model_and_input(case: Case, seed: int) -> tuple[Attention, torch.Tensor]:
    torch.manual_seed(seed)
    model = Attention(case.heads, case.kv_heads, case.score_mod, case.mask_mod, case.mask_heads, case.slopes)
    return model.requires_grad_(False), torch.randn(B, S, case.heads * D)


# a tensor the score_mod captures (its other buffers): the trace (backend/capture/trace.py's make_fx of
# torch.func.functionalize) fails on it, as make_fx(functionalize(...)) of the same Dynamo graph does in plain torch
CAPTURED = {"window per head, captured slopes tp2": Case(2, score_mod=None, mask_mod=window_per_head, mask_heads=4,
                                                         slopes=True)}


@pytest.mark.parametrize("name", list(CASES))
def test_heads_sharded_match_one_device_and_move_nothing(name):
    case = CASES[name]
    model, x = model_and_input(case, zlib.crc32(name.encode()))
    expected = model(x)
    run = simulate_ranks(model, x, mesh=fxshard.MeshSpec(tp=case.tp), placements=MEGATRON)
    torch.testing.assert_close(run.full()[0], expected, rtol=1e-5, atol=1e-6)
    # the output is left P(sum) (as DTensor leaves a row-parallel matmul): nothing moves on any rank
    assert all(summarize(collective_calls(g))[0] == {} for g in run.lowered.values())


@pytest.mark.parametrize("name", list(CAPTURED))
def test_a_captured_tensor_is_refused_with_what_to_write_instead(name):
    """A score_mod reading a tensor it captures (a slopes buffer): stage 1 cannot trace it (torch's functionalize
    has no rule for that flex call), and says so with the fix, not functionalize's 'NYI'."""
    from fxshard.backend.capture.trace import TraceError

    model, x = model_and_input(CAPTURED[name], 0)
    with pytest.raises(TraceError, match=r"reads tensors it captures \(1 of them.*Compute the values inside"):
        simulate_ranks(model, x, mesh=fxshard.MeshSpec(tp=CAPTURED[name].tp), placements=MEGATRON)


def test_each_rank_calls_its_subgraphs_with_global_heads():
    """Rank r of 2 holds heads 2r, 2r + 1: its score_mod and mask_mod add 2r to the kernel's head index."""
    model, x = model_and_input(CASES["window per head tp2"], 0)
    run = simulate_ranks(model, x, mesh=fxshard.MeshSpec(tp=2), placements=MEGATRON)
    for (rank,), program in run.lowered.items():
        (call,) = program.graph.find_nodes(op="call_function", target=torch.ops.higher_order.flex_attention)
        subgraphs = [getattr(program, call.args[3].target), getattr(program, call.args[4][-1].target)]
        for subgraph, head_at in zip(subgraphs, (2, 1)):  # score_mod(score, b, h, ...), mask_mod(b, h, ...)
            head = list(subgraph.graph.find_nodes(op="placeholder"))[head_at]
            assert [(u.target, u.args[1]) for u in head.users] == [(torch.ops.aten.add.Tensor, 2 * rank)]


@pytest.fixture
def fake_mesh_2():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized(), "a process group leaked from another test module"
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    finally:
        dist.destroy_process_group()


def compiled_collectives(mesh, inductor: bool) -> dict[str, int]:
    """torch.compile(backend="fxshard") of the parallelized module: the collectives of rank 0's lowered program."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model, x = model_and_input(CASES["causal alibi tp2"], 1)
    parallelize_module(model, mesh, {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(),
                                     "o": RowwiseParallel()})
    graphs: dict = {}
    out = torch.compile(model, backend="fxshard",
                        options={"inductor": inductor, "on_graph": lambda stage, gm: graphs.setdefault(stage, gm)})(x)
    assert out.shape == x.shape
    return summarize(collective_calls(graphs["lower"]))[0]


def test_parallelized_module_compiles_with_one_all_reduce(fake_mesh_2):
    """RowwiseParallel asks for a replicated output: its all_reduce is the program's one collective."""
    assert compiled_collectives(fake_mesh_2, inductor=False) == {"all_reduce": 1}


@pytest.mark.slow
def test_parallelized_module_compiles_with_inductor(fake_mesh_2):
    """Inductor's CPU flex kernel compiles the local program (~40 s here)."""
    assert compiled_collectives(fake_mesh_2, inductor=True) == {"all_reduce": 1}


def test_torch_has_no_flex_backward_on_cpu():
    """What torch supports: flex attention's backward is refused on CPU, eager and compiled, in torch 2.13 and
    2.15; when this fails, torch trains through flex on CPU and fxshard's rule needs its backward too."""
    q, k, v = (torch.randn(1, 2, S, D, requires_grad=True) for _ in range(3))
    with pytest.raises(NotImplementedError, match="does not support backward on CPU"):
        flex_attention(q, k, v)
