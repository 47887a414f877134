"""A tensor-parallel MLP compiled with torch.compile(backend="fxshard") on gloo ranks.

    python examples/mlp_tp.py                         # spawns 2 CPU ranks on 127.0.0.1
    torchrun --nproc-per-node 2 examples/mlp_tp.py    # the same program, launched by torchrun

The model is written in global shapes; parallelize_module says how its weights are sharded
(column-parallel up projection, row-parallel down projection). fxshard plans the
communication: one all_reduce, as Megatron-LM would write by hand.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


class MLP(nn.Module):
    def __init__(self, dim: int = 64, hidden: int = 256):
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x)))


def make_mesh(device: str, world_size: int, kind: str = "named"):
    """A 1-D mesh of all ranks, made the ways users make one: with a dim name, without
    (``init_device_mesh(device, (n,))``, as most DTensor docs write it), or as the ``tp`` slice of a
    (1, n) mesh."""
    if kind == "unnamed":
        return init_device_mesh(device, (world_size,))
    if kind == "slice":
        return init_device_mesh(device, (1, world_size), mesh_dim_names=("dp", "tp"))["tp"]
    return init_device_mesh(device, (world_size,), mesh_dim_names=("tp",))


def run(rank: int, world_size: int, device: str = "cpu", mesh_kind: str = "named") -> dict:
    """Compile and run the sharded MLP on this rank; returns what it checked."""
    if device == "cuda":
        torch.cuda.set_device(rank)
    mesh = make_mesh(device, world_size, mesh_kind)
    torch.manual_seed(0)  # same weights and inputs on every rank
    model = MLP().to(device)
    x = torch.randn(4, 16, 64, device=device)
    expected = model(x)

    parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    graphs = {}
    compiled = torch.compile(model, backend="fxshard",
                             options={"on_graph": lambda stage, gm: graphs.__setitem__(stage, gm)})
    with torch.no_grad():
        out = compiled(x)
    # RowwiseParallel's default use_local_output=True hands a plain (replicated) tensor on, eager and compiled
    assert not isinstance(out, DTensor), type(out)
    error = (out - expected).abs().max().item()
    local = graphs["lower"]
    collectives = [n.target.__name__ for n in local.graph.nodes
                   if n.op == "call_function" and getattr(n.target, "namespace", "") == "_c10d_functional"
                   and n.target.__name__ != "wait_tensor.default"]
    if rank == 0:
        from fxshard.printing import format_graph

        print("== sharded global graph (stage 3) ==")
        print(format_graph(graphs["plan"]))
        print("\n== local program of rank 0 (stage 5), compiled by Inductor ==")
        print(format_graph(local, layouts=False))
        print(f"\ncollectives per call: {collectives}")
        print(f"output: a plain tensor {tuple(out.shape)}, whole on every rank, as eager (use_local_output=True)")
        print(f"max abs error vs single device: {error:.2e}")
    return {"error": error, "collectives": collectives}


def train(rank: int, world_size: int, device: str = "cpu", steps: int = 3, mesh_kind: str = "named") -> dict:
    """A few SGD steps through torch.compile(backend="fxshard"): the backend compiles the joint
    forward+backward program because the parameters (and the input) require grad."""
    mesh = make_mesh(device, world_size, mesh_kind)
    torch.manual_seed(0)
    reference = MLP().to(device)
    model = MLP().to(device)
    model.load_state_dict(reference.state_dict())
    parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    graphs = {}
    compiled = torch.compile(lambda x: model(x).square().mean(), backend="fxshard",
                             options={"on_graph": lambda stage, gm: graphs.__setitem__(stage, gm)})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    errors, placements_kept = [], True
    for _ in range(steps):
        x = torch.randn(4, 16, 64, device=device, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_()
        loss = compiled(x)
        loss.backward()
        ref_loss = reference(x_ref).square().mean()
        ref_loss.backward()
        errors.append(abs(loss.item() - ref_loss.item()))  # a plain tensor, as the model hands it on
        errors.append((x.grad - x_ref.grad).abs().max().item())
        for (_, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
            placements_kept &= isinstance(p.grad, DTensor) and p.grad.placements == p.placements
            errors.append((p.grad.full_tensor() - q.grad).abs().max().item())
        optimizer.step()
        ref_optimizer.step()
        optimizer.zero_grad()
        ref_optimizer.zero_grad()

    def kinds(gm: torch.fx.GraphModule) -> list[str]:
        return [n.target.__name__ for n in gm.graph.nodes
                if n.op == "call_function" and getattr(n.target, "namespace", "") == "_c10d_functional"
                and n.target.__name__ != "wait_tensor.default"]

    return {"error": max(errors), "placements_kept": placements_kept, "forward": kinds(graphs["lower"]),
            "backward": kinds(graphs["lower_backward"])}


def spawn(world_size: int = 2, timeout: float = 600.0, device: str = "cpu", **kwargs) -> dict[int, dict]:
    """Run on ``world_size`` local ranks (gloo on CPU, NCCL on GPUs); raises if a rank fails or hangs."""
    from ranks import launch

    return launch(run, world_size, timeout, device, **kwargs)


def main() -> None:
    results = spawn(int(os.environ.get("WORLD_SIZE_FXSHARD", "2")))  # under torchrun: this process is one rank
    worst = max(r["error"] for r in results.values())
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"all ranks ok; worst error {worst:.2e}")
    sys.exit(0 if worst <= 1e-5 else 1)


if __name__ == "__main__":
    main()
