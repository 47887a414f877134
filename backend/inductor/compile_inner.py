"""Inductor on a lowered local program without AOTAutograd's second trace.

``compile_fx`` runs every graph it is given through AOTAutograd: a pass that runs the program on fake
tensors to learn what it mutates and aliases, then a functionalizing trace with Inductor's
decompositions, then the inner compile. fxshard's local programs need neither pass: they are
functional ATen graphs (stage 1 functionalized them) whose every value's metadata fxshard knows. For
a Llama layer's forward and backward region that second trace was 0.31 + 0.45 s of the first step
(bench/compile.py, 1 layer, one rank), the size of all of fxshard's planning.

``compile_direct`` does what of it such a program needs: every value's fake metadata in the example
inputs' mode, each op Inductor decomposes replaced by its decomposition (traced once per op and
input metadata, the other calls of it copied), Inductor's joint-graph passes (as ``compile_fx``
runs them on an inference graph), then ``compile_fx_inner``. A program it cannot take as it is (a
mutating op, a call that is no ATen operator, a symbolic size, an output that is no tensor)
returns None: the caller compiles it through ``compile_fx``.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import operator
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from fxshard.graph import copy_graph_module, copy_node, metadata
from fxshard.lowering.localize import fake_values, program_fake_values

from fxshard.backend.inductor.prepared_cache import load_prepared, prepared_key, store_prepared

__all__ = ["compile_direct", "takes_directly"]

aten = torch.ops.aten
_IMPLICIT = torch._C.DispatchKey.CompositeImplicitAutograd
_KEPT = object()  # a decomposition that leaves the call as it is (Inductor lowers the op itself)


def _transposed(node: fx.Node, d0: int, d1: int) -> tuple[Any, tuple] | None:
    ndim = node.args[0].meta["val"].dim()
    if ndim < 2:
        return None
    order = list(range(ndim))
    order[d0 % ndim], order[d1 % ndim] = order[d1 % ndim], order[d0 % ndim]
    return aten.permute.default, (node.args[0], order)


def _reshaped(node: fx.Node) -> tuple[Any, tuple] | None:
    """A reshape that can view its input is that view (otherwise it copies: traced)."""
    x, size = node.args[0].meta["val"], node.args[1]
    try:
        with x.fake_mode:
            x.view(size)
    except (RuntimeError, ValueError):  # not viewable (fake tensors raise either)
        return None
    return aten.view.default, (node.args[0], size)


# What Inductor's decompositions make of the views a lowered program is full of, without tracing them
# (a trace costs ~5 ms; a layer's backward has some fifty): the same op, the same metadata, so each
# value keeps its fake value. None: trace the decomposition after all.
_REWRITES: dict[Any, Callable[[fx.Node], tuple[Any, tuple] | None]] = {
    aten.t.default: lambda n: _transposed(n, 0, 1),
    aten.transpose.int: lambda n: _transposed(n, n.args[1], n.args[2]),
    aten._unsafe_view.default: lambda n: (aten.view.default, n.args),
    aten.reshape.default: _reshaped,
    aten.detach.default: lambda n: (aten.alias.default, n.args),
}


def takes_directly(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> bool:
    """Whether ``gm`` is a graph Inductor can take without AOTAutograd: calls of ATen (or custom)
    operators that mutate nothing, static shapes, tensors in and out; and this torch has the entry
    points ``compile_direct`` calls."""
    if not _entry_points() or not all(isinstance(x, FakeTensor) and not _symbolic(x) for x in example_inputs):
        return False
    for node in gm.graph.nodes:
        if node.op == "call_function":
            if node.target is operator.getitem:
                continue
            if not isinstance(node.target, torch._ops.OpOverload) or node.target._schema.is_mutable:
                return False
        elif node.op == "output":
            outs = node.args[0]
            if not isinstance(outs, (tuple, list)) or not all(isinstance(a, fx.Node) for a in outs):
                return False
        elif node.op not in ("placeholder", "get_attr"):
            return False
    return True


@functools.cache
def _entry_points() -> bool:
    """Whether Inductor's private entry points are there as torch 2.13 has them (elsewhere: ``compile_fx``)."""
    try:
        from torch._dynamo.utils import get_inputs_devices  # noqa: F401
        from torch._inductor.compile_fx import _recursive_joint_graph_passes, compile_fx_inner  # noqa: F401
    except ImportError:
        return False
    return "input_device" in inspect.signature(_recursive_joint_graph_passes).parameters


def _symbolic(x: torch.Tensor) -> bool:
    return any(isinstance(s, torch.SymInt) for s in (*x.shape, *x.stride()))


def compile_direct(gm: fx.GraphModule, example_inputs: Sequence[FakeTensor]) -> Callable[..., list[Any]]:
    """``gm`` (``takes_directly``) compiled by Inductor's inner compiler as ``compile_fx`` would compile it
    for inference, under the Inductor config in force; the result takes the inputs as arguments."""
    from torch._dynamo.utils import get_inputs_devices
    from torch._inductor.compile_fx import _recursive_joint_graph_passes, compile_fx_inner

    program = copy_graph_module(gm)
    mode = example_inputs[0].fake_mode if example_inputs else FakeTensorMode()
    key = prepared_key(program, example_inputs)  # a second run reads the prepared program (prepared_cache.py)
    prepared = load_prepared(key, example_inputs, mode) if key is not None else None
    if prepared is not None:
        program = prepared
    else:
        program_fake_values(program, example_inputs, mode)
        decompose_for_inductor(program, mode)
        devices = get_inputs_devices(example_inputs, program)
        program = _recursive_joint_graph_passes(program, input_device=next(iter(devices), None))
        if key is not None:
            store_prepared(key, program)
    _give_code_if_no_calls(program)
    output = program.graph.find_nodes(op="output")[0]
    output.meta["user_visible_output_idxs"] = list(range(len(output.args[0])))  # strides as the program's values
    context = torch._guards.TracingContext.try_get() or torch._guards.TracingContext(mode)
    with torch._guards.tracing(context), _wrapper_config():  # the FX graph cache reads the shape environment
        compiled = compile_fx_inner(program, list(example_inputs), is_inference=True,
                                    cpp_wrapper=torch._inductor.config.cpp_wrapper)

    def run(*args: Any) -> list[Any]:
        return compiled(list(args))  # Inductor's boxed convention: the list is its to empty

    return run


def _give_code_if_no_calls(program: fx.GraphModule) -> None:
    """Inductor hands back a program without calls (an identity: a DTensor hook's redistribute to the layout
    a value has) as its own Python ``forward``; one loaded from disk (``load_prepared``) has no code until written."""
    if not any(node.op == "call_function" for node in program.graph.nodes):
        program.recompile()


def _wrapper_config() -> Any:
    """The config ``compile_fx`` adds for its C++ wrapper (``config.cpp_wrapper``: ``cpu_wrapper.py``)."""
    from torch._inductor import config
    from torch._inductor.compile_fx import get_cpp_wrapper_config

    return config.patch(get_cpp_wrapper_config()) if config.cpp_wrapper else contextlib.nullcontext()


def decompose_for_inductor(gm: fx.GraphModule, mode: FakeTensorMode) -> None:
    """Replace in place each call Inductor's decomposition table (or a composite op's own) rewrites by
    what it rewrites it to, as AOTAutograd's trace would. Every value has its fake ``meta["val"]``."""
    from torch._inductor.decomposition import select_decomp_table

    table = select_decomp_table()
    traced: dict[Any, Any] = {}
    for node in list(gm.graph.nodes):
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        if target not in table and not target.has_kernel_for_dispatch_key(_IMPLICIT):
            continue
        rewritten = _REWRITES[target](node) if target in _REWRITES and not node.kwargs else None
        if rewritten is not None:
            node.target, node.args = rewritten
            continue
        key = (target, metadata((node.args, node.kwargs)))
        if key not in traced:
            traced[key] = _decomposition(node, table, mode)
        if traced[key] is not _KEPT:
            _splice(gm, node, traced[key], mode)
    gm.graph.lint()
    gm.recompile()


def _decomposition(node: fx.Node, table: dict, mode: FakeTensorMode) -> Any:
    """The graph a call of ``node``'s op on its arguments' metadata decomposes to, or ``_KEPT``."""
    from torch.fx.experimental.proxy_tensor import make_fx

    target = node.target
    flat, spec = pytree.tree_flatten((node.args, node.kwargs))
    if target in table:  # most of the table's entries decline most calls (NotImplemented): no trace needed
        args, kwargs = pytree.tree_unflatten([a.meta["val"] if isinstance(a, fx.Node) else a for a in flat], spec)
        with mode:
            if table[target](*args, **kwargs) is NotImplemented:
                return _KEPT
    positions = [i for i, a in enumerate(flat) if isinstance(a, fx.Node)]

    def call(*tensors: Any) -> Any:
        values = list(flat)
        for i, t in zip(positions, tensors):
            values[i] = t
        args, kwargs = pytree.tree_unflatten(values, spec)
        return target(*args, **kwargs)

    with mode:
        graph = make_fx(call, decomposition_table=table)(*[flat[i].meta["val"] for i in positions])
    calls = [n for n in graph.graph.nodes if n.op == "call_function"]
    if len(calls) == 1 and calls[0].target is target:
        return _KEPT
    return graph


def _splice(gm: fx.GraphModule, node: fx.Node, decomposed: fx.GraphModule, mode: FakeTensorMode) -> None:
    """``node`` replaced by a copy of ``decomposed`` (its placeholders: ``node``'s tensor arguments); kept
    where it has several results and some reader takes them other than one by one (``getitem``)."""
    returned = decomposed.graph.find_nodes(op="output")[0].args[0]
    if not isinstance(returned, fx.Node) and any(u.target is not operator.getitem for u in node.users):
        return
    inputs = iter(a for a in pytree.tree_leaves((node.args, node.kwargs)) if isinstance(a, fx.Node))
    env: dict[fx.Node, Any] = {}
    added: list[fx.Node] = []
    result: Any = None
    with gm.graph.inserting_before(node):
        for n in decomposed.graph.nodes:
            if n.op == "placeholder":
                env[n] = next(inputs)
            elif n.op == "output":
                result = fx.node.map_arg(n.args[0], lambda a: env[a])
            elif n.op == "get_attr":  # a constant the decomposition made: the program holds its own
                name = _fresh_attr(gm, n.target)
                setattr(gm, name, getattr(decomposed, n.target))
                env[n] = gm.graph.get_attr(name)
                added.append(env[n])
            else:
                env[n] = copy_node(gm.graph, n, lambda a: env[a])
                added.append(env[n])
    fake_values(gm, added, mode)
    if isinstance(result, fx.Node):
        node.replace_all_uses_with(result)
    else:  # several results: the program reads them through getitem
        for user in list(node.users):
            user.replace_all_uses_with(result[user.args[1]])
            gm.graph.erase_node(user)
    gm.graph.erase_node(node)


def _fresh_attr(gm: fx.GraphModule, base: str) -> str:
    k = 0
    while hasattr(gm, f"_decomposed_{base}_{k}"):
        k += 1
    return f"_decomposed_{base}_{k}"
