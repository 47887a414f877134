"""A dropless mixture-of-experts layer written as torchtitan writes it, and the gloo rank program that trains
it (a module of its own: spawned ranks import it by name).

Top-k routing over softmax scores, the (token, choice) pairs sorted stably by expert, the rows gathered
by ``order // k``, SwiGLU experts as ``torch._grouped_mm`` over stacked weights with offsets from
``torch.histc`` counts, the results added back by ``index_add``. ``skew`` biases the router toward the
first experts, as trained routers often are, so the ranks receive unequal numbers of rows; ``balance``
returns Switch Transformer's load-balancing loss beside (it reads the counts the region reads).
"""
from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F


class DroplessMoE(torch.nn.Module):
    def __init__(self, dim: int = 32, hidden: int = 48, experts: int = 8, top_k: int = 2, skew: float = 0.0,
                 dtype: torch.dtype = torch.float32, shared: bool = False, balance: bool = False):
        super().__init__()
        self.top_k, self.experts, self.balance = top_k, experts, balance
        self.router = torch.nn.Parameter(torch.randn(dim, experts, dtype=dtype) * dim ** -0.5)
        self.register_buffer("bias", -skew * torch.arange(experts, dtype=dtype))
        self.w1 = torch.nn.Parameter(torch.randn(experts, dim, hidden, dtype=dtype) * dim ** -0.5)
        self.w3 = torch.nn.Parameter(torch.randn(experts, dim, hidden, dtype=dtype) * dim ** -0.5)
        self.w2 = torch.nn.Parameter(torch.randn(experts, hidden, dim, dtype=dtype) * hidden ** -0.5)
        self.shared = torch.nn.Linear(dim, dim, bias=False, dtype=dtype) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        scores = torch.softmax(x @ self.router + self.bias, dim=-1)
        top, chosen = torch.topk(scores, self.top_k, dim=1)
        flat = chosen.view(-1)
        counts = torch.histc(flat.float(), bins=self.experts, min=0, max=self.experts)
        order = torch.argsort(flat, stable=True)
        weights = top.view(-1)[order]
        tokens = order // self.top_k
        rows = x[tokens] * weights[:, None]
        offsets = torch.cumsum(counts, dim=0).to(torch.int32)
        rows = rows.bfloat16()  # the grouped matmul's one dtype on CPU, as torchtitan casts for it
        h = F.silu(torch._grouped_mm(rows, self.w1.bfloat16(), offs=offsets)) \
            * torch._grouped_mm(rows, self.w3.bfloat16(), offs=offsets)
        out = torch._grouped_mm(h, self.w2.bfloat16(), offs=offsets).to(x.dtype)
        base = self.shared(x) if self.shared is not None else torch.zeros_like(x)
        y = base.index_add(0, tokens, out).reshape(shape)
        if not self.balance:
            return y
        # Switch Transformer's load-balancing loss: experts x sum(fraction of pairs routed x mean score)
        return y, self.experts * (counts / flat.numel() * scores.mean(0)).sum()


def routed_rows(chosen: torch.Tensor, ranks: int, experts: int) -> list[tuple[int, int]]:
    """Per rank, (the rows of the other ranks' pairs routed to its experts, its own pairs their experts run):
    ``chosen`` is [tokens, k] expert ids, the tokens in blocks per rank, the experts in blocks per rank."""
    owner = chosen.reshape(ranks, -1) // (experts // ranks)
    return [(int((owner == r).sum() - (owner[r] == r).sum()), int((owner[r] != r).sum())) for r in range(ranks)]


def received_by_routing(chosen: torch.Tensor, ranks: int, experts: int, row_bytes: int) -> list[int]:
    """What each rank must receive to run its experts' rows and get its own rows' results back, at
    ``row_bytes`` a row each way."""
    return [(incoming + returned) * row_bytes for incoming, returned in routed_rows(chosen, ranks, experts)]


def sgd_steps(rank: int, world_size: int, device: str = "cpu", steps: int = 2, tokens: int = 64, skew: float = 2.0,
              lr: float = 0.1, experts_sharded: bool = True) -> dict[str, Any]:
    """``steps`` SGD steps of a ``DroplessMoE`` with its experts ``Shard(0)`` on an ``ep`` axis of all ranks
    (``experts_sharded``; else replicated: data parallel) and the tokens ``Shard(0)`` on it, through
    torch.compile(backend="fxshard"); the same steps on one device.
    Returns the worst loss error, the worst error of a parameter's update relative to one device's update,
    and the stages whose graphs hold the routed op."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from step_checks import loss_error, update_errors

    mesh = init_device_mesh(device, (world_size,), mesh_dim_names=("ep",))
    torch.manual_seed(0)
    reference = DroplessMoE(skew=skew)
    model = copy.deepcopy(reference)
    for name in ("router", "w1", "w2", "w3"):
        placement = Shard(0) if name != "router" and experts_sharded else Replicate()
        setattr(model, name, torch.nn.Parameter(distribute_tensor(getattr(model, name).detach(), mesh, [placement])))
    model.bias = distribute_tensor(model.bias, mesh, [Replicate()])
    stages: list[str] = []
    compiled = torch.compile(model, backend="fxshard", options={
        "on_graph": lambda stage, gm: stages.append(stage) if any(
            "routed_experts" in str(n.target) for n in gm.graph.nodes) else None})
    before = [p.detach().clone() for p in reference.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=lr)
    worst_loss = 0.0
    for step in range(steps):
        x = torch.randn(tokens, 32, generator=torch.Generator().manual_seed(step))
        target = torch.randn(tokens, 32, generator=torch.Generator().manual_seed(100 + step))
        out = compiled(distribute_tensor(x, mesh, [Shard(0)]))
        loss = ((out.float() - distribute_tensor(target, mesh, [Shard(0)]).float()) ** 2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        ref_loss = ((reference(x).float() - target.float()) ** 2).mean()
        ref_loss.backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        worst_loss = max(worst_loss, loss_error(loss, ref_loss))
    errors = update_errors(model, reference, before)  # an expert no row reached: no update either side
    from torch._dynamo.utils import counters

    return {"loss_error": worst_loss, "update_error": max(errors.values()), "errors": errors,
            "routed": sorted(set(stages)), "graphs": dict(counters["stats"])}
