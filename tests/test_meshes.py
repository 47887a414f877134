"""Every DeviceMesh a user can build lowers: with or without dim names, 1-D slices of a 2-D mesh,
flattened meshes. Groups are checked against rank lists computed here from the mesh's coordinates."""
from __future__ import annotations

import pytest
import torch.distributed as dist

from fxshard.lowering.groups import MeshGroups
from fxshard.mesh import MeshSpec


@pytest.fixture(scope="module")
def fake_world_8():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized(), "a process group leaked from another test module"
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _ranks(group_name: str) -> list[int]:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return dist.get_process_group_ranks(_resolve_process_group(group_name))


def expected_group(sizes: tuple[int, ...], picked: list[tuple[int, int, int]]) -> list[int]:
    """Rank 0's group over the (mesh dim, sub-axis size, inner) in ``picked``, row-major over them."""
    def coordinate(rank: int) -> list[int]:
        out = []
        for s in reversed(sizes):
            out.append(rank % s)
            rank //= s
        return out[::-1]

    def key(rank: int) -> tuple:  # the picked sub-axes' coordinates, major first
        c = coordinate(rank)
        return tuple((c[d] // inner) % size for d, size, inner in picked)

    def others(rank: int) -> tuple:  # everything else, which must equal rank 0's
        c = coordinate(rank)
        rest = []
        for d, s in enumerate(sizes):
            here = [(size, inner) for dd, size, inner in picked if dd == d]
            rest.append(tuple(c[d] // i % sz for sz, i in _complement(s, here)))
        return tuple(rest)

    members = [r for r in range(8) if others(r) == others(0)]
    return sorted(members, key=key)


def _complement(axis_size: int, taken: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The (size, inner) pieces of an axis not covered by ``taken``."""
    out, inner = [], 1
    for size, at in sorted(taken, key=lambda t: t[1]):
        if at > inner:
            out.append((at // inner, inner))
        inner = at * size
    if inner < axis_size:
        out.append((axis_size // inner, inner))
    return out


CASES = [  # (mesh sizes, axes picked as (dim, size, inner))
    ((8,), [(0, 8, 1)]),
    ((8,), [(0, 2, 4)]),
    ((8,), [(0, 4, 1)]),
    ((8,), [(0, 2, 2)]),
    ((2, 4), [(0, 2, 1)]),
    ((2, 4), [(1, 4, 1)]),
    ((2, 4), [(1, 2, 2)]),
    ((2, 4), [(0, 2, 1), (1, 4, 1)]),
    ((2, 4), [(0, 2, 1), (1, 2, 1)]),
]


@pytest.mark.parametrize("named", [True, False], ids=["named", "unnamed"])
@pytest.mark.parametrize("sizes, picked", CASES)
def test_groups_of_axes_and_sub_axes_with_or_without_dim_names(fake_world_8, sizes, picked, named):
    from torch.distributed.device_mesh import init_device_mesh

    names = tuple(f"d{i}" for i in range(len(sizes)))
    mesh = init_device_mesh("cpu", sizes, mesh_dim_names=names if named else None)
    spec = MeshSpec.from_device_mesh(mesh)
    assert spec == MeshSpec(dict(zip(names, sizes)))  # an unnamed mesh's axes are d0, d1, ...
    axes = tuple(spec.sub_axis(names[d], size, inner) for d, size, inner in picked)
    assert _ranks(MeshGroups(mesh)(axes)) == expected_group(sizes, picked)


def test_slices_and_flattened_meshes_are_meshes_of_their_own(fake_world_8):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    tp = mesh["tp"]
    assert MeshSpec.from_device_mesh(tp) == MeshSpec(tp=4)
    assert _ranks(MeshGroups(tp)(MeshSpec(tp=4).axis("tp"))) == [0, 1, 2, 3]
    assert _ranks(MeshGroups(tp)(MeshSpec(tp=4).sub_axis("tp", 2, 1))) == [0, 1]
    flat = mesh._flatten("dp_tp")
    assert MeshSpec.from_device_mesh(flat) == MeshSpec(dp_tp=8)
    assert _ranks(MeshGroups(flat)(MeshSpec(dp_tp=8).sub_axis("dp_tp", 2, 4))) == [0, 4]


def test_a_mesh_without_a_named_axis_says_which_axes_it_has(fake_world_8):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (8,))
    with pytest.raises(ValueError, match=r"has no axis 'tp'; its axes are \['d0'\]"):
        MeshGroups(mesh)(MeshSpec(tp=8).axis("tp"))


def test_the_reference_groups_are_right():
    """expected_group itself, on cases small enough to write out."""
    assert expected_group((2, 4), [(1, 4, 1)]) == [0, 1, 2, 3]
    assert expected_group((2, 4), [(0, 2, 1)]) == [0, 4]
    assert expected_group((8,), [(0, 2, 4)]) == [0, 4]
    assert expected_group((8,), [(0, 2, 2)]) == [0, 2]
    assert expected_group((2, 4), [(0, 2, 1), (1, 2, 1)]) == [0, 1, 4, 5]
