"""Loading a ~1 GiB checkpoint onto 4 gloo ranks: fxshard.load_sharded vs the naive way.

    python bench/load.py                 # 1 GiB, 4 ranks
    python bench/load.py --mib 256       # smaller

naive: every rank ``torch.load``s the whole state dict, then ``distribute_tensor`` keeps its shard.
fxshard: every rank reads only its shard of each tensor from a .safetensors file
(``fxshard.load_sharded`` on a meta-device module). Each rank reports its wall time and its
peak RSS increase (VmHWM after loading, the mark reset just before, minus VmRSS before), each
method in fresh processes.
Column-sharded and row-sharded weights alternate, so both contiguous and strided reads count.
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))

N_TENSORS = 16


class Weights(torch.nn.Module):
    def __init__(self, rows: int, cols: int):
        super().__init__()
        self.w = torch.nn.ParameterList(torch.nn.Parameter(torch.empty(rows, cols)) for _ in range(N_TENSORS))


def plan() -> dict:
    from torch.distributed.tensor import Shard

    return {f"w.{i}": (Shard(i % 2),) for i in range(N_TENSORS)}


def status_mib(field: str) -> float:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024  # kB
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak_rss() -> float:
    """Reset the peak-RSS mark (Linux: 5 > /proc/self/clear_refs); returns the RSS now (MiB)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status_mib("VmRSS")


def run(rank: int, world_size: int, device: str = "cpu", method: str = "fxshard", folder: str = "",
        rows: int = 0, cols: int = 0) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    import fxshard

    mesh = init_device_mesh(device, (world_size,), mesh_dim_names=("tp",))
    dist.barrier()
    before, start = reset_peak_rss(), time.perf_counter()
    if method == "fxshard":
        with torch.device("meta"):
            model = Weights(rows, cols)
        fxshard.load_sharded(model, f"{folder}/weights.safetensors", mesh, plan=plan())
    else:
        model = Weights(rows, cols)
        state = torch.load(f"{folder}/weights.pt", weights_only=True)
        placements = plan()
        for name, tensor in state.items():
            i = int(name.split(".")[1])
            model.w[i] = torch.nn.Parameter(distribute_tensor(tensor, mesh, placements[name]))
        del state
    seconds = time.perf_counter() - start
    local = sum(p.to_local().numel() * 4 for p in model.parameters()) / 2**20
    dist.barrier()
    return {"seconds": seconds, "peak_increase_mib": status_mib("VmHWM") - before, "local_mib": local}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024, help="checkpoint size")
    parser.add_argument("--ranks", type=int, default=4)
    opts = parser.parse_args()
    from ranks import spawn
    from safetensors.torch import save_file

    cols = 4096
    rows = opts.mib * 2**20 // (N_TENSORS * cols * 4)
    with tempfile.TemporaryDirectory() as folder:
        state = {f"w.{i}": torch.randn(rows, cols) for i in range(N_TENSORS)}
        save_file(state, f"{folder}/weights.safetensors")
        torch.save(state, f"{folder}/weights.pt")
        size_mib = sum(t.numel() * 4 for t in state.values()) / 2**20
        del state
        rows_out = []
        for method in ("naive", "fxshard"):
            results = spawn(run, opts.ranks, 600.0, "cpu", method=method, folder=folder, rows=rows, cols=cols)
            seconds = statistics.median(r["seconds"] for r in results.values())
            peak = statistics.median(r["peak_increase_mib"] for r in results.values())
            rows_out.append((method, seconds, peak, results[0]["local_mib"]))
    print(f"checkpoint {size_mib:.0f} MiB ({N_TENSORS} fp32 tensors [{rows}, {cols}], Shard(0)/Shard(1) alternating) "
          f"on {opts.ranks} gloo ranks; medians over ranks\n")
    print("| method | time per rank (s) | peak RSS increase per rank (MiB) | % of checkpoint | local shard (MiB) |")
    print("|---|---:|---:|---:|---:|")
    for method, seconds, peak, local in rows_out:
        print(f"| {method} | {seconds:.2f} | {peak:.0f} | {100 * peak / size_mib:.0f}% | {local:.0f} |")
    naive, ours = rows_out
    print(f"\nfxshard / naive: time {ours[1] / naive[1]:.2f}x, peak RSS increase {ours[2] / max(naive[2], 1e-9):.2f}x")


if __name__ == "__main__":
    main()
