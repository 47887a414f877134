"""The ops a mixture-of-experts layer and complex rotary embeddings run, each with a rule that moves
nothing or less than replicating it would (fxshard/rules_moe.py, the registry's entries).

Each case is exact against one device on simulated ranks, warns of no op run replicated, and moves
what the rule promises: a scatter-add of a Partial(sum) source reduces the destination's size, not
the source's; a sort keeps the other dims sharded; a grouped matmul's backward in Megatron's
column/row-parallel layouts gathers nothing.
"""
from __future__ import annotations

import warnings
from collections import Counter

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import fxshard
from fxshard.backend.explain import collectives_of
from fxshard.backend.simulate import simulate_ranks

WORLD = 2
T, R, D, K = 8, 16, 32, 8  # tokens, routed rows (top-2), hidden, the contraction a row-parallel expert shards


def _run(fn, *args, placements, grad=False):
    """(the simulated run, its collectives by kind, fxshard's replicated-op warnings)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = simulate_ranks(fn, *args, mesh=fxshard.MeshSpec(tp=WORLD), placements=placements, grad=grad)
    ours = sorted({str(w.message) for w in caught if str(w.message).startswith("fxshard")})
    return run, collectives_of(run.graph), ours


try:  # torchtitan's own op (its module needs no triton, unlike torchtitan's MoE)
    from torchtitan.ops.scatter_add import deterministic_scatter_add
except ImportError:
    deterministic_scatter_add = None


def _titan_scatter_add(out, index, src):
    return deterministic_scatter_add(out, index.unsqueeze(1).expand(-1, src.shape[1]), src)


SCATTERS = {
    "torchtitan.deterministic_scatter_add": _titan_scatter_add,
    "index_add": lambda out, index, src: out.index_add(0, index, src),
    "scatter_add": lambda out, index, src: out.scatter_add(0, index.unsqueeze(1).expand(-1, src.shape[1]), src),
}


@pytest.mark.parametrize("name", list(SCATTERS))
def test_a_partial_source_is_scattered_before_it_is_reduced(name):
    """Expert outputs of a row-parallel projection (Partial(sum)) combined into tokens: the sum of the
    ranks' scatters is the scatter of the sum, so the [T, D] result is all-reduced (for the nonlinear op
    after it), not the [R, D] rows."""
    if name.startswith("torchtitan") and deterministic_scatter_add is None:
        pytest.skip("torchtitan is not installed")
    scatter = SCATTERS[name]
    torch.manual_seed(0)
    h, w, index = torch.randn(R, K), torch.randn(K, D), torch.randint(0, T, (R,))

    def combine(h, w, index):
        return torch.relu(scatter(torch.zeros(T, D), index, h @ w))

    want = combine(h, w, index)
    run, moved, warned = _run(combine, h, w, index, placements={0: [Shard(1)], 1: [Shard(0)]})
    torch.testing.assert_close(run.full()[0], want)
    assert warned == []
    assert [(c.kind, int(c.bytes_per_rank)) for c in moved] == [("all_reduce", T * D * 4)]


SORTS = {
    "sort.stable": lambda x: torch.sort(x, dim=1, stable=True)[0],
    "sort.stable indices": lambda x: torch.sort(x, dim=-1, stable=True, descending=True)[1],
    "argsort": lambda x: torch.argsort(x, dim=1),
    "argsort.stable": lambda x: torch.argsort(x, dim=1, stable=True),
}


@pytest.mark.parametrize("name", list(SORTS))
def test_a_sort_along_an_unsharded_dim_keeps_the_rows_sharded(name):
    """Rows sharded, sorted along the columns: each rank sorts its rows, nothing moves."""
    torch.manual_seed(0)
    x = torch.randn(8, 6)
    run, moved, warned = _run(SORTS[name], x, placements={0: [Shard(0)]})
    torch.testing.assert_close(run.full()[0], SORTS[name](x))
    assert warned == []
    sort = next(n for n in run.graph.graph.nodes if "sort" in str(n.target))
    layout = sort.meta["layout"]
    layout = layout[0] if isinstance(layout, tuple) else layout
    assert layout.dims[0][0].axis is not None and all(p.axis is None for p in layout.dims[1])
    assert moved == []


def test_complex_rotary_trains_with_heads_sharded():
    """Llama-style complex RoPE: ``polar`` builds the table, the backward conjugates it (``_conj``); both
    elementwise, so heads stay sharded through forward and backward and nothing runs replicated."""
    torch.manual_seed(0)
    b, s, heads, d = 2, 4, 4, 8
    x = torch.randn(b, s, heads, d, requires_grad=True)
    angle = torch.randn(s, d // 2)

    def rope(x, angle):
        table = torch.polar(torch.ones_like(angle), angle)
        xc = torch.view_as_complex(x.reshape(b, s, heads, d // 2, 2))
        return torch.view_as_real(xc * table[None, :, None, :]).flatten(3)

    want = rope(x, angle)
    want.backward(torch.ones_like(want))
    run, moved, warned = _run(rope, x, angle, placements={0: [Shard(2)]}, grad=True)
    torch.testing.assert_close(run.full()[0], want.detach())
    torch.testing.assert_close(run.full_grads()[0], x.grad)
    assert warned == []
    assert moved == []


def test_grouped_mm_backward_in_megatron_layouts_gathers_nothing():
    """Column-parallel then row-parallel experts (``aten._grouped_mm``, bf16: its only dtype under
    torch.compile): the forward all-reduces the output (for the nonlinear op after it), the backward the
    input's gradient; the weight gradients (the 2-D x 2-D grouped form) stay sharded. Entries in {-1, 0, 1}:
    every sum is a small integer, exact in bf16 in any order."""
    torch.manual_seed(0)
    e, s, hidden, inner = 2, 16, 16, 16  # the kernel wants 16-byte strides: local dims of 8 bf16

    def ternary(*shape):
        return torch.randint(-1, 2, shape).to(torch.bfloat16).requires_grad_()

    x, w1, w2 = ternary(s, hidden), ternary(e, hidden, inner), ternary(e, inner, hidden)
    offs = torch.tensor([8, 16], dtype=torch.int32)

    def experts(x, w1, w2, offs):
        return torch.relu(torch._grouped_mm(torch.relu(torch._grouped_mm(x, w1, offs=offs)), w2, offs=offs))

    want = experts(x, w1, w2, offs)
    want.backward(torch.ones_like(want))
    run, moved, warned = _run(experts, x, w1, w2, offs, placements={1: [Shard(2)], 2: [Shard(1)], 3: [Replicate()]},
                              grad=True)
    torch.testing.assert_close(run.full()[0], want.detach(), rtol=0, atol=0)
    grads = run.full_grads()
    for i, t in enumerate((x, w1, w2)):
        torch.testing.assert_close(grads[i], t.grad, rtol=0, atol=0)
    assert warned == []
    assert Counter(c.kind for c in moved) == {"all_reduce": 2}
