"""Every knob of the backend in one object: its options, ``fxshard.compile``'s, the environment's switches and the
tuned thresholds, declared and documented here, and the one place the environment is read.

A compile's ``Options`` are the ones in force (``in_force``: ``DEFAULTS`` with the environment's switches) with
the options it was given (``from_backend``: ``torch.compile(..., options={...})``, or ``fxshard.compile``'s
keyword arguments). The modules deep in stage 6 that read a threshold or a switch (folding, regions, ends, the
C++ wrapper) read ``in_force()`` rather than an instance passed down through every signature between: the
thresholds are process-wide, as the module constants they were, and a bench or a test changes one by
replacing ``DEFAULTS`` (``dataclasses.replace(options.DEFAULTS, worth_seconds=0.0)``). Whatever changes what
is planned, lowered or compiled is part of the lowered cache's key (``cache_text``). This module imports no
other module of the backend: every layer of it may read it.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from fxshard.costs import CostModel
from fxshard.policies import DEFAULT_TRAINING_SPLIT, MixedPrecision, TrainingSplit

__all__ = ["Options", "DEFAULTS", "in_force", "BACKEND_OPTIONS"]

# the switches the environment sets: field -> variable; ``0`` turns each off
_ENVIRONMENT = {"fold": "FXSHARD_FOLD", "lowered_cache": "FXSHARD_LOWERED_CACHE", "cpu_wrapper": "FXSHARD_CPU_WRAPPER"}
# what changes nothing a compile makes, only who sees it or whether it is kept: not in the cache's key
_NOT_KEYED = frozenset({"on_graph", "debug_dir", "lowered_cache", "many_sizes"})


@dataclass(frozen=True)
class Options:
    """How the backend compiles (see ``backend/__init__.py`` for the options a user gives)."""

    # the backend's options (``torch.compile(..., options={...})``) and fxshard.compile's arguments
    strict: bool = False  # an op without a sharding rule is an error, not replicated
    inductor: bool = True  # False: the lowered graph (or the plain one) runs as it is
    bucketing: bool = True  # False: each collective and its wait stay where lowering put them (compile_local.py)
    regional: bool = True  # each distinct layer compiled once, not the whole local program (layers/regions.py)
    cost_model: CostModel | None = None  # the planner's costs (None: fxshard.CostModel())
    training_split: TrainingSplit = DEFAULT_TRAINING_SPLIT  # which gathered values the forward keeps for the backward
    mixed_precision: MixedPrecision | None = None  # the dtypes parameters compute and gradients sum in
    on_graph: Callable[[str, Any], None] | None = None  # called with (stage, GraphModule) for each stage's graph
    debug_dir: str | None = None  # each stage's graph written there as text
    # "auto": a plain module's parameters and arguments placed by fxshard.auto_placements on ``mesh`` (a
    # DeviceMesh) within ``memory_budget`` bytes per rank (backend/auto_placements.py)
    placements: str | None = None
    memory_budget: float | None = None
    mesh: Any = None
    # the environment's switches (``with_environment``)
    fold: bool = True  # FXSHARD_FOLD: a training step's repeated layers planned once (programs/fold.py)
    lowered_cache: bool = True  # FXSHARD_LOWERED_CACHE: each rank's lowered programs kept on disk (lowered_cache.py)
    cpu_wrapper: bool = True  # FXSHARD_CPU_WRAPPER: CPU programs compiled with Inductor's C++ wrapper
    # the tuned thresholds
    min_layers: int = 5  # the fewest alike layers folded: four are planned, a fifth is the first folding saves
    # the fewest alike layers a program is cut into regions for (layers/regions.py): the cut adds the prologue's
    # and the epilogue's compiles, which cost what a layer's code does (bench/train.py's Llama under TP, first
    # step, one process: 2 layers 16.0 s whole against 17.4 cut, 3 layers 17.4 / 17.7 both ways, 4 layers 19.3 / 18.0)
    shared_layers: int = 3
    # what an end region's ops cost a step uncompiled beyond their cost compiled (layers/end_regions.py): an op
    # called from an FX graph ~10 us (this project's machine), a value written by one op and read by the next
    # (beyond what a fused kernel moves) at 2 GB/s; an end is compiled from 0.5 ms a step: ~1-2 s of compile pays
    # back in a few thousand steps
    op_seconds: float = 10e-6
    bytes_per_second: float = 2e9
    worth_seconds: float = 0.5e-3
    # CPU programs with fewer expected kernels keep the Python wrapper (inductor/cpu_wrapper.py): a C++-wrapped
    # program costs the compiler ~2.2 s and ~0.1 s a kernel, a Python-wrapped one ~1.1 s a kernel (this project's
    # machine, 2026-11-28: one Dynamo-compiled function of 1 / 2 / 4 / 8 kernels, first call 1.45 / 2.54 / 4.80 /
    # 9.21 s Python-wrapped, 2.28 / 2.35 / 2.51 / 2.87 s C++-wrapped, built separately; 3.09 / 3.23 / 3.37 / 3.72 s
    # built as one source). At two kernels it is about even; ``expected_kernels`` counts one kernel for ops
    # Inductor splits into two where their sizes differ (an FSDP step's epilogue backward: 2 expected, 3 made;
    # 2.1 s Python-wrapped against 1.5 C++-wrapped, 2026-11-29), and one for two runs Inductor fuses into one loop
    # nest (FSDP's forward prologue: 2 expected, 1 made)
    min_kernels: int = 2
    many_sizes: int = 8  # programs for one graph past which the user is told (programs/sizes.py; Dynamo's limit too)

    @classmethod
    def from_backend(cls, given: Mapping[str, Any] | None) -> Options:
        """The options in force with the backend's ``given`` ones (``torch.compile(..., options=...)``,
        ``fxshard.compile``'s keyword arguments); a ValueError names an unknown one."""
        given = dict(given or {})
        unknown = set(given) - BACKEND_OPTIONS
        if unknown:
            raise ValueError(f"unknown fxshard options {sorted(unknown)}; known: {sorted(BACKEND_OPTIONS)}")
        split = given.get("training_split", DEFAULT_TRAINING_SPLIT)
        if not isinstance(split, TrainingSplit):
            raise TypeError(f"fxshard option training_split={split!r}: expected a fxshard.TrainingSplit, e.g. "
                            "fxshard.TrainingSplit(keep_gathered_activations=False)")
        policy = given.get("mixed_precision")
        if policy is not None and not isinstance(policy, MixedPrecision):
            raise TypeError(f"fxshard option mixed_precision={policy!r}: expected a fxshard.MixedPrecision, e.g. "
                            "fxshard.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)")
        if given.get("placements") not in (None, "auto"):
            raise ValueError(f"fxshard option placements={given['placements']!r}: the backend takes \"auto\" (with "
                             "memory_budget= and mesh=); give placements of your own as DTensors "
                             "(distribute_tensor, parallelize_module) or to fxshard.explain/simulate")
        if given.get("placements") == "auto" and (given.get("memory_budget") is None or given.get("mesh") is None):
            raise ValueError("fxshard option placements=\"auto\" needs memory_budget= (bytes per rank) and mesh= (the "
                             "DeviceMesh to place the module on)")
        return dataclasses.replace(in_force(), **given)

    def with_environment(self) -> Options:
        """These options with each switch the environment turns off (``FXSHARD_FOLD=0`` and the like) off: the
        one place fxshard reads the environment."""
        off = {name: False for name, variable in _ENVIRONMENT.items() if os.environ.get(variable, "1") == "0"}
        return dataclasses.replace(self, **off)

    def cache_text(self) -> str:
        """What of these options goes into a cache key: every field that changes what is planned, lowered or
        compiled, as the same text in every process (not the callbacks that watch, nor the cache's own switch)."""
        return repr(tuple((f.name, repr(getattr(self, f.name))) for f in dataclasses.fields(self)
                          if f.name not in _NOT_KEYED))


# the options ``torch.compile(..., options={...})`` takes: the backend's own, not the switches and thresholds
BACKEND_OPTIONS = frozenset({"strict", "inductor", "bucketing", "regional", "cost_model", "training_split",
                             "mixed_precision", "on_graph", "debug_dir", "placements", "memory_budget", "mesh"})

# the process-wide options: what a compile starts from, and what the modules deep in stage 6 read (``in_force``)
DEFAULTS = Options()


def in_force() -> Options:
    """The process-wide options now: ``DEFAULTS`` with the environment's switches."""
    return DEFAULTS.with_environment()
