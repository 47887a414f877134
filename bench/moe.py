"""Dropless expert parallelism: fxshard's routed-experts op against torchtitan-style eager EP, on gloo ranks.

    python bench/moe.py              # every row (~5 min on 2 cores); prints a markdown table
    python bench/moe.py --quick      # the first row only
    python bench/moe.py --json

The model is tests/moe_programs.py's ``DroplessMoE`` (top-2 of 8 SwiGLU experts, a router biased toward the
first experts by ``SKEW``, bf16 grouped matmuls), trained by SGD on a mean-square loss, the experts
``Shard(0)`` on a 1-D ``ep`` mesh of every rank and the tokens split over the ranks. Per training step
(forward, backward, the SGD step) on each side:

- fxshard: the unchanged model, its expert stacks DTensors ``Shard(0)`` and the router ``Replicate()``, the
  loss function ``torch.compile(backend="fxshard")``'d whole; each rank's tokens and targets given as
  ``DTensor.from_local`` of its rows. Stage 1 makes the routed region one op (fxshard/routing.py).
- baseline (``eager_ep``): the same layer written the way torchtitan's ExpertParallel runs it eagerly,
  written here from the algorithm: tokens and router local to each rank, the experts DTensors ``Shard(0)``
  used as their local shards; each rank sorts its pairs by expert, exchanges the per-expert counts
  (``all_to_all_single``), reads the split sizes with ``.tolist()``, sends the rows by
  ``all_to_all_single_autograd``, groups the rows it received by local expert, runs the grouped matmuls,
  undoes the grouping and sends the results back the same way; the loss is the rank's sum over the global
  count (the global mean); after the backward the router's gradient is all-reduced (as DDP would).
- baseline under ``torch.compile(backend="inductor")`` (``compiled_ep``): the same step function, compiled;
  Dynamo breaks the graph at the ``.tolist()`` reading the split sizes, as it does in torchtitan.

Each side's first step is checked against one device (the loss and every gradient, on the same data)
before anything is timed. Counted the same way for every side: the process-group ops (``c10d::*``) the
profiler records in one more step, with the bytes this rank received (an all_to_all's from the split
sizes the profiler records: the rows its peers sent; the others by ``fxshard.costs.collective_bytes``).
First step: the step that compiles (the slowest rank's). Step time: after ``WARM`` more steps, ``TIMED``
rounds of one step per side, the order turned each round; a round's step is its slowest rank's; a side's
step time is the median of its rounds, and fxshard's ratio to another side the median of the rounds' ratios,
so the machine's drift between rounds cancels. The sides of a row run in one job (fxshard first, then the
baseline eager, then compiled), and the rows of one ep in one job, so the later ones find torch initialized;
Inductor's caches are off, so each compiles from scratch. Bytes: the busiest rank's. The machine is small
and shared: read the ratios.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "tests"))

EXPERTS, TOP_K, SKEW = 8, 2, 0.5  # bias -SKEW * expert id: expert 7's logit 3.5 below expert 0's
ROWS = {2: [(256, 64), (1024, 128)], 4: [(1024, 128)]}  # ep -> (global tokens, dim); hidden 2 x dim
MORE = {4: [(256, 64)]}  # --all: the ep 4 row that brings a full run past 5 minutes
WARM, TIMED = 2, 10  # steps after the first (which compiles) not timed; then rounds of one timed step per side
# the first step's loss and gradients against one device: the largest difference over the largest entry, at most
# bf16's relative tolerance (torch.testing's default for bf16): the experts' matmuls run in bf16 on every side, the
# compiled ones with Inductor's fused casts
TOLERANCE = 1.6e-2
SIDES = ("fxshard", "eager_ep", "compiled_ep")
LR = 0.1


# ---- the baseline: torchtitan-style expert parallelism, eager --------------------------------------------
class EagerEP(torch.nn.Module):
    """``DroplessMoE``'s layer on this rank's tokens, the experts dispatched by hand: the router local (its
    gradient all-reduced by the trainer), the expert stacks DTensors ``Shard(0)`` whose local shards run."""

    def __init__(self, reference: torch.nn.Module, mesh: Any):
        from torch.distributed.tensor import Shard, distribute_tensor

        super().__init__()
        self.mesh, self.group = mesh, mesh.get_group()
        self.n, self.experts, self.top_k = mesh.size(), reference.experts, reference.top_k
        self.local = self.experts // self.n
        self.router = torch.nn.Parameter(reference.router.detach().clone())
        self.register_buffer("bias", reference.bias.clone())
        for name in ("w1", "w2", "w3"):
            setattr(self, name, torch.nn.Parameter(distribute_tensor(getattr(reference, name).detach(), mesh,
                                                                     [Shard(0)])))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed._functional_collectives as funcol

        scores = torch.softmax(x @ self.router + self.bias, dim=-1)
        top, chosen = torch.topk(scores, self.top_k, dim=1)
        flat = chosen.view(-1)
        order = torch.argsort(flat, stable=True)  # this rank's pairs by expert: blocks per destination rank
        tokens = order // self.top_k
        rows = x[tokens] * top.view(-1)[order][:, None]
        counts = torch.bincount(flat, minlength=self.experts)  # this rank's pairs per expert
        # from each source rank, its rows per expert of this rank: [n * local], source-major
        incoming = funcol.all_to_all_single(counts, None, None, self.group).wait()
        send = counts.view(self.n, self.local).sum(1).tolist()  # the host sync torchtitan makes too
        recv = incoming.view(self.n, self.local).sum(1).tolist()
        rows = funcol.all_to_all_single_autograd(rows, recv, send, self.group)
        # the received rows lie by source, then expert: put them in expert order for the grouped matmul
        expert_of_row = torch.arange(self.local).repeat(self.n).repeat_interleave(incoming)
        by_expert = torch.argsort(expert_of_row, stable=True)
        per_expert = incoming.view(self.n, self.local).sum(0)
        out = self._experts(rows[by_expert], torch.cumsum(per_expert, 0).to(torch.int32))
        out = out[torch.argsort(by_expert)]  # back in arrival order
        out = funcol.all_to_all_single_autograd(out, send, recv, self.group)  # this rank's pairs, sorted
        return torch.zeros_like(x).index_add(0, tokens, out)

    def _experts(self, rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = (w.to_local().bfloat16() for w in (self.w1, self.w2, self.w3))
        b = rows.bfloat16()
        h = F.silu(torch._grouped_mm(b, w1, offs=offsets)) * torch._grouped_mm(b, w3, offs=offsets)
        return torch._grouped_mm(h, w2, offs=offsets).to(rows.dtype)


def _eager_step(model: EagerEP, global_elements: int) -> Callable:
    """forward + backward of this rank's tokens; the router's gradient summed over the ranks (DDP's job)."""
    import torch.distributed as dist

    def step(x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = ((model(x) - target) ** 2).sum() / global_elements  # this rank's share of the global mean
        loss.backward()
        dist.all_reduce(model.router.grad, group=model.group)
        return loss.detach()
    return step


# ---- one row, on every rank --------------------------------------------------------------------------------
def _data(step: int, tokens: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.randn(tokens, dim, generator=torch.Generator().manual_seed(step)),
            torch.randn(tokens, dim, generator=torch.Generator().manual_seed(1000 + step)))


_SIZES = {"float": 4, "double": 8, "long int": 8, "int": 4, "c10::BFloat16": 2, "c10::Half": 2,
          "bool": 1, "unsigned char": 1, "signed char": 1, "short int": 2}


def counted(step: Callable[[], None], rank: int) -> tuple[dict[str, int], int]:
    """({kind: calls}, bytes this rank received) of the process-group ops (``c10d::*``) ``step()`` runs, from the
    profiler: an all_to_all's rows from the split sizes it records (all but this rank's own); an all_reduce
    sized by its gloo work's input (the c10d op records its tensor list without shapes), by the planner's
    formula (``fxshard.costs.collective_bytes``)."""
    from torch.profiler import ProfilerActivity, profile

    from fxshard.costs import collective_bytes

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step()
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    reduced = [e for e in events if e.name == "gloo:all_reduce"]
    calls: dict[str, int] = {}
    received = 0
    for e in events:
        if not e.name.startswith("c10d::") or "barrier" in e.name:
            continue
        shapes, dtypes, concrete = e.input_shapes, e.input_dtypes, e.concrete_inputs
        if "alltoall_base" in e.name:  # (output, input, group, output splits, input splits, ...)
            kind, out_shape, splits = "all_to_all", shapes[0], concrete[3]
            row = _SIZES[dtypes[0]] * int(torch.Size(out_shape[1:]).numel())
            size = dist_size()
            received += (sum(splits) - splits[rank]) * row if splits else out_shape[0] // size * (size - 1) * row
        elif "allreduce_" in e.name:
            kind = "all_reduce"
            work = reduced[calls.get(kind, 0)]
            nbytes = sum(_SIZES[d] * _numel(s) for s, d in zip(work.input_shapes, work.input_dtypes))
            received += int(collective_bytes(kind, dist_size(), nbytes))
        else:
            raise NotImplementedError(f"bench/moe.py cannot size {e.name}")
        calls[kind] = calls.get(kind, 0) + 1
    return calls, received


def dist_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size()


def _numel(shape: Any) -> int:
    if shape and isinstance(shape[0], (list, tuple)):
        return sum(_numel(s) for s in shape)
    return int(torch.Size(shape).numel())


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / max(float(want.float().abs().max()), 1e-30))


def run_row(rank: int, world_size: int, device: str, tokens: int, dim: int, sides: tuple[str, ...]) -> dict:
    """One row on this rank: each side built, its first step timed and checked against one device, ``WARM`` more
    steps; then ``TIMED`` rounds of one step per side; then one more step per side, counted."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import fxshard  # noqa: F401 (the backend)
    from moe_programs import DroplessMoE

    mesh = init_device_mesh(device, (world_size,), mesh_dim_names=("ep",))
    torch.manual_seed(0)
    reference = DroplessMoE(dim=dim, hidden=2 * dim, experts=EXPERTS, top_k=TOP_K, skew=SKEW)
    x0, t0 = _data(0, tokens, dim)
    want_loss = ((reference(x0) - t0) ** 2).mean()
    want_loss.backward()
    want = {name: p.grad for name, p in reference.named_parameters()}
    want_loss = want_loss.detach()
    chosen = torch.topk(torch.softmax(x0 @ reference.router + reference.bias, -1), TOP_K, 1)[1]
    result: dict[str, Any] = {"routed": [int(c) for c in torch.bincount(chosen.view(-1), minlength=EXPERTS)]}

    torch._dynamo.reset()  # the previous row's programs
    built: dict[str, tuple[Callable, Callable]] = {}
    for side in sides:
        try:
            fwd_bwd, opt_step, first, errors = _build_and_check(side, reference, mesh, tokens, dim, rank, want,
                                                                 float(want_loss))
        except Exception as e:  # one side that cannot run fails its cells, not the table
            import traceback

            traceback.print_exc()
            result[side] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
            continue
        for k in range(1, 1 + WARM):
            fwd_bwd(*_data(k, tokens, dim))
            opt_step()
        built[side] = (fwd_bwd, opt_step)
        result[side] = {"first_s": first, "errors": errors, "times": []}
    # the sides' steps alternated, the order turned each round: the machine's drift meets every side alike
    order = list(built)
    for k in range(TIMED):
        for side in order[k % len(order):] + order[:k % len(order)]:
            fwd_bwd, opt_step = built[side]
            x, t = _data(1 + WARM + k, tokens, dim)
            dist.barrier()
            start = time.perf_counter()
            fwd_bwd(x, t)
            opt_step()
            result[side]["times"].append(time.perf_counter() - start)
    for side, (fwd_bwd, opt_step) in built.items():
        x, t = _data(99, tokens, dim)
        dist.barrier()
        result[side]["calls"], result[side]["bytes"] = counted(lambda: (fwd_bwd(x, t), opt_step()), rank)
    return result


def _build_and_check(side: str, reference: torch.nn.Module, mesh: Any, tokens: int, dim: int, rank: int,
                     want: dict, want_loss: float) -> tuple[Callable, Callable, float, dict]:
    """(forward + backward of a step, the SGD step, the first step's seconds, the first step's errors against one
    device: the loss and every gradient, this rank's experts' rows of them for the baseline)."""
    import copy

    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    mine = slice(rank * (tokens // mesh.size()), (rank + 1) * (tokens // mesh.size()))
    local = EXPERTS // mesh.size()
    if side == "fxshard":
        model = copy.deepcopy(reference)
        model.zero_grad()
        for name in ("router", "w1", "w2", "w3"):
            placement = Replicate() if name == "router" else Shard(0)
            setattr(model, name, torch.nn.Parameter(distribute_tensor(getattr(model, name).detach(), mesh,
                                                                     [placement])))
        model.bias = distribute_tensor(model.bias, mesh, [Replicate()])

        def loss_fn(x, target):
            return ((model(x) - target) ** 2).mean()

        compiled = torch.compile(loss_fn, backend="fxshard")

        def fwd_bwd(x, target):
            xs = DTensor.from_local(x[mine], mesh, [Shard(0)], run_check=False)  # each rank's rows, as a loader
            ts = DTensor.from_local(target[mine], mesh, [Shard(0)], run_check=False)
            loss = compiled(xs, ts)
            loss.backward()
            return loss.detach()

        def full_loss(loss):
            return loss.full_tensor() if isinstance(loss, DTensor) else loss

        def grad_of(p):
            return p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
    else:
        model = EagerEP(reference, mesh)
        inner = _eager_step(model, tokens * dim)
        if side == "compiled_ep":
            inner = torch.compile(inner, backend="inductor")

        def fwd_bwd(x, target):
            return inner(x[mine], target[mine])

        def full_loss(loss):
            total = loss.clone()
            dist.all_reduce(total)
            return total

        def grad_of(p):  # the router's whole (all-reduced), the experts' this rank's rows
            return p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad

    optimizer = torch.optim.SGD(model.parameters(), lr=LR)

    def opt_step():
        optimizer.step()
        optimizer.zero_grad()

    x0, t0 = _data(0, tokens, dim)
    dist.barrier()
    start = time.perf_counter()
    loss = fwd_bwd(x0, t0)
    first = time.perf_counter() - start
    errors = {"loss": abs(float(full_loss(loss)) - want_loss) / abs(want_loss)}
    for name, p in model.named_parameters():
        g = grad_of(p)
        ref = want[name] if g.shape == want[name].shape else want[name][rank * local:(rank + 1) * local]
        errors[name] = _relative(g, ref)
    if max(errors.values()) > TOLERANCE:
        raise AssertionError(f"{side} is not one device's: {errors}")
    start = time.perf_counter()
    opt_step()
    return fwd_bwd, opt_step, first + time.perf_counter() - start, errors


def run_rows(rank: int, world_size: int, device: str, shapes: list, sides: tuple[str, ...]) -> list[dict]:
    return [run_row(rank, world_size, device, tokens, dim, sides) for tokens, dim in shapes]


def measure(ep: int, shapes: list, sides: tuple[str, ...] = SIDES) -> list[dict]:
    """The rows of one ep, in one job (the later rows find torch initialized; their programs are compiled
    anew: other shapes, Inductor's caches off)."""
    from ranks import spawn

    results = spawn(run_rows, ep, 900.0, "cpu", progress=None, shapes=shapes, sides=sides)
    return [_row(ep, tokens, dim, {r: results[r][k] for r in results}, sides) for k, (tokens, dim) in enumerate(shapes)]


def _row(ep: int, tokens: int, dim: int, results: dict, sides: tuple[str, ...]) -> dict:
    row = {"ep": ep, "tokens": tokens, "dim": dim}
    # the busiest rank's bytes and first step (the step waits for it); a round's step time the slowest rank's
    rounds = {}
    for side in sides:
        per = [results[r].get(side, {}) for r in range(ep)]
        if any("error" in p for p in per):
            row[side] = {"error": next(p["error"] for p in per if "error" in p)}
            continue
        rounds[side] = [max(ts) for ts in zip(*(p["times"] for p in per))]
        row[side] = {"calls": per[0]["calls"], "bytes": max(p["bytes"] for p in per),
                     "bytes_per_rank": [p["bytes"] for p in per],
                     "step_s": statistics.median(rounds[side]),
                     "first_s": max(p["first_s"] for p in per),
                     "worst_error": max(max(p["errors"].values()) for p in per)}
    row["routed"] = results[0]["routed"]
    for other in ("eager_ep", "compiled_ep"):  # the median of the rounds' ratios: the drift between rounds cancels
        if "fxshard" in rounds and other in rounds:
            row[f"step_vs_{other}"] = statistics.median(f / o for f, o in zip(rounds["fxshard"], rounds[other]))
    return row


def _calls(c: dict) -> int:
    return sum(c.values())


def _cells(side: dict) -> list[str]:
    if "error" in side:
        return ["fails"] * 4
    return [str(_calls(side["calls"])), f"{side['bytes'] / 1024:.1f}", f"{side['step_s'] * 1e3:.1f}",
            f"{side['first_s']:.1f}"]


def _ratio(a: dict, b: dict, key: Callable[[dict], float]) -> str:
    if "error" in a or "error" in b or not key(b):
        return "n/a"
    return f"{key(a) / key(b):.2f}"


def _paired(row: dict, other: str) -> str:
    return f"{row[f'step_vs_{other}']:.2f}" if f"step_vs_{other}" in row else "n/a"


def table(rows: list[dict]) -> str:
    lines = ["| ep | tokens | dim | side | calls / step | KiB / rank / step | step ms | first step s | worst error |",
             "|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        for side in SIDES:
            if side not in r:
                continue
            s = r[side]
            err = "" if "error" in s else f"{s['worst_error']:.1e}"
            lines.append(f"| {r['ep']} | {r['tokens']} | {r['dim']} | {side} | " + " | ".join(_cells(s))
                         + f" | {err} |")
    lines += ["", "| ep | tokens | dim | calls fxshard / eager | bytes fxshard / eager | step fxshard / eager | "
              "first step fxshard / eager | step fxshard / compiled | first step fxshard / compiled |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        f, e, c = r["fxshard"], r["eager_ep"], r.get("compiled_ep", {"error": "not run"})
        lines.append(f"| {r['ep']} | {r['tokens']} | {r['dim']} | "
                     f"{_ratio(f, e, lambda s: _calls(s['calls']))} | {_ratio(f, e, lambda s: s['bytes'])} | "
                     f"**{_paired(r, 'eager_ep')}** | {_ratio(f, e, lambda s: s['first_s'])} | "
                     f"**{_paired(r, 'compiled_ep')}** | {_ratio(f, c, lambda s: s['first_s'])} |")
    lines += ["", "calls by kind (rank 0, one step) and bytes per rank:"]
    for r in rows:
        for side in SIDES:
            s = r.get(side)
            if s and "error" not in s:
                kinds = ", ".join(f"{n} {k}" for k, n in sorted(s["calls"].items()))
                lines.append(f"- ep {r['ep']}, {r['tokens']} x {r['dim']}, {side}: {kinds}; bytes per rank "
                             f"{s['bytes_per_rank']}")
            elif s:
                lines.append(f"- ep {r['ep']}, {r['tokens']} x {r['dim']}, {side}: fails: {s['error']}")
        lines.append(f"- ep {r['ep']}, {r['tokens']} x {r['dim']}: pairs per expert at step 0 {r['routed']}")
    return "\n".join(lines)


def main() -> None:
    # first steps compile from scratch on every side (Inductor's on-disk caches off), as bench/train.py
    os.environ["TORCHINDUCTOR_FORCE_DISABLE_CACHES"] = "1"
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true", help="the first row only")
    parser.add_argument("--all", action="store_true", help="ep 4 at 256 x 64 too (a full run then takes ~8 min)")
    parser.add_argument("--no-compiled", action="store_true", help="skip the baseline under torch.compile")
    args = parser.parse_args()
    sides = tuple(s for s in SIDES if not (args.no_compiled and s == "compiled_ep"))
    start, load = time.time(), os.getloadavg()
    plan = {2: ROWS[2][:1]} if args.quick else {ep: shapes + (MORE.get(ep, []) if args.all else [])
                                               for ep, shapes in ROWS.items()}
    rows = [row for ep, shapes in plan.items() for row in measure(ep, shapes, sides)]
    print(json.dumps(rows, indent=1) if args.json else table(rows))
    print(f"\nwall {time.time() - start:.0f} s; load average (1, 5, 15 min) at start {load[0]:.2f} {load[1]:.2f} "
          f"{load[2]:.2f}, at end {' '.join(f'{v:.2f}' for v in os.getloadavg())}; torch {torch.__version__}")


if __name__ == "__main__":
    main()
