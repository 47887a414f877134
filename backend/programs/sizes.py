"""One compiled program per distinct set of input sizes, for graphs Dynamo made with dynamic sizes.

fxshard plans communication for concrete sizes: which rank holds which rows, whether a view
moves data and which collective is cheapest all depend on them. Dynamo compiles a graph with
symbolic sizes once a size changes (automatic dynamic shapes) or from the start
(``dynamic=True``), and serves it for every later size. ``per_size`` is what the backend calls: a
graph with static sizes gets its one program, plus a Dynamo guard on its DTensor inputs' global
shapes (``guard_global_shapes``); a graph with dynamic sizes gets a ``PerSizePrograms``, which
finds the program compiled for the sizes of each call and compiles one (all six stages) for sizes
it has not seen. So a data-parallel loop whose last batch is short compiles two or three
programs, and no program ever runs on sizes it was not planned for. Where only dims no layout
shards grow (a dynamic KV cache's length), two or three such programs show the plan does not
depend on them, and one program compiled for symbolic sizes serves the later sizes
(``size_generic.py``).
"""
from __future__ import annotations

import logging
import warnings
from typing import Any, Callable, Hashable, Sequence

import torch
import torch.fx as fx

from fxshard.backend.options import in_force
from fxshard.backend.capture.dynamo_calls import dynamic_by_default, guard_global_shapes

log = logging.getLogger("fxshard")


def per_size(gm: fx.GraphModule, example_inputs: Sequence[Any], compile_for: Callable[[Sequence[Any]], Callable],
             graph_id: str) -> Callable:
    """``compile_for(example_inputs)`` for a graph of static sizes (guarded on its DTensors' global
    shapes); else a ``PerSizePrograms``."""
    if not _has_dynamic_sizes(gm, example_inputs):
        guard_global_shapes(gm)
        return compile_for(example_inputs)
    if dynamic_by_default():
        warnings.warn(
            "torch.compile(..., dynamic=True) with backend='fxshard': fxshard plans communication for concrete "
            "sizes, so it compiles one program per distinct set of input sizes it is called with (checked at each "
            "call, never reused for other sizes). Leave dynamic unset to silence this.", stacklevel=3)
    from fxshard.backend.programs.size_generic import affine_sizes_only

    return PerSizePrograms(example_inputs, compile_for, graph_id, affine_sizes=affine_sizes_only(gm))


class PerSizePrograms:
    """Calls the program compiled for the sizes of its arguments, compiling one per new set of sizes."""

    def __init__(self, example_inputs: Sequence[Any], compile_for: Callable[[Sequence[Any]], Callable],
                 graph_id: str, affine_sizes: bool = False):
        self.compile_for = compile_for
        self.graph_id = graph_id
        self.programs: dict[Hashable, Callable] = {}
        # one program for the sizes that grow where two programs show the plan does not depend on them
        # (backend/programs/size_generic.py); ``affine_sizes``: Dynamo's graph computes sizes by sums and products only
        self.affine_sizes = affine_sizes
        self.generic: Any = None  # a SizeGenericProgram, once two programs allow one
        self._recent: list[tuple[Hashable, Callable]] = []  # the last three (sizes, program) compiled
        concrete = _concrete(example_inputs)
        if concrete is not None:  # compile now, as Dynamo expects of a backend; else at the first call
            self._compile(sizes_key(concrete), concrete)

    def __call__(self, *args: Any) -> Any:
        key = sizes_key(args)
        program = self.programs.get(key)
        if self.generic is not None and not getattr(program, "compiled", program is not None) and \
                self.generic.accepts(key):
            outs = self.generic(key, args)
            if outs is not None:
                return outs
        if program is None:
            program = self._compile(key, args)
        return program(*args)

    def _compile(self, key: Hashable, inputs: Sequence[Any]) -> Callable:
        if self.programs:
            log.info("fxshard graph %s: new input sizes %s, compiling program %d for them",
                     self.graph_id, _sizes_text(key), len(self.programs) + 1)
        many = in_force().many_sizes  # past this many programs for one graph, tell the user (options.py)
        if len(self.programs) == many:
            warnings.warn(
                f"fxshard has compiled {many} programs for one graph, one per distinct set of input sizes, and "
                "compiles again for each new one. Pad inputs to a few fixed sizes (e.g. drop_last=True or padding in "
                "the DataLoader) to compile less.", stacklevel=3)
        program = self.programs[key] = self.compile_for(inputs)
        self._recent = [*self._recent[-2:], (key, program)]
        if self.generic is None and self.affine_sizes:
            from fxshard.backend.programs.size_generic import generalize

            # while the programs may yet prove one serves every size, Inductor waits for a size's second call
            if hasattr(program, "uncompiled_calls"):
                program.uncompiled_calls = 1
            self.generic = generalize(self._recent, self.affine_sizes)
            if self.generic is not None:
                log.info("fxshard graph %s: the programs for sizes %s and %s differ only in the sizes of unsharded "
                         "dims: one program compiled for symbolic sizes serves every later size on their line",
                         self.graph_id, _sizes_text(self._recent[-2][0]), _sizes_text(key))
        return program


def sizes_key(args: Sequence[Any]) -> tuple:
    """What a program is specialized on: each tensor's global shape and strides, each number's value."""
    key = []
    for a in args:
        if isinstance(a, torch.Tensor):
            key.append((tuple(a.shape), tuple(a.stride())))
        elif isinstance(a, (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool)):
            key.append(a)
        else:
            key.append(None)  # a mesh, a process group: Dynamo guards those itself
    return tuple(key)


def _has_dynamic_sizes(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> bool:
    from torch.fx.experimental.symbolic_shapes import has_free_symbols

    if any(isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)) for x in example_inputs):
        return True
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        value = node.meta.get("example_value")
        if isinstance(value, torch.Tensor) and (has_free_symbols(value.shape) or has_free_symbols(value.stride())):
            return True
    return False


def _concrete(example_inputs: Sequence[Any]) -> list[Any] | None:
    """The example inputs with symbolic numbers replaced by their hints; None if one has no hint."""
    out = []
    for x in example_inputs:
        if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            hint = x.node.hint
            if hint is None:
                return None
            x = type(hint)(hint)
        elif isinstance(x, torch.Tensor):
            from torch.fx.experimental.symbolic_shapes import has_free_symbols

            if has_free_symbols(x.shape):
                return None
        out.append(x)
    return out


def _sizes_text(key: tuple) -> str:
    return ", ".join(str(list(k[0])) if isinstance(k, tuple) else str(k) for k in key if k is not None)
