"""Programs the gloo tests run on every rank (a module of its own: spawned ranks import it by name)."""
from __future__ import annotations

import copy
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_module, distribute_tensor
from torch.utils.data import DataLoader, TensorDataset


class MLP(torch.nn.Module):
    def __init__(self, dim: int = 16, hidden: int = 32):
        super().__init__()
        self.up = torch.nn.Linear(dim, hidden)
        self.down = torch.nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def data_parallel_epochs(rank: int, world_size: int, device: str = "cpu", epochs: int = 2, samples: int = 11,
                         batch: int = 4, reads_shape: bool = False) -> dict:
    """SGD over a DataLoader without drop_last (batches 4, 4, 3: the last one short, and uneven over 2
    ranks), for ``epochs`` epochs, through torch.compile(backend="fxshard") with its default dynamic
    shapes; the same steps on one device. ``reads_shape``: the loss reads ``x.shape[0]``."""
    mesh = init_device_mesh(device, (world_size,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    reference = MLP()
    model = copy.deepcopy(reference)
    distribute_module(model, mesh)  # every parameter a replicated DTensor: data parallel
    dataset = TensorDataset(torch.randn(samples, 16), torch.randn(samples, 16))

    def loss_fn(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if reads_shape:
            return F.mse_loss(net(x), y, reduction="sum") / x.shape[0]
        return F.mse_loss(net(x), y)

    programs: list[str] = []
    compiled = torch.compile(lambda x, y: loss_fn(model, x, y), backend="fxshard",
                             options={"on_graph": lambda stage, gm: programs.append(stage) if stage == "plan" else None})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    losses, ref_losses, sizes = [], [], []
    for _ in range(epochs):
        for x, y in DataLoader(dataset, batch_size=batch):
            loss = compiled(distribute_tensor(x, mesh, [Shard(0)]), distribute_tensor(y, mesh, [Shard(0)]))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            ref_loss = loss_fn(reference, x, y)
            ref_loss.backward()
            ref_optimizer.step()
            ref_optimizer.zero_grad()
            losses.append(loss.full_tensor().item() if isinstance(loss, DTensor) else loss.item())
            ref_losses.append(ref_loss.item())
            sizes.append(len(x))
    param_error = max((p.full_tensor() - q).abs().max().item()
                      for p, q in zip(model.parameters(), reference.parameters()))

    # inference with dynamic=True: one program per size, each checked per call
    import warnings

    inference_programs: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        infer = torch.compile(model, backend="fxshard", dynamic=True, options={
            "on_graph": lambda stage, gm: inference_programs.append(stage) if stage == "plan" else None})
    inference_error = 0.0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for rows in (4, 3, 4, 2, 3):
            x = torch.randn(rows, 16)
            with torch.no_grad():
                out = infer(distribute_tensor(x, mesh, [Shard(0)]))
                inference_error = max(inference_error, (out.full_tensor() - reference(x)).abs().max().item())
    warned = any("dynamic=True" in str(w.message) for w in caught)
    return {"losses": losses, "ref_losses": ref_losses, "sizes": sizes, "programs": len(programs),
            "param_error": param_error, "inference_error": inference_error,
            "inference_programs": len(inference_programs), "warned_dynamic": warned}


def threads_and_slow_exit(rank: int, world_size: int, device: str = "cpu", exit_delay: float = 0.0) -> dict:
    """What a spawned rank gets (threads), and a rank that takes ``exit_delay`` s to leave after returning."""
    import multiprocessing.util
    import time

    import torch._inductor.config as inductor_config

    from fxshard.backend.reports.report import StageReporter

    if exit_delay:
        multiprocessing.util.Finalize(None, time.sleep, args=(exit_delay,), exitpriority=100)
    with StageReporter(label="toy").timed("counting threads"):  # progress the parent prints (rank 0's)
        threads = torch.get_num_threads()
    return {"threads": threads, "compile_threads": inductor_config.compile_threads}


def busy_in_a_stage(rank: int, world_size: int, device: str = "cpu", seconds: float = 60.0) -> dict:
    """Rank 1 stays inside an fxshard stage (as a long Inductor compile would); rank 0 returns at once."""
    import time

    from fxshard.backend.reports.report import StageReporter

    if rank == 1:
        with StageReporter().timed("compiling the local program with Inductor"):
            time.sleep(seconds)
    return {}


def one_rank_crashes_in_a_collective(rank: int, world_size: int, device: str = "cpu") -> dict:
    """Rank 1 dies of a signal (as a native crash would) while rank 0 waits for it in an all_reduce."""
    import os

    import torch.distributed as dist

    if rank == 1:
        os.abort()
    dist.all_reduce(torch.ones(4))
    return {}


class Branchy(torch.nn.Module):
    """Two matmuls with Python between them that reads values: Dynamo splits ``forward`` into three
    graphs (at the ``if`` on a tensor and at ``.item()``)."""

    def __init__(self, dim: int = 8, hidden: int = 16):
        super().__init__()
        self.up = torch.nn.Linear(dim, hidden, bias=False)
        self.down = torch.nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        if h.mean() > 0:
            h = torch.relu(h)
        else:
            h = -h
        scale = h.abs().amax().item()
        return self.down(h / (1.0 + scale))


def graph_breaks(rank: int, world_size: int, device: str = "cpu") -> dict:
    """Megatron's MLP split by graph breaks, through torch.compile(backend="fxshard"): forward (both
    branches) and one training step against one device, and each graph's input layouts."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from fxshard.graph import LAYOUT

    mesh = init_device_mesh(device, (world_size,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    reference = Branchy()
    model = copy.deepcopy(reference)
    parallelize_module(model, mesh, {"up": ColwiseParallel(use_local_output=False),
                                     "down": RowwiseParallel(use_local_output=False)})
    inputs: list[dict[str, str]] = []  # per planned graph (inference, then the joint ones of training)

    def on_graph(stage: str, gm: torch.fx.GraphModule) -> None:
        if stage == "plan":
            inputs.append({n.name: str(n.meta[LAYOUT]) for n in gm.graph.nodes
                           if n.op == "placeholder" and not n.name.startswith("tangent")})

    compiled = torch.compile(model, backend="fxshard", options={"inductor": False, "on_graph": on_graph})
    x = torch.randn(4, 8)
    forward_error = 0.0
    with torch.no_grad():
        for sign in (1.0, -1.0):  # one branch, then the other
            out = compiled(sign * x)
            forward_error = max(forward_error, (out.full_tensor() - reference(sign * x)).abs().max().item())
    compiled(x).sum().backward()
    reference(x).sum().backward()
    grad_error = max((p.grad.full_tensor() - q.grad).abs().max().item()
                     for p, q in zip(model.parameters(), reference.parameters()))
    return {"forward_error": forward_error, "grad_error": grad_error, "inputs": inputs}


class Blocks(torch.nn.Module):
    """Residual MLP blocks (``layers.0``, ``layers.1``, ...) ending in a sum: FSDP's model in miniature."""

    def __init__(self, dim: int = 32, hidden: int = 64, n_layers: int = 2):
        super().__init__()
        self.layers = torch.nn.ModuleList(MLPBlock(dim, hidden) for _ in range(n_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.sum()


class MLPBlock(torch.nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.up = torch.nn.Linear(dim, hidden, bias=False)
        self.down = torch.nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


def shard_parameters(model: torch.nn.Module, mesh, placements: Sequence[Any] = (Shard(0),)) -> None:
    """FSDP as placements: every parameter a Shard(0) DTensor (uneven where its rows do not divide);
    or every parameter in ``placements``."""
    for name, param in list(model.named_parameters()):
        owner = model.get_submodule(name.rpartition(".")[0])
        owner.register_parameter(name.rpartition(".")[2],
                                 torch.nn.Parameter(distribute_tensor(param.detach(), mesh, list(placements))))


def fsdp_blocks(rank: int, world_size: int, device: str = "cpu", dim: int = 15, hidden: int = 31,
                tokens: int = 128, steps: int = 2, regional: bool = False, layers: int = 2) -> dict:
    """SGD steps of ``Blocks`` (``layers`` of them) with every parameter Shard(0) (uneven rows for odd sizes)
    through torch.compile(backend="fxshard") with bucketing on; the same steps on one device. Returns the
    worst loss and parameter errors and the collectives of the compiled forward and backward (Inductor's
    code: whole programs, or with ``regional`` each distinct region's, from three layers on)."""
    import fxshard

    mesh = init_device_mesh(device, (world_size,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    reference = Blocks(dim, hidden, layers)
    model = copy.deepcopy(reference)
    shard_parameters(model, mesh)
    compiled = torch.compile(model, backend="fxshard", options={"cost_model": fxshard.CostModel(default_latency=0.0),
                                                                "regional": regional})

    def batch(step: int) -> torch.Tensor:
        return torch.randn(tokens, dim, generator=torch.Generator().manual_seed(step))
    return sgd_against_one_device(lambda step: compiled(distribute_tensor(batch(step), mesh, [Shard(0)])),
                                  lambda step: reference(batch(step)), model, reference, steps, lr=0.01)


def sgd_against_one_device(loss: Callable[[int], torch.Tensor], reference_loss: Callable[[int], torch.Tensor],
                           model: torch.nn.Module, reference: torch.nn.Module, steps: int, lr: float) -> dict:
    """``steps`` SGD steps of ``model`` on ``loss(step)`` (compiled, sharded) and of ``reference`` on
    ``reference_loss(step)`` (one device): the worst relative loss error, the worst parameter error, and
    the code Inductor generated for the first step."""
    from torch._inductor.utils import run_and_get_code

    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=lr)
    loss_error, codes = 0.0, []
    for step in range(steps):
        def train_step() -> torch.Tensor:
            value = loss(step)
            value.backward()
            return value
        if step == 0:
            value, codes = run_and_get_code(train_step)
        else:
            value = train_step()
        optimizer.step()
        optimizer.zero_grad()
        ref_value = reference_loss(step)
        ref_value.backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        value = value.full_tensor() if isinstance(value, DTensor) else value
        loss_error = max(loss_error, abs(value.item() - ref_value.item()) / abs(ref_value.item()))
    param_error = max(((p.full_tensor() if isinstance(p, DTensor) else p) - q).abs().max().item()
                      for p, q in zip(model.parameters(), reference.parameters()))
    return {"loss_error": loss_error, "param_error": param_error, "codes": codes}


class SwiGLUBlock(torch.nn.Module):
    """A Llama feed-forward block in miniature: RMSNorm, gate and up, SiLU-gated, down, and the residual.
    Its backward sums two input gradients (gate's and up's): the weight gradients come before that sum's
    reduction in Inductor's order."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.norm = torch.nn.RMSNorm(dim)
        self.gate = torch.nn.Linear(dim, hidden, bias=False)
        self.up = torch.nn.Linear(dim, hidden, bias=False)
        self.down = torch.nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def sequence_parallel(model: torch.nn.Sequential, mesh) -> None:
    """torchtitan's tensor + sequence parallel plan for a ``Sequential`` of ``SwiGLUBlock``s on [tokens, dim]
    inputs sharded on the tokens (``parallelize_module``): the norms and the residual stream on token
    shards, gate and up column-parallel, down row-parallel back to token shards."""
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                   parallelize_module)

    plan = {}
    for i in range(len(model)):
        plan.update({f"{i}.norm": SequenceParallel(sequence_dim=0),
                     f"{i}.gate": ColwiseParallel(input_layouts=Shard(0)),
                     f"{i}.up": ColwiseParallel(input_layouts=Shard(0)),
                     f"{i}.down": RowwiseParallel(output_layouts=Shard(0), use_local_output=False)})
    parallelize_module(model, mesh, plan)


def sequence_parallel_blocks(rank: int, world_size: int, device: str = "cpu", dim: int = 32, hidden: int = 64,
                             tokens: int = 16, steps: int = 2) -> dict:
    """SGD steps of two ``SwiGLUBlock``s under ``sequence_parallel`` through torch.compile(backend="fxshard")
    (whole programs: the collectives' windows, backend/inductor/collective_windows.py, span both blocks); the same
    steps on one device. Returns the worst loss and parameter errors and the compiled programs' code."""
    mesh = init_device_mesh(device, (world_size,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    reference = torch.nn.Sequential(SwiGLUBlock(dim, hidden), SwiGLUBlock(dim, hidden))
    model = copy.deepcopy(reference)
    sequence_parallel(model, mesh)
    compiled = torch.compile(model, backend="fxshard", options={"regional": False})

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.randn(tokens, dim, generator=torch.Generator().manual_seed(step)),
                torch.randn(tokens, dim, generator=torch.Generator().manual_seed(100 + step)))

    def loss(step: int) -> torch.Tensor:
        x, target = (distribute_tensor(t, mesh, [Shard(0)]) for t in batch(step))
        return ((compiled(x) - target) ** 2).mean()

    def reference_loss(step: int) -> torch.Tensor:
        x, target = batch(step)
        return ((reference(x) - target) ** 2).mean()
    return sgd_against_one_device(loss, reference_loss, model, reference, steps, lr=0.1)


class AttentionBlock(torch.nn.Module):
    """A pre-norm attention block (RMSNorm, q/k/v, causal SDPA, o, the residual) on [batch, seq, dim]: the
    part of a transformer layer whose saved values include SDPA's two outputs (out, logsumexp)."""

    def __init__(self, dim: int = 32, heads: int = 4):
        super().__init__()
        self.norm = torch.nn.RMSNorm(dim)
        self.q, self.k, self.v, self.o = (torch.nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.head_dim = dim // heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.norm(x)
        # -1 heads: under parallelize_module's column-parallel q/k/v each rank views its own heads
        q, k, v = (p(h).view(b, s, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(o.transpose(1, 2).reshape(b, s, -1))


class CheckpointedBlocks(torch.nn.Module):
    """``AttentionBlock``s, each called through ``torch.utils.checkpoint`` (non-reentrant), as a model with
    activation checkpointing runs its layers."""

    def __init__(self, dim: int = 32, heads: int = 4, n_layers: int = 2):
        super().__init__()
        self.blocks = torch.nn.ModuleList(AttentionBlock(dim, heads) for _ in range(n_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return x


def parallelize_attention(model: CheckpointedBlocks, mesh, sequence_parallel: bool) -> None:
    """Megatron's plan for ``CheckpointedBlocks`` (``parallelize_module``): q/k/v column-parallel, o
    row-parallel; with ``sequence_parallel`` the norms and the residual stream on sequence shards (dim 1)."""
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                   parallelize_module)

    plan: dict[str, Any] = {}
    for i in range(len(model.blocks)):
        for name in ("q", "k", "v"):
            plan[f"blocks.{i}.{name}"] = ColwiseParallel(input_layouts=Shard(1)) if sequence_parallel \
                else ColwiseParallel()
        plan[f"blocks.{i}.o"] = RowwiseParallel(output_layouts=Shard(1), use_local_output=False) \
            if sequence_parallel else RowwiseParallel()
        if sequence_parallel:
            plan[f"blocks.{i}.norm"] = SequenceParallel()
    parallelize_module(model, mesh, plan)


def checkpointed_attention(rank: int, world_size: int, device: str = "cpu", sequence_parallel: bool = False,
                           steps: int = 2) -> dict:
    """``CheckpointedBlocks`` under Megatron TP (or TP+SP) through torch.compile(backend="fxshard"): per step,
    on fresh random data, the worst errors of the loss, the input's gradient and every parameter's gradient
    against one device, then an SGD step of both."""
    mesh = init_device_mesh(device, (world_size,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    reference = CheckpointedBlocks()
    model = copy.deepcopy(reference)
    parallelize_attention(model, mesh, sequence_parallel)
    compiled = torch.compile(model, backend="fxshard")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    errors = {"loss": 0.0, "input_grad": 0.0, "param_grad": 0.0}
    for step in range(steps):
        generator = torch.Generator().manual_seed(step)
        x, target = torch.randn(2, 8, 32, generator=generator), torch.randn(2, 8, 32, generator=generator)
        ref_x = x.clone().requires_grad_()
        x = (distribute_tensor(x, mesh, [Shard(1)]) if sequence_parallel else x).requires_grad_()
        out = compiled(x)
        out = out.full_tensor() if isinstance(out, DTensor) else out
        loss = ((out - target) ** 2).mean()
        loss.backward()
        ref_loss = ((reference(ref_x) - target) ** 2).mean()
        ref_loss.backward()
        grad = x.grad.full_tensor() if isinstance(x.grad, DTensor) else x.grad
        errors["loss"] = max(errors["loss"], abs(loss.item() - ref_loss.item()))
        errors["input_grad"] = max(errors["input_grad"], (grad - ref_x.grad).abs().max().item())
        for p, q in zip(model.parameters(), reference.parameters()):
            p_grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            errors["param_grad"] = max(errors["param_grad"], (p_grad - q.grad).abs().max().item())
        optimizer.step()
        ref_optimizer.step()
        optimizer.zero_grad()
        ref_optimizer.zero_grad()
    return errors


class BranchingLinear(torch.nn.Linear):
    """A linear layer that branches on its output (``if h.sum() > 0``): Dynamo breaks the graph inside it
    and compiles the DTensor hooks around it (``parallelize_module``'s) as frames of their own."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = super().forward(x)
        if h.sum() > 0:
            return torch.relu(h)
        return -h


class BranchingMLP(torch.nn.Module):
    def __init__(self, dim: int = 8, hidden: int = 16):
        super().__init__()
        self.up = BranchingLinear(dim, hidden, bias=False)  # no bias: the input's sign picks the branch
        self.down = torch.nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.up(x))


def training_through_breaks(rank: int, world_size: int, device: str = "cpu", steps: int = 3) -> dict:
    """SGD steps of Megatron's ``BranchingMLP`` through torch.compile(backend="fxshard") (both branches: the
    input's sign alternates), against one device; then as many again compiled anew (Dynamo reset), reading
    what the first compile kept on disk, as a script's second run does. Per compile: the worst errors."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh(device, (world_size,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    reference = BranchingMLP()
    model = copy.deepcopy(reference)
    parallelize_module(model, mesh, {"up": ColwiseParallel(use_local_output=False),
                                     "down": RowwiseParallel(use_local_output=False)})

    def batch(step: int) -> torch.Tensor:
        return (-1) ** step * torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
    errors = []
    for _ in range(2):
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="fxshard")
        result = sgd_against_one_device(lambda step: (compiled(batch(step)) ** 2).mean(),
                                        lambda step: (reference(batch(step)) ** 2).mean(), model, reference, steps,
                                        lr=0.1)
        errors.append({"loss_error": result["loss_error"], "param_error": result["param_error"]})
    return {"errors": errors}


class FailingMLP(torch.nn.Module):
    """Megatron's MLP whose rank ``failing_rank`` fails in the middle of a training step: between its two
    graphs (``where="forward"``) or in the backward (a gradient hook), raising or leaving (``os._exit(3)``)."""

    def __init__(self, failing_rank: int, how: str, where: str, dim: int = 8, hidden: int = 16):
        super().__init__()
        self.up = torch.nn.Linear(dim, hidden, bias=False)
        self.down = torch.nn.Linear(hidden, dim)
        self.failing_rank, self.how, self.where = failing_rank, how, where

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = _fail_there(self.up(x), self.failing_rank, self.how, self.where)
        return self.down(torch.relu(h))


def _fail_on(rank: int, how: str) -> None:
    import os

    import torch.distributed as dist

    if dist.get_rank() == rank:
        if how == "exit":
            os._exit(3)
        raise RuntimeError(f"rank {rank} fails in its compiled step")


@torch._dynamo.disable  # Python between two graphs: a graph break
def _fail_there(h: torch.Tensor, rank: int, how: str, where: str) -> torch.Tensor:
    if where == "forward":
        _fail_on(rank, how)
    else:
        h.register_hook(lambda grad: _fail_on(rank, how))
    return h


def one_rank_fails_in_a_compiled_step(rank: int, world_size: int, device: str = "cpu", how: str = "raise",
                                      where: str = "forward") -> dict:
    """SGD steps of ``FailingMLP`` under torch.compile(backend="fxshard") in which rank 1 fails (``how``,
    ``where``: as ``FailingMLP``'s) while rank 0 runs on into the collectives rank 1 never joins."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh(device, (world_size,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    model = FailingMLP(1, how, where)
    parallelize_module(model, mesh, {"up": ColwiseParallel(use_local_output=False),
                                     "down": RowwiseParallel(use_local_output=False)})
    compiled = torch.compile(model, backend="fxshard")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        (compiled(torch.randn(4, 8)) ** 2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return {}
