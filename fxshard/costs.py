"""What communication costs: the alpha-beta cost model, and the bytes each collective makes a rank receive.

Bytes are those the busiest rank receives over the network, per collective. A cost is
``latency + bytes / bandwidth`` per mesh axis (a flattened group runs at its slowest axis), plus
local copies at ``copy_bandwidth``. Symbolic sizes are costed at their hints (fxshard/hints.py).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import sympy
import torch

from .hints import at_hints
from .mesh import MeshAxis, Size, as_size


@dataclass(frozen=True)
class CostModel:
    """Alpha-beta cost per collective: ``latency + bytes / bandwidth`` of its mesh axes.

    ``bandwidth`` and ``latency`` map axis names to bytes/s and seconds; other axes use the
    defaults (one node). A collective over several axes (a flattened group) runs at the
    slowest bandwidth and the largest latency among them. ``copy_bandwidth`` prices local
    copies (slicing, permutes, packing); ``compute_rate`` (FLOP/s) the matmuls a rank does, where
    a step's cost counts compute too (``fxshard.auto_placements``: a replicated matmul every rank
    repeats costs its whole time on each).
    """

    default_bandwidth: float = 100e9
    default_latency: float = 10e-6
    copy_bandwidth: float = 1000e9
    compute_rate: float = 100e12
    bandwidth: tuple[tuple[str, float], ...] = ()
    latency: tuple[tuple[str, float], ...] = ()

    def axis_bandwidth(self, axis: MeshAxis) -> float:
        return self._bandwidths.get(axis.name, self.default_bandwidth)

    def axis_latency(self, axis: MeshAxis) -> float:
        return self._latencies.get(axis.name, self.default_latency)

    @functools.cached_property
    def _bandwidths(self) -> dict[str, float]:
        return dict(self.bandwidth)

    @functools.cached_property
    def _latencies(self) -> dict[str, float]:
        return dict(self.latency)

    def collective_cost(self, axes: Sequence[MeshAxis], nbytes: Size) -> float:
        latency = max(max(self.axis_latency(a) for a in axes), TIE_BREAK)
        return latency + numeric(nbytes) / min(self.axis_bandwidth(a) for a in axes)

    def copy_cost(self, nbytes: Size) -> float:
        return numeric(nbytes) / self.copy_bandwidth


DEFAULT_COST_MODEL = CostModel()
# the least a collective costs (s): between plans that move the same bytes, fewer collectives win even
# under a bandwidth-only model (latency 0), which would otherwise tie one all_reduce with two
# reduce_scatters and an all_gather; far below a byte's cost, so it never outweighs bytes
TIE_BREAK = 1e-15


def numel(shape: Sequence[Size]) -> Size:
    n: Size = 1
    for s in shape:
        n = n * s
    return as_size(n)


def dtype_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def numeric(x: Size) -> float:
    """A float for ranking costs; symbolic sizes are evaluated at their hints (fxshard/hints.py)."""
    if isinstance(x, (int, float)):
        return float(x)
    return float(at_hints(x))


def collective_bytes(kind: str, n: Size, local_bytes: Size) -> Size:
    """Bytes one rank receives in a collective over ``n`` ranks on ``local_bytes`` per rank."""
    if kind == "all_gather":
        return as_size((n - 1) * local_bytes)
    factor = {"all_reduce": 2, "reduce_scatter": 1, "all_to_all": 1}.get(kind, 0)
    if not factor:
        return 0
    if isinstance(n, int) and isinstance(local_bytes, int):
        return -(-factor * (n - 1) * local_bytes // n)  # uneven chunks: the busiest rank rounds up
    return as_size(sympy.sympify(factor * (n - 1) * local_bytes) / n)
