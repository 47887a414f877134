"""Process-group names for mesh axes and sub-axes, from a torch DeviceMesh.

Sub-axes come from ``DeviceMesh._unflatten``; every rank lowers the same graph in the same
order, so the groups are created in the same order everywhere, as torch requires.
"""
from __future__ import annotations

from typing import Any

from fxshard.mesh import MeshAxis


class MeshGroups:
    """``groups(axis) -> group name`` for functional collectives on ``device_mesh``."""

    def __init__(self, device_mesh: Any):
        self.device_mesh = device_mesh
        self._names: dict[MeshAxis, str] = {}

    def __call__(self, axis: MeshAxis) -> str:
        if axis not in self._names:
            self._names[axis] = self._group_name(axis)
        return self._names[axis]

    def _group_name(self, axis: MeshAxis) -> str:
        mesh = self.device_mesh
        names = list(mesh.mesh_dim_names or ())
        if axis.name not in names:
            raise ValueError(f"DeviceMesh {mesh} has no axis {axis.name!r}")
        if axis.is_whole:
            return mesh.get_group(axis.name).group_name
        outer = int(axis.axis_size) // (int(axis.size) * int(axis.inner))
        sizes, sub_names = [], []
        for size, tag in ((outer, "o"), (int(axis.size), "m"), (int(axis.inner), "i")):
            if size > 1:
                sizes.append(size)
                sub_names.append(f"{axis.name}_{tag}{int(axis.size)}x{int(axis.inner)}")
        sub = mesh._unflatten(names.index(axis.name), tuple(sizes), tuple(sub_names))
        return sub[f"{axis.name}_m{int(axis.size)}x{int(axis.inner)}"].get_group().group_name
