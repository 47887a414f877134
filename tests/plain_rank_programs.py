"""Rank programs of tests/test_plain_programs.py: graphs that hold no DTensor, on gloo ranks (spawned
ranks import this module by name)."""
from __future__ import annotations

import copy

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor


class Block(torch.nn.Module):
    """A linear layer and tensor methods (view, transpose): a graph the local-program path refused."""

    def __init__(self, dim: int = 8):
        super().__init__()
        self.lin = torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.lin(x)).view(x.shape[0], 2, -1)
        return x + h.transpose(1, 2).transpose(1, 2).reshape(x.shape)


class Stack(torch.nn.Module):
    """Blocks and a head: FSDP2's model, ``fully_shard`` per block and the root."""

    def __init__(self, dim: int = 8, n_layers: int = 2):
        super().__init__()
        self.layers = torch.nn.ModuleList(Block(dim) for _ in range(n_layers))
        self.head = torch.nn.Linear(dim, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x).sum(1)


def _full_grad(p: torch.Tensor) -> torch.Tensor:
    return p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad


def fsdp2_training(rank: int, world_size: int, device: str = "cpu", steps: int = 2) -> dict:
    """A ``fully_shard`` model through torch.compile(backend="fxshard"): SGD steps on each rank's part of
    a fresh batch against one device on the whole batch; the largest loss and parameter differences."""
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device, (world_size,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    reference = Stack()
    model = copy.deepcopy(reference)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    compiled = torch.compile(model, backend="fxshard")
    ours = torch.optim.SGD(model.parameters(), lr=0.1)
    theirs = torch.optim.SGD(reference.parameters(), lr=0.1)
    loss_error = 0.0
    for step in range(steps):
        torch.manual_seed(100 + step)  # the same fresh batch on every rank, each rank computing its part
        x = torch.randn(2 * world_size, 8)
        loss = compiled(x.chunk(world_size)[rank]).square().sum()
        want = reference(x).square().sum()
        loss.backward()
        (want / world_size).backward()  # FSDP2 averages the ranks' gradients
        ours.step(), theirs.step(), ours.zero_grad(), theirs.zero_grad()
        whole = loss.detach().clone()
        torch.distributed.all_reduce(whole)
        loss_error = max(loss_error, abs(whole.item() - want.item()) / abs(want.item()))  # relative
    param_error = max((p.full_tensor() - q).abs().max().item()
                      for p, q in zip(model.parameters(), reference.parameters()))
    return {"loss_error": loss_error, "param_error": param_error}


class Branchy(torch.nn.Module):
    """tests/rank_programs.py's Branchy with a break after ``up``: an ``if`` on the mean, ``.item()`` of the
    max, then ``down``. With local outputs, the graphs between the breaks hold only plain tensors."""

    def __init__(self, dim: int = 8, hidden: int = 16):
        super().__init__()
        self.up = torch.nn.Linear(dim, hidden, bias=False)
        self.down = torch.nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        torch._dynamo.graph_break()
        if h.mean() > 0:
            h = torch.relu(h).view(h.shape[0], 2, -1).transpose(1, 2).reshape(h.shape)
        else:
            h = -h
        scale = h.abs().amax().item()
        return self.down(h / (1.0 + scale))


def tensor_parallel_plain_pieces(rank: int, world_size: int, device: str = "cpu") -> dict:
    """Branchy column- then row-parallel, ``up``'s output gathered and handed on as a plain tensor (every
    rank's the same), through torch.compile(backend="fxshard"): forward (both branches) and the gradients
    of one step against one device."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh(device, (world_size,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    reference = Branchy()
    model = copy.deepcopy(reference)
    parallelize_module(model, mesh, {"up": ColwiseParallel(output_layouts=Replicate()),
                                     "down": RowwiseParallel(input_layouts=Replicate(), use_local_output=False)})
    compiled = torch.compile(model, backend="fxshard")
    torch.manual_seed(1)
    x = torch.randn(4, 8)
    forward_error = 0.0
    with torch.no_grad():
        for sign in (1.0, -1.0):  # one branch, then the other (``up`` has no bias)
            out = compiled(sign * x).full_tensor()
            forward_error = max(forward_error, (out - reference(sign * x)).abs().max().item())
    compiled(x).full_tensor().sum().backward()
    reference(x).sum().backward()
    grad_error = max((_full_grad(p) - q.grad).abs().max().item()
                     for p, q in zip(model.parameters(), reference.parameters()))
    return {"forward_error": forward_error, "grad_error": grad_error}
