"""What a distributed training step is checked by against one device's (tests/moe_programs.py, tests/cp_programs.py)."""
from __future__ import annotations

from typing import Sequence

import torch
from torch.distributed.tensor import DTensor


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def loss_error(loss: torch.Tensor, reference: torch.Tensor) -> float:
    """|loss - one device's| relative to one device's."""
    return abs(_full(loss).item() - reference.item()) / abs(reference.item())


def update_errors(model: torch.nn.Module, reference: torch.nn.Module,
                  before: Sequence[torch.Tensor]) -> dict[str, float]:
    """Each parameter's update against one device's, relative to one device's update (a gradient lost or wrong is
    an error of about 1; a parameter neither side moved, 0)."""
    return {name: (_full(p) - q).abs().max().item() / max((q - q0).abs().max().item(), 1e-30)
            for (name, p), q, q0 in zip(model.named_parameters(), reference.parameters(), before)}
