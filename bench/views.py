"""View chains: communication planned by fxshard vs. what DTensor issues eagerly.

For each chain of view-like ops (reshape/view, transpose, split, unbind, cat) applied to one
global tensor with given DTensor placements, this prints one row:

    chain | mesh | fxshard collectives | fxshard B/rank | DTensor collectives | DTensor B/rank | ratio

* fxshard: ``fxshard.explain(fn, x, mesh=device_mesh, placements={0: placements})`` (stages
  1-3, no communication runs); its collectives include the redistribution of outputs to a
  layout that has a DTensor form.
* DTensor: ``fn(distribute_tensor(x, device_mesh, placements))`` run eagerly under
  ``CommDebugMode`` (collective counts) and a dispatch mode that records every
  ``torch.ops._c10d_functional`` collective with its input size and group size (bytes).
  If DTensor raises (a view it cannot shard), its columns say ``error: <reason>``: that is a
  finding about DTensor, not a failure of the bench.
* ratio = fxshard bytes / DTensor bytes (0/0 counts as 1.0; ``inf`` when only fxshard moves bytes).
* fx out / DT out: the output placements of each side (``S(d)``, ``R``, ``SS(d;k)`` =
  ``_StridedShard(d, split_factor=k)``); a chain can end sharded on one side and replicated on the other.
* ``@out`` marks an fxshard collective that only converts the graph output to a layout DTensor can
  express; ``[no rule: op]`` marks a chain where fxshard replicated the inputs of an op it has no
  rule for (found by first explaining with ``strict=True``).

Bytes are those one rank *receives* over the network, computed with the same formulas fxshard's
planner uses, from the collective's per-rank input size ``b`` and group size ``n``:

    all_gather                    (n - 1) * b
    all_reduce                    2 * (n - 1) / n * b      (ring: reduce-scatter + all-gather)
    reduce_scatter, all_to_all    (n - 1) / n * b

Both sides run on one fake process group of world size 8 (``init_process_group("fake")``,
rank 0, no real communication, no GPU) with a 1-D mesh tp=4 and a 2-D mesh dp=2 x tp=2 built
on it. Run from the repository root::

    python bench/views.py

It takes a few seconds. The closing summary gives median ratios and how many chains fxshard moves
fewer / equal / more bytes than DTensor on, and names every chain where fxshard moves more
(``FINDING:`` lines).
"""
from __future__ import annotations

import statistics
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.placement_types import Placement, _StridedShard
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode

import fxshard
from fxshard.lowering.collective_ops import COLLECTIVES, LOWERED
from fxshard.placements import placements_from_layout, placements_to_str
from fxshard.propagate import UnsupportedOpError

WORLD_SIZE = 8
MESHES = {"tp=4": ((4,), ("tp",)), "dp=2,tp=2": ((2, 2), ("dp", "tp"))}

# ---------------------------------------------------------------------------------------------
# The chains: each a function of one global tensor. b=2, s=8, h=64, a heads of hd = h / a.


def head_split(a: int) -> Callable:
    return lambda x: x.view(2, 8, a, 64 // a)


def head_split_merge(a: int) -> Callable:
    return lambda x: (x.view(2, 8, a, 64 // a) * 2).view(2, 8, 64)


def head_split_6(x):  # [b, s, 48] -> [b, s, 6, 8]: 6 heads, not divisible by 4 ranks
    return x.view(2, 8, 6, 8)


def merge_s_h(x):  # [b, s, h] -> [b, s*h]
    return x.reshape(2, 8 * 64)


def head_merge(x):  # [b, s, a, hd] -> [b, s, h]
    return x.reshape(2, 8, 64)


def tokens_flatten_unflatten(x):  # [b, s, h] -> [b*s, h] -> [b, s, h]
    return (x.view(16, 64) * 2).view(2, 8, 64)


def tokens_unflatten(x):  # [b*s, h] -> [b, s, h]
    return x.view(2, 8, 64)


def tokens_unflatten_b8(x):  # [b*s, h] -> [b, s, h] with b = 8, s = 2
    return x.view(8, 2, 64)


def attn_out_merge(x):  # [b, a, s, hd] -> transpose -> [b, s, a*hd] (attention output)
    return x.transpose(1, 2).reshape(2, 8, 64)


def transpose_flatten(x):  # [b, s, h] -> [b, h, s] -> [b, h*s]
    return x.transpose(1, 2).reshape(2, 64 * 8)


def attn_batch_heads(x):  # [b, a, s, hd] -> [b*a, s, hd] -> [b, a, s, hd]
    return (x.reshape(16, 8, 8) * 2).view(2, 8, 8, 8)


def qkv_split_sum(x):  # fused [b, s, 3h] -> q, k, v -> q + k + v
    q, k, v = x.split(64, dim=2)
    return q + k + v


def qkv_unbind(a: int) -> Callable:
    def fn(x):  # fused [b, s, 3h] -> [b, s, 3, a, hd] -> unbind(2) -> q + k + v
        q, k, v = x.view(2, 8, 3, a, 64 // a).unbind(2)
        return q + k + v
    return fn


def qkv_split_cat(x):  # fused [b, s, 3h] -> q, k, v -> cat (scaled, so not a no-op)
    q, k, v = x.split(64, dim=2)
    return torch.cat([q, k * 2, v * 3], dim=2)


def cat_on_s(x):  # [b, s, h] -> cat of three on s -> [b, 3s, h]
    return torch.cat([x, x * 2, x * 3], dim=1)


def chunk_s(x):  # [b, s, h] -> first half of s
    return x.chunk(2, dim=1)[0] * 2


def cat_three(x):  # [b, s, h] -> cat of three [b, s, h] on h -> [b, s, 3h]
    return torch.cat([x, x * 2, x * 3], dim=2)


def flatten_unflatten_2d(x):  # [8, 4, 16] -> [32, 16] -> [8, 4, 16]
    return (x.flatten(0, 1) * 2).unflatten(0, (8, 4))


def flatten_2d(x):  # [8, 4, 16] -> [32, 16]
    return x.flatten(0, 1) * 2


def unflatten_2d(x):  # [32, 16] -> [4, 8, 16]: outer dim 4 = dp x tp
    return x.view(4, 8, 16)


def unflatten_2d_small(x):  # [32, 16] -> [2, 16, 16]: outer dim 2 < 4 ranks sharding it
    return x.view(2, 16, 16)


def uneven_flatten(x):  # [b, 6, h], s=6 sharded unevenly over 4 -> [b*6, h]
    return x.reshape(12, 64)


S, R = Shard, Replicate
SS = _StridedShard


@dataclass(frozen=True)
class Chain:
    name: str
    mesh: str
    shape: tuple[int, ...]
    placements: tuple[Placement, ...]
    fn: Callable


CHAINS: list[Chain] = [
    # 1-D mesh tp=4
    Chain("[b,s,h] h -> [b,s,a,hd] a=8>=n", "tp=4", (2, 8, 64), (S(2),), head_split(8)),
    Chain("[b,s,h] h -> [b,s,a,hd] a=2<n", "tp=4", (2, 8, 64), (S(2),), head_split(2)),
    Chain("head split+merge a=8", "tp=4", (2, 8, 64), (S(2),), head_split_merge(8)),
    Chain("head split+merge a=2", "tp=4", (2, 8, 64), (S(2),), head_split_merge(2)),
    Chain("[b,s,48] h -> [b,s,6,8] 6%n!=0", "tp=4", (2, 8, 48), (S(2),), head_split_6),
    Chain("[b,s,h] h -> [b,s*h]", "tp=4", (2, 8, 64), (S(2),), merge_s_h),
    Chain("[b,s,a,hd] a -> [b,s,h] merge", "tp=4", (2, 8, 8, 8), (S(2),), head_merge),
    Chain("[b,s,h] s -> [b*s,h] -> back", "tp=4", (2, 8, 64), (S(1),), tokens_flatten_unflatten),
    Chain("[b*s,h] 0 -> [b,s,h] b=2<n", "tp=4", (16, 64), (S(0),), tokens_unflatten),
    Chain("[b*s,h] 0 -> [b,s,h] b=8", "tp=4", (16, 64), (S(0),), tokens_unflatten_b8),
    Chain("[b,s,h] s: transpose, flatten", "tp=4", (2, 8, 64), (S(1),), transpose_flatten),
    Chain("attn [b,a,s,hd] a: transpose+reshape", "tp=4", (2, 8, 8, 8), (S(1),), attn_out_merge),
    Chain("attn [b,a,s,hd] a -> [b*a,s,hd] -> back", "tp=4", (2, 8, 8, 8), (S(1),), attn_batch_heads),
    Chain("qkv strided: split, q+k+v", "tp=4", (2, 8, 192), (SS(2, split_factor=3),), qkv_split_sum),
    Chain("qkv strided: view 5-D, unbind a=8", "tp=4", (2, 8, 192), (SS(2, split_factor=3),), qkv_unbind(8)),
    Chain("qkv strided: view 5-D, unbind a=2", "tp=4", (2, 8, 192), (SS(2, split_factor=3),), qkv_unbind(2)),
    Chain("qkv strided: split, cat", "tp=4", (2, 8, 192), (SS(2, split_factor=3),), qkv_split_cat),
    Chain("[b,s,h] h: cat of 3 on h", "tp=4", (2, 8, 64), (S(2),), cat_three),
    Chain("[b,s,h] h: cat of 3 on s", "tp=4", (2, 8, 64), (S(2),), cat_on_s),
    Chain("[b,s,h] s: chunk(2, s)[0]", "tp=4", (2, 8, 64), (S(1),), chunk_s),
    Chain("[b,6,h] s uneven -> [b*6,h]", "tp=4", (2, 6, 64), (S(1),), uneven_flatten),
    # 2-D mesh dp=2 x tp=2
    Chain("2-D (S0,S0): flatten+unflatten", "dp=2,tp=2", (8, 4, 16), (S(0), S(0)), flatten_unflatten_2d),
    Chain("2-D (S0,S0): flatten", "dp=2,tp=2", (8, 4, 16), (S(0), S(0)), flatten_2d),
    Chain("2-D (S0,S0): unflatten [4,8,16]", "dp=2,tp=2", (32, 16), (S(0), S(0)), unflatten_2d),
    Chain("2-D (S0,S0): unflatten [2,16,16]", "dp=2,tp=2", (32, 16), (S(0), S(0)), unflatten_2d_small),
    Chain("2-D (S0,S2): head split a=8", "dp=2,tp=2", (2, 8, 64), (S(0), S(2)), head_split(8)),
    Chain("2-D (S2,S2): head split a=2", "dp=2,tp=2", (2, 8, 64), (S(2), S(2)), head_split(2)),
    Chain("2-D (S0,S1): attn a -> [b*a,s,hd]", "dp=2,tp=2", (2, 8, 8, 8), (S(0), S(1)), attn_batch_heads),
]

# ---------------------------------------------------------------------------------------------
# Measuring


def received_bytes(kind: str, input_bytes: float, n: int) -> float:
    """Bytes one rank receives for a collective on ``n`` ranks with ``input_bytes`` per rank."""
    if kind == "all_gather":
        return (n - 1) * input_bytes
    if kind == "all_reduce":
        return 2 * (n - 1) * input_bytes / n
    if kind in ("reduce_scatter", "all_to_all"):
        return (n - 1) * input_bytes / n
    raise ValueError(f"no byte formula for collective {kind!r}")


_FUNCOL_KINDS = {op._opname: COLLECTIVES[op._opname].kind for op in LOWERED}  # torch.ops._c10d_functional.<name> -> kind


class CollectiveRecorder(TorchDispatchMode):
    """Records (kind, input bytes, group size) of each functional collective below DTensor."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor desugar into local ops and collectives first
        if func.namespace == "_c10d_functional" and func._opname in _FUNCOL_KINDS:
            kind = _FUNCOL_KINDS[func._opname]
            inp = args[0]
            group = kwargs.get("group_name", args[-1])
            n = dist.distributed_c10d._resolve_process_group(group).size()
            self.calls.append((kind, inp.numel() * inp.element_size(), n))
        return func(*args, **kwargs)


@dataclass
class Side:
    kinds: str  # "2x all_gather(tp)", "-" for none, or "error: ..."
    bytes: float | None  # None on error
    out: str = "-"  # output placements


def _count(kinds: Sequence[str]) -> str:
    counts: dict[str, int] = {}
    for k in kinds:
        counts[k] = counts.get(k, 0) + 1
    return ", ".join(f"{n}x {k}" if n > 1 else k for k, n in counts.items()) or "-"


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    text = next((line for line in text if line.strip()), type(e).__name__)
    head = text.split(": ")[0]  # "Cannot unflatten unevenly sharded tensor: output dimension ..." -> the claim
    text = head if len(head) >= 25 else text
    return "error: " + (text if len(text) <= 60 else text[:57] + "...")


def _feeds_output(node) -> bool:
    """Whether a redistribution only feeds the graph output (a conversion to a DTensor layout)."""
    return all(u.op == "output" for u in node.users)


def run_fxshard(chain: Chain, x: torch.Tensor, mesh: DeviceMesh) -> Side:
    placements, note = {0: chain.placements}, ""
    try:
        try:
            e = fxshard.explain(chain.fn, x, mesh=mesh, placements=placements, strict=True)
        except UnsupportedOpError as exc:  # an op without a rule: its inputs get replicated
            note = " [no rule: " + str(exc).split(" for ")[1].split(" ")[0] + "]"
            e = fxshard.explain(chain.fn, x, mesh=mesh, placements=placements)
    except Exception as exc:  # noqa: BLE001 - a chain fxshard cannot plan is a row, not a crash
        return Side(_short(exc), None)
    kinds = [f"{c.kind}({','.join(str(a) for a in c.axes)}){' @out' if _feeds_output(c.node) else ''}"
             for c in e.collectives]
    out = placements_from_layout(e.output_layouts[0])
    return Side(_count(kinds) + note, float(e.bytes_per_rank), placements_to_str(out) if out is not None else "?")


def run_dtensor(chain: Chain, x: torch.Tensor, mesh: DeviceMesh) -> Side:
    dx = distribute_tensor(x, mesh, chain.placements)
    rec = CollectiveRecorder()
    try:
        with CommDebugMode() as comm, rec:
            y = chain.fn(dx)
    except Exception as exc:  # noqa: BLE001 - DTensor refusing a view is a finding
        return Side(_short(exc), None)
    counted = sum(comm.get_comm_counts().values())
    if counted != len(rec.calls):  # both watch the same ops; a mismatch means an unknown collective
        raise AssertionError(f"{chain.name}: CommDebugMode saw {counted} collectives, recorder {len(rec.calls)}")
    kinds = [f"{k}(n={n})" for k, _, n in rec.calls]
    return Side(_count(kinds), sum(received_bytes(k, b, n) for k, b, n in rec.calls), placements_to_str(y.placements))


def ratio(fx: Side, dt: Side) -> float | None:
    if fx.bytes is None or dt.bytes is None:
        return None
    if dt.bytes == 0:
        return 1.0 if fx.bytes == 0 else float("inf")
    return fx.bytes / dt.bytes


# ---------------------------------------------------------------------------------------------
# Reporting

COLUMNS = ("chain", "mesh", "fxshard collectives", "fx B/rank", "DTensor collectives", "DT B/rank", "ratio",
           "fx out", "DT out")


def _fmt_bytes(side: Side) -> str:
    return "-" if side.bytes is None else f"{side.bytes:g}"


def _fmt_ratio(r: float | None) -> str:
    return "n/a" if r is None else f"{r:.2f}"


def print_table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in [COLUMNS, *rows]) for i in range(len(COLUMNS))]

    def line(cells: Sequence[str]) -> str:
        return " | ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()

    print(line(COLUMNS))
    print("-+-".join("-" * w for w in widths))
    for r in rows:
        print(line(r))


Result = tuple[Chain, Side, Side, "float | None"]


def _median_line(label: str, results: list[Result]) -> str:
    rs = [r for *_, r in results if r is not None]
    return f"  {label}: " + (f"{statistics.median(rs):.2f} over {len(rs)} chains" if rs else "n/a (no chains)")


def print_summary(results: list[Result]) -> None:
    both = [t for t in results if t[3] is not None]  # both sides ran
    fewer = [c for c, fx, dt, _ in both if fx.bytes < dt.bytes]
    equal = [c for c, fx, dt, _ in both if fx.bytes == dt.bytes]
    more = [(c, fx, dt) for c, fx, dt, _ in both if fx.bytes > dt.bytes]
    dt_errors = [c for c, _, dt, _ in results if dt.bytes is None]
    fx_errors = [(c, fx) for c, fx, _, _ in results if fx.bytes is None]
    print()
    print("median byte ratio, fxshard / DTensor (0/0 = 1, x/0 = inf):")
    print(_median_line("all chains both ran", both))
    for mesh in MESHES:
        print(_median_line(f"mesh {mesh}", [t for t in both if t[0].mesh == mesh]))
    print(_median_line("chains where either side communicates", [t for t in both if t[1].bytes or t[2].bytes]))
    print(f"summary: of {len(both)} chains both ran, fxshard moves fewer bytes on {len(fewer)}, equal on "
          f"{len(equal)}, more on {len(more)}; DTensor raised on {len(dt_errors)} and fxshard on {len(fx_errors)} "
          f"of {len(results)} chains")
    for c, fx, dt in more:
        print(f"FINDING: fxshard moves MORE bytes than DTensor on {c.name!r} ({c.mesh}): "
              f"{fx.bytes:g} B ({fx.kinds}) vs {dt.bytes:g} B ({dt.kinds})")
    for c, fx in fx_errors:
        print(f"FINDING: fxshard failed on {c.name!r} ({c.mesh}): {fx.kinds}")


def main() -> int:
    warnings.filterwarnings("ignore")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD_SIZE)
    meshes = {k: init_device_mesh("cpu", sizes, mesh_dim_names=names) for k, (sizes, names) in MESHES.items()}
    torch.manual_seed(0)
    results, rows = [], []
    for chain in CHAINS:
        x = torch.randn(chain.shape)
        fx = run_fxshard(chain, x, meshes[chain.mesh])
        dt = run_dtensor(chain, x, meshes[chain.mesh])
        r = ratio(fx, dt)
        results.append((chain, fx, dt, r))
        rows.append((chain.name, chain.mesh, fx.kinds, _fmt_bytes(fx), dt.kinds, _fmt_bytes(dt), _fmt_ratio(r),
                     fx.out, dt.out))
    print_table(rows)
    print_summary(results)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
