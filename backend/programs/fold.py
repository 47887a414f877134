"""Plan and lower a model's repeated layers once: stages 1-5 on a four-layer program, its layer 1 stamped out.

A model of L identical layers (a chain of calls of one nested compile region, ``block_regions.py``) is
planned as the model of layers 0, 1, L-2 and L-1 (``shorten``: the Dynamo graph without the calls of layers
2..L-3, layer L-2 reading layer 1's outputs). Its planned forward and backward are then made L layers long
(``unfold``): layer 1's nodes are copied once per dropped layer, on that layer's parameters, each copy reading
what the one before it returns (forward) or what the one after it returns (backward), and each copy's
saved values and gradients added to the program's, when someone reads it (``unfolder``: the step runs without
the whole plan). Stages 4-6 run on the four layers too (``fold_lowered.py``): this rank's lowered programs and
its regions are unfolded alike. Stages 1-5 then cost four layers and a copy per other layer; the program is
the one planning the whole model gives wherever the planner gives every middle layer the same plan, which
``unfold`` checks: layers 1 and L-2 of the short program must be the same program (code, layouts) reading their
inputs from corresponding places, else it returns None, says why on the ``fxshard`` logger, and the whole model
is planned (the decision reads the global plan only, so every rank takes the same path). ``tests/test_fold.py``
compares folded steps with whole ones.
"""
from __future__ import annotations

import functools
import logging
import operator
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from fxshard.graph import (ARG_LAYOUTS, LAYOUT, copy_node, copy_nodes, eliminate_dead_code, graph_module, new_node,
                           outputs)
from fxshard.layer_names import common_layer, layer_of_inputs, renumbered
from fxshard.timing import stage

from fxshard.backend.options import in_force
from fxshard.backend.programs.joint import TrainingPlan
from fxshard.backend.programs.same_values import alike_inputs, same_value
from fxshard.backend.layers.regional_program import Region, program_structure
from fxshard.backend.layers.regions import backward_regions, forward_regions, saved_regions, split_regions

__all__ = ["Shortened", "shorten", "unfold", "unfolder", "STAMP"]

STAMP = "fxshard_stamp"  # node.meta of an unfolded program's copy of the template's node: the layer it is for
log = logging.getLogger("fxshard")  # TORCH_LOGS="fxshard" shows it, as the other stages' lines
_invoke_subgraph = torch.ops.higher_order.invoke_subgraph


@dataclass
class Shortened:
    """A Dynamo graph without its middle layers' calls, and which layers it dropped."""

    gm: fx.GraphModule
    layers: int  # how many the model has
    template: int  # the layer whose plan is stamped out (1, the second call's)
    successor: int  # the kept layer that follows the dropped ones (L-2, the last call but one's), planned alike


def shorten(gm: fx.GraphModule) -> Shortened | None:
    """``gm`` without the calls of layers 2..L-3 of its chain of region calls (layer L-2 reading what layer 1
    returns), or None where it has no such chain of ``Options.min_layers`` or more. A chain: calls of one region, each
    reading the one before's outputs at the same operands (the residual stream), the same shared values at the
    same operands (rotary tables), and placeholders of its own elsewhere (its parameters); the outputs of a call
    read by the next call only."""
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is _invoke_subgraph]
    if not calls:
        return None  # no repeated blocks (fxshard.compile of a module without, or torch.compile's capture)
    fewest = in_force().min_layers  # four are planned: a fifth is the first that folding saves (options.py)
    if len(calls) < fewest or len({c.args[1] for c in calls}) != 1:
        return _refused(f"{len(calls)} calls of {len({c.args[1] for c in calls})} regions, not {fewest} or "
                        "more of one")
    chained = _chain_operands(calls)
    if chained is None:
        return None  # _chain_operands says why
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    graph.output(copy_nodes(graph, gm.graph, env))
    copies = [env[c] for c in calls]
    dropped, successor = copies[2:-2], copies[-2]
    for position, k in chained.items():  # layer L-2 reads layer 1's outputs
        successor.update_arg(2 + position, _output(copies[1], k))
    for call in reversed(dropped):
        if call._erased:  # the next call's erasure took it: only that call read it
            continue
        readers = list(call.users)
        for r in readers:
            graph.erase_node(r)
        inputs = [a for a in call.all_input_nodes if a.op != "placeholder"]
        graph.erase_node(call)
        _erase_unread(inputs)
    short = graph_module(gm, graph)
    short.meta.update(gm.meta)
    for attr in ("compile_subgraph_reason",):
        if hasattr(gm, attr):
            setattr(short, attr, getattr(gm, attr))
    template, successor = _layer_of(calls[1]), _layer_of(calls[-2])
    if template is None or successor is None or successor - template != len(calls) - 3:
        return _refused("the calls' parameters do not say which layers they are")
    return Shortened(short, len(calls), template, successor)


def _layer_of(call: fx.Node) -> int | None:
    """The layer a call is of: the index in its parameters' names (``layers_7_...``), one for all; None else.
    Not always its position among the calls: Dynamo may trace a model's first layer inline."""
    return common_layer(a.name for a in call.args[2:] if isinstance(a, fx.Node) and a.op == "placeholder")


def _erase_unread(nodes: Sequence[fx.Node]) -> None:
    """Each of ``nodes`` no one reads any more, and so on up its inputs (placeholders stay: the dropped layers'
    parameters remain the program's inputs)."""
    stack = list(nodes)
    while stack:
        node = stack.pop()
        if node.op != "placeholder" and not node.users and not node._erased:
            stack += node.all_input_nodes
            node.graph.erase_node(node)


def _chain_operands(calls: Sequence[fx.Node]) -> dict[int, int] | None:
    """Operand position -> the previous call's output index, for the operands by which each call reads the
    one before; None where the calls do not form a chain."""
    def from_previous(a: Any, previous: fx.Node) -> int | None:
        if isinstance(a, fx.Node) and a.target is operator.getitem and a.args[0] is previous:
            return a.args[1]
        return None

    operands = [c.args[2:] for c in calls]
    if len({len(o) for o in operands}) != 1 or any(c.kwargs for c in calls):
        return _refused("the calls take different numbers of operands, or keywords")
    chained = {p: k for p, k in ((p, from_previous(a, calls[0])) for p, a in enumerate(operands[1])) if k is not None}
    if not chained:
        return _refused("no call reads the one before it")
    for i in range(1, len(calls)):
        for p, a in enumerate(operands[i]):
            if p in chained:
                if from_previous(a, calls[i - 1]) != chained[p]:
                    return _refused("a call reads the one before it at another operand")
            elif not _alike_operands(operands[0][p], a, calls[0], calls[i]):
                return _refused(f"call {i} reads {getattr(a, 'name', a)} where call 0 reads "
                                f"{getattr(operands[0][p], 'name', operands[0][p])}: neither the value before it, "
                                "a shared value nor one made alike from its own inputs")
    for i, call in enumerate(calls[:-1]):  # what a call returns is read by the next call only
        for getter in call.users:
            if getter.target is not operator.getitem or any(u is not calls[i + 1] for u in getter.users):
                return _refused("a call's output is read past the next call")
    return chained


def _alike_operands(a: Any, b: Any, call_a: fx.Node, call_b: fx.Node) -> bool:
    """Whether operand ``b`` of ``call_b`` is for it what ``a`` is for ``call_a``: the same value (a shared
    node), or the same expression (a constant made per call, ``getattr`` of a parameter) whose inputs are
    shared nodes or, at the same places, inputs of each call's own (read by nothing else). Random values made
    per call differ: the plan's check (``same_values.same_value``) refuses them."""
    if a is b:
        return True
    if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
        return type(a) is type(b) and not isinstance(a, torch.Tensor) and a == b
    if a.op == "placeholder" or b.op == "placeholder":
        return a.op == b.op == "placeholder" and _only_feeds(a, call_a) and _only_feeds(b, call_b)
    if (a.op, a.target) != (b.op, b.target) or a.op not in ("call_function", "call_method") or \
            len(a.args) != len(b.args) or a.kwargs.keys() != b.kwargs.keys():
        return False
    return all(_alike_operands(x, y, call_a, call_b) for x, y in zip(a.args, b.args)) and \
        all(_alike_operands(a.kwargs[k], b.kwargs[k], call_a, call_b) for k in a.kwargs)


def _only_feeds(node: fx.Node, call: fx.Node) -> bool:
    """Whether everything read from ``node`` ends in ``call`` (its input of its own)."""
    stack, seen = list(node.users), set()
    while stack:
        user = stack.pop()
        if user is call or user in seen:
            continue
        if user.op == "output" or not user.users:
            return False
        seen.add(user)
        stack += list(user.users)
    return True


def _output(call: fx.Node, k: int) -> fx.Node:
    """The getitem of ``call``'s output ``k`` (the one the next call read)."""
    for getter in call.users:
        if getter.target is operator.getitem and getter.args[1] == k:
            return getter
    raise AssertionError(f"no getitem of output {k} of {call}")


def unfold(plan: TrainingPlan, short: Shortened) -> TrainingPlan | None:
    """The plan of the whole model from the plan of its ``short`` program: layer ``template``'s forward and
    backward nodes copied for every dropped layer; None where layers ``template`` and ``successor`` are not
    planned alike (their code, layouts or where they read from differ), or a value of the template's is read
    past the layer after it (a skip connection the copies would not continue)."""
    unfolding = unfolder(plan, short)
    return unfolding() if unfolding is not None else None


def unfolder(plan: TrainingPlan, short: Shortened) -> Callable[[], TrainingPlan | None] | None:
    """``unfold`` in two steps: the check now (None where it refuses), the copies when the returned function is
    called (a step run through its lowered programs reads the whole plan only for its summary line or ``plan``;
    the copies cost ~8 ms a layer). The function returns None only where the unfolded program is out of order,
    a check no folded program has failed."""
    step = _Step(plan.forward, plan.backward, plan.num_outputs, plan.grad_inputs, plan.program.input_names)
    layers = _Layers.of(step, short.template, short.successor)
    if layers is None:
        return None

    def unfolded() -> TrainingPlan | None:
        whole = layers.unfolded()
        return replace(plan, forward=whole[0], backward=whole[1], joint=None) if whole is not None else None
    return unfolded


@dataclass
class _Step:
    """What unfolding reads of a training step, planned or lowered."""

    forward: fx.GraphModule  # primals -> (*outputs, *saved)
    backward: fx.GraphModule  # (*saved, *tangents) -> gradients of grad_inputs
    num_outputs: int
    grad_inputs: Sequence[int]
    names: Sequence[str]  # of the primals


@dataclass
class _Layers:
    """A short program's step whose layers t and s are planned alike (``of`` checks it), and how to copy t."""

    step: _Step
    t: int  # the template
    s: int  # its successor
    f: "_Alike"  # the forward's layers t and s
    b: "_Alike"  # the backward's
    region: dict[fx.Node, Any]  # the forward's regions (layers by index)
    backward_region: dict[fx.Node, Any]
    params: dict[str, fx.Node]  # the forward's placeholders by name
    layer_index: dict[str, int]  # a layer's placeholder's name -> its layer
    saved_of: dict[fx.Node, fx.Node]  # a backward placeholder -> the forward value saved for it
    # saved parameters of the next layer that a layer's backward reads (a recomputed norm of its input, in
    # the region of the gradient it computes): layer t's backward reads layer s's, layer s's layer s+1's
    next_params: set[fx.Node] = field(default_factory=set)

    @property
    def stamps(self) -> range:
        return range(self.t + 1, self.s)

    def unfolded(self) -> tuple[fx.GraphModule, fx.GraphModule] | None:
        """The whole step's forward and backward, or None where they are out of order."""
        step = self.step
        forward, env, copies = self.forward()
        backward, saved_values = self.backward(forward, env, copies)
        forward.output(tuple([env[o] for o in outputs(step.forward)[:step.num_outputs]] + saved_values))
        eliminate_dead_code(forward)  # linted below
        try:
            forward.lint()
            backward.lint()
        except RuntimeError:
            return _refused("the unfolded program is not in order")
        return graph_module(step.forward, forward), graph_module(step.backward, backward)

    @classmethod
    def of(cls, step: _Step, t: int, s: int, maps: tuple[dict, dict] | None = None) -> "_Layers | None":
        """``step``'s layers ``t`` (the template) and ``s`` (its successor: ``Shortened``), checked alike (None,
        the reason logged, where they are not); ``maps``: the forward's and backward's regions where known (a
        program bucketed by them: ``fold_lowered.py``), else found here."""
        forward, backward = step.forward, step.backward
        region = maps[0] if maps is not None else forward_regions(forward, root_gathers_first=False)
        if not region:
            return _refused("the forward has no layers")
        params = {p.name: p for p in forward.graph.find_nodes(op="placeholder")}
        layer_index = {p.name: k for p, k in layer_of_inputs(forward).items()}
        if any(u.op != "output" for name, k in layer_index.items() if t < k < s for u in params[name].users):
            return _refused("the dropped calls were not layers t+1..s-1")
        f = _Alike.of(forward, region, t, s, descending=False)
        if f is None:
            return None  # _Alike.of says why
        for a_t, a_s in zip(f.inputs, f.successor_inputs):  # what is neither shared nor the neighbour's: parameters
            if a_t is not a_s and a_t not in f.chain and a_t not in f.equal and \
                    not (layer_index.get(a_t.name) == t and a_s.name == renumbered(a_t.name, s)):
                return _refused(f"layer {t} reads {a_t.name} where layer {s} reads {a_s.name}")
        names = step.names
        with_grad = {names[k] for k in step.grad_inputs}
        for node in f.inputs:  # every dropped layer's parameters are the template's: layouts, shapes, dtypes, grads
            if node.op == "placeholder" and layer_index.get(node.name) == t:
                for j in range(t + 1, s):
                    other = params.get(renumbered(node.name, j))
                    if other is None or not alike_inputs(node, other) or \
                            (node.name in with_grad) != (other.name in with_grad):
                        return _refused(f"layer {j}'s {renumbered(node.name, j)} is not alike layer {t}'s")
        saved_values = list(outputs(forward))[step.num_outputs:]
        backward_region = maps[1] if maps is not None else backward_regions(
            backward, saved_regions(forward, region, step.num_outputs), max(region.values()) + 1)
        b = _Alike.of(backward, backward_region, t, s, descending=True)
        if b is None:
            return None
        if not f.slots_chain_to(region, t - 1) or not b.slots_chain_to(backward_region, s + 1):
            return _refused("a layer reads a value of a layer other than the one next to it")
        saved_of = dict(zip(backward.graph.find_nodes(op="placeholder"), saved_values))
        layers = cls(step, t, s, f, b, region, backward_region, params, layer_index, saved_of)
        # what is neither shared nor the neighbour's: saved values, layer s's the counterparts of layer t's (or
        # of the layer after each)
        for bt, bs in zip(b.inputs, b.successor_inputs):
            if bt is bs or bt in b.chain or bt in b.equal:
                continue
            if bt in saved_of and bs in saved_of and layers.next_layers(saved_of[bt], saved_of[bs]):
                layers.next_params.add(bt)
            elif not (bt in saved_of and bs in saved_of and layers.corresponds(saved_of[bt], saved_of[bs])):
                return _refused(f"layer {t}'s backward reads {bt.name} where layer {s}'s reads {bs.name}")
        if any(a in saved_of and saved_of[a] in f.position and saved_of[a] not in layers.redirect
               for node in b.successor_body for a in node.all_input_nodes):
            return _refused(f"layer {s}'s backward reads a value of layer {t}'s other than its input")
        grad_of = {names[k]: g for k, g in zip(step.grad_inputs, outputs(backward))}
        for k in step.grad_inputs:
            if t < layer_index.get(names[k], -1) < s and layers.gradient_maker(names[k], grad_of) is None:
                return _refused(f"{names[k]}'s gradient is made neither in layer {t}'s backward nor in the "
                                f"one before it, alike in layer {s}'s")
        return layers

    def gradient_maker(self, name: str, grad_of: dict[str, Any]) -> tuple[fx.Node, int] | None:
        """Where a dropped layer's parameter ``name`` gets its gradient, as a node of layer t's backward and
        the layer whose backward that node is of: its own (0), or the layer before's (-1: the layer's
        backward makes the next layer's input norm's gradient, recomputing it there), found alike for layer
        s (+1 there), else None."""
        b, t, s = self.b, self.t, self.s
        own = grad_of.get(renumbered(name, t))
        if own in b.position and grad_of.get(renumbered(name, s)) is b.successor_body[b.position[own]]:
            return own, 0
        after = grad_of.get(renumbered(name, s))
        if after in b.position and grad_of.get(renumbered(name, s + 1)) is b.successor_body[b.position[after]]:
            return after, -1
        return None

    @functools.cached_property
    def redirect(self) -> dict[fx.Node, int]:
        """What layer s reads of layer t's forward (it reads the last copy's), by position in the layer."""
        return {self.f.body[p]: p for p in self.f.chain.values()}

    def layer(self, node: fx.Node) -> int | None:
        return self.layer_index.get(node.name) if node.op == "placeholder" else None

    def next_layers(self, v_t: fx.Node, v_s: fx.Node) -> bool:
        """Whether ``v_t`` is a parameter of layer s (the one after t) and ``v_s`` the same of layer s+1."""
        return self.layer(v_t) == self.s and self.layer(v_s) == self.s + 1 and \
            v_s.name == renumbered(v_t.name, self.s + 1)

    def corresponds(self, v_t: fx.Node, v_s: fx.Node) -> bool:
        """Whether forward value ``v_s`` is for layer s what ``v_t`` is for layer t."""
        f = self.f
        if v_t in f.position:
            return f.successor_body[f.position[v_t]] is v_s
        if self.layer(v_t) == self.t:
            return v_s.op == "placeholder" and v_s.name == renumbered(v_t.name, self.s)
        if v_t in f.chain:
            return f.body[f.chain[v_t]] is v_s
        return v_t is v_s or same_value(v_t, v_s)

    def forward(self) -> tuple[fx.Graph, dict[fx.Node, fx.Node], dict[int, dict[fx.Node, fx.Node]]]:
        """The whole forward but for its output: the short program's nodes and, after layer t's, its copies
        (``copies[j]``: layer t's node -> layer j's), layer s reading the last copy."""
        f, t, s = self.f, self.t, self.s
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for node in self.step.forward.graph.nodes:
            if node.op in ("placeholder", "get_attr"):
                env[node] = copy_node(graph, node, lambda a: env[a])
        copies: dict[int, dict[fx.Node, fx.Node]] = {}

        def stamp() -> None:
            for j in self.stamps:
                copies[j] = {}
                for node in f.body:
                    copies[j][node] = _copy(graph, node, lambda a: self.version(a, j, env, copies), stamp=j)

        redirect = self.redirect
        successor = set(f.successor_body)
        readers = [n for n in f.successor_body if any(a in redirect for a in n.all_input_nodes)]
        _emit(self.step.forward, self.region, t, f.body, readers, False, emit=lambda node: _copy(
                  graph, node, lambda a: copies[s - 1][a] if node in successor and a in redirect else env[a], env),
              between=stamp)
        return graph, env, copies

    def version(self, v: fx.Node, j: int, env: dict, copies: dict) -> fx.Node:
        """The new forward's value that is, for copied layer j, what ``v`` is for layer t."""
        f = self.f
        if v in f.position:
            return copies[j][v]
        if self.layer(v) == self.t:
            return env[self.params[renumbered(v.name, j)]]
        if v in f.chain:
            p = f.chain[v]
            return env[f.body[p]] if j == self.t + 1 else copies[j - 1][f.body[p]]
        return env[v]

    def backward(self, forward: fx.Graph, env: dict, copies: dict) -> tuple[fx.Graph, list[fx.Node]]:
        """The whole backward, and the new forward's values it takes saved, in the order it takes them: the
        short program's nodes and, after layer s's, the copies of layer t's (from layer s-1 down), each reading
        its own saved values; layer t reading the last copy's gradients, layer s the saved values of its input
        the forward now gives it."""
        b, t, s, saved_of = self.b, self.t, self.s, self.saved_of
        backward = self.step.backward
        graph = fx.Graph()
        benv: dict[fx.Node, fx.Node] = {}
        placeholders = list(backward.graph.find_nodes(op="placeholder"))
        placeholder_of: dict[fx.Node, fx.Node] = {}  # new forward value -> new backward placeholder
        for node in placeholders:
            benv[node] = copy_node(graph, node)
            if node in saved_of:
                placeholder_of[env[saved_of[node]]] = benv[node]
        for node in backward.graph.find_nodes(op="get_attr"):
            benv[node] = copy_node(graph, node)
        first_tangent = next(benv[p] for p in placeholders if p not in saved_of)

        def saved(value: fx.Node, like: fx.Node) -> fx.Node:
            if value not in placeholder_of:
                with graph.inserting_before(first_tangent):
                    placeholder_of[value] = graph.placeholder(f"saved_{value.name}")
                placeholder_of[value].target = placeholder_of[value].name  # the name made unique
                placeholder_of[value].meta = dict(like.meta)
            return placeholder_of[value]

        bcopies: dict[int, dict[fx.Node, fx.Node]] = {}

        def next_param(a: fx.Node, j: int) -> fx.Node:  # layer j+1's parameter that layer t's reads of layer s
            return saved(env[self.params[renumbered(saved_of[a].name, j + 1)]], a)

        def version(a: fx.Node, j: int) -> fx.Node:
            if a in b.position:
                return bcopies[j][a]
            if a in self.next_params:
                return next_param(a, j)
            if a in saved_of:
                return saved(self.version(saved_of[a], j, env, copies), a)
            if a in b.chain:
                p = b.chain[a]
                return benv[b.successor_body[p]] if j == s - 1 else bcopies[j + 1][b.body[p]]
            return benv[a]

        def stamp() -> None:
            for j in reversed(self.stamps):
                bcopies[j] = {}
                for node in b.body:
                    bcopies[j][node] = _copy(graph, node, lambda a: version(a, j), stamp=j)

        bredirect = {b.successor_body[p]: p for p in b.chain.values()}  # layer t reads the first copy's
        template, successor, redirect = set(b.body), set(b.successor_body), self.redirect

        def read(node: fx.Node, a: fx.Node) -> fx.Node:
            if node in template and a in bredirect:
                return bcopies[t + 1][b.body[bredirect[a]]]
            if node in template and a in self.next_params:  # the layer after t is the first copy
                return next_param(a, t)
            if node in successor and a in saved_of and saved_of[a] in redirect:
                return saved(copies[s - 1][saved_of[a]], a)
            return benv[a]

        redirected = [n for n in b.body if any(a in bredirect for a in n.all_input_nodes)] + \
            [n for n in b.successor_body if any(a in saved_of and saved_of[a] in redirect for a in n.all_input_nodes)]
        _emit(backward, self.backward_region, s, b.body, redirected, True,
              emit=lambda node: _copy(graph, node, lambda a: read(node, a), benv), between=stamp)

        # a copied layer's parameter gets its copy of the template's gradient
        names = self.step.names
        grads = list(outputs(backward))
        grad_of = {names[k]: g for k, g in zip(self.step.grad_inputs, grads)}
        new_grads = []
        for k, grad in zip(self.step.grad_inputs, grads):
            j = self.layer_index.get(names[k], -1)
            maker = self.gradient_maker(names[k], grad_of) if t < j <= s else None
            if maker is not None and t < j < s:  # a copy's: its own backward's, or the one before it
                node, offset = maker
                maker_layer = j + offset
                new_grads.append(bcopies[maker_layer][node] if maker_layer > t else benv[node])
            elif maker is not None and maker[1] == -1 and j == s:  # layer s's, made by the last copy
                new_grads.append(bcopies[s - 1][maker[0]])
            else:
                new_grads.append(benv[grad] if isinstance(grad, fx.Node) else grad)
        graph.output(tuple(new_grads))
        # the dropped layers' stand-in gradients (zeros of their parameters) and what only they read go
        eliminate_dead_code(graph)  # linted with the forward (unfolded)
        value_of = {p: v for v, p in placeholder_of.items()}
        for p in list(graph.find_nodes(op="placeholder")):
            if p in value_of and not p.users:
                graph.erase_node(p)
                del value_of[p]
        # saved values in program order, as ``joint.partition`` orders them (inputs first, then by layer)
        order = {n: k for k, n in enumerate(forward.nodes)}
        kept = sorted(value_of, key=lambda p: order[value_of[p]])
        for p in kept:
            first_tangent.prepend(p)
        return graph, [value_of[p] for p in kept]


@dataclass
class _Alike:
    """Layers t and s of a short program's forward (backward), found planned alike: the template's body, the
    successor's, and how the one that runs second reads the one that runs first (``chain``: a value the
    template reads from its neighbour -> the position, in a layer's body, of its counterpart)."""

    body: list[fx.Node]  # layer t's nodes, in order
    successor_body: list[fx.Node]  # layer s's
    position: dict[fx.Node, int]  # of layer t's nodes
    inputs: list[fx.Node]  # what layer t reads, in its region's order
    successor_inputs: list[fx.Node]
    chain: dict[fx.Node, int]
    neighbours: list[fx.Node]  # the values the first-running layer reads from the layer before it
    equal: set[fx.Node]  # what layer t reads that layer s reads a node of its own computing alike (shared)

    @classmethod
    def of(cls, gm: fx.GraphModule, region: dict[fx.Node, Any], t: int, s: int, descending: bool) -> "_Alike | None":
        found = {r.index: r for r in split_regions(gm, region, descending, only=(t, s))}
        rt, rs = found.get(t), found.get(s)
        if rt is None or rs is None or not _same_program(rt, rs):
            return _refused("the layers' regions differ in code or layouts")
        position = {n: k for k, n in enumerate(rt.body)}
        successor_position = {n: k for k, n in enumerate(rs.body)}
        chain: dict[fx.Node, int] = {}
        neighbours: list[fx.Node] = []
        equal: set[fx.Node] = set()
        for a_t, a_s in zip(rt.inputs, rs.inputs):
            if not descending and a_s in position:  # layer s reads layer t's value; t read its predecessor's
                chain[a_t] = position[a_s]
                neighbours.append(a_t)
            elif descending and a_t in successor_position:  # layer t's backward reads layer s's
                chain[a_t] = successor_position[a_t]
                neighbours.append(a_s)
            elif a_t is not a_s and same_value(a_t, a_s):
                equal.add(a_t)  # made per layer outside it, alike (a view of the rotary tables, a mask)
            elif a_t is not a_s and not (a_t.op == "placeholder" and a_s.op == "placeholder"):
                return _refused(f"layer {t} reads {a_t.name} where layer {s} reads {a_s.name}: neither a "
                                "neighbour's value, shared, made alike, nor the layer's own")
        first = rt if not descending else rs
        second = set(rs.body if not descending else rt.body) | set(first.body)
        for node in first.body:  # what runs first is read by what runs second only (or leaves the program)
            if any(u not in second and u.op != "output" for u in node.users):
                return _refused("a value of the layer running first is read past the layer after it")
        return cls(rt.body, rs.body, position, rt.inputs, rs.inputs, chain, neighbours, equal)

    def slots_chain_to(self, region: dict[fx.Node, Any], neighbour: int) -> bool:
        """Whether every value read from a neighbour is that neighbouring layer's."""
        return all(region.get(n) == neighbour for n in self.neighbours)


def _refused(reason: str) -> None:
    """Why a program is not folded (its whole model is planned then), for whoever logs this module."""
    log.info("fxshard: the layers are planned whole, not folded: %s", reason)
    return None


def _same_program(a: Region, b: Region) -> bool:
    """Two regions with the same code and the same layouts at every node."""
    if program_structure(a.graph.graph) != program_structure(b.graph.graph):
        return False
    return all(x.meta.get(LAYOUT) == y.meta.get(LAYOUT) and x.meta.get(ARG_LAYOUTS) == y.meta.get(ARG_LAYOUTS)
               for x, y in zip(a.graph.graph.nodes, b.graph.graph.nodes))


def _copy(graph: fx.Graph, node: fx.Node, value: Any, env: dict | None = None, stamp: int | None = None) -> fx.Node:
    """``node`` appended to ``graph``, each argument node ``a`` read as ``value(a)``; a copy for layer ``stamp``
    says so (``STAMP``)."""
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), value)
    new = new_node(graph, node.op, node.target, args, kwargs)
    new.meta = dict(node.meta)
    if stamp is not None:
        new.meta[STAMP] = stamp
    if env is not None:
        env[node] = new
    return new


def _emit(gm: fx.GraphModule, region: dict[fx.Node, Any], layer: int, copied: Sequence[fx.Node],
          redirected: Sequence[fx.Node], descending: bool, emit: Any, between: Any) -> None:
    """Each computing node of ``gm`` through ``emit``, and ``between()`` (the copies of the ``copied`` nodes)
    right after the last node of region ``layer`` (the real layer that runs before the copies): in program order,
    the order the whole model's trace would give, where what the copies read comes before that point and the
    ``redirected`` nodes (which read the copies) after it; else in region order (a valid order: a node's region
    follows its inputs')."""
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]

    def point() -> int:
        return max((k for k, n in enumerate(nodes) if region[n] == layer), default=-1) + 1

    inside = set(copied)
    needed = {a for n in copied for a in n.all_input_nodes if a not in inside and a.op == "call_function"}
    first = point()
    if not needed <= set(nodes[:first]) or set(redirected) & set(nodes[:first]):
        position = {n: k for k, n in enumerate(nodes)}
        nodes.sort(key=lambda n: (-region[n] if descending else region[n], position[n]))
        first = point()
    for node in nodes[:first]:
        emit(node)
    between()
    for node in nodes[first:]:
        emit(node)


