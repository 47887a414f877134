"""Python's cyclic garbage collector paused while a program compiles.

Compiling builds hundreds of thousands of long-lived objects (FX nodes, fake tensors, Inductor's IR),
and each full collection walks them all: at 8 layers of bench/compile.py's Llama the collector ran
3 full passes during fxshard's first step, 1.1 s of its 19 s (0.35 s at 2 layers), each longer than the
last as the heap grew. Paused for Dynamo's capture, fxshard's stages and Inductor's compile, the
cycles those leave are collected at the collector's next pass after it (the first step's peak resident
memory +24 MiB at 8 layers). torch.distributed.checkpoint pauses it the same way around state dicts.
"""
from __future__ import annotations

import contextlib
import gc
from typing import Iterator

__all__ = ["collector_paused"]


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Within the block no automatic collection runs; as it was after (nested blocks leave it off)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
