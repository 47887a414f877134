"""Abstract device meshes: axis names and sizes, no process groups.

Sizes may be sympy expressions so that propagation and planning can run on a symbolic
number of ranks. A mesh axis can be seen as several sub-axes (a mesh axis of 8 as 2x4);
a sub-axis is identified by its size and the product of the sizes below it (``inner``), so
the same sub-axis has one name however the axis was split.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence, Union

import sympy

Size = Union[int, sympy.Expr]
Coordinate = Union[Sequence[int], Mapping[str, int]]


def is_static(n: Any) -> bool:
    return isinstance(n, int) or (isinstance(n, sympy.Integer))


def as_size(n: Any) -> Size:
    """Normalize a size: python int when static, sympy expression otherwise."""
    if isinstance(n, bool):
        raise TypeError(f"a size cannot be a bool: {n!r}")
    if isinstance(n, int):
        return n
    if isinstance(n, sympy.Integer):
        return int(n)
    if isinstance(n, sympy.Expr):
        return n
    if hasattr(n, "__index__"):
        return int(n)
    raise TypeError(f"expected an int or a sympy expression as a size, got {n!r}")


def divides(d: Size, n: Size) -> bool:
    """Whether ``d`` divides ``n``; symbolic sizes are assumed to divide (checked at run time)."""
    if is_static(d) and is_static(n):
        return int(n) % int(d) == 0
    q = sympy.simplify(sympy.sympify(n) / sympy.sympify(d))
    return not (q.is_integer is False)


@dataclass(frozen=True)
class MeshAxis:
    """A mesh axis or sub-axis: coordinate = (axis coordinate // inner) % size.

    ``axis_size`` is the size of the whole mesh axis ``name``; a whole axis has
    ``size == axis_size`` and ``inner == 1``. Printed as its coordinate formula:
    ``tp`` (whole), ``tp/4`` (major sub-axis: tp // 4), ``tp%4`` (minor), ``tp/2%2``.
    """

    name: str
    size: Size
    inner: Size = 1
    axis_size: Size = 0

    def __post_init__(self) -> None:
        if self.axis_size == 0:
            object.__setattr__(self, "axis_size", as_size(self.size * self.inner))

    @property
    def is_whole(self) -> bool:
        return self.inner == 1 and self.size == self.axis_size

    def __str__(self) -> str:
        if self.is_whole:
            return self.name
        text = self.name
        if self.inner != 1:
            text += f"/{self.inner}"
        if self.size * self.inner != self.axis_size:
            text += f"%{self.size}"
        return text

    def __repr__(self) -> str:
        return f"MeshAxis({self})"

    def coordinate(self, axis_coordinate: int) -> int:
        return (axis_coordinate // int(self.inner)) % int(self.size)

    def overlaps(self, other: "MeshAxis") -> bool:
        if self.name != other.name:
            return False
        lo1, hi1 = self.inner, self.inner * self.size
        lo2, hi2 = other.inner, other.inner * other.size
        if not all(is_static(v) for v in (lo1, hi1, lo2, hi2)):
            return True
        return not (hi1 <= lo2 or hi2 <= lo1)

    def split(self, outer: Size) -> tuple["MeshAxis", "MeshAxis"]:
        """This axis seen as (outer x size/outer), major first."""
        inner_size = as_size(self.size // outer) if is_static(self.size) else as_size(self.size / outer)
        return (MeshAxis(self.name, as_size(outer), as_size(self.inner * inner_size), self.axis_size),
                MeshAxis(self.name, inner_size, self.inner, self.axis_size))

    def merge(self, minor: "MeshAxis") -> "MeshAxis | None":
        """The one sub-axis covering ``self`` directly above ``minor``, if they are adjacent."""
        if self.name != minor.name or self.inner != minor.inner * minor.size:
            return None
        return MeshAxis(self.name, as_size(self.size * minor.size), minor.inner, self.axis_size)


def axis_names(device_mesh: Any) -> tuple[str, ...]:
    """A DeviceMesh's axis names: its ``mesh_dim_names``, or ``d0, d1, ...`` for a mesh without names."""
    names = device_mesh.mesh_dim_names
    return tuple(names) if names else tuple(f"d{i}" for i in range(device_mesh.ndim))


@dataclass(frozen=True)
class MeshSpec:
    """An abstract device mesh: ordered axis names and sizes, major first."""

    names: tuple[str, ...]
    sizes: tuple[Size, ...]

    def __init__(self, axes: Mapping[str, Any] | Sequence[tuple[str, Any]] | None = None, **kw: Any):
        items = list(axes.items() if isinstance(axes, Mapping) else (axes or [])) + list(kw.items())
        if not items:
            raise ValueError("a MeshSpec needs at least one axis, e.g. MeshSpec(tp=4)")
        names = tuple(str(n) for n, _ in items)
        if len(set(names)) != len(names):
            raise ValueError(f"mesh axis names must be unique, got {names}")
        for n in names:
            if not n.isidentifier():
                raise ValueError(f"mesh axis name {n!r} must be an identifier")
        sizes = tuple(as_size(s) for _, s in items)
        for n, s in zip(names, sizes):
            if is_static(s) and s < 1:
                raise ValueError(f"mesh axis {n!r} has size {s}; sizes must be >= 1")
        object.__setattr__(self, "names", names)
        object.__setattr__(self, "sizes", sizes)
        object.__setattr__(self, "_static", all(is_static(s) for s in sizes))  # asked once per plan lookup

    @classmethod
    def from_device_mesh(cls, device_mesh: Any) -> "MeshSpec":
        return cls(list(zip(axis_names(device_mesh), device_mesh.shape)))

    @property
    def ndim(self) -> int:
        return len(self.names)

    @property
    def is_static(self) -> bool:
        return self._static

    @property
    def world_size(self) -> Size:
        n: Size = 1
        for s in self.sizes:
            n = n * s
        return as_size(n)

    def size_of(self, name: str) -> Size:
        return self.sizes[self.index(name)]

    def index(self, name: str) -> int:
        try:
            return self.names.index(name)
        except ValueError:
            raise ValueError(f"mesh has no axis {name!r}; its axes are {self.names}") from None

    def axis(self, name: str | int) -> MeshAxis:
        """The whole mesh axis ``name`` (or index)."""
        if isinstance(name, int):
            name = self.names[name]
        s = self.size_of(name)
        return MeshAxis(name, s, 1, s)

    def sub_axis(self, name: str, size: Size, inner: Size) -> MeshAxis:
        total = self.size_of(name)
        if is_static(total) and is_static(size) and is_static(inner) and total % (size * inner) != 0:
            raise ValueError(f"mesh axis {name!r} of size {total} has no sub-axis of size {size} inside {inner}")
        return MeshAxis(name, as_size(size), as_size(inner), total)

    def axes(self) -> tuple[MeshAxis, ...]:
        return tuple(self.axis(n) for n in self.names)

    def coordinate_dict(self, coordinate: Coordinate) -> dict[str, int]:
        if isinstance(coordinate, Mapping):
            missing = set(self.names) - set(coordinate)
            if missing:
                raise ValueError(f"coordinate {dict(coordinate)} lacks mesh axes {sorted(missing)}")
            return {n: int(coordinate[n]) for n in self.names}
        coordinate = tuple(coordinate)
        if len(coordinate) != self.ndim:
            raise ValueError(f"coordinate {coordinate} has {len(coordinate)} entries; mesh {self} has {self.ndim} axes")
        return {n: int(c) for n, c in zip(self.names, coordinate)}

    def coordinates(self) -> list[tuple[int, ...]]:
        """Every coordinate in rank order (row-major over axes)."""
        if not self.is_static:
            raise ValueError(f"mesh {self} is symbolic; it has no list of coordinates")
        out: list[tuple[int, ...]] = [()]
        for s in self.sizes:
            out = [c + (i,) for c in out for i in range(int(s))]
        return out

    def __str__(self) -> str:
        return "Mesh(" + ", ".join(f"{n}={s}" for n, s in zip(self.names, self.sizes)) + ")"

    __repr__ = __str__
