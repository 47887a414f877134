"""A training step run under one ambient state per call, for tests/test_lowered_cache.py's two processes.

The process-wide state a program is compiled under (autocast, default dtype, SDPA's backends, grad mode,
deterministic algorithms) is not in Dynamo's graph, yet tracing reads it: a second process that loads the
first's lowered program under another state must get what a cold compile under that state computes.

    python cache_states.py OUT [--cold] STATE [STATE ...]

runs the step once per state (a fresh Dynamo each time, the caches as the environment sets them) and saves
``{state: (output, gradients, cache counters)}`` to OUT; with ``--cold``, ``{state: (cold, warm)}``: the step
first with every cache off, then with the caches as set.
"""
from __future__ import annotations

import contextlib
import sys
from typing import Callable, ContextManager

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

DIM, HEADS, TOKENS = 16, 4, 8


class Attention(torch.nn.Module):
    """Head-parallel attention: column-parallel q, k, v (no communication: each rank its heads) and SDPA."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(DIM, DIM) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, HEADS, DIM // HEADS).transpose(1, 2) for p in (self.q, self.k, self.v))
        return F.scaled_dot_product_attention(q, k, v)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


@contextlib.contextmanager
def _deterministic():
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


def _math_sdpa() -> ContextManager:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.MATH])


# each state by name; "inductor" compiles through Inductor (the prepared-program cache too), the others not
STATES: dict[str, Callable[[], ContextManager]] = {
    "plain": contextlib.nullcontext,
    "inductor": contextlib.nullcontext,
    # without Inductor, the lowered graph runs eagerly under autocast: only Inductor's program shows the cast
    "inductor_autocast_bf16": lambda: torch.autocast("cpu", dtype=torch.bfloat16),
    "inductor_autocast_fp16": lambda: torch.autocast("cpu", dtype=torch.float16),
    "default_float64": lambda: _default_dtype(torch.float64),
    "math_sdpa": _math_sdpa,
    "deterministic": _deterministic,
    "no_grad": torch.no_grad,
}


def step(state: str, mesh) -> tuple[torch.Tensor, list[torch.Tensor], dict[str, int]]:
    """A fresh compile of the model (as a new process makes it) and one step under ``state``: the output's and
    the gradients' local tensors (no gradients under ``no_grad``), and the lowered cache's hits and misses."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = Attention()
    for linear in (model.q, model.k, model.v):
        linear.weight = torch.nn.Parameter(distribute_tensor(linear.weight.detach(), mesh, [Shard(0)]))
        linear.bias = torch.nn.Parameter(distribute_tensor(linear.bias.detach(), mesh, [Shard(0)]))
    x = distribute_tensor(torch.randn(2, TOKENS, DIM), mesh, [Replicate()])
    compiled = torch.compile(model, backend="fxshard", options={"inductor": state.startswith("inductor")})
    with STATES[state]():
        out = compiled(x)
        if torch.is_grad_enabled():
            out.to_local().float().sum().backward()
    grads = [p.grad.to_local() for p in model.parameters() if p.grad is not None]
    return out.to_local().detach(), grads, {k: v for k, v in counters["fxshard"].items() if "lowered" in k}


def cold_and_warm(state: str, mesh) -> tuple[tuple, tuple]:
    """The step under ``state`` with every cache off (Inductor's and fxshard's), then with them as set."""
    from torch._inductor import config

    with config.patch(force_disable_caches=True):
        cold = step(state, mesh)
    return cold, step(state, mesh)


def main(path: str, states: list[str]) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    run = step
    if states[0] == "--cold":
        run, states = cold_and_warm, states[1:]
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
        torch.save({state: run(state, mesh) for state in states}, path)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
