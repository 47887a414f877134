"""Peak memory of compiling a model whose parameters do not fit at global size: run as a script in a
fresh process (``python memory_programs.py fxshard|dtensor``), prints one JSON line."""
from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch import nn

DIM, LAYERS, WORLD = 4096, 6, 4  # 6 x 64 MiB of fp32 weights at global size; a quarter per rank


class Stack(nn.Module):
    """Megatron pairs: column-parallel then row-parallel linears."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(DIM, DIM, bias=False) for _ in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def placements_of(name: str) -> tuple:
    from torch.distributed.tensor import Shard

    return (Shard(0),) if int(name.split(".")[1]) % 2 == 0 else (Shard(1),)


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field)) / 1024


def start_measuring() -> float:
    """Reset the peak resident size (Linux: clear_refs 5) and return the resident size now."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_mib("VmRSS")


def growth_since(before: float) -> float:
    """How far the resident size rose above ``before`` at its peak since ``start_measuring``."""
    return _status_mib("VmHWM") - before


def sharded_from_meta(mesh) -> nn.Module:
    """The model built on the meta device, each parameter then given only this rank's shard (random)."""
    from torch.distributed.tensor import DTensor

    from fxshard.placements import layout_from_placements

    with torch.device("meta"):
        model = Stack()
    for name, param in list(model.named_parameters()):
        placements = placements_of(name)
        layout = layout_from_placements(mesh, param.shape, placements)
        local = torch.randn([int(s) for s in layout.local_shape((0,))])
        owner = model.get_submodule(name.rpartition(".")[0])
        owner.register_parameter(name.rpartition(".")[2], nn.Parameter(
            DTensor.from_local(local, mesh, placements, run_check=False), requires_grad=False))
    return model


def warm_up(mesh, how: str) -> None:
    """Import and exercise Dynamo and Inductor once, so their own first-use memory is not counted."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    small = nn.Linear(8, 8, bias=False)
    small.weight = nn.Parameter(distribute_tensor(small.weight.detach(), mesh, [Replicate()]), requires_grad=False)
    x = distribute_tensor(torch.randn(2, 8), mesh, [Replicate()])
    with torch.no_grad():
        if how == "fxshard":
            import fxshard

            fxshard.compile(small)(x)
        else:
            torch.compile(small)(x)


def main(how: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
    warm_up(mesh, how)
    global_mib = LAYERS * DIM * DIM * 4 / 2**20
    out = {"global_mib": global_mib}
    if how == "fxshard":
        import fxshard

        with torch.device("meta"):
            meta_model = Stack()
        before = start_measuring()
        fxshard.explain(meta_model, torch.empty(8, DIM, device="meta"), mesh=fxshard.MeshSpec(tp=WORLD),
                        placements={n: placements_of(n) for n, _ in meta_model.named_parameters()})
        out["explain_growth_mib"] = growth_since(before)
    model = sharded_from_meta(mesh)
    x = distribute_tensor(torch.randn(8, DIM), mesh, [Replicate()])
    before = start_measuring()
    with torch.no_grad():
        if how == "fxshard":
            import fxshard

            fxshard.compile(model)(x)
        else:
            torch.compile(model)(x)
    out["compile_growth_mib"] = growth_since(before)
    dist.destroy_process_group()
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
