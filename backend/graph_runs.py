"""A function Dynamo splits into several graphs, planned run by run with layouts carried across breaks.

Between two graphs Python reads the first one's outputs (an ``if``, an ``.item()``) and hands
them to the next one. ``RunPlanner`` plans each run of a graph: its arguments and parameters
laid out as the function's ``placements`` and DTensors say, and every tensor an earlier run
returned in the layout that run left it in (a sharded activation stays sharded across the
break; re-replicating it would hide the gather it costs). What else a run keeps with a value
(the simulated ranks' blocks) travels with its layout.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch

from fxshard.costs import CostModel
from fxshard.layout import Layout
from fxshard.placements import as_mesh_spec

from fxshard.backend.capture.capture import Captured
from fxshard.backend.driver import PlannedProgram, plan_program
from fxshard.backend.capture.inputs import find_device_mesh, input_layouts, modules_of, named_inputs
from fxshard.backend.reports.report import StageReporter


class RunPlanner:
    """Plans each graph run of ``fn(*args)`` in turn; ``carry`` records what a run returned."""

    def __init__(self, fn: Callable, args: Sequence[Any], *, mesh: Any = None,
                 placements: Mapping[Any, Any] | None = None, strict: bool = False,
                 cost_model: CostModel | None = None):
        self.fn, self.args = fn, args
        self.mesh = mesh  # a DeviceMesh, MeshSpec or {axis: size}; None: the first run's DTensors'
        self.placements = dict(placements or {})
        self.strict, self.cost_model = strict, cost_model
        self.keys: set[Any] = set()  # argument indices and parameter names some run had as an input
        # id(value) -> (value, layout, what the run keeps with it, the value's version then); the value
        # is held so its id stays unique
        self._carried: dict[int, tuple[Any, Layout, Any, int]] = {}

    def plan(self, captured: Captured, inputs: Sequence[Any], reporter: StageReporter | None = None) -> PlannedProgram:
        """Stages 1-3 of one run of ``captured`` on ``inputs`` (its real inputs, placeholder order)."""
        if self.mesh is None:
            self.mesh = find_device_mesh(captured.example_inputs)
            if self.mesh is None:
                raise ValueError("give mesh= (a MeshSpec, DeviceMesh or {axis: size}) unless the function's "
                                 "parameters or arguments are DTensors")
        spec = as_mesh_spec(self.mesh)
        named = named_inputs(self.fn, self.args, inputs)
        keys = [key for _, key in named]
        self.keys.update(k for k in keys if k is not None)
        given = {k: p for k, p in self.placements.items() if k in keys}
        fresh = [None if self.carried(x) is not None else x for x in inputs]
        layouts = input_layouts(fresh, spec, keys, given)
        names = []
        for pos, ((name, key), local_name) in enumerate(zip(named, captured.local_names)):
            carried = self.carried(inputs[pos])
            if carried is not None:
                layouts[pos] = carried[0]
            names.append(name if key is not None or not local_name else _unique(local_name, names))
        return plan_program(captured.gm, captured.example_inputs, training=False, mesh=spec, layouts=layouts,
                            names=names, strict=self.strict, cost_model=self.cost_model, reporter=reporter)

    def carry(self, values: Sequence[Any], layouts: Sequence[Layout], kept: Sequence[Any] | None = None) -> None:
        """A run returned ``values`` in ``layouts``; later runs that read one of them take it so."""
        for k, (value, layout) in enumerate(zip(values, layouts)):
            self._carried[id(value)] = (value, layout, kept[k] if kept is not None else None, _version(value))

    def carried(self, value: Any) -> tuple[Layout, Any] | None:
        """(layout, what its run kept) of a value an earlier run returned; None for any other value.
        What the run kept is None once Python wrote into the value (``out.index_add_(...)`` between
        graphs): the value itself is then the truth, to be cut into the layout again."""
        entry = self._carried.get(id(value))
        if entry is None or entry[0] is not value:
            return None
        return entry[1], (entry[2] if _version(value) == entry[3] else None)

    def check_placements(self) -> None:
        """After the last run: every key of ``placements`` names a tensor argument or a parameter or
        buffer of the function (one that control flow kept out of every graph is no error)."""
        known = set(self.keys) | {i for i, a in enumerate(self.args) if isinstance(a, torch.Tensor)}
        for module in modules_of(self.fn):
            known |= {name for name, _ in list(module.named_parameters()) + list(module.named_buffers())}
        unknown = [k for k in self.placements if k not in known]
        if unknown:
            raise KeyError(f"placements names {unknown}, which are not inputs of the function; "
                           f"use argument indices or parameter names: {sorted(str(k) for k in known)}")


def _unique(name: str, taken: Sequence[str]) -> str:
    out, k = name, 1
    while out in taken:
        out, k = f"{name}_{k}", k + 1
    return out


def _version(value: Any) -> int:
    """A tensor's version counter (bumped by every in-place write); -1 for what has none."""
    return getattr(value, "_version", -1)
