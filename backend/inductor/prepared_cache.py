"""Programs prepared for Inductor, kept on disk: a script's second run skips each program's preparation.

``compile_direct`` prepares a lowered program for Inductor's inner compiler: every value's fake
metadata, Inductor's decompositions and its joint-graph passes. Inductor's FX graph cache then finds
the compiled program by the prepared one's code, but the preparation ran first, every run: 0.3 s of a
4-layer FSDP step's second run (bench/compile.py --warm), half of it the pattern matcher's set-up, which
DTensor + FSDP2's second run never pays (AOTAutograd's cache hands over the compiled graph before any
pass). Here the prepared program is kept under a key of everything its preparation reads: the program's
code and constants, the example inputs' metadata, the process-wide state it is traced under
(``cache_files.ambient_state``), the preparation's own code, torch's version and Inductor's config. The
next run loads it (nodes, names and block tags, ``torch.fx._graph_pickler``), computes its fake values
again, and Inductor's cache finds the same entry. The store is on exactly when
Inductor's FX graph cache is, in Inductor's cache directory: clearing that clears this too.
"""
from __future__ import annotations

import functools
import hashlib
import pathlib
from typing import Any, Sequence

import torch
import torch.fx as fx

from fxshard.lowering.localize import program_fake_values

from fxshard.backend.inductor.cache_files import ambient_state, cache_path, stable, tensor_digest, write_whole
from fxshard.backend.inductor.inductor_calls import counters, custom_joint_passes, fx_graph_cache_on, portable_config

__all__ = ["prepared_key", "load_prepared", "store_prepared"]

# the code that prepares a program: a change to it makes every entry stale
_PREPARATION = ("compile_inner.py", "prepared_cache.py")


def prepared_key(program: fx.GraphModule, example_inputs: Sequence[Any]) -> str | None:
    """The key of ``program`` prepared for these inputs, or None where nothing is kept (Inductor's FX graph
    cache off, a custom joint pass, a constant or an input this key cannot read)."""
    if not fx_graph_cache_on() or custom_joint_passes():
        return None
    ambient = ambient_state()  # the preparation traces the program again, under it
    if ambient is None:
        return None
    parts: list[Any] = [torch.__version__, ambient, program.code]
    for x in example_inputs:
        if not isinstance(x, torch.Tensor):
            return None
        parts.append((tuple(x.shape), x.stride(), x.storage_offset(), x.dtype, x.device, x.requires_grad))
    for node in program.graph.nodes:
        if node.op == "call_module":
            return None
        if node.op == "get_attr":
            value = getattr(program, node.target, None)
            if not isinstance(value, torch.Tensor) or isinstance(value, torch._subclasses.FakeTensor):
                return None
            parts.append((node.target, value.dtype, tuple(value.shape), tensor_digest(value)))
    parts.append(_preparation_digest())
    parts.append([(name, stable(value)) for name, value in sorted(portable_config().items())])
    return hashlib.sha256(repr(parts).encode()).hexdigest()


@functools.cache
def _preparation_digest() -> str:
    """The preparation's source, read once per process (an explicit cache: the files do not change under it)."""
    here = pathlib.Path(__file__).parent
    return hashlib.sha256(b"".join((here / name).read_bytes() for name in _PREPARATION)).hexdigest()


def _path(key: str) -> pathlib.Path:
    return cache_path("fxshard_prepared", key)


def load_prepared(key: str, example_inputs: Sequence[Any], mode: Any) -> fx.GraphModule | None:
    """The program kept under ``key``, its fake values computed again for ``example_inputs`` (in ``mode``);
    None where none is kept or it cannot be read."""
    from torch.fx._graph_pickler import GraphPickler

    path = _path(key)
    if not path.exists():
        counters["fxshard"]["prepared_cache_miss"] += 1
        return None
    try:
        program = GraphPickler.loads(path.read_bytes(), mode)
    except Exception:  # a torn or foreign file: prepared again, and stored over it
        counters["fxshard"]["prepared_cache_miss"] += 1
        return None
    placeholders = program.graph.find_nodes(op="placeholder")
    if len(placeholders) != len(example_inputs):
        counters["fxshard"]["prepared_cache_miss"] += 1
        return None
    program_fake_values(program, example_inputs, mode)
    counters["fxshard"]["prepared_cache_hit"] += 1
    return program


def store_prepared(key: str, program: fx.GraphModule) -> None:
    """Keep ``program`` under ``key``: its graph and the block tags Inductor's bucketing pass reads (the fake
    values are computed again on loading). Written whole or not at all: ranks may write one key at once."""
    from torch.fx._graph_pickler import GraphPickler, Options

    try:
        data = GraphPickler.dumps(program, Options(ops_filter=None, node_metadata_key_filter=lambda k: k == "custom"))
    except Exception:  # something in it does not pickle: prepared again next time
        return
    write_whole(_path(key), data)
