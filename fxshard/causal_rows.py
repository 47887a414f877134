"""Causal attention on one rank's query rows (context parallelism): two ops and what they compute.

One device computes row ``i`` of ``softmax(q k^T * scale, causal) v`` over keys ``0..i``. A rank whose
query rows are sharded holds them in runs of consecutive positions (one run under ``Shard``, several
under a strided, round-robin layout) and gets the keys whole. For a run ``[lo, hi)`` the keys ``[0, lo)``
are all visible and the keys ``[lo, hi)`` are the run's own causal square (where torch's top-left and
bottom-right alignments agree), so the rank calls the model's own kernel on exactly the work its rows
need (CPU flash, CUDA flash, memory-efficient), and combines the two partial softmaxes by their logsumexps::

    lse = logaddexp(lse_own, lse_before)
    out = out_own * exp(lse_own - lse) + out_before * exp(lse_before - lse)

The backward kernels read the output and the logsumexp they are given, so a run's gradients over one
block of keys are the kernel called on that block with the run's whole (combined) output and logsumexp,
as ring attention's backward does: grad_query sums over the blocks, and grad_key / grad_value are placed
at their keys (zeros elsewhere): the rank's share of a Partial(sum) over the sequence's axes.

Stage 4 (lowering/query_rows.py) replaces a causal kernel call on sharded query rows by these ops with
the rank's runs; one op per call keeps every rank's program the same list of nodes (simulate runs them
in lockstep), and ``flops`` counts its calls as torch's FlopCounterMode counts the kernel's.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

aten = torch.ops.aten
SEQUENCE = 2  # q, k, v, the outputs and the logsumexp: [batch, heads, sequence, ...]



def _efficient(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float | None) -> tuple:
    out, lse = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)[:2]
    return out, lse[..., :q.shape[SEQUENCE]]  # its logsumexp is padded to a multiple of 32 queries


def _efficient_backward(g: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                        lse: torch.Tensor, causal: bool, scale: float | None) -> tuple:
    n = q.shape[SEQUENCE]
    padded = torch.nn.functional.pad(lse, (0, -(-n // 32) * 32 - n))
    seed, offset = (torch.empty((), dtype=torch.long, device=q.device) for _ in range(2))  # no dropout: unread
    return aten._scaled_dot_product_efficient_attention_backward(
        g, q, k, v, None, out, padded, seed, offset, 0.0, [True, True, True, False], causal, scale=scale)[:3]


def _flash_backward(g: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, causal: bool, scale: float | None) -> tuple:
    seed = torch.empty(2, dtype=torch.uint64, device=q.device)  # no dropout: its RNG state is unread
    offset = torch.empty((), dtype=torch.uint64, device=q.device)
    return aten._scaled_dot_product_flash_attention_backward(
        g, q, k, v, out, lse, None, None, q.shape[SEQUENCE], k.shape[SEQUENCE], 0.0, causal, seed, offset,
        scale=scale)[:3]


# the kernels (``rules_attention.QUERY_ROWS_OPS``) by name, called without dropout or mask:
# (q, k, v, causal, scale) -> (out, lse [b, h, s]); (grad_out, q, k, v, out, lse, causal, scale) -> (dq, dk, dv)
FORWARD: dict[str, Callable] = {
    "cpu_flash": lambda q, k, v, causal, scale: aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, scale=scale)[:2],
    "flash": lambda q, k, v, causal, scale: aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, causal, False, scale=scale)[:2],
    "efficient": _efficient,
}
BACKWARD: dict[str, Callable] = {
    "cpu_flash": lambda g, q, k, v, out, lse, causal, scale: aten._scaled_dot_product_flash_attention_for_cpu_backward(
        g, q, k, v, out, lse, 0.0, causal, scale=scale)[:3],
    "flash": _flash_backward,
    "efficient": _efficient_backward,
}
KERNEL_OF = {aten._scaled_dot_product_flash_attention_for_cpu.default: "cpu_flash",
             aten._scaled_dot_product_flash_attention_for_cpu_backward.default: "cpu_flash",
             aten._scaled_dot_product_flash_attention.default: "flash",
             aten._scaled_dot_product_flash_attention_backward.default: "flash",
             aten._scaled_dot_product_efficient_attention.default: "efficient",
             aten._scaled_dot_product_efficient_attention_backward.default: "efficient"}


def runs_of(rows: Sequence[int]) -> list[int]:
    """The maximal runs of consecutive global rows, flat: ``lo, hi, offset`` each (``offset`` its first local row)."""
    runs: list[list[int]] = []
    for local, row in enumerate(rows):
        if runs and runs[-1][1] == row:
            runs[-1][1] = row + 1
        else:
            runs.append([row, row + 1, local])
    return [n for run in runs for n in run]


def _runs(runs: Sequence[int]) -> list[tuple[int, int, int]]:
    return list(zip(runs[0::3], runs[1::3], runs[2::3]))


def _keys(t: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    return t.narrow(SEQUENCE, lo, hi - lo)


@torch.library.custom_op("fxshard::causal_rows_attention", mutates_args=())
def causal_rows_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, runs: list[int],
                          kernel: str, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The causal attention of the query rows ``runs`` name over the whole keys: (out, logsumexp)."""
    call = FORWARD[kernel]
    outs, lses = [], []
    for lo, hi, offset in _runs(runs):
        q = query.narrow(SEQUENCE, offset, hi - lo)
        out, lse = call(q, _keys(key, lo, hi), _keys(value, lo, hi), True, scale)
        if lo:
            before, lse_before = call(q, _keys(key, 0, lo), _keys(value, 0, lo), False, scale)
            total = torch.logaddexp(lse, lse_before)
            out = (out * (lse - total).exp().unsqueeze(-1) + before * (lse_before - total).exp().unsqueeze(-1)
                   ).to(out.dtype)
            lse = total
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, SEQUENCE).contiguous(), torch.cat(lses, SEQUENCE).contiguous()


@causal_rows_attention.register_fake
def _(query, key, value, runs, kernel, scale=None):
    b, h, s, _ = query.shape
    return query.new_empty((b, h, s, value.shape[-1])), query.new_empty((b, h, s), dtype=torch.float32)


@torch.library.custom_op("fxshard::causal_rows_attention_backward", mutates_args=())
def causal_rows_attention_backward(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                                   value: torch.Tensor, out: torch.Tensor, logsumexp: torch.Tensor, runs: list[int],
                                   kernel: str, scale: float | None = None
                                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of ``causal_rows_attention``: grad_query of the rows, this rank's share of grad_key and
    grad_value (whole keys)."""
    call = BACKWARD[kernel]
    grad_queries = []
    grad_key, grad_value = torch.zeros_like(key), torch.zeros_like(value)
    for lo, hi, offset in _runs(runs):
        rows = [t.narrow(SEQUENCE, offset, hi - lo) for t in (grad_out, query, out, logsumexp)]
        blocks = [(lo, hi, True)] + ([(0, lo, False)] if lo else [])
        dq = None
        for start, end, causal in blocks:
            g, q, o, lse = rows
            dq_block, dk, dv = call(g, q, _keys(key, start, end), _keys(value, start, end), o, lse, causal, scale)
            dq = dq_block if dq is None else dq + dq_block
            _keys(grad_key, start, end).add_(dk)
            _keys(grad_value, start, end).add_(dv)
        grad_queries.append(dq)
    return torch.cat(grad_queries, SEQUENCE).contiguous(), grad_key, grad_value


@causal_rows_attention_backward.register_fake
def _(grad_out, query, key, value, out, logsumexp, runs, kernel, scale=None):
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape)


CAUSAL_ROWS_OPS = (torch.ops.fxshard.causal_rows_attention.default,
                   torch.ops.fxshard.causal_rows_attention_backward.default)


def flops(target: object, args: Sequence[object]) -> int | None:
    """The FLOPs of a call of one of ``CAUSAL_ROWS_OPS`` (args: its values, tensors or fakes), as torch's
    FlopCounterMode counts each kernel call it makes (the causal square as a whole one); None: another op."""
    if target is CAUSAL_ROWS_OPS[0]:
        q, k, v, runs = args[:4]
        return sum(sdpa_flop_count(_rows(q, hi - lo), _rows(k, n), _rows(v, n))
                   for lo, hi, _ in _runs(runs) for n in ((hi - lo), lo) if n)
    if target is CAUSAL_ROWS_OPS[1]:
        g, q, k, v, _, _, runs = args[:7]
        return sum(sdpa_backward_flop_count(_rows(g, hi - lo), _rows(q, hi - lo), _rows(k, n), _rows(v, n))
                   for lo, hi, _ in _runs(runs) for n in ((hi - lo), lo) if n)
    return None


def _rows(t: torch.Tensor, n: int) -> tuple[int, ...]:
    shape = list(t.shape)
    shape[SEQUENCE] = n
    return tuple(shape)
