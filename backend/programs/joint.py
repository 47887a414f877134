"""Training: plan the joint forward+backward graph, then split it into a forward and a backward.

Propagating over the joint graph lets the backward choose its own strategies (a column-parallel
matmul's input gradient is Partial and is all-reduced; an FSDP weight's gradient is Partial on
the data axis and is reduce-scattered into the parameter's layout), while the forward and the
backward agree on every value they share: the saved activations cross the split in the layout
the plan gave them.

Splitting: the forward computes what the outputs need and returns the outputs plus the values
the backward reads ("saved"). A redistribution that grows a value (an all_gather of an FSDP
weight or a sequence-parallel activation), and views of its result, are recomputed in the
backward instead of saved: no rank keeps a gathered copy of a value the plan shards between
the two passes, except what the policy keeps (``fxshard.policies.TrainingSplit``: tiny
parameters, and the parameter the backward needs first, which it would hold at that moment
anyway). Views of parameters are recomputed too (free), and what a ``torch.utils.checkpoint`` region
computed, but random draws (SDPA without dropout recomputes exactly). All other values the backward
reads are saved as the forward left them; a multi-output op's (SDPA's ``(out, logsumexp)``) as its
outputs, each a tensor, never as its tuple.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor

from fxshard.costs import CostModel
from fxshard.graph import CHECKPOINTED, LAYOUT, SRC_LAYOUT, copy_node, graph_module, output_layouts, outputs
from fxshard.layout import Layout, LayoutError
from fxshard.mesh import MeshSpec
from fxshard.ops import REDISTRIBUTE
from fxshard.pipeline import shard_graph
from fxshard.policies import DEFAULT_TRAINING_SPLIT, TrainingSplit
from fxshard.rebuild import replayable
from fxshard.registry import CHEAP_FOLLOWERS, RELABELS
from fxshard.timing import stage

from fxshard.layer_names import ROOT, block_of
from fxshard.backend.capture.inputs import dtensor_layout
from fxshard.backend.capture.trace import JointSignature, TangentMismatch, TracedProgram, trace_global

aten = torch.ops.aten



@dataclass
class TrainingPlan:
    """The planned global forward and backward graphs of one training program."""

    forward: fx.GraphModule  # primals -> (*outputs, *saved)
    backward: fx.GraphModule  # (*saved, *tangents) -> gradients of grad_inputs
    joint: fx.GraphModule | None  # the planned joint graph both were cut from (None: unfolded, backend/programs/fold.py)
    program: TracedProgram  # the joint trace (names, positions, input layouts)
    num_outputs: int
    grad_inputs: tuple[int, ...]  # which primals get a gradient, in the backward's output order
    output_layouts: tuple[Layout, ...]  # of the forward outputs (= the tangents' layouts)
    grad_layouts: tuple[Layout, ...]  # of the gradients (= their primals' layouts)

    @property
    def num_saved(self) -> int:
        return len(outputs(self.forward)) - self.num_outputs


def plan_training(gm: fx.GraphModule, example_inputs: Sequence[Any], mesh: MeshSpec | None = None,
                  layouts: Mapping[int, Layout] | None = None, names: Sequence[str] | None = None,
                  strict: bool = False, cost_model: CostModel | None = None,
                  split: TrainingSplit = DEFAULT_TRAINING_SPLIT) -> TrainingPlan:
    """Stages 1-3 for training: trace the joint graph in global shapes, plan it, split it (``split``
    says which gathered values the forward keeps for the backward)."""
    program, out_layouts = _joint_program(gm, example_inputs, mesh, layouts, names, strict, cost_model)
    signature = program.joint
    assert signature is not None
    for name, layout in zip(signature.tangent_names, out_layouts):
        program.input_layouts[name] = layout
    grad_layouts = tuple(program.input_layouts[program.input_names[k]] for k in signature.grad_inputs)
    joint = shard_graph(program.gm, program.mesh, program.input_layouts, strict=strict, cost_model=cost_model,
                        output_layouts=list(out_layouts) + list(grad_layouts),
                        output_names=[None] * len(out_layouts) + [program.input_names[k] for k in signature.grad_inputs])
    with stage("split"):
        forward, backward = partition(joint, signature, split)
    return TrainingPlan(forward, backward, joint, program, signature.num_forward_outputs, signature.grad_inputs,
                        out_layouts, grad_layouts)


def _joint_program(gm: fx.GraphModule, example_inputs: Sequence[Any], mesh: MeshSpec | None,
                   layouts: Mapping[int, Layout] | None, names: Sequence[str] | None, strict: bool,
                   cost_model: CostModel | None) -> tuple[TracedProgram, tuple[Layout, ...]]:
    """The joint trace, and the layouts of its tangents: each forward output's, reduced (the tangent
    of a Partial output would be Replicate, not Partial).

    A program that returns scalars only (a loss) is traced once: a scalar is Replicate or Partial,
    so its tangent is replicated whatever the plan, and its shape and dtype are Dynamo's example
    value's (the trace checks them, and says when they differ). So is a program that returns
    DTensors only (logits): each leaves in the placements Dynamo's example value has, which are
    what eager DTensor returns (reduced where Partial, as its tangent is). Other programs are first
    traced and planned forward-only, to learn the layouts their outputs leave in.
    """
    examples = [n.meta.get("example_value") if isinstance(n, fx.Node) else None for n in outputs(gm)]
    scalars = bool(examples) and all(isinstance(e, torch.Tensor) and e.dim() == 0 for e in examples)
    if scalars or (examples and all(isinstance(e, DTensor) for e in examples)):
        try:
            with stage("trace"):
                program = trace_global(gm, example_inputs, mesh=mesh, layouts=layouts, names=names, tangents=examples)
            if scalars:
                return program, tuple(Layout.replicated(program.mesh, ()) for _ in examples)
            return program, tuple(dtensor_layout(e, program.mesh).with_partial(()) for e in examples)
        except (TangentMismatch, LayoutError):
            pass  # an output is not what Dynamo's example value says (a to_local() region), or is a DTensor of
            # another mesh than the program's: plan the forward to learn its layouts
    with stage("trace"):
        forward_only = trace_global(gm, example_inputs, mesh=mesh, layouts=layouts, names=names)
    planned_forward = shard_graph(forward_only.gm, forward_only.mesh, forward_only.input_layouts, strict=strict,
                                  cost_model=cost_model)
    out_layouts = tuple(l.with_partial(()) for l in output_layouts(planned_forward))
    values = [n.meta["val"] for n in outputs(planned_forward)]
    with stage("trace"):
        program = trace_global(gm, example_inputs, mesh=mesh, layouts=layouts, names=names, tangents=values)
    return program, out_layouts


def _ancestors(roots: Sequence[fx.Node]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = [r for r in roots if isinstance(r, fx.Node)]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return seen


def _local_numel(layout: Layout) -> int:
    return math.prod(int(s) for s in layout.max_local_shape())


def grows(node: fx.Node) -> bool:
    """A planned redistribution whose result is larger per rank than its input (it gathers)."""
    if node.target is not REDISTRIBUTE:
        return False
    return _local_numel(node.meta[LAYOUT]) > _local_numel(node.meta[SRC_LAYOUT])


def _local_bytes(node: fx.Node) -> int:
    return _local_numel(node.meta[LAYOUT]) * node.meta["val"].element_size()


def _is_cast(node: fx.Node) -> bool:
    """A dtype cast (a mixed-precision parameter cast for compute, ``fxshard.MixedPrecision``)."""
    return node.target is aten._to_copy.default and set(node.kwargs) <= {"dtype"}


def input_root(node: fx.Node) -> fx.Node | None:
    """The placeholder ``node`` is a relabelling or a dtype cast of (a parameter's bf16 copy gathers as the
    parameter: FSDP gathers it again in the backward), or None."""
    while node.op == "call_function" and (node.target in RELABELS or _is_cast(node)) and \
            isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node if node.op == "placeholder" else None


def small_gathers(gm: fx.GraphModule, forward: set[fx.Node], keep_below_fraction: int) -> set[fx.Node]:
    """Gathers of parameters (and views of them) so small that the backward reuses them: more than
    ``keep_below_fraction`` times smaller than the largest (a norm's weight beside the matrices),
    a re-gather would cost a collective's latency to save a few KiB. Activations are never kept."""
    gathers = [n for n in gm.graph.nodes if n in forward and grows(n) and input_root(n.args[0]) is not None]
    small = max((_local_bytes(n) for n in gathers), default=0) // keep_below_fraction
    return {n for n in gathers if _local_bytes(n) <= small}


def _transposes_from_root(node: fx.Node) -> int | None:
    """How many 2-D transposes lead from a placeholder to ``node`` (None: other ops too)."""
    count = 0
    while node.op == "call_function":
        if node.target is aten.t.default or (node.target is aten.transpose.int and len(node.meta["val"].shape) == 2):
            count += 1
            node = node.args[0]
        elif _is_cast(node):
            node = node.args[0]
        else:
            return None
    return count if node.op == "placeholder" else None


def reuse_first_gather(gm: fx.GraphModule, forward: set[fx.Node]) -> set[fx.Node]:
    """The backward's first gather of a root parameter the forward gathered too reuses the forward's.

    The backward would gather it again at once, while every saved activation is still alive,
    so keeping it raises no peak: FSDP2 leaves its root module (the output projection) unsharded
    after forward for the same reason. Only a parameter outside the repeated layers (``block_of``:
    the root): a layer's kept gather (the last layer's, where the plan leaves the output projection
    sharded) is one more output of that layer's program, which then differs from the others' and
    costs Inductor a compile each way (backend/layers/regions.py). Rewrites the joint graph; returns the
    forward gathers kept.
    """
    def parity(n: fx.Node) -> int | None:
        count = _transposes_from_root(n.args[0])
        return None if count is None else count % 2

    def held_as(f: fx.Node, odd: int) -> Layout:
        layout = f.meta[LAYOUT]
        return Layout(layout.mesh, layout.shape[::-1], layout.dims[::-1], layout.partial) if odd else layout

    gathers = [n for n in gm.graph.nodes if grows(n) and parity(n) is not None
               and block_of(input_root(n.args[0]).name) == ROOT]
    pairs = [(b, f) for b in gathers if b not in forward for f in gathers if f in forward
             and input_root(f.args[0]) is input_root(b.args[0]) and not b.meta[LAYOUT].partial
             and held_as(f, (parity(b) - parity(f)) % 2) == b.meta[LAYOUT]]
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    # a gather both passes read (stage 3 moved the parameter, not its transposes): no rewrite needed
    shared = [(use, f) for f in gathers if f in forward
              for use in [_first_backward_use(f, forward, order)] if use is not None]
    if not pairs and not shared:
        return set()
    b, f = min(pairs + shared, key=lambda bf: order[bf[0]])
    if b not in gathers:
        return {f}
    odd = (parity(b) - parity(f)) % 2
    replacement = f
    if odd:
        with gm.graph.inserting_after(b):
            replacement = gm.graph.call_function(aten.t.default, (f,))
        replacement.meta.update({"val": b.meta["val"], LAYOUT: b.meta[LAYOUT]})
    b.replace_all_uses_with(replacement)
    gm.graph.erase_node(b)
    return {f}


def _first_backward_use(node: fx.Node, forward: set[fx.Node], order: Mapping[fx.Node, int]) -> fx.Node | None:
    """The first backward node that reads ``node``, directly or through relabellings (None: none does)."""
    uses = [u for u in node.users if u not in forward]
    uses += [v for u in node.users if u in forward and u.target in RELABELS
             for v in [_first_backward_use(u, forward, order)] if v is not None]
    return min(uses, key=order.__getitem__, default=None)


def recomputed(gm: fx.GraphModule, forward: set[fx.Node], split: TrainingSplit) -> set[fx.Node]:
    """Forward nodes the backward recomputes rather than saves: gathers (but those ``split`` keeps:
    small parameters, the root's first, and activations with ``keep_gathered_activations``),
    views of them, views of the primals, and what a ``torch.utils.checkpoint`` region computed
    (but random draws, which would differ). Rewrites ``gm`` (see ``reuse_first_gather``)."""
    keep = small_gathers(gm, forward, split.keep_below_fraction)
    if split.keep_first_backward_gather:
        keep |= reuse_first_gather(gm, forward)
    out: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node not in forward or node.op != "call_function":
            continue
        source = node.args[0] if node.args else None
        if node.target is operator.getitem:
            # an output of a multi-output op (SDPA's (out, logsumexp)) is recomputed with its op or saved
            # itself: the backward never reads the op's tuple from the forward
            if source in out:
                out.add(node)
            continue
        regathered = grows(node) and node not in keep and \
            (input_root(source) is not None or not split.keep_gathered_activations)
        if regathered or (node.target in CHEAP_FOLLOWERS and source in out) or \
                ((node.target in RELABELS or _is_cast(node)) and isinstance(source, fx.Node)
                 and source.op == "placeholder") or \
                _checkpointed(node):
            out.add(node)
    return out


def _saved(grads: Sequence[fx.Node], forward: set[fx.Node], recompute: set[fx.Node]) -> tuple[list[fx.Node], set[fx.Node]]:
    """(the forward values the backward reads, the backward's nodes): the gradients' ancestors, cut
    at forward values that are not recomputed."""
    saved: dict[fx.Node, None] = {}
    in_backward: set[fx.Node] = set()
    stack = list(grads)
    while stack:
        n = stack.pop()
        if n in in_backward or n in saved:
            continue
        if n in forward and n not in recompute:
            saved[n] = None
            continue
        in_backward.add(n)
        stack.extend(n.all_input_nodes)
    return list(saved), in_backward


_REBUILD_DEPTH = 8  # the longest chain of pointwise ops and views the backward replays for one saved value


def _rebuilds_freely(node: fx.Node) -> bool:
    """A pointwise op or a view: the backward replays it from its inputs for nothing but a fused read
    (no collective, no random draw, no reduction)."""
    return node.target is not REDISTRIBUTE and CHECKPOINTED not in node.meta and replayable(node)


def rebuilt_pointwise(saved: Sequence[fx.Node], in_backward: set[fx.Node]) -> set[fx.Node]:
    """Saved values the backward can rebuild from values it holds anyway (other saved values, the
    primals, its own nodes) by pointwise ops and views alone, with the forward nodes on the way.

    Rebuilding one holds its bytes no more between the passes and adds none: it reads only what is
    kept anyway. A normalization's output, from its kept input and statistics; SwiGLU's product, from
    its two kept projections. AOTAutograd's min-cut partitioner recomputes such chains too; without
    it a layer held ~5 hidden-sized tensors more than DTensor + Inductor (bench/results/gpu.md)."""
    kept = set(saved)

    def rebuildable(n: fx.Node, candidate: fx.Node, depth: int, chain: set[fx.Node]) -> bool:
        if n is not candidate and (n.op == "placeholder" or n in kept or n in in_backward):
            return True
        if depth >= _REBUILD_DEPTH or not _rebuilds_freely(n):
            return False
        if all(rebuildable(a, candidate, depth + 1, chain) for a in n.all_input_nodes):
            chain.add(n)
            return True
        return False

    rebuilt: set[fx.Node] = set()
    for node in reversed(list(saved)):
        if node.op == "placeholder":
            continue
        chain: set[fx.Node] = set()
        if rebuildable(node, node, 0, chain):
            kept.discard(node)
            rebuilt |= chain
    return rebuilt


def _checkpointed(node: fx.Node) -> bool:
    """Whether ``node`` ran in a checkpointed region and recomputing it gives the same value."""
    return CHECKPOINTED in node.meta and not draws_random(node)


_PROBABILITIES = ("dropout_p", "p")  # a seeded op's chance of a draw mattering: at 0 the op draws nothing


def draws_random(node: fx.Node) -> bool:
    """Whether ``node`` draws random numbers: a seeded op, unless its dropout probability is 0 (SDPA's
    ``dropout_p=0.0``, as a model in eval or without attention dropout calls it), which recomputes exactly."""
    target = node.target
    if torch.Tag.nondeterministic_seeded not in getattr(target, "tags", ()):
        return False
    schema = getattr(target, "_schema", None)
    for k, arg in enumerate(schema.arguments if schema is not None else ()):
        if arg.name in _PROBABILITIES:
            value = node.args[k] if k < len(node.args) else node.kwargs.get(arg.name, arg.default_value)
            return value != 0
    return True


def _check_saved(saved: Sequence[fx.Node]) -> None:
    """A value crossing to the backward is one value: a multi-output op's tuple would reach stage 4 as a
    program input without a layout (``recomputed`` keeps its outputs with it)."""
    for n in saved:
        if isinstance(n.meta.get("val"), (tuple, list)):
            raise RuntimeError(f"fxshard's training split would save {n.format_node()}, a multi-output op, whole: "
                               "this is a bug in backend/programs/joint.py (recomputed); please report it with the program")


def partition(joint: fx.GraphModule, signature: JointSignature,
              split: TrainingSplit = DEFAULT_TRAINING_SPLIT) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Cut a planned joint graph into forward (primals -> outputs + saved) and backward
    (saved + tangents -> gradients)."""
    nodes = list(joint.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    num_tangents = len(signature.tangent_names)
    primals, tangents = placeholders[:len(placeholders) - num_tangents], placeholders[len(placeholders) - num_tangents:]
    outs = outputs(joint)
    forward_outs, grads = outs[:signature.num_forward_outputs], outs[signature.num_forward_outputs:]
    forward = _ancestors(forward_outs) | set(primals)
    # every output of a multi-output forward op is the forward's (the backward reads logsumexp, say)
    forward |= {n for n in nodes if n.target is operator.getitem and n.args[0] in forward}
    recompute = recomputed(joint, forward, split)
    nodes = list(joint.graph.nodes)  # recomputed() may have rewritten a backward gather
    saved, in_backward = _saved(grads, forward, recompute)
    if split.recompute_pointwise:
        rebuilt = rebuilt_pointwise(saved, in_backward)
        if rebuilt:
            saved, in_backward = _saved(grads, forward, recompute | rebuilt)
    order = {n: i for i, n in enumerate(nodes)}
    saved.sort(key=order.__getitem__)
    _check_saved(saved)

    fwd_graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in nodes:
        if n in forward:
            env[n] = copy_node(fwd_graph, n, env.__getitem__)
    fwd_graph.output(tuple(env[n] for n in list(forward_outs) + saved))

    bwd_graph = fx.Graph()
    benv: dict[fx.Node, fx.Node] = {}
    for n in saved:
        p = bwd_graph.placeholder(f"saved_{n.name}")
        p.meta.update({k: v for k, v in n.meta.items() if k in ("val", LAYOUT, "tensor_meta")})
        benv[n] = p
    for t in tangents:
        benv[t] = copy_node(bwd_graph, t)
    for n in nodes:
        if n in in_backward and n.op != "placeholder":
            benv[n] = copy_node(bwd_graph, n, benv.__getitem__)
    bwd_graph.output(tuple(benv[g] for g in grads))
    return graph_module(joint, fwd_graph), graph_module(joint, bwd_graph)
