"""Every attention kernel tracing can produce, forward and backward, with masks and grouped-query heads (issue 18).

Each case calls one ATen kernel as tracing leaves it (or ``F.scaled_dot_product_attention``, which
picks one), with q, k, v (and a per-head mask or bias) sharded by heads, Megatron's attention, and
runs it on simulated ranks: the result (with ``grad``: the training program's output and every
gradient) matches one device, and the plan moves nothing: heads are independent, grouped-query
k/v heads go with their q heads. CPU has no kernel for CUDA's flash, memory-efficient and cuDNN
attention nor for the overrideable fused one: tests/attention_kernels.py registers CPU stand-ins
(the math formula, no dropout) for this module only; ``test_stand_ins_compute_torch_math`` checks
them against torch's math path.
"""
from __future__ import annotations

import contextlib
import zlib
from dataclasses import dataclass, field
from typing import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard
from torch.nn.attention import SDPBackend, sdpa_kernel

import fxshard
from attention_kernels import reference, register_cuda_kernels_on_cpu
from fxshard.backend.explain import collectives_of
from fxshard.backend.simulate import simulate_ranks

aten = torch.ops.aten
B, S, D = 2, 16, 8  # 16 queries: the efficient kernel pads its logsumexp to 32

# ---- the kernels, called as tracing leaves them -------------------------------------------------
# kernel(q, k, v, mask, is_causal) -> (output, logsumexp); mask is None or a float mask/bias


def cpu_flash(q, k, v, m, causal):
    return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=m)[:2]


def cuda_flash(q, k, v, m, causal):  # no mask argument: masked calls go to the other kernels
    return aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)[:2]


def efficient(q, k, v, m, causal):
    return aten._scaled_dot_product_efficient_attention(q, k, v, m, True, 0.0, causal)[:2]


def cudnn(q, k, v, m, causal):
    return aten._scaled_dot_product_cudnn_attention(q, k, v, m, True, 0.0, causal)[:2]


def overrideable(q, k, v, m, causal):
    return aten._scaled_dot_product_fused_attention_overrideable(q, k, v, m, 0.0, causal)[:2]


def sdpa(q, k, v, m, causal):  # the public call: the default kernel on CPU is flash for CPU
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=causal, enable_gqa=k.size(1) != q.size(1))
    return out, None


@dataclass(frozen=True)
class Case:
    kernel: Callable
    tp: int
    kv_heads: int = 8  # q has 8 heads; 4: grouped-query, 1: multi-query
    mask: tuple[int, ...] | None = None  # its shape; (B, 8, S, S) is sharded by heads like q
    causal: bool = False
    grad: bool = True  # the training program (forward + backward); else the forward, logsumexp included
    bool_mask: bool = False  # only the public call takes bool masks (it converts them for the kernels)
    mask_grad: bool = False  # a learned bias: its gradient too (the efficient kernel's grad_bias)
    math: bool = False  # the public call under sdpa_kernel([SDPBackend.MATH]): the math decomposition
    collectives: dict[str, int] = field(default_factory=dict)


BCAST, PER_BATCH, PER_HEAD = (1, 1, S, S), (B, 1, S, S), (B, 8, S, S)
CASES = {
    "cpu_flash gqa causal tp4": Case(cpu_flash, 4, kv_heads=4, causal=True),
    "cpu_flash mask[1,1,s,t] tp2": Case(cpu_flash, 2, mask=BCAST),
    "cpu_flash gqa mask[b,h,s,t] tp4": Case(cpu_flash, 4, kv_heads=4, mask=PER_HEAD),
    "cpu_flash mask[b,1,s,t] forward tp4": Case(cpu_flash, 4, mask=PER_BATCH, grad=False),
    "cpu_flash mqa forward tp4": Case(cpu_flash, 4, kv_heads=1, grad=False),
    # one kv head serves every q head: grad k/v are sums over the heads, all-reduced
    "cpu_flash mqa tp2": Case(cpu_flash, 2, kv_heads=1, collectives={"all_reduce": 2}),
    "flash gqa causal tp4": Case(cuda_flash, 4, kv_heads=4, causal=True),
    "flash forward tp2": Case(cuda_flash, 2, grad=False),
    "efficient bias[1,1,s,t] tp4": Case(efficient, 4, mask=BCAST),
    "efficient causal bias[b,h,s,t] tp2": Case(efficient, 2, mask=PER_HEAD, causal=True),
    "efficient learned bias[b,h,s,t] tp4": Case(efficient, 4, mask=PER_HEAD, mask_grad=True),
    # a bias broadcast over the heads: its gradient sums over them, all-reduced
    "efficient learned bias[1,1,s,t] tp2": Case(efficient, 2, mask=BCAST, mask_grad=True,
                                                collectives={"all_reduce": 1}),
    # its backward's meta kernel gives grad_key q's heads: no grouped-query training
    "efficient gqa bias[b,1,s,t] forward tp4": Case(efficient, 4, kv_heads=4, mask=PER_BATCH, grad=False),
    "cudnn gqa causal tp4": Case(cudnn, 4, kv_heads=4, causal=True),
    "cudnn bias[b,1,s,t] tp2": Case(cudnn, 2, mask=PER_BATCH),
    "cudnn gqa bias[1,1,s,t] forward tp2": Case(cudnn, 2, kv_heads=4, mask=BCAST, grad=False),
    "overrideable gqa bias[b,h,s,t] tp4": Case(overrideable, 4, kv_heads=4, mask=PER_HEAD, mask_grad=True),
    "sdpa gqa bool mask[b,1,s,t] tp2": Case(sdpa, 2, kv_heads=4, mask=PER_BATCH, bool_mask=True),
    "sdpa gqa causal tp2": Case(sdpa, 2, kv_heads=4, causal=True),
    "sdpa math gqa bool mask[b,1,s,t] tp2": Case(sdpa, 2, kv_heads=4, mask=PER_BATCH, bool_mask=True, math=True),
    "sdpa math gqa causal tp2": Case(sdpa, 2, kv_heads=4, causal=True, math=True),
}


def inputs(case: Case, seed: int) -> list[torch.Tensor]:
    """q, k, v (and the mask): fresh random values; a bool mask keeps every query's own key."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, 8, S, D, generator=g)
    k, v = (torch.randn(B, case.kv_heads, S, D, generator=g) for _ in range(2))
    out = [t.requires_grad_(case.grad) for t in (q, k, v)]
    if case.mask is not None:
        if case.bool_mask:
            out.append((torch.rand(case.mask, generator=g) > 0.3) | torch.eye(S, dtype=torch.bool))
        else:
            out.append(torch.randn(case.mask, generator=g).requires_grad_(case.mask_grad))
    return out


def program(case: Case) -> Callable:
    """The function simulated: the output, and in forward cases the logsumexp where the kernel has one."""
    def fn(q, k, v, *mask):
        out, lse = case.kernel(q, k, v, mask[0] if mask else None, case.causal)
        return out if case.grad or lse is None else (out, lse)
    return fn


def placements(case: Case) -> dict:
    heads = (Shard(1),)
    kv = heads if case.kv_heads > 1 else (Replicate(),)
    return {0: heads, 1: kv, 2: kv, **({3: heads} if case.mask == PER_HEAD else {})}


@contextlib.contextmanager
def kernels(case: Case) -> Iterator[None]:
    with register_cuda_kernels_on_cpu(), (sdpa_kernel([SDPBackend.MATH]) if case.math else contextlib.nullcontext()):
        yield


@dataclass
class Result:
    outputs: list[torch.Tensor]  # simulated, then single-device: outputs and gradients
    expected: list[torch.Tensor]
    collectives: dict[str, int]


def run(case: Case, seed: int) -> Result:
    """The case on simulated ranks and on one device."""
    args, fn = inputs(case, seed), program(case)
    with kernels(case):
        sim = simulate_ranks(fn, *args, mesh=fxshard.MeshSpec(tp=case.tp), placements=placements(case),
                             grad=case.grad)
        result = fn(*args)
        expected = list(result) if isinstance(result, tuple) else [result]
        if case.grad:
            wrt = [a for a in args if a.requires_grad]
            expected += torch.autograd.grad(expected[0].sum(), wrt)
    grads = sim.full_grads() if case.grad else {}
    outputs = sim.full() + [grads[i] for i in sorted(grads)]  # by argument index, as ``wrt``
    counts: dict[str, int] = {}
    for c in collectives_of(sim.graph):
        counts[c.kind] = counts.get(c.kind, 0) + 1
    return Result(outputs, [e.detach() for e in expected], counts)


@pytest.fixture(scope="module")
def results() -> Callable[[str], Result]:
    """Each case run once for both tests below."""
    done: dict[str, Result] = {}

    def get(name: str) -> Result:
        if name not in done:
            done[name] = run(CASES[name], seed=zlib.crc32(name.encode()))
        return done[name]
    return get


@pytest.mark.parametrize("name", list(CASES))
def test_matches_one_device(results, name):
    r = results(name)
    assert len(r.outputs) == len(r.expected)
    for got, want in zip(r.outputs, r.expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", list(CASES))
def test_heads_sharded_move_nothing(results, name):
    assert results(name).collectives == CASES[name].collectives


STAND_INS = {"flash": (cuda_flash, False), "efficient": (efficient, True), "cudnn": (cudnn, True),
             "overrideable": (overrideable, True)}


@pytest.mark.parametrize("kernel", list(STAND_INS))
def test_stand_ins_compute_torch_math(kernel):
    """A stand-in's output and gradients (grouped-query heads, causal, a broadcast bias) are torch's math path's."""
    fn, masked = STAND_INS[kernel]
    g = torch.Generator().manual_seed(len(kernel))
    q, k, v = (torch.randn(B, h, S, D, generator=g, requires_grad=True) for h in (8, 4, 4))
    mask = torch.randn(B, 1, S, S, generator=g) if masked else None
    with register_cuda_kernels_on_cpu():
        out = fn(q, k, v, mask, True)[0]
        grads = torch.autograd.grad(out.sum(), (q, k, v))
    want = reference(q, k, v, mask, is_causal=True)
    want_grads = torch.autograd.grad(want.sum(), (q, k, v))
    torch.testing.assert_close((out,) + grads, (want,) + want_grads)
