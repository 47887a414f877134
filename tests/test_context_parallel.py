"""Context parallelism (issue 68): the sequence dim sharded on a ``cp`` axis through causal attention.

Q, the residual stream and the MLP stay sequence-sharded; only K and V are all-gathered (the Llama 3
way), and each rank's causal attention runs on its own rows over the keys before them and its own
block (fxshard/causal_rows.py); the backward's dK/dV come back as Partial sums over cp. Checked on
simulated ranks against one device, on fresh random data: outputs and every gradient; the bytes
``explain`` plans; and each rank's FLOPs (``flops_by_rank``, as torch's FlopCounterMode counts them).
"""
from __future__ import annotations

import pathlib
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard, _StridedShard

import fxshard
from fxshard.backend.explain import collectives_of, explain
from fxshard.backend.reports.flops import counting_mode
from fxshard.backend.simulate import simulate_ranks

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
from cp_programs import CFG, Blocks  # noqa: E402
from models.llama import COLUMN_PARALLEL, ROW_PARALLEL, Llama, LlamaConfig  # noqa: E402

B, S = 2, 64


def _fresh(seed: int, cfg: LlamaConfig = CFG) -> tuple[Blocks, torch.Tensor]:
    torch.manual_seed(seed)
    return Blocks(cfg), torch.randn(B, S, cfg.dim, requires_grad=True)


def _check_training(model: nn.Module, x: torch.Tensor, mesh: fxshard.MeshSpec, placements: dict,
                    grad_out: torch.Tensor | None = None) -> dict[str, int]:
    """Simulated ranks' output and every gradient (input and parameters) equal one device's; the plan's counts."""
    sim = simulate_ranks(model, x, mesh=mesh, placements=placements, grad=True)
    out = model(x)
    names = [0] + [n for n, _ in model.named_parameters()]
    want = dict(zip(names, torch.autograd.grad(out.sum(), [x] + list(model.parameters()))))
    torch.testing.assert_close(sim.full()[0], out.detach(), rtol=1e-5, atol=1e-5)
    got = sim.full_grads()
    assert set(got) == set(want)
    for name in names:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
    counts: dict[str, int] = {}
    for c in collectives_of(sim.graph):
        counts[c.kind] = counts.get(c.kind, 0) + 1
    return counts


def _kv_bytes(cfg: LlamaConfig, layers: int, cp: int, tp: int = 1) -> float:
    """What gathering K and V costs a rank: 2 x layers x (cp-1)/cp x the K/V bytes (a tp rank's heads)."""
    kv = B * S * cfg.n_kv_heads * cfg.head_dim * 4 // tp
    return 2 * layers * (cp - 1) / cp * kv


def test_two_blocks_cp4_exact_moving_only_keys_and_values():
    model, x = _fresh(0)
    mesh, placements = fxshard.MeshSpec(cp=4), {0: (Shard(1),)}
    counts = _check_training(model, x, mesh, placements)
    # training: K, V gathered per layer (kept for the backward), dK + dV + dQ's input gradient reduce-scattered
    # once per layer beside the normed input's gather, every replicated weight's gradient all-reduced
    assert counts == {"all_gather": 6, "reduce_scatter": 2, "all_reduce": 18}
    e = explain(model, x.detach(), mesh=mesh, placements=placements)
    assert e.bytes_per_rank <= 1.1 * _kv_bytes(CFG, 2, 4) + 4096
    assert [c.kind for c in e.collectives] == ["all_gather"] * 4


def test_flops_by_rank_balanced_and_not_duplicated():
    model, x = _fresh(1)
    x = x.detach()
    with counting_mode() as one_device:
        model(x)
    for placement in ((Shard(1),), (_StridedShard(1, split_factor=2),)):
        flops = explain(model, x, mesh=fxshard.MeshSpec(cp=4), placements={0: placement}).flops_by_rank
        assert len(flops) == 4
        assert max(flops) / (sum(flops) / 4) <= 1.15, (placement, flops)
        assert sum(flops) <= 1.15 * one_device.get_total_flops(), (placement, flops)


def test_round_robin_rows_balance_causal_attention():
    """Rank r's rows of a contiguous shard see r+1 blocks of keys: the last rank does most of the attention;
    a strided (round-robin) layout of the sequence, DTensor's _StridedShard, evens it out, exactly."""
    cfg = LlamaConfig(dim=64, n_heads=4, n_kv_heads=4, ffn_dim=128)
    model, x = _fresh(2, cfg)

    def flops(placement: tuple) -> list[int]:
        return explain(model, x.detach(), mesh=fxshard.MeshSpec(cp=4), placements={0: placement}).flops_by_rank

    contiguous, strided = flops((Shard(1),)), flops((_StridedShard(1, split_factor=4),))
    spread = [max(f) - min(f) for f in (contiguous, strided)]
    assert spread[1] * 3 < spread[0], (contiguous, strided)
    _check_training(model, x, fxshard.MeshSpec(cp=4), {0: (_StridedShard(1, split_factor=4),)})


def test_cp2_tp2_megatron_exact():
    model, x = _fresh(3)
    placements = {0: (Shard(1), Replicate())}
    for name, _ in model.named_parameters():
        if any(k in name for k in COLUMN_PARALLEL):
            placements[name] = (Replicate(), Shard(0))
        elif any(k in name for k in ROW_PARALLEL):
            placements[name] = (Replicate(), Shard(1))
    mesh = fxshard.MeshSpec(cp=2, tp=2)
    _check_training(model, x, mesh, placements)
    e = explain(model, x.detach(), mesh=mesh, placements=placements)
    # K, V of the rank's heads gathered on cp; the row-parallel projections' partial sums reduced on tp
    by_axes = e.bytes_by_axes()
    assert by_axes["cp"] <= 1.1 * _kv_bytes(CFG, 2, 2, tp=2) + 4096, by_axes
    flops = e.flops_by_rank
    with counting_mode() as one_device:
        model(x.detach())
    assert max(flops) / (sum(flops) / 4) <= 1.15 and sum(flops) <= 1.15 * one_device.get_total_flops(), flops


def test_fsdp_dp_x_cp_x_tp_training_exact():
    """dp x cp x tp = 2 x 2 x 2: the batch on dp, the sequence on cp, Megatron on tp, every weight's other dim
    sharded on dp (FSDP: gathered where used, its gradient reduce-scattered)."""
    model, x = _fresh(9)
    placements = {0: (Shard(0), Shard(1), Replicate())}
    for name, _ in model.named_parameters():
        if any(k in name for k in COLUMN_PARALLEL):
            placements[name] = (Shard(1), Replicate(), Shard(0))
        elif any(k in name for k in ROW_PARALLEL):
            placements[name] = (Shard(0), Replicate(), Shard(1))
        else:
            placements[name] = (Shard(0), Replicate(), Replicate())
    counts = _check_training(model, x, fxshard.MeshSpec(dp=2, cp=2, tp=2), placements)
    assert counts["reduce_scatter"] >= 18, counts  # every weight's gradient into its dp shard


@pytest.mark.parametrize("causal", [False, True])
def test_sharded_queries_with_grouped_heads_and_masks(causal):
    """Grouped-query k/v (fewer heads than q) and, non-causal, an additive mask sharded with the queries."""
    g = torch.Generator().manual_seed(4 + causal)
    q = torch.randn(B, 8, S, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(B, 2, S, 16, generator=g, requires_grad=True) for _ in range(2))
    mask = None if causal else torch.randn(B, 1, S, S, generator=g)

    def fn(q, k, v, *mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[0] if mask else None, is_causal=causal,
                                              enable_gqa=True)

    args = (q, k, v) + (() if mask is None else (mask,))
    placements = {i: (Shard(2),) for i in range(len(args))}
    sim = simulate_ranks(fn, *args, mesh=fxshard.MeshSpec(cp=4), placements=placements, grad=True)
    out = fn(*args)
    want = torch.autograd.grad(out.sum(), [q, k, v])
    torch.testing.assert_close(sim.full()[0], out.detach(), rtol=1e-5, atol=1e-5)
    got = sim.full_grads()
    for i, w in enumerate(want):
        torch.testing.assert_close(got[i], w, rtol=1e-5, atol=1e-5)
    kinds = {c.kind for c in collectives_of(sim.graph)}
    assert kinds <= {"all_gather", "reduce_scatter"}, kinds  # K/V gathered, dK/dV reduce-scattered; q never moves


def test_examples_llama_cp4_exact():
    """The examples' Llama (embedding, rotary table, grouped-query heads, loss) with the tokens Shard(1) on cp."""
    torch.manual_seed(5)
    model = Llama(LlamaConfig(vocab_size=128, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128))
    tokens, targets = (torch.randint(0, 128, (B, S)) for _ in range(2))
    placements = {0: (Shard(1),), 1: (Shard(1),)}
    sim = simulate_ranks(model.loss, tokens, targets, mesh=fxshard.MeshSpec(cp=4), placements=placements, grad=True)
    loss = model.loss(tokens, targets)
    want = dict(zip([n for n, _ in model.named_parameters()], torch.autograd.grad(loss, list(model.parameters()))))
    torch.testing.assert_close(sim.full()[0], loss.detach(), rtol=1e-5, atol=1e-6)
    got = sim.full_grads()
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    queries = [c for c in collectives_of(sim.graph) if c.kind == "all_gather" and c.bytes_per_rank > 4096]
    assert len(queries) <= 3 * 2, queries  # per layer: K, V and the normed input for the backward's weight grads


def _exact_at_cp4(model: nn.Module, ids: torch.Tensor):
    """``model(ids)`` with the ids Shard(1) on cp=4 equals one device's (logits); its explanation."""
    mesh, placements = fxshard.MeshSpec(cp=4), {0: (Shard(1),)}
    with torch.no_grad():
        want = model(ids)
        got = fxshard.simulate(model, ids, mesh=mesh, placements=placements)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    return explain(model, ids, mesh=mesh, placements=placements)


def test_hugging_face_llama_cp4_exact():
    """transformers' LlamaForCausalLM (its SDPA attention, causal mask from the cache positions) with the ids
    Shard(1) on cp=4: logits equal one device's, and attention moves only K and V (gathered)."""
    transformers = pytest.importorskip("transformers")
    from hint_programs import Logits

    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=S,
                                   attn_implementation="sdpa")
    torch.manual_seed(6)
    model = Logits(transformers.LlamaForCausalLM(cfg).eval())
    e = _exact_at_cp4(model, torch.randint(0, 256, (B, S)))
    kv = B * S * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4  # one K or V
    assert e.bytes_per_rank <= 1.1 * (2 * 2 * 3 / 4 * kv) + 4096, e.report()  # 2 layers x (K, V) x (cp-1)/cp


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


class FlexCausal(nn.Module):
    """q/k/v projections around FlexAttention with a causal block mask (blocks of 16 rows) and a score_mod
    that reads the query index: each rank's subgraphs must see global query rows. The block mask's tensors
    are buffers (``fxshard.compile`` reads no tensor that is not an argument, parameter or buffer) that the
    forward wraps in a BlockMask again."""

    def __init__(self, heads: int = 4, head_dim: int = 8, block: int = 16):
        super().__init__()
        from torch.nn.attention.flex_attention import create_block_mask

        self.heads, self.head_dim = heads, head_dim
        self.q, self.k, self.v, self.o = (nn.Linear(heads * head_dim, heads * head_dim, bias=False) for _ in range(4))
        mask = create_block_mask(causal, None, None, S, S, device="cpu", BLOCK_SIZE=block)
        self.mask_sizes = (mask.seq_lengths, mask.BLOCK_SIZE)
        for i, t in enumerate(mask.as_tuple()[2:10]):
            self.register_buffer(f"mask_{i}", t, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention

        block_mask = BlockMask(self.mask_sizes[0], *(getattr(self, f"mask_{i}") for i in range(8)),
                               BLOCK_SIZE=self.mask_sizes[1], mask_mod=causal)
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, -1, self.head_dim).transpose(1, 2).contiguous() for p in (self.q, self.k, self.v))
        out = flex_attention(q, k, v, score_mod=lambda score, b, h, q, kv: score - 0.1 * (q - kv),
                             block_mask=block_mask)
        return self.o(out.transpose(1, 2).reshape(b, s, -1))


def test_flex_attention_causal_block_mask_cp4_exact():
    """FlexAttention (forward: torch has no CPU backward) with the sequence Shard(1) on cp=4: each rank's block
    mask rows are its query blocks, its mask_mod and score_mod get global query indices; only K and V move."""
    torch.manual_seed(7)
    model = FlexCausal().requires_grad_(False)
    x = torch.randn(B, S, 32)
    mesh, placements = fxshard.MeshSpec(cp=4), {0: (Shard(1),)}
    got = simulate_ranks(model, x, mesh=mesh, placements=placements).full()[0]
    torch.testing.assert_close(got, model(x), rtol=1e-5, atol=1e-5)
    e = explain(model, x, mesh=mesh, placements=placements)
    assert [c.kind for c in e.collectives] == ["all_gather"] * 2, e.report()
    assert e.bytes_per_rank == 2 * 3 / 4 * B * S * 32 * 4
    flops = e.flops_by_rank  # its matmuls and its flex call on the rank's rows (FlopCounterMode: dense)
    assert len(set(flops)) == 1 and flops[0] > 4 * 2 * B * (S // 4) * 32 * 32, flops


def test_flex_attention_rows_not_in_whole_blocks_gather_the_queries():
    """Rows of a rank that would cut a block of the block mask (16 rows per rank, blocks of 32): the plan keeps
    the queries whole there (gathered), exact, instead of giving a rank half a block."""
    torch.manual_seed(8)
    model = FlexCausal(block=32).requires_grad_(False)
    x = torch.randn(B, S, 32)
    mesh, placements = fxshard.MeshSpec(cp=4), {0: (Shard(1),)}
    got = simulate_ranks(model, x, mesh=mesh, placements=placements).full()[0]
    torch.testing.assert_close(got, model(x), rtol=1e-5, atol=1e-5)
    e = explain(model, x, mesh=mesh, placements=placements)
    assert [c.kind for c in e.collectives] == ["all_gather"] * 3, e.report()  # q too


CUDA_KERNELS = {
    "flash": lambda q, k, v: torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)[0],
    "efficient": lambda q, k, v: torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0,
                                                                                         True)[0],
}


@pytest.mark.parametrize("kernel", list(CUDA_KERNELS))
def test_cuda_kernels_causal_rows_on_stand_ins(kernel):
    """The CUDA flash and memory-efficient kernels' causal calls on sharded rows, forward and backward, on the CPU
    stand-ins of tests/attention_kernels.py (the math formula with the real kernels' outputs: padded logsumexp,
    RNG state): one device's values and gradients, q never gathered. The real kernels: tests/test_gpu.py's GPU tier."""
    from attention_kernels import register_cuda_kernels_on_cpu

    g = torch.Generator().manual_seed(10)
    q, k, v = (torch.randn(B, 4, S, 16, generator=g, requires_grad=True) for _ in range(3))
    fn = CUDA_KERNELS[kernel]
    with register_cuda_kernels_on_cpu():
        sim = simulate_ranks(fn, q, k, v, mesh=fxshard.MeshSpec(cp=4), placements={i: (Shard(2),) for i in range(3)},
                             grad=True)
        out = fn(q, k, v)
        want = torch.autograd.grad(out.sum(), [q, k, v])
    torch.testing.assert_close(sim.full()[0], out.detach(), rtol=1e-5, atol=1e-5)
    got = sim.full_grads()
    for i, w in enumerate(want):
        torch.testing.assert_close(got[i], w, rtol=1e-5, atol=1e-5)
    gathered = [c for c in collectives_of(sim.graph) if c.kind == "all_gather"]
    assert len(gathered) == 2, gathered  # k and v (kept for the backward), never q


def test_torchtitan_llama3_cp4_exact():
    """torchtitan's Llama 3 as its builder makes it (fused QKV, GQA, complex RoPE from its buffer, its SDPA
    attention; tests/titan_programs.py) with the tokens Shard(1) on cp=4 and its parameters replicated: the logits
    one device's, and only K and V move (2 per layer)."""
    pytest.importorskip("torchtitan")
    pytest.importorskip("triton", reason="torchtitan's models import triton (torch 2.15's build brings it)")
    import titan_programs as titan

    model = titan.build(titan.llama3_config())
    e = _exact_at_cp4(model, torch.randint(0, titan.VOCAB, (B, S), generator=torch.Generator().manual_seed(11)))
    assert [c.kind for c in e.collectives] == ["all_gather"] * 4, e.report()


# Hugging Face architectures of tests/zoo.py (their own attention code: SDPA, sliding windows as masks, ALiBi in
# eager attention, an encoder; MoE layers, whose replicated experts route each rank's own tokens: the routed op
# without dispatch) with the ids Shard(1) on cp=4: K and V gathered per layer, nothing else
ZOO_CP = {"llama": 4, "mistral": 4, "gemma3": 4, "gpt_neox": 4, "bloom": 4, "bert": 4, "mixtral": 4}
ZOO_CP_SLOW = {"qwen2": 4, "gemma": 4, "phi3": 4, "falcon": 4, "opt": 4, "qwen2_moe": 4}


@pytest.mark.parametrize("name", list(ZOO_CP) + [pytest.param(n, marks=pytest.mark.slow) for n in ZOO_CP_SLOW])
def test_zoo_architectures_cp4_exact(name):
    pytest.importorskip("transformers")
    from zoo import ZOO

    arch = ZOO[name]
    torch.manual_seed(12)
    model = arch.build()
    args, fn = arch.example(B, 16), arch.call(model)
    with torch.no_grad():
        want = fn(*args)
        run = simulate_ranks(fn, *args, mesh=fxshard.MeshSpec(cp=4), placements={0: (Shard(1),)})
    torch.testing.assert_close(run.full()[0], want, rtol=1e-4, atol=1e-5)
    kinds = [c.kind for c in collectives_of(run.graph)]
    assert kinds == ["all_gather"] * {**ZOO_CP, **ZOO_CP_SLOW}[name], kinds


def test_head_tail_order():
    """Rank r's contiguous shard of the reordered sequence holds chunks r and 2 cp - 1 - r of 2 cp."""
    assert fxshard.head_tail_order(16, 2).tolist() == [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11]
    with pytest.raises(ValueError, match="pad it to a multiple of 8"):
        fxshard.head_tail_order(20, 4)
    positions = torch.tensor([0, 3, 1, 2])
    visible = fxshard.causal_mask(positions)[0, 0] == 0
    assert visible.tolist() == [[p >= q for q in positions.tolist()] for p in positions.tolist()]


def test_hugging_face_llama_head_tail_cp4_exact_and_even():
    """transformers' Llama on head-tail reordered tokens (fxshard.head_tail_order: ids and position ids permuted,
    fxshard.causal_mask of the positions as its 4-d attention mask) with Shard(1) on cp=4: the logits are one
    device's natural-order logits in that order, only K and V move, and every rank's FLOPs are equal (its dense
    masked kernel computes each row's every score: even, though no fewer than the contiguous shards' busiest)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=S,
                                   attn_implementation="sdpa")
    torch.manual_seed(13)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 256, (B, S))
    order = fxshard.head_tail_order(S, 4)

    def logits(ids, positions, mask):
        return model(input_ids=ids, position_ids=positions, attention_mask=mask).logits

    args = (ids[:, order], order[None].expand(B, -1).contiguous(), fxshard.causal_mask(order))
    mesh, placements = fxshard.MeshSpec(cp=4), {0: (Shard(1),), 1: (Shard(1),)}
    with torch.no_grad():
        want = model(input_ids=ids).logits[:, order]
        got = fxshard.simulate(logits, *args, mesh=mesh, placements=placements)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    e = explain(logits, *args, mesh=mesh, placements=placements)
    assert [c.kind for c in e.collectives] == ["all_gather"] * 4, e.report()
    assert len(set(e.flops_by_rank)) == 1, e.flops_by_rank


def _causal_at(positions: torch.Tensor):
    """A mask_mod: a key is visible where its position is at most the query's."""
    def mask_mod(b, h, q_idx, kv_idx):
        return positions[q_idx] >= positions[kv_idx]
    return mask_mod


class FlexPositions(nn.Module):
    """FlexAttention whose causal mask compares the tokens' positions (a buffer the mask_mod reads), so the same
    module runs on any token order: natural, or head-tail reordered."""

    def __init__(self, positions: torch.Tensor, block: int = 8):
        super().__init__()
        from torch.nn.attention.flex_attention import create_block_mask

        self.q, self.k, self.v, self.o = (nn.Linear(32, 32, bias=False) for _ in range(4))
        self.register_buffer("positions", positions, persistent=False)
        mask = create_block_mask(_causal_at(positions), None, None, S, S, device="cpu", BLOCK_SIZE=block)
        self.mask_sizes = (mask.seq_lengths, mask.BLOCK_SIZE)
        for i, t in enumerate(mask.as_tuple()[2:10]):
            self.register_buffer(f"mask_{i}", t, persistent=False)

    def visible_blocks(self) -> torch.Tensor:
        """Key blocks each query block reads (partial and full): the kernel's work per query block."""
        return (self.mask_0 + self.mask_2)[0, 0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention

        block_mask = BlockMask(self.mask_sizes[0], *(getattr(self, f"mask_{i}") for i in range(8)),
                               BLOCK_SIZE=self.mask_sizes[1], mask_mod=_causal_at(self.positions))
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, -1, 8).transpose(1, 2).contiguous() for p in (self.q, self.k, self.v))
        return self.o(flex_attention(q, k, v, block_mask=block_mask).transpose(1, 2).reshape(b, s, -1))


def test_flex_attention_head_tail_cp4_exact_and_balanced():
    """FlexAttention on head-tail reordered tokens with Shard(1) on cp=4: one device's natural-order result in that
    order, only K and V move, and its block mask gives every rank the same number of key blocks to read
    (2 cp + 1 of 8 rows each), where contiguous shards give rank r 4 r + 3."""
    order = fxshard.head_tail_order(S, 4)
    torch.manual_seed(14)
    natural = FlexPositions(torch.arange(S)).requires_grad_(False)
    reordered = FlexPositions(order).requires_grad_(False)
    reordered.load_state_dict(natural.state_dict())
    x = torch.randn(B, S, 32)
    mesh, placements = fxshard.MeshSpec(cp=4), {0: (Shard(1),)}
    got = simulate_ranks(reordered, x[:, order], mesh=mesh, placements=placements).full()[0]
    torch.testing.assert_close(got, natural(x)[:, order], rtol=1e-5, atol=1e-5)
    e = explain(reordered, x[:, order], mesh=mesh, placements=placements)
    assert [c.kind for c in e.collectives] == ["all_gather"] * 2, e.report()
    assert [b.sum().item() for b in natural.visible_blocks().view(4, -1)] == [3, 7, 11, 15]
    assert [b.sum().item() for b in reordered.visible_blocks().view(4, -1)] == [9, 9, 9, 9]
