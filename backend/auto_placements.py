"""``fxshard.auto_placements``: give a mesh and a memory budget per rank, get the placements of a program's
parameters and arguments that make its step cheapest (``fxshard/placement_search.py`` searches).

The function is captured once (its repeated blocks as regions), folded to four layers where it has more
(``programs/fold.py``: a role decided once for every layer, so the search costs the same at any depth), and
traced once; every candidate is a plan of that trace (stages 2-3), priced as ``explain`` would show it. The
answer is an ``AutoPlacements``: a plain ``{parameter name or argument index: placements}`` dict that every
door takes back as ``placements=`` (``explain``, ``simulate``, ``simulate_plan``; ``distribute`` makes a
module's parameters DTensors for ``torch.compile`` and ``fxshard.compile``), with why each was chosen. The
backend's ``options={"placements": "auto", "memory_budget": ..., "mesh": device_mesh}`` runs the same search
on Dynamo's graph (``plan_backend_inputs``).
"""
from __future__ import annotations

import collections
import copy
import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor

from fxshard.costs import CostModel
from fxshard.graph import code_on_demand, outputs
from fxshard.layer_names import any_layer
from fxshard.layout import Layout
from fxshard.mesh import MeshSpec
from fxshard.pipeline import propagate_graph, shard_graph
from fxshard.fused_projections import fused_factors
from fxshard.placement_search import Priced, Role, SearchResult, search_placements
from fxshard.placements import as_mesh_spec, placements_from_layout, placements_to_str
from fxshard.policies import QUICK_REFINEMENT
from fxshard.propagate import Decisions
from fxshard.routing import ROUTED_OPS, stack_sources

from fxshard.backend.capture.capture import capture
from fxshard.backend.capture.inputs import input_layouts, modules_of, named_inputs
from fxshard.backend.capture.trace import TracedProgram, trace_global
from fxshard.backend.inductor.collector import collector_paused
from fxshard.backend.layers.block_regions import captured_with_regions, repeated_blocks
from fxshard.backend.options import in_force
from fxshard.backend.programs.fold import shorten
from fxshard.backend.reports.flops import flops_by_node

__all__ = ["AutoPlacements", "auto_placements"]


class AutoPlacements(dict):
    """``{parameter name or argument index: placements}``, as ``placements=`` takes it, and why.

    ``reasons``: the same keys, each with what decided its placement (pinned, or the alternatives
    tried against the final plan: which cost more, which would not fit the budget); ``priced``: the
    plan's modeled step cost, bytes per rank and memory per rank; ``report()`` says all of it by role."""

    def __init__(self, placements: Mapping[Any, Any], reasons: Mapping[Any, str], result: SearchResult,
                 roles: Mapping[str, list[Any]]):
        super().__init__(placements)
        self.reasons = dict(reasons)
        self.result = result
        self.roles = dict(roles)  # role name -> the keys it decided

    @property
    def priced(self) -> Priced:
        return self.result.priced

    @property
    def evaluations(self) -> int:
        """How many plans the search priced."""
        return self.result.evaluations

    def report(self) -> str:
        p, budget = self.priced, self.result.budget
        lines = []
        for name, decision in self.result.decisions.items():
            count = decision.role.count
            lines.append(f"{name}: {placements_to_str(placements_from_layout(self.result.layouts[name]))}  "
                         f"({count} tensor{'s' * (count != 1)}): {decision.reason(self.result.quick, budget)}")
        lines.append(f"modeled step: {p.cost * 1e6:.1f} us ({p.communication * 1e6:.1f} us communication and "
                     f"copies, {p.compute * 1e6:.1f} us compute), {p.collectives} collectives, "
                     f"{p.bytes_per_rank} B/rank received")
        asked = self.result.memory_budget
        of_budget = f"of the budget {int(asked)}" if math.isfinite(asked) else "(no budget)"
        state = " and their training state" if self.result.training else ""
        lines.append(f"memory per rank: {p.memory} B {of_budget} (parameters{state} {p.parameter_memory} B, peak "
                     f"activations {p.activation_memory} B); {self.evaluations} plans priced")
        return "\n".join(lines)

    def distribute(self, module: torch.nn.Module, device_mesh: Any) -> torch.nn.Module:
        """``module`` with each of its parameters named here made a DTensor of these placements on
        ``device_mesh`` (in place: ``distribute_tensor`` of its value, ``requires_grad`` kept), for
        ``torch.compile(module, backend="fxshard")`` or ``fxshard.compile``. Returns ``module``."""
        from torch.distributed.tensor import distribute_tensor

        for name, placements in self.items():
            if not isinstance(name, str):
                continue
            owner_name, _, leaf = name.rpartition(".")
            owner = module.get_submodule(owner_name)
            value = getattr(owner, leaf)
            if isinstance(value, DTensor):
                continue
            shared = distribute_tensor(value.detach(), device_mesh, placements)
            if isinstance(value, torch.nn.Parameter):
                owner.register_parameter(leaf, torch.nn.Parameter(shared, requires_grad=value.requires_grad))
            else:
                owner.register_buffer(leaf, shared)
        return module


def auto_placements(fn: Callable, *args: Any, mesh: Any, memory_budget: float, training: bool = False,
                    placements: Mapping[Any, Any] | None = None, cost_model: CostModel | None = None,
                    optimizer_states: int = 2) -> AutoPlacements:
    """The placements of ``fn``'s parameters and tensor arguments that minimize its modeled step cost (the
    cost model's communication plus each rank's compute) with at most ``memory_budget`` bytes per rank
    (parameters, and when ``training`` their gradients and ``optimizer_states`` tensors each (Adam: 2), plus
    peak activations). ``mesh``: a MeshSpec, DeviceMesh or {axis: size}; ``placements``: what is already
    decided (argument index or parameter name -> placements, as every door takes them), kept; DTensor
    parameters and arguments keep theirs. ``training``: ``fn`` returns its loss (a scalar), and the step is its
    forward and backward. A ValueError says when nothing fits the budget, and the least memory found."""
    spec = as_mesh_spec(mesh)
    _check_budget(memory_budget)
    held = modules_of(fn)
    module = held[0] if len(held) == 1 else None
    blocks = repeated_blocks(module) if module is not None else []
    with collector_paused():
        captured, left_out = _captured_short(fn, args, module, blocks, placements)
    names = named_inputs(fn, args, captured.objects)
    keys = [key for _, key in names]
    layouts = input_layouts(captured.objects, spec, keys, placements)
    pinned = {pos for pos, (obj, key) in enumerate(zip(captured.objects, keys))
              if isinstance(obj, DTensor) or (key is not None and key in (placements or {}))}
    result, by_role = search_program(captured.gm, captured.example_inputs, captured.objects, keys,
                                     [n for n, _ in names], spec, layouts, pinned, memory_budget, training=training,
                                     cost_model=cost_model, optimizer_states=optimizer_states, left_out=left_out)
    return _answer(result, by_role, captured.objects, keys, left_out)


@dataclass
class LeftOut:
    """The layers a capture of four of them left out (``_four_layers``): the model's count, and their tensors."""

    layers: int
    tensors: list[tuple[str, torch.Tensor]]  # (parameter or buffer name, value)


def _captured_short(fn: Callable, args: Sequence[Any], module: torch.nn.Module | None, blocks: Sequence[Any],
                    placements: Mapping[Any, Any] | None) -> tuple[Any, LeftOut | None]:
    """``fn`` captured with its repeated layers cut to four (0, 1, L-2, L-1: what ``fold.shorten`` keeps), so
    that Dynamo's capture, which grows with the parameters it lifts and guards, costs the same at any depth;
    the whole model where it has no such layers, where ``placements`` or a DTensor names a layer left out, or
    where the cut model does not capture (its code reads how many layers there are)."""
    whole = lambda: captured_with_regions(lambda: capture(fn, args), blocks)  # noqa: E731
    cut = _four_layers(module, blocks) if module is not None else None
    if cut is None:
        return whole(), None
    container, kept, left_out = cut
    given = set(placements or {})
    if any(name in given or isinstance(t, DTensor) for name, t in left_out.tensors):
        return whole(), None
    everything = container._modules
    container._modules = kept
    try:
        return captured_with_regions(lambda: capture(fn, args), blocks), left_out
    except Exception:  # noqa: BLE001 (a model that needs all its layers to run: captured whole)
        pass
    finally:
        container._modules = everything
    return whole(), None


def _four_layers(module: torch.nn.Module, blocks: Sequence[Any]) -> tuple[torch.nn.Module, dict, LeftOut] | None:
    """The one container of ``Options.min_layers`` or more alike blocks in ``module``, its members 0, 1, L-2 and
    L-1 (under their own indices), and what the others hold; None where there is not exactly one."""
    alike = {id(b) for b in blocks}
    found = [c for c in module.modules() if isinstance(c, (torch.nn.ModuleList, torch.nn.Sequential))
             and len(c) >= in_force().min_layers and all(id(m) in alike for m in c)
             and len({type(m) for m in c}) == 1]
    if len(found) != 1:
        return None
    container = found[0]
    prefix = next(name for name, m in module.named_modules() if m is container)
    indices = list(container._modules)
    keep = {indices[0], indices[1], indices[-2], indices[-1]}
    kept = {k: m for k, m in container._modules.items() if k in keep}
    tensors = [(f"{prefix}.{k}.{name}", t) for k, m in container._modules.items() if k not in keep
               for name, t in list(m.named_parameters()) + list(m.named_buffers())]
    return container, kept, LeftOut(len(indices), tensors)


def _check_budget(memory_budget: Any) -> None:
    if not isinstance(memory_budget, (int, float)) or isinstance(memory_budget, bool) or not memory_budget > 0:
        raise ValueError(f"memory_budget={memory_budget!r}: give the bytes each rank may hold, a positive number "
                         "(e.g. 0.4 * the parameters' bytes)")


def search_program(gm: fx.GraphModule, example_inputs: Sequence[Any], objects: Sequence[Any], keys: Sequence[Any],
                   names: Sequence[str], mesh: MeshSpec, layouts: Mapping[int, Layout], pinned: set[int],
                   memory_budget: float, *, training: bool, cost_model: CostModel | None,
                   optimizer_states: int = 2,
                   left_out: LeftOut | None = None) -> tuple[SearchResult, dict[str, list[int]]]:
    """The search on a captured graph (Dynamo's): ``layouts`` by input position, ``pinned`` the positions
    not searched, ``left_out``: the layers a capture of four left out (their tensors join their roles); returns
    the result and, per role, the input positions it decided."""
    with code_on_demand(), collector_paused():
        short = shorten(gm) if in_force().fold else None
        program, out_layouts = _trace(short.gm if short is not None else gm, example_inputs, mesh, layouts, names,
                                      training)
        roles, by_role = _roles(program, objects, keys, layouts, pinned, training, left_out)
        plan = _planner(program, out_layouts, cost_model)
        flops = flops_by_node(program.gm)
        layers = short.layers if short is not None else left_out.layers if left_out is not None else 0
        joint = program.joint
        result = search_placements(
            roles, program.mesh, plan, memory_budget, flops=flops, layers=layers,
            backward_roots=joint.tangent_names if joint is not None else (),
            output_names=([None] * len(out_layouts) + [program.input_names[k] for k in joint.grad_inputs]
                          if joint is not None else ()), training=training,
            optimizer_states=optimizer_states, activation_scale=(layers / 4 if training and layers else 1.0),
            cost_model=cost_model, tied=_tied(program.gm, roles))
    if not result.priced.fits(memory_budget):
        p = result.priced
        raise ValueError(f"no placements found within memory_budget={int(memory_budget)} B per rank on {mesh}: the "
                         f"least memory found is {p.memory} B (parameters{' with gradients and optimizer state' * training}"
                         f" {p.parameter_memory} B, peak activations {p.activation_memory} B). Raise the budget, use "
                         "more ranks, or pin fewer tensors replicated" + (f" ({p.error})" if p.error else ""))
    return result, by_role


def _trace(gm: fx.GraphModule, example_inputs: Sequence[Any], mesh: MeshSpec, layouts: Mapping[int, Layout],
           names: Sequence[str], training: bool) -> tuple[TracedProgram, list[Layout]]:
    """The global trace every candidate is planned from: the forward, or (training) the joint program of a
    function that returns its loss."""
    if not training:
        return trace_global(gm, example_inputs, mesh=mesh, layouts=layouts, names=names), []
    examples = [n.meta.get("example_value") if isinstance(n, fx.Node) else None for n in outputs(gm)]
    if not examples or not all(isinstance(e, torch.Tensor) and e.dim() == 0 for e in examples):
        raise ValueError("auto_placements(training=True) prices a training step of a function that returns its loss, "
                         f"a scalar; this one returns {[tuple(e.shape) if isinstance(e, torch.Tensor) else e for e in examples]}"
                         ": pass the loss (model.loss, or lambda x, y: loss_fn(model(x), y))")
    program = trace_global(gm, example_inputs, mesh=mesh, layouts=layouts, names=names, tangents=examples)
    out_layouts = [Layout.replicated(program.mesh, ()) for _ in examples]
    assert program.joint is not None
    for name, layout in zip(program.joint.tangent_names, out_layouts):
        program.input_layouts[name] = layout
    return program, out_layouts


def _roles(program: TracedProgram, objects: Sequence[Any], keys: Sequence[Any], layouts: Mapping[int, Layout],
           pinned: set[int], training: bool, left_out: LeftOut | None = None) -> tuple[list[Role], dict[str, list[int]]]:
    """The unknowns: a parameter of every repeated layer is one role (``layers.*.wq.weight``; the layers a short
    capture left out count in it), each other tensor input its own; pinned ones are roles with their layout."""
    members: dict[tuple, list[tuple[str, int]]] = {}
    for name, pos in zip(program.input_names, program.tensor_positions):
        obj, key = objects[pos], keys[pos]
        if pos in pinned:
            group: tuple = (f"{_describe(key, name)}", "pinned")
        else:
            group = _group(key if isinstance(key, str) else _describe(key, name), obj, training)
        members.setdefault(group, []).append((name, pos))
    absent = collections.Counter(_group(name, t, training) for name, t in (left_out.tensors if left_out else ()))
    roles, by_role = [], {}
    for group, found in members.items():
        obj = objects[found[0][1]]
        role_name = group[0]
        if role_name in by_role:  # one name, two shapes (layers that differ): tell them apart
            role_name = f"{role_name} {tuple(obj.shape)}"
        pinned_layout = layouts[found[0][1]] if group[-1] == "pinned" else None
        roles.append(Role(role_name, tuple(n for n, _ in found), tuple(int(s) for s in obj.shape), obj.dtype,
                          len(found) + absent.get(group, 0), trainable=bool(training and obj.requires_grad),
                          pinned=pinned_layout, fused=fused_factors(program.gm, found[0][0])))
        by_role[role_name] = [pos for _, pos in found]
    return roles, by_role


def _tied(gm: fx.GraphModule, roles: Sequence[Role]) -> list[list[str]]:
    """The roles that move together: each routed-experts op's weight stacks."""
    role_of = {name: r.name for r in roles for name in r.inputs}
    groups = []
    for node in gm.graph.nodes:
        if node.target in ROUTED_OPS:
            names = list(dict.fromkeys(role_of[p.name] for p in stack_sources(node) if p.name in role_of))
            if len(names) > 1 and names not in groups:
                groups.append(names)
    return groups


def _group(name: str, obj: torch.Tensor, training: bool) -> tuple:
    """What a role is: the name in every layer (``layers.*.wq.weight``), shape, dtype, and whether it trains."""
    return (any_layer(name), tuple(obj.shape), obj.dtype, bool(training and obj.requires_grad))


def _describe(key: Any, name: str) -> str:
    if isinstance(key, int):
        return f"argument {key}"
    return key if key is not None else name


def _planner(program: TracedProgram, out_layouts: Sequence[Layout],
             cost_model: CostModel | None) -> Callable[[Mapping[str, Layout]], fx.GraphModule]:
    """Plans the trace with the given layouts of its inputs: ``quick``, stage 2 alone on one working copy of it,
    propagated again for every candidate (one memo of decisions for all: most of a candidate's decisions are
    its neighbour's, ``Decisions``); else stages 2-3 on a fresh copy, as every door plans."""
    base = dict(program.input_layouts)
    joint = program.joint
    memo = Decisions()
    work = copy.deepcopy(program.gm)

    def plan(layouts: Mapping[str, Layout], quick: bool) -> fx.GraphModule:
        given = {**base, **layouts}
        options: dict[str, Any] = dict(cost_model=cost_model)
        if joint is not None:
            grads = [program.input_names[k] for k in joint.grad_inputs]
            options.update(output_layouts=list(out_layouts) + [given[n] for n in grads],
                           output_names=[None] * len(out_layouts) + grads)
        if quick:
            return propagate_graph(work, program.mesh, given, refinement=QUICK_REFINEMENT, memo=memo, **options)
        return shard_graph(copy.deepcopy(program.gm), program.mesh, given, **options)
    return plan


def _answer(result: SearchResult, by_role: Mapping[str, list[int]], objects: Sequence[Any],
            keys: Sequence[Any], left_out: LeftOut | None = None) -> AutoPlacements:
    """The result by the user's keys (DTensors left out: they bring their own placements), the layers a short
    capture left out included."""
    placements: dict[Any, Any] = {}
    reasons: dict[Any, str] = {}
    roles: dict[str, list[Any]] = {}
    all_reasons = result.reasons()
    named = {any_layer(key): role for role, positions in by_role.items() for key in [keys[positions[0]]]
             if isinstance(key, str)}
    absent: dict[str, list[str]] = {}
    for name, _ in (left_out.tensors if left_out else ()):
        role = named.get(any_layer(name))
        if role is not None:
            absent.setdefault(role, []).append(name)
    for role, positions in by_role.items():
        layout = result.layouts[role]
        users = [keys[pos] for pos in positions if not isinstance(objects[pos], DTensor)]
        for key in sorted(users + absent.get(role, []), key=_natural):
            roles.setdefault(role, []).append(key)
            if key is None:
                continue
            placements[key] = placements_from_layout(layout)
            reasons[key] = all_reasons[role]
    return AutoPlacements(placements, reasons, result, roles)


def _natural(key: Any) -> tuple:
    """Argument indices first, then names with their numbers compared as numbers (``layers.2`` before ``layers.10``)."""
    if not isinstance(key, str):
        return (0, key if isinstance(key, int) else -1, ())
    return (1, 0, tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", key)))


def backend_program(gm: fx.GraphModule, inputs: Sequence[Any], options: Any, reporter: Any, training: bool) -> Any:
    """``torch.compile(module, backend="fxshard", options={"placements": "auto", "memory_budget": ..., "mesh":
    device_mesh})``: Dynamo's graph of a plain module, its inputs placed by the search and compiled as any
    other program (each call's plain inputs sliced to this rank's blocks; the module keeps its whole
    parameters, so the budget is what the compiled program holds beyond them: ``AutoPlacements.distribute``
    keeps only the shards)."""
    from fxshard.backend.capture.inputs import find_device_mesh
    from fxshard.backend.driver import compile_program

    if training:
        raise ValueError("options={'placements': 'auto'} compiles inference (no input requires grad under "
                         "torch.no_grad()); to train, place the parameters first: "
                         "fxshard.auto_placements(model.loss, x, y, mesh=mesh, memory_budget=..., training=True)"
                         ".distribute(model, mesh), then torch.compile(model, backend='fxshard')")
    if find_device_mesh(inputs, gm) is not None:
        raise ValueError("options={'placements': 'auto'} places a plain module, and this program already has "
                         "DTensors: drop the option, or pass plain tensors and parameters")
    _check_budget(options.memory_budget)
    spec = as_mesh_spec(options.mesh)
    names = [n.name for n in gm.graph.find_nodes(op="placeholder")]
    layouts = input_layouts(inputs, spec, names, None)
    with reporter.timed("choosing placements (fxshard.auto_placements)"):
        result, by_role = search_program(gm, inputs, inputs, names, names, spec, layouts, set(),
                                         options.memory_budget, training=False, cost_model=options.cost_model)
    for role, positions in by_role.items():
        for pos in positions:
            layouts[pos] = result.layouts[role]
    reporter.say("placements chosen: " + AutoPlacements({}, {}, result, {}).report().replace("\n", "; "))
    return compile_program(gm, inputs, training=False, options=options, device_mesh=options.mesh, reporter=reporter,
                           mesh=spec, layouts=layouts, names=names)
