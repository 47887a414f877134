"""Process-group names for mesh axes and sub-axes, from a torch DeviceMesh.

Sub-axes come from ``DeviceMesh._unflatten``; every rank lowers the same graph in the same
order, so the groups are created in the same order everywhere, as torch requires.
"""
from __future__ import annotations

from typing import Any

from fxshard.mesh import MeshAxis


class MeshGroups:
    """``groups(axes) -> group name`` for functional collectives on ``device_mesh``.

    ``axes`` is one mesh axis or sub-axis, or several in mesh order (major first): their
    flattened group, whose rank order is row-major over them (``DeviceMesh._flatten``).
    """

    def __init__(self, device_mesh: Any):
        self.device_mesh = device_mesh
        self._names: dict[tuple[MeshAxis, ...], str] = {}

    def __call__(self, axes: MeshAxis | tuple[MeshAxis, ...]) -> str:
        key = (axes,) if isinstance(axes, MeshAxis) else tuple(axes)
        if key not in self._names:
            self._names[key] = self._group_name(key)
        return self._names[key]

    def _group_name(self, axes: tuple[MeshAxis, ...]) -> str:
        mesh = self.device_mesh
        names = list(mesh.mesh_dim_names or ())
        for axis in axes:
            if axis.name not in names:
                raise ValueError(f"DeviceMesh {mesh} has no axis {axis.name!r}")
        if len(axes) == 1 and axes[0].is_whole:
            return mesh.get_group(axes[0].name).group_name
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
