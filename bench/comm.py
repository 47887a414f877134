"""Bytes on the wire per forward: fxshard vs DTensor, per model and parallelism, at world size 8.

    python bench/comm.py            # the table (markdown); --json for machine-readable rows

Both run the same parallelized module on rank 0 of a fake process group of 8 ranks (no data
moves; shapes are real):

- fxshard: ``torch.compile(fn, backend="fxshard")``; the collectives of the compiled rank's
  lowered local graph (stage 5), sized from its shapes.
- DTensor: the eager module under ``CommDebugMode``; every collective it dispatches is recorded
  with its input. DTensor runs at its best: ``loss_parallel()`` around the vocab-parallel loss,
  and its all_to_all path for Shard->Shard even though the process group is a CPU one (DTensor
  would otherwise fall back to all_gather + chunk on CPU, which it does not do on GPUs).

Bytes are what one rank receives, by one formula for both (``fxshard.backend.reports.traffic``):
all_gather (n-1)·in, all_reduce 2(n-1)/n·in, reduce_scatter and all_to_all (n-1)/n·in.
Counts are deterministic, so there is no timing and no noise here.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import pathlib
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

import fxshard
from fxshard.backend.reports.traffic import CollectiveCall, collective_call, collective_calls, summarize

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
from models.llama import Llama, LlamaConfig, tensor_parallel_plan  # noqa: E402

WORLD = 8
LLAMA = LlamaConfig(vocab_size=8192, dim=1024, n_layers=2, n_heads=16, n_kv_heads=8, ffn_dim=2816)
BATCH, SEQ = 8, 256


class CommBytesMode(CommDebugMode):
    """CommDebugMode that also keeps each collective's input size."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[CollectiveCall] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if out is not NotImplemented and not isinstance(func, torch._ops.HigherOrderOperator):
            call = collective_call(func, args)
            if call is not None:
                self.calls.append(call)
        return out


@contextlib.contextmanager
def dtensor_all_to_all() -> Iterator[None]:
    """Let DTensor take its all_to_all path on a CPU mesh (see the module docstring)."""
    from torch.distributed.tensor import _collective_utils as cu

    saved = cu.local_tensor_mode
    cu.local_tensor_mode = lambda: True
    try:
        yield
    finally:
        cu.local_tensor_mode = saved


@dataclass
class Case:
    model: str
    parallelism: str
    mesh: tuple[tuple[str, int], ...]
    build: Callable[[Any, str], "Setup"]  # (device mesh, "dtensor" | "fxshard") -> what to run


@dataclass
class Setup:
    fn: Callable
    args: tuple
    context: Callable[[], Any] = contextlib.nullcontext
    placements: dict | None = None  # fxshard: global arguments sharded by these (else DTensors, compiled)


def llama(cfg: LlamaConfig = LLAMA) -> Llama:
    torch.manual_seed(0)
    return Llama(cfg).eval()


def tokens(cfg: LlamaConfig = LLAMA) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (BATCH, SEQ))


def llama_tp(sequence_parallel: bool, loss: bool = False):
    """torchtitan's Megatron plan through ``parallelize_module``; the same module for both systems."""
    def build(mesh, system):
        model = llama()
        parallelize_module(model, mesh, tensor_parallel_plan(model, sequence_parallel=sequence_parallel))
        if loss:
            return Setup(model.loss, (tokens(), tokens()), loss_parallel)
        return Setup(model, (tokens(),))
    return build


class PinnedOutput(torch.nn.Module):
    """``model`` whose output is pinned to ``placements`` (the layout the DTensor version returns)."""

    def __init__(self, model: torch.nn.Module, placements: tuple):
        super().__init__()
        self.model, self.placements = model, placements

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fxshard.constrain(self.model(x), self.placements)


def fsdp(make: Callable[[], torch.nn.Module], blocks: Callable[[torch.nn.Module], Any]):
    """Parameters Shard(0) on dp, the batch Shard(0). DTensor's way is FSDP2 (``fully_shard`` per
    block, then the root: all-gathers each block's parameters before it runs); fxshard's is the
    plain model with those placements and the logits pinned batch-sharded, as FSDP2 returns them."""
    def build(mesh, system):
        model = make()
        if system == "fxshard":
            pinned = PinnedOutput(model, (Shard(0),))
            placements = {name: (Shard(0),) for name, _ in pinned.named_parameters()}
            return Setup(pinned, (tokens(),), placements={**placements, 0: (Shard(0),)})
        from torch.distributed.fsdp import fully_shard

        for block in blocks(model):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return Setup(model, (tokens()[: BATCH // mesh.size()],))
    return build


def hf_gpt2() -> torch.nn.Module:
    import transformers

    cfg = transformers.GPT2Config(vocab_size=LLAMA.vocab_size, n_embd=LLAMA.dim, n_layer=LLAMA.n_layers,
                                  n_head=LLAMA.n_heads, n_positions=SEQ, attn_implementation="sdpa",
                                  bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return HFLogits(transformers.GPT2LMHeadModel(cfg).eval())


def llama_2d(mesh, system):
    """dp x tp, torchtitan's way for DTensor: the Megatron plan on tp, then FSDP2 on dp. fxshard: the
    same placements as data (weights' other dim Shard on dp), the batch on dp, logits (Shard(0), Shard(-1))."""
    model = llama()
    if system == "fxshard":
        pinned = PinnedOutput(model, (Shard(0), Shard(2)))
        column = ("wq", "wk", "wv", "w1", "w3", "tok_embeddings", "output")
        placements: dict = {0: (Shard(0), Replicate())}
        for name, _ in pinned.named_parameters():
            if any(k in name for k in column):
                placements[name] = (Shard(1), Shard(0))
            elif "wo" in name or "w2" in name:
                placements[name] = (Shard(0), Shard(1))
            else:
                placements[name] = (Shard(0), Replicate())
        return Setup(pinned, (tokens(),), placements=placements)
    from torch.distributed.fsdp import fully_shard

    parallelize_module(model, mesh["tp"], tensor_parallel_plan(model, sequence_parallel=False))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return Setup(model, (tokens()[: BATCH // mesh["dp"].size()],))


def hf_llama_tp(mesh, system):
    """Hugging Face LlamaForCausalLM (the ``models`` extra), Megatron TP with a vocab-parallel embedding
    and output. DTensor: ``parallelize_module`` with its Linear/Embedding styles; fxshard: the same
    shardings as parameter placements on the unmodified model."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=LLAMA.vocab_size, hidden_size=LLAMA.dim, intermediate_size=LLAMA.ffn_dim,
                                   num_hidden_layers=LLAMA.n_layers, num_attention_heads=LLAMA.n_heads,
                                   num_key_value_heads=LLAMA.n_kv_heads, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = HFLogits(transformers.LlamaForCausalLM(cfg).eval())
    column = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
    if system == "fxshard":
        placements = {n: (Shard(0),) for n, _ in model.named_parameters()
                      if any(k in n for k in column + ("embed_tokens", "lm_head"))}
        placements.update({n: (Shard(1),) for n, _ in model.named_parameters() if "o_proj" in n or "down_proj" in n})
        return Setup(model, (tokens(),), placements=placements)
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {"hf.model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
            "hf.lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    for i in range(cfg.num_hidden_layers):
        p = f"hf.model.layers.{i}."
        plan.update({p + "self_attn." + k: ColwiseParallel() for k in ("q_proj", "k_proj", "v_proj")})
        plan.update({p + "mlp." + k: ColwiseParallel() for k in ("gate_proj", "up_proj")})
        plan.update({p + "self_attn.o_proj": RowwiseParallel(), p + "mlp.down_proj": RowwiseParallel()})
    parallelize_module(model, mesh, plan)
    return Setup(model, (tokens(),))


class HFLogits(torch.nn.Module):
    def __init__(self, hf: torch.nn.Module):
        super().__init__()
        self.hf = hf

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=ids, use_cache=False).logits


CASES = [
    Case("llama", "TP", (("tp", WORLD),), llama_tp(False)),
    Case("llama", "TP+SP", (("tp", WORLD),), llama_tp(True)),
    Case("llama loss", "TP, vocab-parallel loss", (("tp", WORLD),), llama_tp(False, loss=True)),
    Case("llama", "FSDP-style", (("dp", WORLD),), fsdp(llama, lambda m: m.layers)),
    Case("llama", "2-D dp x tp", (("dp", 2), ("tp", WORLD // 2)), llama_2d),
    Case("HF LlamaForCausalLM", "TP", (("tp", WORLD),), hf_llama_tp),
    Case("HF GPT2LMHeadModel", "FSDP-style", (("dp", WORLD),), fsdp(hf_gpt2, lambda m: m.hf.transformer.h)),
]


def fxshard_calls(setup: Setup, mesh: Any) -> list[CollectiveCall]:
    """The busiest rank's collectives in fxshard's lowered program."""
    if setup.placements is not None:
        from fxshard.backend.simulate import lowered_graphs

        per_rank = [collective_calls(g) for g in lowered_graphs(
            setup.fn, *setup.args, device_mesh=mesh, placements=setup.placements).values()]
        return max(per_rank, key=lambda calls: summarize(calls)[1])
    graphs: dict = {}
    compiled = torch.compile(setup.fn, backend="fxshard",
                             options={"inductor": False, "on_graph": lambda stage, gm: graphs.__setitem__(stage, gm)})
    with torch.no_grad(), setup.context():
        compiled(*setup.args)
    return collective_calls(graphs["lower"])


def dtensor_calls(setup: Setup, mesh: Any) -> list[CollectiveCall]:
    mode = CommBytesMode()
    with torch.no_grad(), setup.context(), dtensor_all_to_all(), mode:
        setup.fn(*setup.args)
    return mode.calls


def measure(case: Case) -> dict:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=math.prod(s for _, s in case.mesh))
    try:
        mesh = init_device_mesh("cpu", tuple(s for _, s in case.mesh), mesh_dim_names=tuple(n for n, _ in case.mesh))
        torch._dynamo.reset()
        row: dict = {"model": case.model, "parallelism": case.parallelism,
                     "mesh": "x".join(f"{n}{s}" for n, s in case.mesh)}
        for system, calls in (("dtensor", dtensor_calls), ("fxshard", fxshard_calls)):
            try:
                counts, nbytes = summarize(calls(case.build(mesh, system), mesh))
                row[system] = {"collectives": counts, "bytes": nbytes}
            except Exception as e:  # a system that cannot run the case is a row entry, not a crash
                row[system] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"}
        return row
    finally:
        dist.destroy_process_group()


def _cell(entry: dict) -> tuple[str, str]:
    if "error" in entry:
        return "error", entry["error"]
    counts = ", ".join(f"{n} {k}" for k, n in sorted(entry["collectives"].items())) or "none"
    return f"{entry['bytes'] / 2**20:.2f}", counts


def table(rows: list[dict]) -> str:
    lines = ["| model | parallelism | mesh | DTensor MiB | fxshard MiB | fxshard / DTensor | DTensor collectives "
             "| fxshard collectives |", "|---|---|---|---:|---:|---:|---|---|"]
    for r in rows:
        (d_mib, d_calls), (f_mib, f_calls) = _cell(r["dtensor"]), _cell(r["fxshard"])
        d, f = r["dtensor"].get("bytes"), r["fxshard"].get("bytes")
        ratio = "-" if d is None or f is None else ("1.00" if d == f == 0 else f"{f / d:.2f}" if d else "inf")
        lines.append(f"| {r['model']} | {r['parallelism']} | {r['mesh']} | {d_mib} | {f_mib} | {ratio} "
                     f"| {d_calls} | {f_calls} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("-k", default="", help="only cases whose model or parallelism contains this")
    opts = parser.parse_args()
    rows = [measure(c) for c in CASES if opts.k in f"{c.model} {c.parallelism}"]
    print(json.dumps(rows, indent=1) if opts.json else table(rows))
    print(f"\nper forward, bytes one rank receives; {BATCH}x{SEQ} tokens, Llama dim {LLAMA.dim}, "
          f"{LLAMA.n_layers} layers, vocab {LLAMA.vocab_size}, fp32")


if __name__ == "__main__":
    main()
