"""A tiny Hugging Face Qwen3 trained with the features users combine: tied embeddings, bf16 parameters,
activation checkpointing, gradient accumulation and gradient clipping; on one device, on simulated ranks and on
gloo ranks (a module of its own: spawned ranks import it by name; tests/test_training_features.py runs it).

Every run starts from the same weights, representable in bf16 (the fp32 runs hold them upcast), so a bf16 run's
distance from the fp32 run is its arithmetic's rounding only: the bound a sharded bf16 run is held to.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.distributed.tensor.experimental import implicit_replication

VOCAB, TOKENS = 256, (2, 16)  # (batch, seq) of one micro-batch
CONFIG = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
              num_key_value_heads=4, head_dim=8, max_position_embeddings=64, tie_word_embeddings=True)


@dataclass(frozen=True)
class Recipe:
    """How a step trains: micro-batches accumulated per step, the gradients' clipping norm, SGD's rate."""

    steps: int = 2
    micro_batches: int = 2
    max_norm: float = 0.5  # below the tiny model's gradient norm (about 2.2): clipping scales every step
    lr: float = 0.5  # large enough that a bf16 parameter moves by more than its rounding


RECIPE = Recipe()


def tiny_qwen3(dtype: torch.dtype = torch.float32, checkpointing: bool = True, layers: int = 2) -> torch.nn.Module:
    """Qwen3ForCausalLM from a tiny config (SDPA, the head tied to the embedding), seed 0, its weights rounded to
    bf16 then held in ``dtype``; in training mode with transformers' gradient checkpointing (non-reentrant)."""
    import warnings

    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen3Config(attn_implementation="sdpa", **{**CONFIG, "num_hidden_layers": layers})
    model = transformers.Qwen3ForCausalLM(config)
    model = model.to(torch.bfloat16).to(dtype).train()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    if checkpointing:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # transformers 5 renames it activation_checkpointing_enable
            model.gradient_checkpointing_enable()
    return model


def micro_batch(step: int, index: int) -> torch.Tensor:
    """Fresh random token ids per micro-batch, the same on every rank and every run."""
    return torch.randint(0, VOCAB, TOKENS, generator=torch.Generator().manual_seed(1000 * step + index))


def causal_lm_loss(model: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The loss as transformers computes it (labels shifted inside, logits upcast to fp32 for the cross entropy)."""
    def loss(ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids, labels=ids, use_cache=False).loss
    return loss


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


@dataclass
class Trace:
    """What a run saw per step: the accumulated loss, the gradient norm before clipping, and the gradients
    (full, fp32) it stepped with; its parameters at the start and at the end."""

    start: dict[str, torch.Tensor]
    losses: list[float]
    norms: list[float]
    grads: list[dict[str, torch.Tensor]]
    params: dict[str, torch.Tensor]


def backward_of(loss: Callable[[torch.Tensor], torch.Tensor], recipe: Recipe = RECIPE) -> Callable[[int, int], float]:
    """A micro-step as users write one: the micro-batch's loss scaled by the accumulation count, its backward
    summing into ``.grad``."""
    def micro_step(step: int, i: int) -> float:
        value = loss(micro_batch(step, i)) / recipe.micro_batches
        value.backward()
        return full(value).item()
    return micro_step


def train(model: torch.nn.Module, micro_step: Callable[[int, int], float], recipe: Recipe = RECIPE) -> Trace:
    """``recipe.steps`` SGD steps, each accumulating ``micro_batches`` calls of ``micro_step(step, i)`` (which leaves
    its gradients summed into ``.grad`` and returns its share of the loss), then ``clip_grad_norm_``."""
    optimizer = torch.optim.SGD(model.parameters(), lr=recipe.lr)
    start = {n: full(p).detach().float().clone() for n, p in model.named_parameters()}  # SGD steps in place
    losses, norms, grads = [], [], []
    for step in range(recipe.steps):
        losses.append(sum(micro_step(step, i) for i in range(recipe.micro_batches)))
        norms.append(full(torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.max_norm)).item())
        grads.append({n: full(p.grad).detach().float() for n, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
    return Trace(start, losses, norms, grads, {n: full(p).detach().float() for n, p in model.named_parameters()})


def one_device(dtype: torch.dtype, layers: int = 2, recipe: Recipe = RECIPE) -> Trace:
    """The recipe on one device, eager, parameters in ``dtype``."""
    model = tiny_qwen3(dtype, layers=layers)
    return train(model, backward_of(causal_lm_loss(model), recipe), recipe)


def relative_errors(run: Trace, reference: Trace) -> dict[str, float]:
    """The worst per-step relative errors of the loss and of the gradients (norm of the difference over the norm,
    over all parameters together), and the relative error of what the steps moved the parameters by."""
    def rel(a: Iterable[torch.Tensor], b: Iterable[torch.Tensor]) -> float:
        a, b = list(a), list(b)
        return (sum(((x - y) ** 2).sum() for x, y in zip(a, b)) ** 0.5 / sum((y ** 2).sum() for y in b) ** 0.5).item()

    start, names = reference.start, sorted(reference.params)
    return {"loss": max(abs(x - y) / abs(y) for x, y in zip(run.losses, reference.losses)),
            "grad": max(rel((g[n] for n in names), (h[n] for n in names)) for g, h in zip(run.grads, reference.grads)),
            "update": rel((run.params[n] - start[n] for n in names), (reference.params[n] - start[n] for n in names))}


def errors(run: Trace, one_device: Trace, fp32: Trace) -> dict[str, dict[str, float]]:
    """``run``'s relative errors against one device in its dtype and against fp32, and one device's own."""
    return {"one_device": relative_errors(run, one_device), "fp32": relative_errors(run, fp32),
            "own": relative_errors(one_device, fp32)}


def tp_placements(model: torch.nn.Module) -> dict[str, tuple]:
    """The model's own tensor-parallel plan (``model.tp_plan``) as the placements its styles give each parameter
    (fxshard.ShardPlan.from_tp_plan); parameters it does not name stay replicated."""
    import fxshard

    plan = fxshard.ShardPlan.from_tp_plan(model.tp_plan)
    return {n: e.placements for n, _ in model.named_parameters() if (e := plan.lookup(n)) is not None}


def distributed(model: torch.nn.Module, mesh: Any, placements: dict[str, tuple]) -> torch.nn.Module:
    """Every parameter a DTensor in its placements (Replicate where none is given), assigned as a user does by
    name; then ``tie_weights()``, as transformers ties the head to the embedding after loading a checkpoint."""
    for name, param in list(model.named_parameters()):
        owner, _, leaf = name.rpartition(".")
        value = distribute_tensor(param.detach(), mesh, list(placements.get(name, (Replicate(),))))
        model.get_submodule(owner).register_parameter(leaf, torch.nn.Parameter(value))
    model.tie_weights()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


def parallelized(model: torch.nn.Module, mesh: Any) -> torch.nn.Module:
    """The model's own tensor-parallel plan (``model.tp_plan``) applied as ``parallelize_module`` styles, the model
    kept in global shapes (``use_local_output=False``), the head's output gathered; the parameters the plan
    replicates (q/k norms: 'replicated_with_grad_allreduce') and the others it leaves whole replicated DTensors;
    then ``tie_weights()``: parallelize_module distributes the head and the embedding each on its own."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = {"colwise": lambda: ColwiseParallel(use_local_output=False),
              "rowwise": lambda: RowwiseParallel(use_local_output=False),
              "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
              "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate(), use_local_output=False)}
    parallelize_module(model, mesh, {k: styles[v]() for k, v in model.tp_plan.items() if v in styles})
    for name, param in list(model.named_parameters()):
        if not isinstance(param, DTensor):
            owner, _, leaf = name.rpartition(".")
            model.get_submodule(owner).register_parameter(
                leaf, torch.nn.Parameter(distribute_tensor(param.detach(), mesh, [Replicate()])))
    model.tie_weights()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


def training_features(rank: int, world_size: int, device: str = "cpu", door: str = "fxshard.compile",
                      dtype: str = "bfloat16", layers: int = 1) -> dict[str, Trace]:
    """The recipe on ``world_size`` gloo ranks through ``door`` (``fxshard.compile`` on parameters distributed by
    the model's tp plan, or ``torch.compile(backend="fxshard")`` on the model under its plan's
    ``parallelize_module`` styles), Inductor on, parameters in ``dtype``; and on one device in that dtype and in
    fp32. Returns the sharded run's clipped norms and ``errors``: numbers, not tensors (a tensor a spawned rank
    returns lives in memory shared with a process that exits)."""
    from torch.distributed.device_mesh import init_device_mesh

    import fxshard
    import fxshard.backend  # noqa: F401  (registers the backend)

    mesh = init_device_mesh(device, (world_size,), mesh_dim_names=("tp",))
    model = tiny_qwen3(getattr(torch, dtype), layers=layers)
    if door == "fxshard.compile":
        loss, context = fxshard.compile(LossModule(distributed(model, mesh, tp_placements(model)))), nullcontext()
    else:  # the rotary tables transformers builds in forward are plain tensors: replicated, as DTensor lets them be
        loss, context = torch.compile(LossModule(parallelized(model, mesh)), backend="fxshard"), implicit_replication()
    with context:
        sharded = train(model, backward_of(loss))
    fp32 = one_device(torch.float32, layers)
    same = fp32 if dtype == "float32" else one_device(getattr(torch, dtype), layers)
    return {"norms": sharded.norms, "errors": errors(sharded, same, fp32)}


class LossModule(torch.nn.Module):
    """``causal_lm_loss`` as a module: fxshard.compile reads the parameters of the module it is given."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, labels=ids, use_cache=False).loss


def simulated(dtype: torch.dtype, world: int = 2, layers: int = 2, recipe: Recipe = RECIPE) -> Trace:
    """The recipe on ``world`` simulated ranks (``fxshard.simulate(grad=True)``, the model's tp placements): each
    micro-batch's full gradients, scaled, summed into ``.grad`` as its backward would, then clipped and stepped."""
    import fxshard

    model = tiny_qwen3(dtype, layers=layers)
    placements, loss, params = tp_placements(model), causal_lm_loss(model), dict(model.named_parameters())

    def micro_step(step: int, i: int) -> float:
        value, grads = fxshard.simulate(loss, micro_batch(step, i), mesh=fxshard.MeshSpec(tp=world),
                                        placements=placements, grad=True)
        for name, g in grads.items():  # seeded with ones: the gradients of the unscaled loss
            g = (g / recipe.micro_batches).to(dtype)
            params[name].grad = g if params[name].grad is None else params[name].grad + g
        return value.item() / recipe.micro_batches

    return train(model, micro_step, recipe)
