"""Context parallelism's programs: Llama-style blocks on a [batch, seq, dim] input, and SGD steps of them on gloo
ranks with the sequence sharded (tests/test_context_parallel.py, tests/test_e2e_gloo.py)."""
from __future__ import annotations

import copy
import pathlib
import sys
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
from models.llama import LlamaConfig, TransformerBlock, rope_angles  # noqa: E402

CFG = LlamaConfig(dim=64, n_heads=4, n_kv_heads=4, ffn_dim=128)


class Blocks(nn.Module):
    """Llama-style blocks (causal SDPA, separate q/k/v projections, rotary angles from the sequence length)."""

    def __init__(self, cfg: LlamaConfig = CFG, layers: int = 2):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(layers))

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None = None) -> torch.Tensor:
        """``rope``: the rotary angles [seq, head_dim / 2] (default: computed here; a DTensor program passes them
        as a replicated DTensor, since DTensor's eager semantics, which Dynamo traces, mix no plain tensor in)."""
        if rope is None:
            rope = rope_angles(x.shape[1], self.cfg.head_dim, self.cfg.rope_theta, x.device)
        for layer in self.layers:
            x = layer(x, rope)
        return x


def sgd_steps(rank: int, world_size: int, device: str = "cpu", steps: int = 2, batch: int = 2, seq: int = 64,
              lr: float = 0.1) -> dict[str, Any]:
    """``steps`` SGD steps of ``Blocks`` through torch.compile(backend="fxshard") with the input ``Shard(1)`` on a
    ``cp`` axis of all ranks and every parameter replicated; the same steps on one device. Returns the worst loss
    error, the worst parameter-update error relative to one device's update, and the stages whose graphs hold
    fxshard's causal-rows attention."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from step_checks import loss_error, update_errors

    mesh = init_device_mesh(device, (world_size,), mesh_dim_names=("cp",))
    torch.manual_seed(0)
    reference = Blocks()
    model = copy.deepcopy(reference)
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            setattr(module, name, nn.Parameter(distribute_tensor(p.detach(), mesh, [Replicate()])))
    stages: list[str] = []
    compiled = torch.compile(model, backend="fxshard", options={
        "on_graph": lambda stage, gm: stages.append(stage) if any(
            "causal_rows_attention" in str(n.target) for n in gm.graph.nodes) else None})
    rope = distribute_tensor(rope_angles(seq, CFG.head_dim, CFG.rope_theta), mesh, [Replicate()])
    before = [p.detach().clone() for p in reference.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=lr)
    worst_loss = 0.0
    for step in range(steps):
        x = torch.randn(batch, seq, CFG.dim, generator=torch.Generator().manual_seed(step))
        loss = (compiled(distribute_tensor(x, mesh, [Shard(1)]), rope) ** 2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        ref_loss = (reference(x) ** 2).mean()
        ref_loss.backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        worst_loss = max(worst_loss, loss_error(loss, ref_loss))
    errors = update_errors(model, reference, before)
    return {"loss_error": worst_loss, "update_error": max(errors.values()), "stages": sorted(set(stages))}


def flex_forward(rank: int, world_size: int, device: str = "cpu", sequence: bool = True, **options: Any
                 ) -> dict[str, Any]:
    """tests/test_context_parallel.py's ``FlexCausal`` through ``fxshard.compile`` (Inductor's flex attention
    kernel on each rank's query blocks) with the input ``Shard(1)`` on ``cp``: the worst error against one device."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import fxshard
    from test_context_parallel import FlexCausal

    mesh = init_device_mesh(device, (world_size,), mesh_dim_names=("cp",))
    torch.manual_seed(0)
    model = FlexCausal().requires_grad_(False)
    x = torch.randn(2, 64, 32)
    want = model(x)
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            setattr(module, name, nn.Parameter(distribute_tensor(p.detach(), mesh, [Replicate()]), requires_grad=False))
    out = fxshard.compile(model, **options)(distribute_tensor(x, mesh, [Shard(1) if sequence else Replicate()]))
    return {"error": (out.full_tensor() - want).abs().max().item()}
