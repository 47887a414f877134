"""Dynamo traces a model's repeated blocks once: each block's forward a nested compile region.

A Llama's layers are one class called n times, and Dynamo inlines every call: capturing
bench/compile.py's 8-layer Llama traces the layer's Python eight times (0.82 s, 0.47 s with
regions). With the class's ``forward`` a ``torch.compiler.nested_compile_region`` while
fxshard.compile captures (a wrapper of it: marking sets attributes on the function; the class
gets its own ``forward`` back after), Dynamo traces the first call and reuses its graph for
every later call its guards accept (a block whose Python attributes differ is traced again), as
``invoke_subgraph`` calls of one body; stage 1 reads each call's body inline
(``backend/capture/trace.py``), so the traced program is the one Dynamo gives without regions. The class
is marked, not each block: marked per instance (a bound method), torch 2.13's Dynamo passed the
first block's weights to every call. Dynamo inlines a block with a Python side effect (a cache
list appended to) as before; where it refuses the regions, ``captured_with_regions`` captures
again without them.
"""
from __future__ import annotations

import contextlib
import types
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from fxshard.layer_names import layer_members


def repeated_blocks(module: nn.Module) -> list[nn.Module]:
    """The layers of ``module`` (``layer_names.layer_members``: members of a ``ModuleList`` or ``Sequential``
    whose class occurs there twice or more) that are blocks of the user's own (modules holding modules;
    torch's classes, ``nn.Linear`` in a ``Sequential``, are left alone: marking one marks it everywhere),
    with the class's ``forward`` (no instance override)."""
    return [block for block in layer_members(module)
            if not type(block).__module__.startswith("torch.") and any(True for _ in block.children())
            and "forward" not in vars(block) and isinstance(getattr(type(block), "forward", None), types.FunctionType)]


@contextlib.contextmanager
def blocks_as_regions(blocks: Sequence[nn.Module]) -> Iterator[None]:
    """Within the block, the classes of ``blocks`` run their forward as nested compile regions."""
    classes = list(dict.fromkeys(type(block) for block in blocks))
    originals = {cls: vars(cls)["forward"] for cls in classes if "forward" in vars(cls)}
    for cls in classes:
        cls.forward = torch.compiler.nested_compile_region(_calling(cls.forward))
    try:
        yield
    finally:
        for cls in classes:
            if cls in originals:
                cls.forward = originals[cls]
            else:
                del cls.forward


def _calling(forward: Callable) -> Callable:
    """A function of its own for the class's ``forward``: marking a region sets attributes on the function."""
    def block_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return forward(self, *args, **kwargs)

    return block_forward


def captured_with_regions(capture: Callable[[], Any], blocks: Sequence[nn.Module]) -> Any:
    """``capture()`` with ``blocks`` as regions; where Dynamo refuses them, ``capture()`` as it is."""
    if not blocks:
        return capture()
    try:
        with blocks_as_regions(blocks):
            return capture()
    except Exception:  # noqa: BLE001 (any refusal of a region: the plain capture raises what is wrong)
        return capture()  # nothing of the refused one serves it (``capture``: a fresh code object each time)
