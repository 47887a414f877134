"""The training setups the benches compare, written once: fxshard and DTensor (+ FSDP2) on one Llama.

Each system is set up the way its best users run it:

- ``tp`` (1-D mesh ``tp``): torchtitan's Megatron plan through ``parallelize_module``, vocab-parallel
  logits; both systems compile the model's forward (fxshard: ``backend="fxshard"``, which compiles the
  joint program; DTensor: ``backend="inductor"``) and take the loss outside it under ``loss_parallel()``.
  ``tp_sp``: the same with torchtitan's sequence parallelism (norms and the residual stream sharded on
  the sequence between the blocks: Megatron-LM's all_gather / reduce_scatter pairs).
- ``tp_loss`` (``tp``): DTensor as in ``tp``; fxshard as in the FSDP rows below, the way its own users
  write it: the unchanged model, its parameters DTensors with the same shardings as the Megatron plan
  (``megatron_placements``: column-parallel weights, the embedding and the output projection on the
  vocabulary dim; norms replicated) and ``fxshard.compile(model.loss)``, the loss planned with the model.
- ``fsdp`` (``dp``) and ``fsdp_tp`` (``dp`` x ``tp``): DTensor's way is FSDP2 (``fully_shard`` per block
  and the root, on top of the TP plan for 2-D) with each block compiled by Inductor, and torchtitan's
  loss (this rank's loss sum over the global batch's count of valid tokens, all-reduced every step,
  FSDP's gradient division off: the global mean, whatever the ignored targets); fxshard's is the
  unchanged model whose parameters are DTensors with the same shardings, ``fxshard.compile(model.loss)``
  (the global mean: its count of valid tokens is all-reduced too). Both read each rank's rows of the
  global batch locally, as a data loader feeds them (fxshard: the global batch as ``DTensor.from_local``
  of the rows, nothing sent).

- ``fsdp_bf16`` (``dp``): ``fsdp`` in bf16 with fp32 gradient sums: FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32)`` on every ``fully_shard``, fxshard's ``MixedPrecision`` of the same dtypes
  (``fxshard.compile(..., mixed_precision=)``).
- ``tp_float8`` (``tp``): ``tp`` with torchao's tensorwise float8 training (every projection but the output one a
  ``Float8Linear``): fxshard's plain Megatron styles, DTensor's torchao's own float8 styles
  (``Float8ColwiseParallel`` / ``Float8RowwiseParallel``: casts to float8 before the TP collectives).

``materialize`` runs once the parameters are sharded: a model built on the meta device gets its
shards there (bench/memory.py), so no rank ever holds the whole model.
"""
from __future__ import annotations

import statistics
from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

TP_CASES = ("tp", "tp_sp", "tp_loss", "tp_float8")  # on a 1-D tp mesh; DTensor runs torch.compile(model), loss outside
MIXED = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)  # fsdp_bf16's policy, both systems
IGNORE_INDEX = -100  # cross_entropy's default: targets that count for nothing
Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (tokens, targets) of the global batch -> loss (a DTensor)


def build(case: str, system: str, mesh: Any, model: nn.Module, fxshard_options: dict[str, Any],
          tp_options: dict[str, Any] | None = None,
          materialize: Callable[[nn.Module], None] = lambda model: None) -> tuple[nn.Module, Step, Any]:
    """(model, step, fxshard's compiled function or None) of ``case`` on ``system`` ("fxshard" or
    "dtensor"). ``fxshard_options``: ``fxshard.compile``'s keywords (cost_model, bucketing, ...), also
    given to the backend for ``tp`` with ``tp_options`` (backend-only options such as ``on_graph``)."""
    from models.llama import fsdp_placements, fsdp_tp_placements, megatron_placements, tensor_parallel_plan
    from train_llama import distribute_parameters

    if case == "tp_loss" and system == "fxshard":
        import fxshard

        megatron = megatron_placements(model)  # the norms, plain under parallelize_module: replicated DTensors
        distribute_parameters(model, mesh, {name: megatron.get(name, (Replicate(),))
                                            for name, _ in model.named_parameters()})
        materialize(model)
        loss_fn = fxshard.compile(model.loss, **fxshard_options)

        def fx_tp_step(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            whole = (Replicate(),)  # every tp rank reads the whole batch, as under parallelize_module
            loss = loss_fn(DTensor.from_local(tokens, mesh, whole), DTensor.from_local(targets, mesh, whole))
            loss.backward()
            return loss
        return model, fx_tp_step, loss_fn
    if case in TP_CASES:
        plan = tensor_parallel_plan(model, sequence_parallel=case == "tp_sp")
        if case == "tp_float8":
            plan = _float8(model, plan, torchao_styles=system != "fxshard")
        parallelize_module(model, mesh, plan)
        materialize(model)
        options = {**fxshard_options, **(tp_options or {})} if system == "fxshard" else None
        compiled = torch.compile(model, backend="fxshard" if system == "fxshard" else "inductor", options=options)

        def tp_step(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            logits = compiled(tokens)
            with loss_parallel():
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
                loss.backward()
            return loss
        return model, tp_step, None
    dp_mesh = mesh if case == "fsdp" else mesh["dp"]
    mine = _rows(dp_mesh)
    if system == "fxshard":
        import fxshard

        distribute_parameters(model, mesh, fsdp_placements(model) if case != "fsdp_tp" else fsdp_tp_placements(model))
        materialize(model)
        policy = {"mixed_precision": fxshard.MixedPrecision(**MIXED)} if case == "fsdp_bf16" else {}
        loss_fn = fxshard.compile(model.loss, **fxshard_options, **policy)
        batch = (Shard(0),) if case != "fsdp_tp" else (Shard(0), Replicate())

        def fx_step(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            loss = loss_fn(DTensor.from_local(mine(tokens), mesh, batch), DTensor.from_local(mine(targets), mesh, batch))
            loss.backward()
            return loss
        return model, fx_step, loss_fn
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    if case == "fsdp_tp":
        parallelize_module(model, mesh["tp"], tensor_parallel_plan(model, sequence_parallel=False,
                                                                  loss_parallel=False))
    mp_policy = MixedPrecisionPolicy(**MIXED) if case == "fsdp_bf16" else MixedPrecisionPolicy()
    for layer in model.layers:
        layer.compile()
        fully_shard(layer, mesh=dp_mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp_policy)
    materialize(model)

    for module in model.modules():  # torchtitan: the loss is normalized by the global token count instead
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # a plain sum: gloo has no PREMUL_SUM(1.0)

    def fsdp2_step(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = model(mine(tokens))
        if isinstance(logits, DTensor):
            logits = logits.full_tensor()
        labels = mine(targets).flatten()
        # torchtitan's trainer: this rank's loss sum over the valid tokens of the global batch, counted by
        # one all_reduce a step, so the gradients FSDP sums are the global mean's (fxshard's loss) whatever
        # the ignored tokens; FSDP's own division by the dp size is off (above)
        valid = funcol.all_reduce((labels != IGNORE_INDEX).sum(), "sum", dp_mesh)
        # upcast as model.loss does (a no-op in fp32; FSDP2 hands bf16 logits in fsdp_bf16)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels, reduction="sum") / valid
        loss.backward()
        return DTensor.from_local(loss.detach(), dp_mesh, (Partial(),), run_check=False)  # the ranks' sum: the mean
    return model, fsdp2_step, None


def _float8(model: nn.Module, plan: dict[str, Any], torchao_styles: bool) -> dict[str, Any]:
    """``model``'s projections but the output one made torchao's float8 ``Float8Linear`` (tensorwise); the TP
    ``plan`` as it is (fxshard plans the casts) or with torchao's float8 styles for those projections (DTensor)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("tensorwise"),
                               module_filter_fn=lambda module, fqn: fqn != "output")
    if not torchao_styles:
        return plan
    styles = {ColwiseParallel: Float8ColwiseParallel, RowwiseParallel: Float8RowwiseParallel}
    out = {}
    for name, style in plan.items():
        cls = styles.get(type(style)) if name not in ("output", "tok_embeddings") else None
        out[name] = style if cls is None else cls(input_layouts=style.input_layouts[0],
                                                  output_layouts=style.output_layouts[0],
                                                  use_local_output=style.use_local_output)
    return out


def alternated(timed: Callable[[str, int], float], pairs: int, warm: int = 2) -> dict:
    """Both systems' steps alternated: ``timed(system, k)`` runs step ``k`` of ``system`` ("fxshard" or
    "dtensor") and returns its seconds. ``warm`` steps each first (the first compiles), then ``pairs``
    pairs, fxshard first in even pairs and DTensor first in odd ones. A step's time moves with the
    machine's speed, which drifts between processes minutes apart by more than the difference measured;
    alternated, both systems meet the same drift and a pair's ratio cancels it. The step ratio is the
    median of the pairs' ratios."""
    for system in ("fxshard", "dtensor"):
        for k in range(warm):
            timed(system, k)
    times: dict[str, list[float]] = {"fxshard": [], "dtensor": []}
    for k in range(pairs):
        for system in (("fxshard", "dtensor") if k % 2 == 0 else ("dtensor", "fxshard")):
            times[system].append(timed(system, warm + k))
    ratios = [f / d for f, d in zip(times["fxshard"], times["dtensor"])]
    return {"step_s": {s: statistics.median(t) for s, t in times.items()}, "pair_ratio": statistics.median(ratios),
            "pair_ratio_quartiles": statistics.quantiles(ratios, n=4)}


def paired_row(row: dict) -> str:
    """A markdown row of ``alternated``'s result (with its ``case``): step medians, ratio, quartiles."""
    if "error" in row:
        return f"| {row['case']} | fails: {row['error']} | |"
    low, _, high = row["pair_ratio_quartiles"]
    return (f"| {row['case']} | {row['step_s']['fxshard'] * 1e3:.1f}, {row['step_s']['dtensor'] * 1e3:.1f} | "
            f"**{row['pair_ratio']:.2f}** ({low:.2f}-{high:.2f}) |")


PAIRED_HEADER = ("| case | step ms fxshard, DTensor (medians) | step fxshard / DTensor: median of the pairs' ratios "
                 "(quartiles) |\n|---|---|---|")


def adamw(model: nn.Module, lr: float = 1e-3) -> torch.optim.Optimizer:
    """AdamW over the model's parameters, DTensors and plain tensors (a TP plan leaves the norms plain)
    in separate groups: torch 2.11's foreach kernels refuse a group that mixes them."""
    params = list(model.parameters())
    groups = [[p for p in params if isinstance(p, DTensor)], [p for p in params if not isinstance(p, DTensor)]]
    return torch.optim.AdamW([{"params": g} for g in groups if g], lr=lr)


def _rows(dp_mesh: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """This rank's equal share of a global batch's rows (the batch divides over dp)."""
    rank, size = dp_mesh.get_local_rank(), dp_mesh.size()

    def mine(batch: torch.Tensor) -> torch.Tensor:
        per_rank = batch.shape[0] // size
        return batch[rank * per_rank:(rank + 1) * per_rank]
    return mine


def case_mesh(case: str, world_size: int, device: str) -> Any:
    """The mesh of a case: ``tp`` (``tp``, ``tp_sp``) or ``dp`` (``fsdp``) over every rank, ``fsdp_tp``
    2 x (world_size / 2) ``(dp, tp)``."""
    from torch.distributed.device_mesh import init_device_mesh

    shape, names = ((world_size,), ("tp",)) if case in TP_CASES else \
        ((world_size,), ("dp",)) if case in ("fsdp", "fsdp_bf16") else ((2, world_size // 2), ("dp", "tp"))
    return init_device_mesh(device, shape, mesh_dim_names=names)


def cpu_seconds() -> float:
    """CPU time of this process and of the compilers it waited for (Inductor's C++ builds): under a
    shared machine's load (or four ranks on two cores, waiting for each other and for the cores),
    wall time measures the load; CPU time the work."""
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def reported(run: Callable[..., dict], rank: int, case: str, system: str, *args: Any) -> dict:
    """``run(rank, *args)``'s result, or ``{"error": ...}`` where a system cannot run a case (rank 0
    says why on stderr), so that one failing row does not fail the table."""
    import sys

    try:
        return run(rank, *args)
    except Exception as e:
        if rank == 0:
            print(f"{system} {case}: {type(e).__name__}: {str(e).splitlines()[0][:200]}", file=sys.stderr)
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"}
