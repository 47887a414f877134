"""torchtitan's own MoE models with dropless expert parallelism through fxshard, on simulated ranks.

The models are torchtitan 0.3.0's Qwen3-MoE and DeepSeek V3 as tests/titan_programs.py builds them (torchtitan's
builders and initialization, shrunk), and its GPT-OSS (``gpt_oss_config``), not parallelized by torchtitan:
fxshard gets the global program and the EP layout as placements, an ``ep`` axis with the tokens (the batch)
``Shard(0)`` on it and the routed experts' weight stacks (``GroupedExperts``' ``w1_EFD`` / ``w2_EDF`` /
``w3_EFD``, GPT-OSS's weights and biases) ``Shard(0)`` on it, the rest replicated.

torchtitan writes its routed region in its own forms, which stage 1 (backend/capture/routed_experts.py) reads:
its counts are a one-hot ``zeros_like(scores, bool).scatter_(-1, topk ids, True).sum((0, 1))`` (a bincount,
since a topk's ids in a row are distinct), its combine is ``torchtitan::deterministic_scatter_add`` (a
``scatter_add`` along dim 0), the routing scores multiply the experts' outputs before it; GPT-OSS gives each row
its expert's bias by ``repeat_interleave`` of the counts (padded to a static size), its swiglu uses addcmul.
So the region is one routed op: every rank keeps its experts and its tokens, the rows travel by all_to_all,
no stack is gathered.

Each case is checked against one device on fresh random data; the experts run in bf16 (torchtitan casts for
``torch._grouped_mm``), so the gradients are compared to bf16 rounding (``_assert_gradients_close``).
torchtitan 0.3.0 imports triton (torch 2.15's build has it, the 2.13 CPU wheel not: there its tests skip).
The last tests check the one-hot count and bias-spread rules on a plain layer written so (no torchtitan needed).
"""
from __future__ import annotations

import contextlib
import pathlib
import sys
import warnings
from collections import Counter

import pytest
import torch

import fxshard

import torch.nn.functional as F
from torch.distributed.tensor import Shard

from fxshard.backend.explain import collectives_of
from fxshard.backend.simulate import simulate_ranks
from fxshard.routing import ROUTED_OPS

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import titan_programs as titan  # noqa: E402  (imports torchtitan only when a config is built)


@pytest.fixture
def torchtitan():
    """Skips where torchtitan 0.3.0 cannot be imported (the last tests of this file need neither)."""
    pytest.importorskip("triton", reason="torchtitan 0.3.0 imports triton; this torch has none (2.13's CPU wheel)")
    pytest.importorskip("spmd_types", reason="torchtitan 0.3.0's models import spmd_types")
    return pytest.importorskip("torchtitan", reason="torchtitan 0.3.0 is not installed (.ci/run installs it)")

pytestmark = [pytest.mark.filterwarnings("ignore:In CPU autocast:UserWarning"),  # torchtitan's router, fp32 autocast
              pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile:UserWarning")]  # GPT-OSS

SEQ = 16
LAYERS = {"qwen3_moe": 1, "deepseek_v3": 2}  # DeepSeek V3's first layer is dense, its second MoE
STACKS = tuple(".inner_experts." + w for w in (  # the routed experts' stacks, [experts, ...] each
    "w1_EFD", "w2_EDF", "w3_EFD",  # GroupedExperts (Qwen3-MoE, DeepSeek V3)
    "mlp1_weight_EGD", "mlp1_bias_EG", "mlp2_weight_EDF", "mlp2_bias_ED"))  # GptOssGroupedExperts


@contextlib.contextmanager
def experts(n: int):
    """titan_programs' configs with ``n`` routed experts (they read ``titan.EXPERTS`` when called): ep 8 needs 8."""
    before = titan.EXPERTS
    titan.EXPERTS = n
    try:
        yield
    finally:
        titan.EXPERTS = before


def gpt_oss_config() -> object:
    """torchtitan's GPT-OSS (one layer: sliding-window attention with sinks, biased grouped-mm experts with its
    clamped swiglu, a biased softmax router with route_norm) at ``titan.DIM`` with ``titan.EXPERTS`` experts,
    top ``titan.TOP_K``; torchtitan's own attention config at 4 heads of 16 (its default 64 heads of 64 take
    seconds more). Its attention is torchtitan's FlexAttention, run unfused on the CPU (``titan.eager_flex``)."""
    from torchtitan.models.common import CosSinRoPE
    from torchtitan.models.gpt_oss import GptOssModel, _build_gptoss_layers, _make_gptoss_attn_config

    head_dim = 16
    rope = CosSinRoPE.Config(dim=head_dim, max_seq_len=64, theta=150000.0)
    layers = _build_gptoss_layers(dim=titan.DIM, n_layers=1, hidden_dim=titan.MOE_HIDDEN, num_experts=titan.EXPERTS,
                                  top_k=titan.TOP_K, load_balance_coeff=1e-3, attn_backend="flex",
                                  moe_comm_backend="standard", rope=rope)
    for layer_id, layer in enumerate(layers):
        layer.attention = _make_gptoss_attn_config(dim=titan.DIM, layer_id=layer_id, attn_backend="flex", n_heads=4,
                                                   n_kv_heads=2, head_dim=head_dim, sliding_window_size=128,
                                                   rope=rope)
    return GptOssModel.Config(**titan._ends(head_dim), layers=layers)


def model_of(kind: str, seed: int, train: bool) -> torch.nn.Module:
    if kind == "gpt_oss":  # bf16: in fp32 its combine scatter-adds the experts' bf16 rows into fp32 zeros and fails
        titan.eager_flex()
        return titan.build(gpt_oss_config(), seed=seed).bfloat16().train(train)
    model = titan.build(titan.CONFIGS[kind](LAYERS[kind]), seed=seed)
    return model.train(train)


def forward_of(kind: str, model: torch.nn.Module, batch: int):
    """The function simulated: the model, or GPT-OSS with its block-causal masks (torchtitan builds them outside)."""
    if kind != "gpt_oss":
        return model
    masks = model.get_attention_masks(torch.arange(SEQ).repeat(batch, 1))
    return lambda t: model(t, attention_masks=masks)


def tokens(batch: int, seed: int) -> torch.Tensor:
    return torch.randint(0, titan.VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(seed))


def ep_placements(model: torch.nn.Module) -> dict:
    """The EP layout: the tokens (argument 0) and each routed expert stack Shard(0) on ``ep``."""
    stacks = {name: [Shard(0)] for name, _ in model.named_parameters() if name.endswith(STACKS)}
    assert stacks and set(stacks) == {name for name, _ in model.named_parameters() if ".inner_experts." in name}
    return {0: [Shard(0)], **stacks}


def simulate(fn, x, model, ep: int, grad: bool):
    """(the run, fxshard's warnings)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with contextlib.nullcontext() if grad else torch.no_grad():
            run = simulate_ranks(fn, x, mesh=fxshard.MeshSpec(ep=ep), placements=ep_placements(model), grad=grad)
    return run, sorted({str(w.message) for w in caught if str(w.message).startswith("fxshard")})


def stack_gather_bytes(model: torch.nn.Module, ep: int) -> int:
    """What one rank receives to gather the smallest expert stack whole: (ep - 1) / ep of it."""
    smallest = min(p.numel() * p.element_size() for name, p in model.named_parameters() if name.endswith(STACKS))
    return smallest * (ep - 1) // ep


def routed_ops(run) -> int:
    return sum(1 for n in run.graph.graph.nodes if n.target in ROUTED_OPS)


def moe_layers(model: torch.nn.Module) -> int:
    return sum(1 for m in model.modules() if type(m).__name__ in ("GroupedExperts", "GptOssGroupedExperts"))


def _assert_gradients_close(grads, model) -> None:
    """Each gradient against one device's, to bf16's rounding relative to its largest entry: the experts' vjp
    (torch.func's) rounds its bf16 steps (silu's backward) apart from eager autograd's by an ulp here and there,
    as in tests/test_moe_dispatch.py; a gradient lost or misrouted is off by its whole size."""
    for name, p in model.named_parameters():
        assert name in grads, name
        assert (grads[name] - p.grad).abs().max() <= 1e-2 * p.grad.abs().max(), name


FORWARD = [("qwen3_moe", 2, 4), ("qwen3_moe", 4, 4), ("deepseek_v3", 2, 4), ("deepseek_v3", 4, 4),
           ("qwen3_moe", 8, 8), ("deepseek_v3", 8, 8), ("gpt_oss", 2, 4), ("gpt_oss", 4, 4), ("gpt_oss", 8, 8)]


@pytest.mark.parametrize("kind,ep,num_experts", FORWARD)
def test_forward_is_one_devices_and_nothing_moves(torchtitan, kind, ep, num_experts):
    """Inference at ep (eval mode): the logits are one device's; each MoE layer's routed region is one routed op;
    the planned program has no collective at all (attention is per sequence, the tokens stay, the experts stay:
    the only traffic is the routed op's all_to_alls, which explain names apart)."""
    with experts(num_experts):
        model = model_of(kind, seed=ep, train=False)
    x = tokens(2 * ep, seed=10 + ep)
    fn = forward_of(kind, model, len(x))
    with torch.no_grad():
        want = fn(x)
    run, warned = simulate(fn, x, model, ep, grad=False)
    assert warned == []
    torch.testing.assert_close(run.full()[0], want)
    assert routed_ops(run) == moe_layers(model) >= 1
    assert collectives_of(run.graph) == []
    assert min(run.bytes_received) > 0  # what moved: the routed op's rows (and counts), measured per rank


@pytest.mark.parametrize("kind", list(LAYERS))
def test_training_gradients_are_one_devices_with_no_expert_weight_gathered(torchtitan, kind):
    """A training step at ep 2 (train mode: the MoE also counts its tokens per expert into a buffer, reading the
    counts beside the routed op): the loss and every parameter's gradient are one device's; the expert stacks'
    gradients stay Shard(0) with their experts; the only collectives are the all_reduces of the replicated
    parameters' gradients (one each, as DDP), of the mean loss and of each layer's counts for its buffer, none of
    them carrying an expert stack."""
    ep = 2
    model = model_of(kind, seed=3, train=True)
    x = tokens(4, seed=4)

    def loss(t):
        return model(t).float().pow(2).mean()

    want = loss(x)
    want.backward()
    run, warned = simulate(loss, x, model, ep, grad=True)
    assert warned == []
    torch.testing.assert_close(run.full()[0], want.detach())
    grads = run.full_grads()
    _assert_gradients_close(grads, model)
    layouts = dict(zip(run.grad_keys, run.grad_layouts))
    for name in grads:
        if name.endswith(STACKS):
            assert layouts[name].dim_is_sharded(0), name
    assert routed_ops(run) >= moe_layers(model)  # the forward's and the backward's
    replicated = [name for name, _ in model.named_parameters() if not name.endswith(STACKS)]
    collectives = collectives_of(run.graph)
    # and each MoE layer's token counts, summed over the ranks into its tokens_per_expert_E buffer (one int each)
    assert Counter(c.kind for c in collectives) == {"all_reduce": len(replicated) + 1 + moe_layers(model)}
    largest_replicated = max(p.numel() * p.element_size() for name, p in model.named_parameters()
                             if name in replicated)
    assert all(int(c.bytes_per_rank) <= largest_replicated for c in collectives)
    gather = stack_gather_bytes(model, ep)
    assert not [c for c in collectives if c.kind != "all_reduce" and int(c.bytes_per_rank) >= gather]


class OneHotCountsMoE(torch.nn.Module):
    """A dropless layer counting as torchtitan does (one-hot ``scatter_`` then ``sum``) and combining by
    ``scatter_add`` of score-weighted outputs; ``ids``: the experts chosen from outside instead of by topk.
    ``bias``: each row gets its expert's bias ``b1[e]`` by ``repeat_interleave`` of the counts (as GPT-OSS does)."""

    def __init__(self, dim: int = 16, hidden: int = 24, num_experts: int = 4, top_k: int = 2, bias: bool = False):
        super().__init__()
        self.top_k = top_k
        self.router = torch.nn.Parameter(torch.randn(dim, num_experts) * dim ** -0.5)
        self.w1 = torch.nn.Parameter(torch.randn(num_experts, hidden, dim) * dim ** -0.5)
        self.w2 = torch.nn.Parameter(torch.randn(num_experts, dim, hidden) * hidden ** -0.5)
        self.b1 = torch.nn.Parameter(torch.randn(num_experts, hidden)) if bias else None

    def forward(self, x: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
        scores = torch.softmax(x @ self.router, dim=-1)
        if ids is None:
            ids = torch.topk(scores, self.top_k, dim=-1)[1]
        top = scores.gather(-1, ids)
        counts = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, ids, True).sum(dim=0)
        order = torch.argsort(ids.view(-1), stable=True)
        weights = top.view(-1)[order]
        tokens = order // self.top_k
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        rows = x[tokens].bfloat16()
        h = torch._grouped_mm(rows, self.w1.bfloat16().transpose(-2, -1), offs=offsets)
        if self.b1 is not None:
            h = h + self.b1.repeat_interleave(counts, dim=0, output_size=rows.shape[0]).bfloat16()
        h = F.silu(h)
        out = torch._grouped_mm(h, self.w2.bfloat16().transpose(-2, -1), offs=offsets).float() * weights[:, None]
        return torch.zeros_like(x).scatter_add(0, tokens.reshape(-1, 1).expand(-1, x.shape[1]), out)


def _one_hot_run(model, *args):
    placements = {0: [Shard(0)], **({1: [Shard(0)]} if len(args) > 1 else {}), "w1": [Shard(0)], "w2": [Shard(0)],
                  **({"b1": [Shard(0)]} if model.b1 is not None else {})}
    with torch.no_grad():
        want = model(*args)
        run = simulate_ranks(model, *args, mesh=fxshard.MeshSpec(ep=2), placements=placements)
        torch.testing.assert_close(run.full()[0], want)
    return run


def test_one_hot_counts_of_topk_ids_are_a_bincount():
    """The one-hot count of a last-dim topk's ids (distinct in each row) is the keys' bincount: a routed op."""
    torch.manual_seed(0)
    run = _one_hot_run(OneHotCountsMoE(), torch.randn(32, 16))
    assert routed_ops(run) == 1 and collectives_of(run.graph) == []


def test_one_hot_counts_of_other_ids_stay_as_written():
    """Ids from elsewhere may repeat an expert in a row, where the one-hot count (tokens per expert) is not the
    pairs' bincount; stage 1 cannot see that these don't (each row two distinct experts, from the caller), so
    it leaves the program as written: no routed op, exact (the experts gathered). (A row repeating an expert
    makes the program itself ill-defined: its counts then cover fewer rows than it sorts.)"""
    torch.manual_seed(0)
    first = torch.randint(0, 4, (32,), generator=torch.Generator().manual_seed(1))
    other = (first + 1 + torch.randint(0, 3, (32,), generator=torch.Generator().manual_seed(2))) % 4
    ids = torch.stack([first, other], 1)
    run = _one_hot_run(OneHotCountsMoE(), torch.randn(32, 16), ids)
    assert routed_ops(run) == 0


def test_an_experts_bias_spread_over_its_rows_by_the_counts():
    """``b1.repeat_interleave(counts, dim=0, output_size=rows)`` inside the region: on each rank its experts' biases
    repeated by the counts it received (the stack Shard(0) with the weights); forward and gradients at ep 2 are one
    device's, with the bias's gradient kept Shard(0) and no collective but the replicated router's all_reduce."""
    torch.manual_seed(1)
    model = OneHotCountsMoE(bias=True)
    x, target = torch.randn(32, 16), torch.randn(32, 16)
    _one_hot_run(model, x)

    def loss(x, target):
        return ((model(x) - target) ** 2).mean()

    want = loss(x, target)
    want.backward()
    stacks = {name: [Shard(0)] for name in ("w1", "w2", "b1")}
    run = simulate_ranks(loss, x, target, mesh=fxshard.MeshSpec(ep=2), grad=True,
                         placements={0: [Shard(0)], 1: [Shard(0)], **stacks})
    torch.testing.assert_close(run.full()[0], want.detach())
    _assert_gradients_close(run.full_grads(), model)
    assert dict(zip(run.grad_keys, run.grad_layouts))["b1"].dim_is_sharded(0)
    assert routed_ops(run) == 2  # the forward's and the backward's
    assert Counter(c.kind for c in collectives_of(run.graph)) == {"all_reduce": 2}  # the router's gradient, the loss
