"""Which rank holds which element of a layout, as a text grid (DTensor's visualize_sharding, but
for strided, sub-axis, uneven and partial layouts too, since it reads the layout's own indices)."""
from __future__ import annotations

import math
from typing import Any

import torch

MAX_ELEMENTS = 4096


def owners(layout: Any) -> list[list[int]]:
    """For each element (row-major), the ranks whose local block holds it."""
    shape = [int(s) for s in layout.shape]
    ids = torch.arange(math.prod(shape)).reshape(shape)
    held: list[list[int]] = [[] for _ in range(ids.numel())]
    for rank, coord in enumerate(layout.mesh.coordinates()):
        index = ids
        for d in range(layout.ndim):
            if layout.dim_is_sharded(d):
                index = index.index_select(d, layout.local_indices(d, coord))
        for i in index.reshape(-1).tolist():
            held[i].append(rank)
    return held


def visualize(layout: Any) -> str:
    """One line per row of the last dim (leading dims flattened, labelled); each cell lists the ranks
    (row-major over the mesh axes) that hold that element."""
    if not layout.mesh.is_static or not all(isinstance(s, int) for s in layout.shape):
        raise ValueError(f"visualize needs static sizes; {layout} on {layout.mesh} has symbols")
    shape = [int(s) for s in layout.shape]
    if math.prod(shape) > MAX_ELEMENTS:
        raise ValueError(f"visualize shows at most {MAX_ELEMENTS} elements; shape {shape} has {math.prod(shape)}: "
                         "draw the same layout on a smaller shape (the same pieces with smaller local sizes)")
    cells = [",".join(map(str, r)) or "-" for r in owners(layout)]
    cols = shape[-1] if shape else 1
    width = max(len(c) for c in cells)
    lead = shape[:-1]
    header = [f"{layout} on {layout.mesh}; ranks in row-major order of {', '.join(layout.mesh.names)}"]
    if layout.partial:
        header.append("partial: every listed rank holds a share; the value is their reduction")
    lines = []
    for r in range(len(cells) // cols):
        label = ""
        if lead:
            idx, rest = [], r
            for s in reversed(lead):
                idx.append(rest % s)
                rest //= s
            label = "[" + ",".join(map(str, reversed(idx))) + "] "
        lines.append(label + " ".join(c.rjust(width) for c in cells[r * cols:(r + 1) * cols]))
    return "\n".join(header + lines)
