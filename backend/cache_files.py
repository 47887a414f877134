"""Files fxshard keeps in Inductor's cache directory, and the text their keys are made of.

Two stores keep programs across runs (``prepared_cache.py``: programs prepared for Inductor;
``lowered_cache.py``: each rank's lowered programs). Both name an entry by a digest of what it depends
on, written the same in every process, and write an entry whole or not at all: ranks write at once, and a
run may read while another writes.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import pathlib
import tempfile
from typing import Any

import torch

__all__ = ["cache_path", "write_whole", "tensor_digest", "stable"]


def cache_path(folder: str, key: str) -> pathlib.Path:
    """The file of ``key`` in ``folder`` of Inductor's cache directory (``TORCHINDUCTOR_CACHE_DIR``)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return pathlib.Path(cache_dir()) / folder / key


def write_whole(path: pathlib.Path, data: bytes) -> None:
    """``data`` at ``path``, whole or not at all (a file beside it, then renamed over it). A full or read-only
    disk keeps nothing, and says nothing: what was to be kept is made again next time."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, delete=False) as f:
            f.write(data)
        os.replace(f.name, path)
    except OSError:
        with contextlib.suppress(OSError, NameError):
            os.unlink(f.name)


def tensor_digest(tensor: torch.Tensor) -> str:
    """A digest of a real tensor's values."""
    data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    return hashlib.sha256(data.numpy().tobytes()).hexdigest()


def stable(value: Any) -> Any:
    """A config value as the same text in every process: a function (fxshard's bucket cap) by its name,
    and a partial by its function and arguments, not by their addresses."""
    if isinstance(value, functools.partial):
        return ("partial", stable(value.func), tuple(map(stable, value.args)),
                tuple((k, stable(v)) for k, v in sorted(value.keywords.items())))
    if callable(value) and hasattr(value, "__qualname__"):
        return ("function", value.__module__, value.__qualname__)
    if isinstance(value, (list, tuple)):
        return type(value)(map(stable, value))
    if isinstance(value, dict):
        return tuple((k, stable(v)) for k, v in sorted(value.items(), key=lambda kv: repr(kv[0])))
    return value
