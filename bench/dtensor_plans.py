"""What DTensor's own redistribution planners would do, without running any communication.

``dtensor_plans(mesh_shape, shape, src, dst)`` builds ``DTensorSpec``s on a DeviceMesh over a
fake process group (rank 0) and asks DTensor's planner for the list of ``_TransformInfo``s it
would execute, once with the greedy planner and once with the graph (Dijkstra) planner
(``torch/distributed/tensor/_redistribute.py``: ``_gen_transform_infos`` ->
``DTensorRedistributePlanner.generate_greedy_transform_infos`` /
``generate_graph_based_transform_infos``).  The choice is made exactly as DTensor does it: the
``use_graph_based_transform`` argument plus the ``use_min_cost_redistribution_plan`` context
manager; DTensor *forces* the graph planner when a spec has a non-default shard order or a
``_StridedShard``, in which case the "greedy" entry is the graph plan and says so in ``note``.
The flattening pass ``_optimize_transform_infos`` is not applied: it only merges collectives
when a flattened mesh has been created, which never happens on these unnamed meshes.

Bytes are those the busiest rank RECEIVES, summed over transforms, from the collective each
transform implies, with ``n`` the mesh-dim size and ``b`` the per-rank input bytes of that
collective (local shape at that point of the plan, max over ranks, padded the way DTensor pads):

    Shard -> Replicate        all_gather      (n - 1) * b        b = ceil-chunk shard
    Partial -> Replicate      all_reduce      2 * (n - 1) / n * b
    Partial -> Shard(j)       reduce_scatter  (n - 1) / n * b    dim j padded to n * ceil(s_j / n)
    Shard(i) -> Shard(j)      all_to_all      (n - 1) / n * b    dim i ceil-chunk, dim j padded
    Replicate -> Shard/Partial, other local   0

Run ``python bench/dtensor_plans.py`` for a demo table.
"""
from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.tensor._redistribute as R
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor._dtensor_spec import DTensorSpec, ShardOrderEntry, TensorMeta
from torch.distributed.tensor._utils import (
    _compute_local_shape_and_global_offset,
    assert_no_mixed_partial_types,
)
from torch.distributed.tensor.placement_types import Placement, Shard, _is_shard_like, _StridedShard

_DTYPES = {1: torch.uint8, 2: torch.bfloat16, 4: torch.float32, 8: torch.float64}
_MIN_WORLD = 16
_meshes: dict[tuple[int, ...], DeviceMesh] = {}
_own_pg = False


@dataclass
class DTensorPlan:
    planner: str  # "greedy" or "graph"
    transforms: list[str]  # "dim<mesh_dim> <src>-><dst>", one per _TransformInfo
    bytes_per_rank: float  # bytes the busiest rank receives
    seconds_cold: float  # planning time with planner caches cleared
    seconds_cached: float  # second call (hits _gen_transform_infos' functools.cache)
    error: str | None = None  # DTensor raised: transforms=[], bytes=nan
    note: str | None = None  # e.g. DTensor forced the graph planner for the "greedy" entry


def get_mesh(mesh_shape: tuple[int, ...]) -> DeviceMesh:
    """A cached DeviceMesh over ranks 0..prod(mesh_shape)-1 of a (lazily created) fake PG."""
    global _own_pg
    mesh_shape = tuple(mesh_shape)
    if mesh_shape in _meshes:
        return _meshes[mesh_shape]
    n = math.prod(mesh_shape)
    if dist.is_initialized() and dist.get_world_size() < n:
        if not _own_pg:
            raise ValueError(f"mesh {mesh_shape} needs {n} ranks; existing PG has {dist.get_world_size()}")
        dist.destroy_process_group()  # we created it: grow it
        _meshes.clear()
        R.clear_redistribute_planner_cache()
        R._gen_transform_infos.cache_clear()
    if not dist.is_initialized():
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", rank=0, world_size=max(n, _MIN_WORLD), store=FakeStore())
        _own_pg = True
    if dist.get_world_size() == n:
        mesh = init_device_mesh("cpu", mesh_shape)
    else:
        mesh = DeviceMesh("cpu", torch.arange(n).reshape(mesh_shape))
    _meshes[mesh_shape] = mesh
    return mesh


def _shard_order(order: Any) -> tuple[ShardOrderEntry, ...] | None:
    """Accept a ShardOrder, ((tensor_dim, mesh_dims), ...) or {tensor_dim: mesh_dims}."""
    if order is None:
        return None
    items = order.items() if isinstance(order, dict) else order
    return tuple(sorted((ShardOrderEntry(int(t), tuple(m)) for t, m in items), key=lambda e: e.tensor_dim))


def _spec(mesh: DeviceMesh, placements: Sequence[Placement], meta: TensorMeta, order: Any) -> DTensorSpec:
    return DTensorSpec(mesh, tuple(placements), tensor_meta=meta, shard_order=_shard_order(order))


def _normalize(placements: Sequence[Placement], ndim: int) -> tuple[Placement, ...]:
    """Negative shard dims -> positive, as DTensor's user-facing APIs do."""
    def fix(p: Placement) -> Placement:
        if isinstance(p, _StridedShard) and p.dim < 0:
            return _StridedShard(p.dim + ndim, split_factor=p.split_factor)
        return Shard(p.dim + ndim) if type(p) is Shard and p.dim < 0 else p
    return tuple(fix(p) for p in placements)


def _start_state(spec: DTensorSpec) -> tuple[list[Placement], dict[int, list[int]]]:
    """Placements and {tensor_dim: [mesh_dims in shard order]} as the planner sees them."""
    placements, order = spec.placements, spec.shard_order
    if spec.use_strided_shard_as_shard_order:
        try:  # the graph planner normalizes decodable _StridedShard into Shard + shard order
            placements, order = DTensorSpec._normalize_placements_into_shard_order(
                placements, spec.mesh, use_strided_shard_as_shard_order=True
            )
        except ValueError:  # not decodable: greedy fallback keeps _StridedShard as is
            order = DTensorSpec.compute_default_shard_order(placements)
    state: dict[int, list[int]] = {t: [] for t in range(len(spec.shape))}
    for e in order:
        state[e.tensor_dim] = list(e.mesh_dims)
    return list(placements), state


def _max_local_shape(mesh: DeviceMesh, shape: Sequence[int], placements: list[Placement],
                     order: dict[int, list[int]]) -> list[int]:
    """Elementwise max over all mesh coordinates of the local shape (DTensor's own helper)."""
    if not any(isinstance(p, _StridedShard) for p in placements):
        so = tuple(ShardOrderEntry(t, tuple(m)) for t, m in sorted(order.items()) if m)
        placements = list(DTensorSpec._convert_shard_order_to_StridedShard(so, tuple(placements), mesh))
    out = [0] * len(shape)
    for coord in itertools.product(*(range(s) for s in mesh.shape)):
        local, _ = _compute_local_shape_and_global_offset(shape, mesh.shape, list(coord), placements, True)
        out = [max(a, int(b)) for a, b in zip(out, local)]
    return out


def _collective(src: Placement, dst: Placement, n: int) -> str | None:
    """The collective redistribute_local_tensor issues for one transform (None: local)."""
    if src == dst or n == 1:
        return None
    ss = isinstance(src, _StridedShard)
    if dst.is_replicate():
        if src.is_partial():
            return "all_reduce"
        if _is_shard_like(src):
            return "all_gather"
    elif isinstance(dst, _StridedShard):  # via Replicate
        if src.is_partial():
            return "all_reduce"
        if src.is_replicate():
            return None
        if _is_shard_like(src):
            return "all_gather"
    elif dst.is_shard():
        if src.is_partial():
            return "reduce_scatter"
        if src.is_replicate():
            return None
        if ss:  # _StridedShard -> Shard goes via Replicate
            return "all_gather"
        if src.is_shard():
            return "all_to_all"
    elif dst.is_partial() and src.is_replicate():
        return None
    raise RuntimeError(f"redistribute from {src} to {dst} is not supported by DTensor")


def _transform_bytes(info: Any, mesh: DeviceMesh, local: list[int], itemsize: int) -> float:
    n = mesh.size(info.mesh_dim)
    src, dst = info.src_dst_placements
    kind = _collective(src, dst, n)
    if kind is None:
        return 0.0
    shp = list(local)
    if kind in ("all_gather", "all_to_all") and type(src) is Shard:  # padded to the ceil chunk
        shp[src.dim] = -(-int(info.logical_shape[src.dim]) // n)
    if kind in ("all_to_all", "reduce_scatter"):  # new dim padded to split into n equal chunks
        shp[dst.dim] = n * -(-shp[dst.dim] // n)
    b = math.prod(shp) * itemsize
    return {"all_gather": (n - 1) * b, "all_reduce": 2 * (n - 1) / n * b}.get(kind, (n - 1) / n * b)


def _plan(planner: str, src_spec: DTensorSpec, dst_spec: DTensorSpec, itemsize: int) -> DTensorPlan:
    graph = planner == "graph"
    mesh = src_spec.mesh

    def call() -> list[Any]:
        with R.use_min_cost_redistribution_plan(graph):
            return R._gen_transform_infos(src_spec, dst_spec, graph)

    try:  # DTensor refusing (planner or executor) is a result, not a crash
        assert_no_mixed_partial_types(src_spec.placements)  # redistribute_local_tensor checks this
        assert_no_mixed_partial_types(dst_spec.placements)
        R._gen_transform_infos.cache_clear()
        R.clear_redistribute_planner_cache()
        t0 = time.perf_counter()
        call()
        t1 = time.perf_counter()
        infos = call()
        t2 = time.perf_counter()
        placements, order = _start_state(src_spec)
        total = 0.0
        for info in infos:
            local = _max_local_shape(mesh, src_spec.shape, placements, order)
            total += _transform_bytes(info, mesh, local, itemsize)
            R._update_shard_order_and_placements(info, placements, order)
    except Exception as e:
        return DTensorPlan(planner, [], math.nan, math.nan, math.nan, error=f"{type(e).__name__}: {e}")
    note = None
    forced = not all(DTensorSpec.is_default_device_order(s.shard_order) for s in (src_spec, dst_spec)) or any(
        isinstance(p, _StridedShard) for p in (*src_spec.placements, *dst_spec.placements))
    if forced and not graph:
        note = "DTensor forces the graph planner (non-default shard order or _StridedShard)"
    transforms = [f"dim{i.mesh_dim} {i.src_dst_placements[0]}->{i.src_dst_placements[1]}" for i in infos]
    return DTensorPlan(planner, transforms, total, t1 - t0, t2 - t1, note=note)


def dtensor_plans(mesh_shape: tuple[int, ...], shape: tuple[int, ...], src: tuple, dst: tuple,
                  itemsize: int = 4, src_shard_order: Any = None, dst_shard_order: Any = None
                  ) -> dict[str, DTensorPlan]:
    """src/dst are tuples of DTensor placements (Shard, Replicate, Partial, _StridedShard), one per mesh dim.

    src_shard_order/dst_shard_order: optional ShardOrder, ((tensor_dim, mesh_dims), ...) or
    {tensor_dim: mesh_dims}; None means DTensor's default (left-to-right) order.
    Returns {"greedy": DTensorPlan, "graph": DTensorPlan}.
    """
    for name, pl in (("src", src), ("dst", dst)):
        if len(pl) != len(mesh_shape):
            raise ValueError(f"{name} has {len(pl)} placements for a {len(mesh_shape)}-D mesh")
        for p in pl:
            if _is_shard_like(p) and not -len(shape) <= p.dim < len(shape):
                raise ValueError(f"{name} placement {p} out of range for a {len(shape)}-D tensor")
    src, dst = _normalize(src, len(shape)), _normalize(dst, len(shape))
    mesh = get_mesh(tuple(mesh_shape))
    meta = TensorMeta(torch.Size(shape), torch.empty(shape, device="meta").stride(),
                      _DTYPES.get(itemsize, torch.float32))
    out: dict[str, DTensorPlan] = {}
    try:
        src_spec = _spec(mesh, src, meta, src_shard_order)
        dst_spec = _spec(mesh, dst, meta, dst_shard_order)
    except Exception as e:
        err = f"{type(e).__name__}: {e}"
        return {p: DTensorPlan(p, [], math.nan, math.nan, math.nan, error=err) for p in ("greedy", "graph")}
    out["greedy"] = _plan("greedy", src_spec, dst_spec, itemsize)
    if hasattr(R, "DTensorRedistributePlanner") and hasattr(
            R.DTensorRedistributePlanner, "generate_graph_based_transform_infos"):
        out["graph"] = _plan("graph", src_spec, dst_spec, itemsize)
    else:
        out["graph"] = DTensorPlan("graph", [], math.nan, math.nan, math.nan,
                                   error=f"no graph-based planner in torch {torch.__version__}")
    return out


if __name__ == "__main__":
    from torch.distributed.tensor import Partial as P, Replicate as Rp

    S = Shard
    cases: list[tuple[tuple[int, ...], tuple[int, ...], tuple, tuple]] = [
        ((8,), (64, 32), (S(0),), (Rp(),)),
        ((8,), (64, 32), (S(0),), (S(1),)),
        ((8,), (64, 32), (P(),), (S(0),)),
        ((2, 4), (64, 32), (S(0), S(1)), (S(1), S(0))),
        ((4, 4), (64, 32), (S(0), S(0)), (S(1), S(1))),
        ((2, 4), (64, 32), (P(), P()), (S(0), S(1))),
        ((2, 2, 2), (64, 32), (S(0), S(0), S(0)), (S(1), S(1), S(1))),
        ((4,), (7, 5), (S(0),), (S(1),)),
        ((2, 2, 2, 2), (64, 32), (S(0), S(1), Rp(), P()), (Rp(), S(0), S(1), S(0))),
    ]

    def fmt(p: tuple) -> str:
        return "(" + ",".join(str(x) for x in p) + ")"

    print(f"torch {torch.__version__}; bytes = received by the busiest rank (fp32)")
    for mesh_shape, shape, src, dst in cases:
        print(f"\nmesh {mesh_shape} shape {shape}: {fmt(src)} -> {fmt(dst)}")
        for name, plan in dtensor_plans(mesh_shape, shape, src, dst).items():
            if plan.error:
                print(f"  {name:6s} ERROR {plan.error}")
                continue
            print(f"  {name:6s} {plan.bytes_per_rank:10.0f} B  cold {plan.seconds_cold * 1e3:7.3f} ms"
                  f"  cached {plan.seconds_cached * 1e6:6.1f} us  {' ; '.join(plan.transforms) or '(no-op)'}"
                  + (f"  [{plan.note}]" if plan.note else ""))
    # a non-default shard order: dim 0 sharded on mesh dim 1 first, then mesh dim 0
    print("\nmesh (2, 4) shape (64, 32): (S(0),S(0)) order {0:(1,0)} -> (R,R)")
    for name, plan in dtensor_plans((2, 4), (64, 32), (S(0), S(0)), (Rp(), Rp()),
                                    src_shard_order={0: (1, 0)}).items():
        print(f"  {name:6s} {plan.bytes_per_rank:10.0f} B  {' ; '.join(plan.transforms)}  error={plan.error} note={plan.note}")
