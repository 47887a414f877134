"""Low precision as users run it: torchao's float8 training (``convert_to_float8_training``: ``Float8Linear``,
tensorwise and rowwise scaling) under Megatron TP, sequence parallelism and FSDP, on simulated ranks, against the
same float8 model on one device on fresh random data.

What the sharded programs must do (issue 69): the amax of a sharded tensor is each rank's amax all-reduced (max),
so every scale equals one device's; the casts and ``_scaled_mm`` run on each rank's shards, no op replicated (no
fallback warning); FSDP gathers the float8 weight (a quarter of the fp32 bytes: the planner casts each shard
before the gather, as torchao's ``enable_fsdp_float8_all_gather`` does for FSDP2) and its scale.

Numerics: float8's casts round to 3 mantissa bits (e4m3; e5m2 for gradients: 2), so a value that a sum order
moves by one fp32 ulp (a row-parallel projection's partial sums, added in another order than one device's matmul
adds them) rounds to the next float8 number now and then, and that step travels on. Sharded runs are therefore
held to one device's own sensitivity on the same data (``own_sensitivity``: how far its outputs move when its
weights move by one part in 1e6), or to fp32 exactness (1e-6) where that is larger. Measured (dim 64 and 128,
four seeds each, TP=4): the forward is within 4e-7 of one device, or (one tensorwise draw in eight) 1.5e-3 where
one device's own move is 1.5e-3 too; rowwise forwards are bit-identical; gradients move 2e-2 (tensorwise) to 5e-2
(rowwise) on one device alone, the sharded ones as far.
"""
from __future__ import annotations

import copy
import os
import sys
import warnings
from collections import Counter

import pytest
import torch
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import parallelize_module

import fxshard
from fxshard.backend.simulate import fake_world, simulate_ranks

float8 = pytest.importorskip("torchao.float8", reason="torchao is not installed (the lowp extra)")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from models.llama import Llama, LlamaConfig, fsdp_placements, megatron_placements, tensor_parallel_plan  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:.*KernelPreference.*")

CFG = LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=8, n_kv_heads=4, ffn_dim=128)
RECIPES = ["tensorwise", "rowwise"]


def float8_llama(recipe: str | None, seed: int = 0) -> Llama:
    """The examples' Llama with every projection but the output one a torchao ``Float8Linear`` (torchtitan's
    filter); ``recipe`` None: the fp32 model."""
    torch.manual_seed(seed)
    model = Llama(CFG)
    if recipe is not None:
        float8.convert_to_float8_training(model, config=float8.Float8LinearConfig.from_recipe_name(recipe),
                                          module_filter_fn=lambda module, fqn: fqn != "output")
    return model


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().abs().max() / b.detach().abs().max())


def simulated(fn, *args, **kwargs):
    """fxshard.simulate's result, and the messages of fxshard's warnings (an op run replicated)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fxshard.simulate(fn, *args, **kwargs)
    return out, [str(w.message) for w in caught if str(w.message).startswith("fxshard")]


def communication(model, x, mesh, placements) -> tuple[Counter, int]:
    e = fxshard.explain(model, x, mesh=mesh, placements=placements)
    return Counter(c.kind for c in e.collectives), sum(c.bytes_per_rank for c in e.collectives)


@pytest.mark.parametrize("recipe", RECIPES)
def test_float8_megatron_forward_matches_one_device(recipe):
    """Megatron TP on 4 ranks: the output as near one device's float8 model as float8 allows (``tolerance``), no
    op replicated, and the fp32 plan's collectives plus the scales' all-reduces (max). Tensorwise: one value per
    tensor whose amax is over a sharded dim, 9 a layer (the weights of wq, wk, wv, w1, w3, sharded on their rows,
    and of wo, w2, on their columns; wo's and w2's inputs, sharded on their features). Rowwise: a scale per row
    of the contraction, all-reduced only where the contraction is sharded, 4 a layer (wo's and w2's weights and
    inputs), [tokens] or [features] values each."""
    model = float8_llama(recipe)
    x = torch.randint(0, CFG.vocab_size, (2, 16))
    mesh = fxshard.MeshSpec(tp=4)
    placements = megatron_placements(model)
    out, replicated = simulated(model, x, mesh=mesh, placements=placements)
    assert not replicated, replicated
    with torch.no_grad():
        assert relative(out, model(x)) <= tolerance(model, lambda m: [m(x)])
    kinds, nbytes = communication(model, x, mesh, placements)
    fp32_kinds, fp32_bytes = communication(float8_llama(None), x, mesh, placements)
    scales = {"tensorwise": 9, "rowwise": 4}[recipe] * CFG.n_layers
    assert kinds == fp32_kinds + Counter(all_reduce=scales)
    if recipe == "tensorwise":  # one float64 value each (torchao takes the amax to float64 for the scale)
        assert nbytes - fp32_bytes == scales * collective_bytes_of_one(8) <= 4 * 1024
    else:  # float64 too: 2 x 16 tokens, 64 features
        tokens = x.numel()
        assert nbytes - fp32_bytes == CFG.n_layers * 2 * (collective_bytes_of_one(8 * tokens)
                                                          + collective_bytes_of_one(8 * CFG.dim))


def collective_bytes_of_one(itemsize: int, n: int = 4) -> int:
    """Bytes a rank receives all-reducing one value of ``itemsize`` bytes over ``n`` ranks (fxshard.costs)."""
    return -(-2 * (n - 1) * itemsize // n)


@pytest.mark.parametrize("recipe", RECIPES)
def test_float8_sequence_parallel_with_parallelize_module(recipe):
    """torch's own styles (sequence parallel: the norms and residual stream sharded on the sequence) on a float8
    model: exact as under Megatron placements, nothing replicated."""
    model = float8_llama(recipe)
    x = torch.randint(0, CFG.vocab_size, (2, 16))
    sharded = copy.deepcopy(model)
    with fake_world(fxshard.MeshSpec(tp=4)) as mesh:
        with LocalTensorMode(4):
            parallelize_module(sharded, mesh, tensor_parallel_plan(sharded, sequence_parallel=True,
                                                                   loss_parallel=False))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run = simulate_ranks(sharded, x)
    assert not [w for w in caught if str(w.message).startswith("fxshard")]
    with torch.no_grad():
        assert relative(run.full()[0], model(x)) <= tolerance(model, lambda m: [m(x)])


def fsdp_gathers(model, x, y, mesh, placements) -> list[int]:
    """The bytes each all_gather of the training step's forward moves into a rank (rank 0's lowered program)."""
    from fxshard.backend.reports.traffic import collective_calls

    with fake_world(mesh):
        run = simulate_ranks(model.loss, x, y, mesh=mesh, placements=placements, grad=True)
        fwd, _ = run.lowered[(0,)]
        return [c.input_bytes * (c.group_size - 1) for c in collective_calls(fwd) if c.kind == "all_gather"]


@pytest.mark.parametrize("recipe", RECIPES)
def test_float8_fsdp_gathers_float8_weights(recipe):
    """FSDP on dp=4 (a batch of 16 x 32 tokens, 4 per rank): each float8 projection's weight is cast on its shard
    and gathered as float8 with its scale (an all-reduced amax tensorwise, a gathered row of scales rowwise), a
    quarter of the fp32 plan's bytes; the norms, embedding and output projection (not float8) as before."""
    x, y = (torch.randint(0, CFG.vocab_size, (16, 32)) for _ in range(2))
    mesh = fxshard.MeshSpec(dp=4)
    model = float8_llama(recipe)
    placements = {**fsdp_placements(model), 0: (Shard(0),), 1: (Shard(0),)}
    gathered = fsdp_gathers(model, x, y, mesh, placements)
    fp32 = fsdp_gathers(float8_llama(None), x, y, mesh, placements)
    projections = 7 * CFG.n_layers
    weights = sum(p.numel() for n, p in model.named_parameters() if n.startswith("layers.") and "norm" not in n)
    float8_weights = weights * 3 // 4  # a quarter of the fp32 bytes: 1 byte an element
    assert sum(fp32) - sum(gathered) >= 3 * float8_weights - 16 * 1024, (sum(fp32), sum(gathered))
    assert len(gathered) >= len(fp32) - projections


def own_sensitivity(model: Llama, run, draws: int = 3) -> float:
    """How far one device's float8 results (``run(model)``: a list of tensors) move when every weight moves by a
    part in 1e6 (``draws`` moves, the farthest): float8's rounding turns such a move into a whole float8 step
    here and there, as it turns a sum order's."""
    generator = torch.Generator().manual_seed(1)
    base = run(model)
    farthest = 0.0
    for _ in range(draws):
        moved = copy.deepcopy(model)
        with torch.no_grad():
            for p in moved.parameters():
                p.mul_(1 + 1e-6 * torch.randn(p.shape, generator=generator))
        farthest = max(farthest, max(relative(a, b) for a, b in zip(run(moved), base)))
    return farthest


def tolerance(model: Llama, run) -> float:
    """What a sharded float8 run is held to (the module's docstring says why)."""
    return max(1e-6, 2 * own_sensitivity(model, run))


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("parallelism", ["megatron", "fsdp"])
def test_float8_training_matches_one_device(recipe, parallelism):
    """The training step (forward and backward, the output gradient cast to e5m2 with its own all-reduced amax)
    under Megatron TP (tp=4) and FSDP (dp=4): the loss within 1e-5 of one device, every gradient within one
    device's own sensitivity on the same data (``tolerance``)."""
    model = float8_llama(recipe)
    batch = 4 if parallelism == "megatron" else 16
    x, y = (torch.randint(0, CFG.vocab_size, (batch, 32)) for _ in range(2))
    if parallelism == "megatron":
        mesh, placements = fxshard.MeshSpec(tp=4), megatron_placements(model)
    else:
        mesh, placements = fxshard.MeshSpec(dp=4), {**fsdp_placements(model), 0: (Shard(0),), 1: (Shard(0),)}
    names = [n for n, _ in model.named_parameters()]

    def step(m: Llama) -> list[torch.Tensor]:
        m.zero_grad()
        loss = m.loss(x, y)
        loss.backward()
        return [loss.detach()] + [p.grad.clone() for p in m.parameters()]

    loss, *grads = step(model)
    bound = tolerance(model, step)
    (out, sharded_grads), replicated = simulated(model.loss, x, y, mesh=mesh, placements=placements, grad=True)
    assert not replicated, replicated
    assert relative(out, loss) <= 1e-5
    errors = {n: relative(sharded_grads[n], g) for n, g in zip(names, grads)}
    assert max(errors.values()) <= bound, (bound, errors)


# ---- a mixed-precision policy (fxshard.MixedPrecision): FSDP2's, for every door --------------------------------
BF16_FP32 = fxshard.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
BF16 = fxshard.MixedPrecision(param_dtype=torch.bfloat16)  # gradients summed in bf16, as FSDP2 without reduce_dtype


def by_hand(model: Llama, x, y, dtype: torch.dtype) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One device running the policy by hand: the loss of the model with its parameters cast to ``dtype`` (torch's
    own reparametrization, no fxshard op), and the fp32 parameters' gradients."""
    from torch.nn.utils.stateless import _reparametrize_module

    params = dict(model.named_parameters())
    with _reparametrize_module(model, {n: p.to(dtype) for n, p in params.items()}, tie_weights=True):
        loss = model.loss(x, y)
    return loss.detach(), dict(zip(params, torch.autograd.grad(loss, list(params.values()))))


def fsdp_step(model: Llama, x, y, policy: fxshard.MixedPrecision | None):
    """The FSDP training step on dp=4 under ``policy``: (loss, gradients, rank 0's forward calls, backward calls)."""
    from fxshard.backend.reports.traffic import collective_calls

    mesh = fxshard.MeshSpec(dp=4)
    placements = {**fsdp_placements(model), 0: (Shard(0),), 1: (Shard(0),)}
    with fake_world(mesh):
        run = simulate_ranks(model.loss, x, y, mesh=mesh, placements=placements, grad=True, mixed_precision=policy)
        fwd, bwd = run.lowered[(0,)]
        return run.full()[0], run.full_grads(), collective_calls(fwd), collective_calls(bwd)


def moved(calls, kind: str) -> int:
    return sum(c.input_bytes for c in calls if c.kind == kind)


@pytest.mark.parametrize("policy", [BF16_FP32, BF16], ids=["reduce_fp32", "reduce_bf16"])
def test_mixed_precision_fsdp_gathers_bf16_and_sums_in_the_reduce_dtype(policy):
    """FSDP on dp=4 under the policy: each parameter cast on its shard and gathered in bf16, half the fp32 plan's
    bytes forward and backward (the backward gathers again, as FSDP2 does), the same collectives; every gradient
    reduce-scattered into its fp32 shard, in fp32 (the fp32 plan's bytes) or in bf16 (half of them, but the
    embedding's, whose backward accumulates in fp32 and is summed so: a sum is never rounded before it is made).

    Numerics against one device running the policy by hand: the loss within 1e-5, each gradient within 2e-2 of
    its largest value. Why 2e-2: each rank's bf16 matmul rounds its share of a gradient (a bf16 ulp, 2**-8 =
    3.9e-3 relative) before the ranks sum, where one device rounds the whole sum once; measured 4.5e-3 to 7.9e-3
    over two draws, and one device's own bf16-vs-fp32 error is 1.0e-2 to 1.1e-2, so the sharded gradients are
    held to no more than one device's own error in bf16 either (with a quarter's slack)."""
    torch.manual_seed(0)
    model = Llama(CFG)
    x, y = (torch.randint(0, CFG.vocab_size, (16, 32)) for _ in range(2))
    loss, grads, fwd, bwd = fsdp_step(model, x, y, policy)
    _, _, fp32_fwd, fp32_bwd = fsdp_step(model, x, y, None)
    assert Counter(c.kind for c in fwd) == Counter(c.kind for c in fp32_fwd)
    assert Counter(c.kind for c in bwd) == Counter(c.kind for c in fp32_bwd)
    for mine, fp32 in ((fwd, fp32_fwd), (bwd, fp32_bwd)):
        assert abs(moved(mine, "all_gather") / moved(fp32, "all_gather") - 0.5) <= 0.025
    if policy.reduce_dtype == torch.float32:
        assert moved(bwd, "reduce_scatter") == moved(fp32_bwd, "reduce_scatter")
    else:
        embedding = model.tok_embeddings.weight.numel() * 4
        assert moved(bwd, "reduce_scatter") == (moved(fp32_bwd, "reduce_scatter") - embedding) // 2 + embedding
    hand_loss, hand = by_hand(model, x, y, torch.bfloat16)
    _, fp32 = by_hand(model, x, y, torch.float32)
    assert relative(loss, hand_loss) <= 1e-5
    assert all(g.dtype == torch.float32 for g in grads.values())
    errors = {n: relative(grads[n], g) for n, g in hand.items()}
    assert max(errors.values()) <= 2e-2, errors
    own = max(relative(hand[n], fp32[n]) for n in hand)
    assert max(relative(grads[n], fp32[n]) for n in hand) <= 1.25 * own


def test_mixed_precision_in_explain_and_simulate():
    """The policy through explain and simulate's forward: the gathers of a FSDP forward move bf16, the output is
    what one device's policy run gives within bf16's rounding, and output_dtype casts it."""
    torch.manual_seed(1)
    model = Llama(CFG)
    x = torch.randint(0, CFG.vocab_size, (16, 32))
    mesh = fxshard.MeshSpec(dp=4)
    placements = {**fsdp_placements(model), 0: (Shard(0),)}
    plain = fxshard.explain(model, x, mesh=mesh, placements=placements)
    cast = fxshard.explain(model, x, mesh=mesh, placements=placements, mixed_precision=BF16_FP32)
    gathered = [sum(c.bytes_per_rank for c in e.collectives if c.kind == "all_gather") for e in (plain, cast)]
    assert gathered[1] < gathered[0]
    policy = fxshard.MixedPrecision(param_dtype=torch.bfloat16, output_dtype=torch.float32)
    out = fxshard.simulate(model, x, mesh=mesh, placements=placements, mixed_precision=policy)
    from torch.nn.utils.stateless import _reparametrize_module

    with torch.no_grad(), _reparametrize_module(model, {n: p.to(torch.bfloat16) for n, p in model.named_parameters()}):
        want = model(x).float()
    assert out.dtype == torch.float32
    assert relative(out, want) <= 2e-2


def test_mixed_precision_errors_name_the_fix():
    """A policy of a non-floating dtype, a wrong option value, and the torch.compile option itself (Dynamo has
    captured the model in its own dtype by then) say what to write instead."""
    with pytest.raises(TypeError, match="floating torch.dtype"):
        fxshard.MixedPrecision(param_dtype=torch.int8)
    from fxshard.backend.options import Options

    with pytest.raises(TypeError, match="fxshard.MixedPrecision"):
        Options.from_backend({"mixed_precision": "bf16"})
    from fxshard.backend import fxshard_backend

    with pytest.raises(ValueError, match="with_mixed_precision"):
        fxshard_backend(torch.fx.symbolic_trace(torch.nn.Identity()), [torch.ones(1)],
                        options={"mixed_precision": BF16_FP32})


def test_with_mixed_precision_keeps_the_module_and_runs_the_policy_on_one_device():
    """The module transform for torch.compile's door: its parameters, their names and state dict unchanged;
    eagerly on one device it is the policy by hand (bit for bit: the same casts), its gradients fp32."""
    torch.manual_seed(2)
    model = Llama(CFG)
    x, y = (torch.randint(0, CFG.vocab_size, (2, 16)) for _ in range(2))
    hand_loss, hand = by_hand(model, x, y, torch.bfloat16)
    names = list(model.state_dict())
    fxshard.with_mixed_precision(model, BF16_FP32)
    assert list(model.state_dict()) == names
    model.loss(x, y).backward()
    assert torch.equal(model.loss(x, y).detach(), hand_loss)
    for n, p in model.named_parameters():
        assert p.grad.dtype == torch.float32
        torch.testing.assert_close(p.grad, hand[n], rtol=0, atol=0)


@pytest.mark.parametrize("variant", ["float8", "mixed_precision", "autocast"])
def test_low_precision_training_through_torch_compile_on_two_gloo_ranks(variant):
    """Two SGD steps through torch.compile(backend="fxshard") with Inductor on 2 gloo ranks
    (tests/low_precision_programs.py): torchao's tensorwise float8 under Megatron TP (parallelize_module), and
    ``with_mixed_precision(model, MixedPrecision(bf16, fp32))`` under FSDP, and the loss in a bf16 autocast
    region under Megatron TP, each against the same steps on one device: the loss within 1e-4 (autocast: 1e-3,
    bf16 logits); updates within 1e-3 (float8: one draw of fp32 sum orders, the casts agree) or within bf16's
    2e-2 (each rank's bf16 share rounded, as above), the policy's gradients fp32."""
    from test_e2e_gloo import examples_and_tests_on_path

    with examples_and_tests_on_path():
        import low_precision_programs
        from ranks import spawn

        results = spawn(low_precision_programs.sgd_steps, 2, timeout=600.0, variant=variant)
    for rank, result in results.items():
        assert result["loss_error"] < (1e-3 if variant == "autocast" else 1e-4), (rank, result)
        assert max(result["update_errors"].values()) < (1e-3 if variant == "float8" else 2e-2), (rank, result)
        assert variant != "mixed_precision" or result["fp32_grads"], (rank, result)


class AutocastMLP(torch.nn.Module):
    """A Megatron MLP whose projections run in a bf16 autocast region of its own forward."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(64, 128, bias=False)
        self.down = torch.nn.Linear(128, 64, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = self.down(torch.relu(self.up(x)))
        return out.float().pow(2).mean()


def test_autocast_region_in_explain_and_simulate():
    """The region under Megatron TP on 4 ranks: the projections run in bf16 (the row-parallel output's all-reduce
    in fp32: its bf16 partials are summed once widened, never rounded first), forward and training against one
    device's autocast run within bf16's rounding, the gradients fp32."""
    torch.manual_seed(3)
    model = AutocastMLP()
    x = torch.randn(16, 64)
    mesh, placements = fxshard.MeshSpec(tp=4), {"up.weight": (Shard(0),), "down.weight": (Shard(1),)}
    loss = model(x)
    loss.backward()
    (out, grads), replicated = simulated(model, x, mesh=mesh, placements=placements, grad=True)
    assert not replicated, replicated
    assert relative(out, loss) <= 1e-3
    for name, p in model.named_parameters():
        assert grads[name].dtype == torch.float32 and relative(grads[name], p.grad) <= 2e-2
    e = fxshard.explain(model, x, mesh=mesh, placements=placements)
    assert [c.kind for c in e.collectives] == ["all_reduce"]
    assert e.collectives[0].bytes_per_rank == collective_bytes_of_one(16 * 64 * 4)
