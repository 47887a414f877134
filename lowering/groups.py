"""Process-group names for mesh axes and sub-axes, from a torch DeviceMesh.

Sub-axes come from ``DeviceMesh._unflatten``; every rank lowers the same graph in the same
order, so the groups are created in the same order everywhere, as torch requires.
"""
from __future__ import annotations

from typing import Any

from fxshard.mesh import MeshAxis, axis_names


class MeshGroups:
    """``groups(axes) -> group name`` for functional collectives on ``device_mesh``.

    ``axes`` is one mesh axis or sub-axis, or several in mesh order (major first): their
    flattened group, whose rank order is row-major over them (``DeviceMesh._flatten``).
    Axes are named as ``MeshSpec.from_device_mesh`` names them (``d0, d1, ...`` on a mesh
    without dim names).
    """

    def __init__(self, device_mesh: Any):
        self.device_mesh = device_mesh
        self._names: dict[tuple[MeshAxis, ...], str] = {}

    def __call__(self, axes: MeshAxis | tuple[MeshAxis, ...]) -> str:
        key = (axes,) if isinstance(axes, MeshAxis) else tuple(axes)
        if key not in self._names:
            self._names[key] = self._group_name(key)
        return self._names[key]

    def index_in_group(self, name: str, coordinate: dict[str, int]) -> int | None:
        """The place of the rank at ``coordinate`` (axis name -> index) in the group ``name`` this object made
        (row-major over its axes), or None for a group it did not make."""
        axes = next((key for key, made in self._names.items() if made == name), None)
        if axes is None:
            return None
        index = 0
        for axis in axes:
            index = index * int(axis.size) + axis.coordinate(coordinate[axis.name])
        return index

    def _group_name(self, axes: tuple[MeshAxis, ...]) -> str:
        names = list(axis_names(self.device_mesh))
        for axis in axes:
            if axis.name not in names:
                raise ValueError(f"DeviceMesh {self.device_mesh} has no axis {axis.name!r}; its axes are {names}")
        if len(axes) == 1 and axes[0].is_whole:
            return self.device_mesh.get_group(names.index(axes[0].name)).group_name
        mesh = _named(self.device_mesh, tuple(names))
        picked = []
        for axis in axes:  # cut each mesh axis into (outer, axis, inner) where needed
            if axis.is_whole:
                picked.append(axis.name)
                continue
            outer = int(axis.axis_size) // (int(axis.size) * int(axis.inner))
            sizes, sub_names = [], []
            for size, tag in ((outer, "o"), (int(axis.size), "m"), (int(axis.inner), "i")):
                if size > 1:
                    sizes.append(size)
                    sub_names.append(f"{axis.name}_{tag}{int(axis.size)}x{int(axis.inner)}")
            mesh = mesh._unflatten(list(mesh.mesh_dim_names).index(axis.name), tuple(sizes), tuple(sub_names))
            picked.append(f"{axis.name}_m{int(axis.size)}x{int(axis.inner)}")
        sub = mesh[tuple(picked)] if len(picked) > 1 else mesh[picked[0]]
        if len(picked) > 1:
            sub = sub._flatten("_".join(picked))
        return sub.get_group().group_name


def _named(device_mesh: Any, names: tuple[str, ...]) -> Any:
    """``device_mesh`` itself when it has dim names; else a twin with ``names`` sharing its process groups.

    ``DeviceMesh._unflatten`` and ``_flatten`` (how sub-axes and flattened groups are made) need
    dim names; a mesh made as ``init_device_mesh("cpu", (4,))`` has none. The twin is a root mesh
    over the same ranks and layout that reuses the original's groups, so nothing new is created
    for its whole axes.
    """
    if device_mesh.mesh_dim_names:
        return device_mesh
    from torch.distributed.device_mesh import DeviceMesh

    twin = DeviceMesh(device_mesh.device_type, _layout=device_mesh._layout, _rank_map=device_mesh._rank_map,
                      mesh_dim_names=names, _init_backend=False)
    twin._dim_group_names = list(device_mesh._dim_group_names)
    twin._pg_registry = dict(device_mesh._get_root_mesh()._pg_registry)
    return twin
