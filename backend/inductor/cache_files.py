"""Files fxshard keeps in Inductor's cache directory, and the text their keys are made of.

Two stores keep programs across runs (``prepared_cache.py``: programs prepared for Inductor;
``lowered_cache.py``: each rank's lowered programs). Both name an entry by a digest of what it depends
on, written the same in every process, and write an entry whole or not at all: ranks write at once, and a
run may read while another writes. Both read the process-wide state that tracing reads and no graph holds
(``ambient_state``: autocast, grad mode, default dtype, SDPA's backends...): a program traced under bf16
autocast is another program than the same graph traced without.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import logging
import os
import pathlib
import tempfile
from typing import Any, Callable

import torch

from fxshard.backend.inductor.inductor_calls import cache_dir, dynamo_global_state, functorch_portable_config

__all__ = ["cache_path", "write_whole", "tensor_digest", "stable", "ambient_state"]

log = logging.getLogger("fxshard")

# Process-wide switches that change what tracing makes of a graph and that Dynamo's global-state guard (autocast
# per device type, grad mode, default dtype, deterministic algorithms, TF32, reduced-precision reductions, torch
# function) leaves out: which kernel SDPA becomes, fp32 matmul precision, the math libraries in use.
_SWITCHES: tuple[tuple[str, Callable[[], Any]], ...] = (
    ("flash_sdp", lambda: torch.backends.cuda.flash_sdp_enabled()),
    ("mem_efficient_sdp", lambda: torch.backends.cuda.mem_efficient_sdp_enabled()),
    ("math_sdp", lambda: torch.backends.cuda.math_sdp_enabled()),
    ("cudnn_sdp", lambda: torch.backends.cuda.cudnn_sdp_enabled()),
    ("math_sdp_reduced_precision", lambda: torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()),
    ("float32_matmul_precision", torch.get_float32_matmul_precision),
    ("mkldnn", lambda: torch.backends.mkldnn.enabled),
    ("cudnn", lambda: (torch.backends.cudnn.enabled, torch.backends.cudnn.deterministic,
                       torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32)),
    ("inference_mode", torch.is_inference_mode_enabled),
    ("modes", lambda: (tuple(type(m).__qualname__ for m in torch.overrides._get_current_function_mode_stack()),
                       tuple(type(m).__qualname__
                             for m in torch.utils._python_dispatch._get_current_dispatch_mode_stack()))),
    ("functorch_config", lambda: stable(sorted(functorch_portable_config().items()))),
    ("fxshard", lambda: importlib.metadata.version("fxshard")),
)


def cache_path(folder: str, key: str) -> pathlib.Path:
    """The file of ``key`` in ``folder`` of Inductor's cache directory (``TORCHINDUCTOR_CACHE_DIR``)."""
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


def ambient_state() -> tuple | None:
    """The process-wide state a program is traced under, as the same text in every process: Dynamo's own
    global-state guard's reading (what makes Dynamo compile a graph again) and ``_SWITCHES``. None where some of
    it cannot be read (a torch whose guard or switches read otherwise): then nothing is kept, and a warning
    says so once."""
    try:
        guarded = dynamo_global_state()
        switches = tuple((name, read()) for name, read in _SWITCHES)
    except Exception as error:  # noqa: BLE001 - any failure to read means: keep nothing
        _say_unreadable(f"{type(error).__name__}: {error}")
        return None
    return (guarded, switches)


@functools.cache
def _say_unreadable(reason: str) -> None:
    """One warning per reason and process (an explicit cache: a program is compiled many times)."""
    log.warning("fxshard keeps no program on disk in this process (it plans each one again): the state a "
                "program is traced under (autocast, grad mode, default dtype, ...) cannot be read on torch %s: %s",
                torch.__version__, reason)
