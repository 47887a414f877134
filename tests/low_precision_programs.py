"""Low-precision training steps on real gloo ranks (tests/test_low_precision.py spawns them): torchao's float8 under
Megatron TP, and a mixed-precision policy under FSDP, each through torch.compile(backend="fxshard"), against the same
steps on one device."""
from __future__ import annotations

import copy
import pathlib
import sys
from typing import Any

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
from models.llama import Llama, LlamaConfig, tensor_parallel_plan  # noqa: E402

CFG = LlamaConfig(vocab_size=256, dim=64, n_layers=1, n_heads=8, n_kv_heads=4, ffn_dim=128)


def _float8(model: torch.nn.Module) -> torch.nn.Module:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    return convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("tensorwise"),
                                      module_filter_fn=lambda module, fqn: fqn != "output")


def _autocast(loss):
    def in_bf16(x, y):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return loss(x, y)
    return in_bf16


def sgd_steps(rank: int, world_size: int, device: str = "cpu", variant: str = "float8", steps: int = 2,
              lr: float = 0.1) -> dict[str, Any]:
    """``steps`` SGD steps of the examples' Llama (one layer) through torch.compile(backend="fxshard") and on one
    device: ``variant`` "float8" (torchao tensorwise, Megatron's plan as parallelize_module styles, the batch
    replicated), "autocast" (the same plan, fp32 parameters, the loss computed in a bf16 ``torch.autocast`` region
    of the compiled function) or "mixed_precision" (``fxshard.with_mixed_precision(model, MixedPrecision(bf16, fp32))``, every
    parameter Shard(0), the batch Shard(0): FSDP). Returns the worst loss error, each parameter's update error
    relative to one device's update, and whether the gradients are fp32."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.experimental import implicit_replication
    from torch.distributed.tensor.parallel import parallelize_module

    import fxshard
    from step_checks import loss_error, update_errors

    torch.manual_seed(0)
    reference = Llama(CFG)
    if variant == "float8":
        reference = _float8(reference)
    model = copy.deepcopy(reference)
    loss_of = {"reference": reference.loss, "model": model.loss}
    if variant == "autocast":
        loss_of = {name: _autocast(loss) for name, loss in loss_of.items()}
    if variant in ("float8", "autocast"):
        mesh = init_device_mesh(device, (world_size,), mesh_dim_names=("tp",))
        parallelize_module(model, mesh, tensor_parallel_plan(model, loss_parallel=False))
        batch = [Replicate()]
    else:
        mesh = init_device_mesh(device, (world_size,), mesh_dim_names=("dp",))
        for module in model.modules():
            for name, p in list(module.named_parameters(recurse=False)):
                setattr(module, name, torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)])))
        policy = fxshard.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        fxshard.with_mixed_precision(model, policy)
        fxshard.with_mixed_precision(reference, policy)
        batch = [Shard(0)]
    compiled = torch.compile(loss_of["model"], backend="fxshard")
    before = [p.detach().clone() for p in reference.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=lr)
    worst_loss, fp32_grads = 0.0, True
    for step in range(steps):
        generator = torch.Generator().manual_seed(step)
        x, y = (torch.randint(0, CFG.vocab_size, (4, 16), generator=generator) for _ in range(2))
        with implicit_replication():  # FSDP: the rotary table is a plain tensor beside DTensor activations
            loss = compiled(distribute_tensor(x, mesh, batch), distribute_tensor(y, mesh, batch))
        loss.backward()
        fp32_grads &= all(p.grad.dtype == torch.float32 and isinstance(p.grad, DTensor) for p in model.parameters())
        optimizer.step()
        optimizer.zero_grad()
        ref_loss = loss_of["reference"](x, y)
        ref_loss.backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        worst_loss = max(worst_loss, loss_error(loss, ref_loss))
    return {"loss_error": worst_loss, "update_errors": update_errors(model, reference, before),
            "fp32_grads": fp32_grads}
