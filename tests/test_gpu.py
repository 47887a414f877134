"""Inductor on the local graphs (GPU when there is one), single-device numerics, NCCL with 2+ GPUs.

The same checks run on CPU (C++ kernels) and, when CUDA is available, on the GPU (triton
kernels); CI has no GPU, so the CUDA cases are skipped there and run whenever one is lent.
"""
from __future__ import annotations

import pathlib
import sys

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]
KERNEL_MARK = {"cpu": "cpp_fused", "cuda": "triton"}


@pytest.fixture
def fake_world_4():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        yield
    finally:
        dist.destroy_process_group()


def compiled_local_program(make_mlp, device: str, coordinate: tuple, placements: dict | None = None,
                           megatron: bool = False):
    """Rank ``coordinate``'s lowered program for MLP, run eagerly and through Inductor (with its code)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.utils import run_and_get_code

    from fxshard.backend.explain import explain
    from fxshard.lowering.collectives import lower
    from fxshard.lowering.groups import MeshGroups
    from fxshard.lowering.localize import localize

    mesh = init_device_mesh(device, (4,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    model = make_mlp(32, 64, torch.nn.functional.gelu).to(device)
    x = torch.randn(8, 32, device=device)
    reference = model(x).detach()
    if megatron:  # DTensor parameters; the output hook asks for a replicated result
        parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    e = explain(model, x, mesh=mesh, placements=placements)
    local = lower(localize(e.graph, coordinate), coordinate, MeshGroups(mesh))
    values = {name.replace(".", "_"): p for name, p in model.named_parameters()}
    values["arg0"] = x
    inputs = []
    for name, layout in e.input_layouts.items():
        v = values[name]
        inputs.append(v.to_local().detach() if isinstance(v, DTensor) else layout.shard(v.detach(), coordinate))
    with torch.no_grad():
        eager = local(*inputs)[0]
        out, code = run_and_get_code(lambda: compile_fx(local, inputs)(*inputs))
    return reference, e, eager, out[0], "\n".join(code)


@pytest.mark.parametrize("device", DEVICES)
def test_batch_sharded_mlp_compiles_and_matches_the_single_device_rows(fake_world_4, make_mlp, device):
    """No communication in this plan: rank 1's compiled program gives exactly rank 1's rows."""
    reference, e, _, out, code = compiled_local_program(make_mlp, device, (1,), placements={0: (Shard(0),)})
    assert e.collectives == []
    assert KERNEL_MARK[device] in code, f"Inductor emitted no {device} kernel"
    torch.testing.assert_close(out, reference[2:4], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_megatron_mlp_compiled_code_keeps_the_collective(fake_world_4, make_mlp, device):
    """Inductor fuses the local math around the all_reduce and keeps the collective itself."""
    _, e, eager, out, code = compiled_local_program(make_mlp, device, (0,), megatron=True)
    assert [c.kind for c in e.collectives] == ["all_reduce"]
    assert KERNEL_MARK[device] in code and "all_reduce" in code
    # the fake group moves no data, so compare Inductor's program with the same local program run eagerly
    torch.testing.assert_close(out, eager, rtol=1e-4, atol=1e-4)


PLANS = [  # (mesh sizes, shape, src, dst, the plan's steps)
    ((4,), (10, 8), "S(0)", "S(1)", "exchange(a)"),
    ((2, 2), (8, 12), "S(0),S(0)", "S(1),S(1)", "all_to_all(a,b dim 0->1)"),
    ((8,), (2047, 10), "P(sum)", "S(0)", "reduce_scatter(a dim 0 sum)"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sizes, shape, src, dst, steps", PLANS)
def test_plans_on_device(device, sizes, shape, src, dst, steps):
    """Every rank's lowered steps on ``device`` (index tables live there too) rebuild the tensor."""
    import fxshard
    from fxshard.placements import placements_from_str

    mesh = fxshard.MeshSpec(list(zip("abc", sizes)))
    a = fxshard.layout_from_placements(mesh, shape, placements_from_str(src))
    b = fxshard.layout_from_placements(mesh, shape, placements_from_str(dst))
    plan = fxshard.plan_redistribute(a, b)
    assert ", ".join(str(s) for s in plan.steps) == steps
    x = torch.randn(shape, device=device)
    run = fxshard.simulate_plan(plan, x)
    assert run.result.device.type == device
    torch.testing.assert_close(run.result, x)


@pytest.mark.parametrize("device", DEVICES)
def test_exchange_compiles_with_inductor(fake_world_4, device):
    """The exchange's index tables are graph constants on the input's device; Inductor compiles around them."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.utils import run_and_get_code

    from fxshard.backend.explain import explain
    from fxshard.lowering.collectives import lower
    from fxshard.lowering.groups import MeshGroups
    from fxshard.lowering.localize import localize
    from fxshard.ops import constrain_op

    mesh = init_device_mesh(device, (4,), mesh_dim_names=("tp",))
    x = torch.randn(10, 8, device=device)
    e = explain(lambda t: constrain_op(t * 2.0, "S(1)") + 1.0, x, mesh=mesh, placements={0: (Shard(0),)})
    assert [c.kind for c in e.collectives] == ["exchange"]
    local = lower(localize(e.graph, (1,)), (1,), MeshGroups(mesh))
    assert all(b.device.type == device for b in local.buffers())
    block = next(iter(e.input_layouts.values())).shard(x, (1,))
    with torch.no_grad():
        out, codes = run_and_get_code(lambda: compile_fx(local, [block])(block))
    code = "\n".join(codes)
    assert KERNEL_MARK[device] in code and "all_to_all_single" in code
    assert out[0].shape == (10, 2) and out[0].device.type == device


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs for NCCL")
def test_mlp_tensor_parallel_on_two_gpus_with_nccl():
    examples = pathlib.Path(__file__).resolve().parents[1] / "examples"
    sys.path.insert(0, str(examples))
    try:
        import mlp_tp

        results = mlp_tp.spawn(world_size=2, timeout=300.0, device="cuda")
    finally:
        sys.path.remove(str(examples))
    for r in results.values():
        assert r["error"] <= 1e-4 and r["collectives"] == ["all_reduce.default"]


# The real CUDA attention kernels (CPU runs their stand-ins: tests/test_attention.py), each forced by
# sdpa_kernel: (backend, the ATen op it must trace to, grouped-query k/v, a float mask [b, 1, s, t]).
CUDA_ATTENTION = {
    "flash gqa causal": ("FLASH_ATTENTION", "_scaled_dot_product_flash_attention", True, False),
    "efficient mask": ("EFFICIENT_ATTENTION", "_scaled_dot_product_efficient_attention", False, True),
    "cudnn causal": ("CUDNN_ATTENTION", "_scaled_dot_product_cudnn_attention", False, False),
}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", list(CUDA_ATTENTION))
def test_cuda_attention_kernels_by_heads_match_one_gpu(case):
    """Training through a real CUDA kernel, heads sharded on 2 simulated ranks: the output and every
    gradient are one GPU's, and nothing moves."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import fxshard
    from fxshard.backend.explain import collectives_of
    from fxshard.backend.simulate import simulate_ranks

    backend, op, gqa, masked = CUDA_ATTENTION[case]
    torch.manual_seed(0)
    new = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    q, k, v = (new(2, h, 64, 64).requires_grad_() for h in (8, 4 if gqa else 8, 4 if gqa else 8))
    args = (q, k, v) + ((new(2, 1, 64, 64),) if masked else ())

    def fn(q, k, v, *mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[0] if mask else None, is_causal=not masked,
                                              enable_gqa=gqa)

    with sdpa_kernel([getattr(SDPBackend, backend)]):
        try:
            want = fn(*args)
        except RuntimeError as e:  # this GPU (or build) lacks the kernel
            pytest.skip(f"{backend}: {e}")
        want_grads = torch.autograd.grad(want.sum(), (q, k, v))
        heads = (Shard(1),)
        run = simulate_ranks(fn, *args, mesh=fxshard.MeshSpec(tp=2), placements={0: heads, 1: heads, 2: heads},
                             grad=True)
    assert getattr(torch.ops.aten, op).default in {n.target for n in run.graph.graph.nodes}
    assert collectives_of(run.graph) == []
    grads = run.full_grads()
    torch.testing.assert_close([run.full()[0]] + [grads[i] for i in range(3)], [want, *want_grads],
                               rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["FLASH_ATTENTION", "EFFICIENT_ATTENTION"])
def test_cuda_causal_attention_on_sequence_shards_matches_one_gpu(backend):
    """Context parallelism through a real CUDA kernel: causal SDPA with q, k, v Shard(2) on cp=4 simulated ranks,
    each rank's rows computed by fxshard::causal_rows_attention over the gathered keys (fxshard/causal_rows.py):
    the output and every gradient are one GPU's, and q is never gathered (k and v are)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import fxshard
    from fxshard.backend.explain import collectives_of
    from fxshard.backend.simulate import simulate_ranks

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 8, 256, 64, device="cuda", dtype=torch.bfloat16).requires_grad_() for _ in range(3))

    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    with sdpa_kernel([getattr(SDPBackend, backend)]):
        try:
            want = fn(q, k, v)
        except RuntimeError as e:  # this GPU (or build) lacks the kernel
            pytest.skip(f"{backend}: {e}")
        want_grads = torch.autograd.grad(want.sum(), (q, k, v))
        run = simulate_ranks(fn, q, k, v, mesh=fxshard.MeshSpec(cp=4), placements={i: (Shard(2),) for i in range(3)},
                             grad=True)
    assert [c.kind for c in collectives_of(run.graph)].count("all_gather") == 2
    grads = run.full_grads()
    torch.testing.assert_close([run.full()[0]] + [grads[i] for i in range(3)], [want, *want_grads],
                               rtol=2e-2, atol=2e-2)
