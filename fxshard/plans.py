"""A redistribution plan: the steps that turn one layout into another on every rank.

These are the only planner types lowering sees (lowering/collectives.py turns each step into
functional collectives and local ops).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .layout import Layout, exact_div
from .mesh import MeshAxis, Size, as_size

MIXED_SUM_AVG = "sum+avg"  # one reduction of sum axes and avg axes together: a sum, divided by the avg axes' size
STEP_KINDS = ("all_gather", "all_reduce", "reduce_scatter", "all_to_all", "exchange", "local_shard", "local_partial")


@dataclass(frozen=True)
class Step:
    """One step of a plan: ``kind`` on the flattened group ``axes`` (mesh order, major first)."""

    kind: str
    axes: tuple[MeshAxis, ...]
    before: Layout
    after: Layout
    dim: int | None = None  # the tensor dim gathered / sharded (all_to_all: the gathered one), if one
    to_dim: int | None = None  # all_to_all: the dim that becomes sharded, if one
    reduce_op: str | None = None
    bytes_per_rank: Size = 0

    def __post_init__(self) -> None:
        if self.kind not in STEP_KINDS:
            raise ValueError(f"unknown step kind {self.kind!r}; expected one of {STEP_KINDS}")
        if not self.axes:
            raise ValueError(f"a {self.kind} step needs at least one mesh axis")

    @property
    def axis(self) -> MeshAxis:
        """The one mesh axis of a single-axis step."""
        if len(self.axes) != 1:
            raise ValueError(f"step {self} runs on a flattened group of {len(self.axes)} axes")
        return self.axes[0]

    @property
    def group_size(self) -> Size:
        n: Size = 1
        for a in self.axes:
            n = n * a.size
        return as_size(n)

    @property
    def collective_op(self) -> str | None:
        """The op the collective reduces with: sum for avg and for sum and avg mixed (then ``divisor``)."""
        return "sum" if self.reduce_op in ("avg", MIXED_SUM_AVG) else self.reduce_op

    @property
    def divisor(self) -> Size:
        """What the reduced sum is divided by: the size of the avg axes this step reduces (1 for none)."""
        if self.reduce_op not in ("avg", MIXED_SUM_AVG):
            return 1
        return exact_div(_avg_size(self.before), _avg_size(self.after))

    @property
    def is_local(self) -> bool:
        return self.kind.startswith("local")

    def __str__(self) -> str:
        where = f" dim {self.dim}" if self.dim is not None else ""
        if self.to_dim is not None:
            where = f" dim {self.dim if self.dim is not None else '*'}->{self.to_dim}"
        op = f" {self.reduce_op}" if self.reduce_op else ""
        return f"{self.kind}({','.join(str(a) for a in self.axes)}{where}{op})"


def _avg_size(layout: Layout) -> Size:
    n: Size = 1
    for a, op in layout.partial:
        n = n * a.size if op == "avg" else n
    return n


@dataclass(frozen=True)
class Plan:
    src: Layout
    dst: Layout
    steps: tuple[Step, ...]
    cost: float
    dtype: torch.dtype = torch.float32

    @property
    def bytes_per_rank(self) -> Size:
        return as_size(sum((s.bytes_per_rank for s in self.steps), 0))

    @property
    def collectives(self) -> tuple[Step, ...]:
        return tuple(s for s in self.steps if not s.is_local)

    def __str__(self) -> str:
        return f"{self.src} -> {self.dst}: " + (", ".join(str(s) for s in self.steps) or "no-op")
