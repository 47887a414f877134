"""A training step's programs go to Inductor as AOTAutograd gives it a training graph.

fxshard hands Inductor a training step's forward and backward (or their regions) as graphs of their
own, which Inductor would take for inference graphs: ``compile_local(..., training=True)`` keeps
the inference-only pass out (``compile_local.TRAINING_PATCHES``), so an attention layer's rotations
of q and k and its expansion of the grouped k and v fuse into one kernel as they do under
DTensor + FSDP2's compile, instead of three."""
from __future__ import annotations

import pathlib
import sys

import pytest
import torch
import torch.nn.functional as F
from torch._inductor.utils import run_and_get_code
from torch.fx.experimental.proxy_tensor import make_fx

from fxshard.backend.inductor.compile_local import compile_local

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from inductor_code import kernels as generated_kernels  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, DIM, SEQ = 8, 4, 32, 256, 128


def _attention(x, wq, wk, wv, cos, sin):
    """A Llama attention's projections, rotary embedding, grouped k/v expansion and attention."""
    b, s, _ = x.shape
    q = (x @ wq.t()).view(b, s, HEADS, HEAD_DIM)
    k = (x @ wk.t()).view(b, s, KV_HEADS, HEAD_DIM)
    v = (x @ wv.t()).view(b, s, KV_HEADS, HEAD_DIM)

    def rotate(t):
        half = HEAD_DIM // 2
        return t * cos + torch.cat((-t[..., half:], t[..., :half]), -1) * sin

    def expand(t):
        return t[:, :, :, None, :].expand(-1, -1, -1, HEADS // KV_HEADS, -1).reshape(b, s, HEADS, HEAD_DIM)

    q, k, v = rotate(q), expand(rotate(k)), expand(v)
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)


@pytest.mark.parametrize("training, kernels", [(True, 1), (False, 3)])
def test_a_training_program_fuses_the_rotations_and_expansions_into_one_kernel(training, kernels):
    """Training: one kernel, as DTensor + FSDP2's compile of the same layer makes. Inference (torch's
    default, kept for fxshard's inference programs): the pass that pulls each projection down to its
    first reader leaves three. Numerics equal the uncompiled program's either way."""
    torch.manual_seed(0)
    kv = KV_HEADS * HEAD_DIM
    args = [torch.randn(2, SEQ, DIM), torch.randn(DIM, DIM) / 16, torch.randn(kv, DIM) / 16, torch.randn(kv, DIM) / 16,
            torch.randn(1, SEQ, 1, HEAD_DIM), torch.randn(1, SEQ, 1, HEAD_DIM)]
    gm = make_fx(_attention)(*args)
    torch._dynamo.reset()
    with torch.no_grad():
        run, codes = run_and_get_code(lambda: compile_local(gm, args, None, training=training))
        out = run(*args)
    assert [len(generated_kernels(code)) for code in codes] == [kernels], [generated_kernels(code) for code in codes]
    torch.testing.assert_close(out[0] if isinstance(out, (tuple, list)) else out, _attention(*args))
