"""A repeated block's forward+backward traced once and stamped out for every call.

Stage 1's joint trace runs autograd over the whole program under ``make_fx``: every op of every
layer is dispatched twice (forward and backward) through functionalization, the proxy tracer and
fake tensors, about 0.1 s per Llama layer on this machine, the largest of fxshard's own stages at
8 layers. Dynamo already gives a model's repeated blocks as calls of one body
(``backend/layers/block_regions.py``). So, while the joint is traced, a call of a body runs as one opaque
op (``fxshard::block_forward``, whose autograd formula is ``fxshard::block_backward``): the
body's own joint is traced on the first call with its inputs' metadata (``trace_template``) and
split where its backward starts; each op call is then replaced by a copy of the template's
forward nodes and each backward op by a copy of its backward nodes (``stamp``). The program is
the one the inline trace gives: the same ops on the same values, each layer's backward where
autograd runs it.

A body is stamped only where reading it inline needs nothing of the program around it: tensor
operands and outputs only, no DTensor API call in it (pins, ``to_local`` regions), no activation
checkpoint, no nested region, no write into an operand, no operand that is a local shard. Otherwise
it is traced inline as before (``Templates.call`` returns None), and should stamping fail anyway,
stage 1 traces the whole program again inline (``trace._stamped``). A forward-only trace (inference)
stamps its calls the same way: their templates have no backward.
"""
from __future__ import annotations

import contextlib
import functools
import operator
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor, disable_fake_tensor_cache
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing, get_proxy_mode, make_fx

from fxshard.graph import CHECKPOINTED, EAGER_SHAPE, LOCAL_REGION, REGION_EXIT, copy_node
from fxshard.lowering.localize import fresh_fake
from fxshard.ops import CONSTRAIN

from fxshard.backend.capture.dynamo_calls import autograd_tensor, interpreter_stack_cleared

_Meta = tuple  # (shape, stride, dtype, device)


@dataclass(eq=False)
class BlockTemplate:
    """One body's joint on one kind of operands: forward nodes, then backward nodes.

    ``outputs``: the template nodes (or placeholders) the body returns; ``residuals``: the forward
    nodes the backward reads; ``grads``: the template nodes of the gradients of ``grad_inputs``
    (operand positions); ``differentiable``: the outputs that take a gradient (a tangent each).
    """

    module: fx.GraphModule  # holds the constants the body's trace made (get_attr)
    primals: list[fx.Node]
    tangents: list[fx.Node]
    forward: list[fx.Node]
    backward: list[fx.Node]
    outputs: list[fx.Node]
    residuals: list[fx.Node]
    grads: list[fx.Node]
    grad_inputs: tuple[int, ...]
    differentiable: tuple[int, ...]
    number: int = 0  # its key in _LIVE (the ops' argument): id(template)
    index: int = 0  # its place among one trace's templates (names of the constants it lends)
    metas: dict[str, list[_Meta]] = field(default_factory=dict)


# the templates of the traces under way, for the ops' fake and autograd rules (which get a number only)
_LIVE: "weakref.WeakValueDictionary[int, BlockTemplate]" = weakref.WeakValueDictionary()


def _empty(metas: Sequence[_Meta], like: Sequence[Any] = ()) -> list[torch.Tensor]:
    """Fresh tensors of ``metas``; fake ones of the mode of the fake tensors in ``like`` made without dispatching
    (the fake mode's dispatch and cache lookup of ~35 values per layer call were half of stage 1 at depth)."""
    mode = next((x.fake_mode for x in like if isinstance(x, FakeTensor)), None)
    if mode is not None:
        return [fresh_fake(mode, shape, stride, dtype, device) for shape, stride, dtype, device in metas]
    return [torch.empty_strided(shape, stride, dtype=dtype, device=device) for shape, stride, dtype, device in metas]


@torch.library.custom_op("fxshard::block_forward", mutates_args=())
def block_forward(operands: list[torch.Tensor], template: int) -> list[torch.Tensor]:
    """A call of a repeated block during stage 1's joint trace: its outputs, then its residuals."""
    raise RuntimeError("fxshard::block_forward exists only while stage 1 traces a joint program")


@block_forward.register_fake
def _(operands: list[torch.Tensor], template: int) -> list[torch.Tensor]:
    return _empty(_LIVE[template].metas["forward"], operands)


@torch.library.custom_op("fxshard::block_backward", mutates_args=())
def block_backward(values: list[torch.Tensor], template: int) -> list[torch.Tensor]:
    """A block call's backward: (operands, residuals, output gradients) -> the operands' gradients."""
    raise RuntimeError("fxshard::block_backward exists only while stage 1 traces a joint program")


@block_backward.register_fake
def _(values: list[torch.Tensor], template: int) -> list[torch.Tensor]:
    return _empty(_LIVE[template].metas["grads"], values)


def _setup_context(ctx: Any, inputs: tuple, output: list[torch.Tensor]) -> None:
    operands, number = inputs
    template = _LIVE[number]
    ctx.number = number
    residuals = output[len(template.outputs):]
    ctx.mark_non_differentiable(*residuals)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(*operands, *residuals)


def _backward(ctx: Any, grads: Sequence[torch.Tensor | None]) -> tuple:
    template = _LIVE[ctx.number]
    saved = list(ctx.saved_tensors)
    # an output no one differentiates (a layer's auxiliary value the next one ignores) gets zeros
    tangents = [grads[k] if grads[k] is not None else torch.zeros_like(_empty([template.metas["forward"][k]])[0])
                for k in template.differentiable]
    with _uncached():
        made = block_backward(saved + tangents, ctx.number)
    full: list[torch.Tensor | None] = [None] * len(template.primals)
    for k, g in zip(template.grad_inputs, made):
        full[k] = g
    return full, None


block_forward.register_autograd(_backward, setup_context=_setup_context)
BLOCK_FORWARD = torch.ops.fxshard.block_forward.default
BLOCK_BACKWARD = torch.ops.fxshard.block_backward.default


def _uncached() -> contextlib.AbstractContextManager:
    """The active fake mode without its dispatch cache: keying a block call's ~45 operands cost more than
    the ``register_fake`` rule (``_empty``) it would save."""
    mode = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
    return disable_fake_tensor_cache(mode) if mode is not None else contextlib.nullcontext()


def _requires_grad(x: torch.Tensor) -> bool:
    """Whether autograd tracks ``x``: read beneath functionalization's wrappers (which say False)."""
    return autograd_tensor(x).requires_grad


def _meta(t: torch.Tensor) -> _Meta:
    return (tuple(t.shape), tuple(t.stride()), t.dtype, t.device)


class Templates:
    """The templates of one joint trace, by body and operands' metadata (None: trace that body inline).

    ``interpret(body)`` gives a fresh stage-1 interpreter of a body (no pins, no local views, no
    stamping of its own nested calls); ``decompositions`` are the joint trace's."""

    def __init__(self, interpret: Callable[[fx.GraphModule], Any], decompositions: dict) -> None:
        self.interpret = interpret
        self.decompositions = decompositions
        self.by_key: dict[tuple, BlockTemplate | None] = {}
        self.used: list[BlockTemplate] = []

    def call(self, body: fx.GraphModule, operands: Sequence[Any]) -> tuple | None:
        """The outputs of a stamped call of ``body`` (traced as ``fxshard::block_forward``), or None."""
        returned = next(n for n in reversed(body.graph.nodes) if n.op == "output").args[0]
        if (not operands or not all(isinstance(x, torch.Tensor) for x in operands)
                or not isinstance(returned, (tuple, list))):
            return None
        grads = tuple(_requires_grad(x) and x.dtype.is_floating_point for x in operands)
        key = (body, tuple(_meta(x) for x in operands), grads)
        if key not in self.by_key:
            self.by_key[key] = self._trace(body, operands, grads)
        template = self.by_key[key]
        if template is None:
            return None
        with _uncached():
            out = block_forward(list(operands), template.number)
        return tuple(out[:len(template.outputs)])

    def _trace(self, body: fx.GraphModule, operands: Sequence[torch.Tensor],
               grads: tuple[bool, ...]) -> BlockTemplate | None:
        # the joint being traced is paused: no proxy modes, no functionalization around the body's own trace
        with disable_proxy_modes_tracing(), interpreter_stack_cleared():
            template = trace_template(self.interpret, body, [_meta(x) for x in operands], grads,
                                      self.decompositions)
        if template is not None:
            template.number, template.index = id(template), len(self.used)
            _LIVE[template.number] = template
            self.used.append(template)
        return template


def trace_template(interpret: Callable[[fx.GraphModule], Any], body: fx.GraphModule, metas: Sequence[_Meta],
                   grads: Sequence[bool], decompositions: dict) -> BlockTemplate | None:
    """``body``'s joint on fresh fake operands of ``metas`` (those of ``grads`` requiring grad), or None
    where the body is not stamped (see the module's docstring)."""
    primals = _empty(metas)
    for x, g in zip(primals, grads):
        x.requires_grad_(g)
    grad_inputs = tuple(k for k, g in enumerate(grads) if g)
    seen: dict[str, Any] = {}  # what the trace found: its interpreter, where the backward starts, ...

    def forward(*xs: torch.Tensor) -> tuple:
        interpreter = interpret(body)
        seen["interpreter"] = interpreter
        out = interpreter.run(*xs)
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)

    def joint(*xs: torch.Tensor) -> tuple:
        with torch.set_grad_enabled(bool(grad_inputs)):  # a forward-only trace runs without grad, as stage 1's
            outs = torch.func.functionalize(forward, remove="mutations")(*xs)
        if not all(isinstance(o, torch.Tensor) for o in outs):
            raise _NotStamped
        nodes = get_proxy_mode().tracer.graph.nodes
        seen["boundary"] = len(nodes)
        differentiable = [k for k, o in enumerate(outs) if o.requires_grad]
        seen["differentiable"] = tuple(differentiable)
        # the output gradients: one node each (stamp maps them to the gradients the call is given)
        tangents = [torch.empty_like(outs[k]) for k in differentiable]
        seen["tangents"] = list(nodes)[seen["boundary"]:]
        if len(seen["tangents"]) != len(tangents):
            raise _NotStamped
        wrt = [xs[k] for k in grad_inputs]
        made: Sequence[Any] = [None] * len(wrt)
        if differentiable and wrt:
            made = torch.autograd.grad([outs[k] for k in differentiable], wrt, tangents, allow_unused=True)
        made = [g if g is not None else torch.zeros_like(p) for g, p in zip(made, wrt)]
        return tuple(outs) + tuple(made)

    try:
        gm = make_fx(joint, tracing_mode="real", decomposition_table=decompositions)(*primals)
    except Exception:  # noqa: BLE001 (read inline, the body gives its own error, if it has one)
        return None
    if _holds_program_facts(gm.graph) or len(seen["interpreter"].local_views):
        return None
    return _split(gm, seen["boundary"], seen["tangents"], seen["differentiable"], grad_inputs)


class _NotStamped(Exception):
    """The body returns something other than tensors (or its output gradients are not one node each)."""


def _holds_program_facts(graph: fx.Graph) -> bool:
    """Whether the body's trace holds what stage 1 reads against the program around it: a pin, a local
    region's marks, a checkpoint, a nested call, a write into an operand."""
    marks = (CHECKPOINTED, EAGER_SHAPE, LOCAL_REGION, REGION_EXIT)
    return any(n.target in (CONSTRAIN, BLOCK_FORWARD, BLOCK_BACKWARD) or any(m in n.meta for m in marks)
               or _mutates(n) for n in graph.nodes)


def _mutates(node: fx.Node) -> bool:
    """An op writing into its arguments: functionalization's copy back into a mutated operand, which
    is the program around the body's to make functional (a KV cache written in place)."""
    schema = getattr(node.target, "_schema", None)
    return node.op == "call_function" and schema is not None and schema.is_mutable


def _split(gm: fx.GraphModule, boundary: int, tangents: list[fx.Node],
           differentiable: tuple[int, ...], grad_inputs: tuple[int, ...]) -> BlockTemplate:
    """The traced joint cut where its backward starts (``boundary``: the nodes traced when the forward
    returned); ``tangents``: the nodes standing for the output gradients."""
    nodes = list(gm.graph.nodes)
    primals = [n for n in nodes if n.op == "placeholder"]
    output = nodes[-1]
    computing = ("call_function", "get_attr")
    forward = [n for n in nodes[:boundary] if n.op in computing]
    backward = [n for n in nodes[boundary:] if n.op in computing and n not in tangents]
    returned = list(output.args[0])
    outs, grads = returned[:len(returned) - len(grad_inputs)], returned[len(returned) - len(grad_inputs):]
    in_forward = set(forward)
    residuals = list(dict.fromkeys(a for n in backward for a in n.all_input_nodes if a in in_forward))
    residuals += [g for g in grads if g in in_forward and g not in residuals]  # a gradient the forward made
    template = BlockTemplate(gm, primals, tangents, forward, backward, outs, residuals, grads,
                             grad_inputs, differentiable)
    template.metas = {"forward": [_meta(n.meta["val"]) for n in outs + residuals],
                      "grads": [_meta(n.meta["val"]) for n in grads]}
    return template


def stamp(gm: fx.GraphModule) -> None:
    """Replace every ``fxshard::block_forward`` / ``block_backward`` call in ``gm`` by a copy of its
    template's forward / backward nodes."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in (BLOCK_FORWARD, BLOCK_BACKWARD):
            continue
        values, number = node.args
        template = _LIVE[number]
        if node.target is BLOCK_FORWARD:
            env = dict(zip(template.primals, values))
            made = _copied(gm, node, template, template.forward, env)
            results = [made[n] for n in template.outputs + template.residuals]
        else:
            n_in, n_res = len(template.primals), len(template.residuals)
            env = dict(zip(template.primals, values[:n_in]))
            env.update(zip(template.residuals, values[n_in:n_in + n_res]))
            env.update(zip(template.tangents, values[n_in + n_res:]))
            made = _copied(gm, node, template, template.backward, env)
            results = [made[n] for n in template.grads]
        for user in list(node.users):
            if user.target is not operator.getitem:
                raise AssertionError(f"{node} is read other than by index: {user}")
            user.replace_all_uses_with(results[user.args[1]])
            graph.erase_node(user)
        graph.erase_node(node)
    gm.recompile()


def _copied(gm: fx.GraphModule, at: fx.Node, template: BlockTemplate, nodes: Sequence[fx.Node],
            env: dict[fx.Node, Any]) -> dict[fx.Node, Any]:
    """``nodes`` of ``template`` copied into ``gm`` before ``at`` (``env``: template node -> its copy);
    a constant the template holds is held by ``gm`` too, once, under a name of its own."""
    graph = gm.graph
    with graph.inserting_before(at):
        for n in nodes:
            if n in env:
                continue
            if n.op == "get_attr":
                name = f"_fxshard_block{template.index}_{n.target.replace('.', '_')}"
                if not hasattr(gm, name):  # an attribute, as make_fx keeps the constants it lifts
                    setattr(gm, name, functools.reduce(getattr, n.target.split("."), template.module))
                env[n] = graph.get_attr(name)
                env[n].meta = dict(n.meta)
            else:
                env[n] = copy_node(graph, n, lambda a: env[a])
    return env
