"""The spellings of a dropless MoE's parts in Dynamo's graph, each read by one small rule.

Stage 1's rewrite (``routed_experts.py``) finds a routed region by what its nodes are: a sort by expert,
the per-expert counts, row gathers, row-wise ops and grouped matmuls, stacks spread over the rows, the
adds back into tokens. Models spell each part their own way (torchtitan's one-hot counts and its
``deterministic_scatter_add``, transformers' unstable sort, ``histc(max=E - 1)`` and grouped_mm fallback op,
GPT-OSS's ``addcmul``); this module holds those spellings, as data (the op-name sets) and as functions of
one node, each saying why its form means what the rewrite needs. Nodes are Dynamo's (``call_function``
of torch functions, ``call_method`` of tensor methods), read by name and static shape.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.fx as fx

from fxshard.backend.capture.dynamo_calls import kept_whole_by_dynamo


ELEMENTWISE = frozenset({
    "mul", "add", "sub", "truediv", "div", "neg", "silu", "gelu", "relu", "sigmoid", "tanh", "exp", "pow", "square",
    "sqrt", "rsqrt", "clamp", "float", "bfloat16", "half", "to", "type_as", "contiguous", "erf", "abs", "where",
    "addcmul",  # GPT-OSS's swiglu (torchtitan/models/gpt_oss/moe.py): out + out * linear, elementwise
})


# in-place elementwise ops on a region value (transformers' ``out.add_(bias)`` after a grouped matmul): the body
# copies the region's nodes in graph order, so the write lands before every later read of it there; region values
# never alias a tensor outside (its seeds are fresh gathers), and none is read outside, so no one else sees it
IN_PLACE = frozenset({"add_", "sub_", "mul_", "div_"})


COUNT_OPS = frozenset({"cumsum", "to", "int", "long", "float", "view", "reshape", "type"})  # safe on each rank's counts


CASTS_AND_FLATS = frozenset({"to", "float", "long", "int", "view", "reshape", "flatten", "contiguous"})


STACK_VIEWS = frozenset({"transpose", "to", "bfloat16", "float", "half", "contiguous", "permute"})


# custom ops that are ``out.scatter_add(0, index, src)`` called as ``op(out, index, src)``: torchtitan's combine
# (torchtitan/ops/scatter_add.py runs exactly that under deterministic algorithms; its autograd is scatter_add's)
SCATTER_ADD_OPS = frozenset({"torchtitan::deterministic_scatter_add"})


# custom ops that are ``torch._grouped_mm(input, weight, offs=offs)``: transformers' fallback for weights not in bf16
# under torch.compile (integrations/moe.py: rows [offs[e-1], offs[e]) times weight[e], each group alone; called as
# ``op(input, weight, offs=offs)``), its autograd its own
GROUPED_MM_OPS = frozenset({"transformers::grouped_mm_fallback"})


def name_of(n: Any) -> str | None:
    if not isinstance(n, fx.Node):
        return None
    if n.op == "call_method":
        return n.target
    if n.op == "call_function":
        return getattr(n.target, "__name__", None)
    return None


def example(n: Any) -> Any:
    return n.meta.get("example_value") if isinstance(n, fx.Node) else None


def shape_of(n: Any) -> tuple | None:
    """A value's shape, or None for a non-tensor and for symbolic sizes (a graph Dynamo made dynamic: left as
    written, every check here being on static sizes)."""
    v = example(n)
    if not isinstance(v, torch.Tensor) or not all(isinstance(d, int) for d in v.shape):
        return None
    return tuple(v.shape)


def argument(n: fx.Node, i: int, key: str, default: Any = None) -> Any:
    """Argument ``i`` (or keyword ``key``) of a call, counting the tensor a method is called on as argument 0."""
    return n.args[i] if len(n.args) > i else n.kwargs.get(key, default)


def stripped(n: Any) -> Any:
    """``n`` without casts and flattening views (``keys.view(-1).float()`` -> ``keys``' root)."""
    while name_of(n) in CASTS_AND_FLATS and n.op == "call_method" \
            or (name_of(n) == "flatten" and n.op == "call_function"):
        n = n.args[0]
    return n


def sorts_by_expert(n: Any) -> bool:
    """Whether ``n`` is ``torch.sort(keys)`` ascending along dim 0 / -1, stable or not (transformers' grouped_mm
    experts sort without ``stable``): a sort that is not stable orders the rows of one expert arbitrarily, but the
    region's result does not depend on the order of the rows between sort and combine (the soundness check keeps
    that order unseen), only on each row's expert, which any ascending sort groups the same way."""
    return name_of(n) == "sort" and argument(n, 1, "dim", -1) in (0, -1) and not argument(n, 2, "descending", False)


def sorted_source(n: Any) -> Any:
    """``x`` where ``n`` is ``sort(x)[0]`` (the sorted values: transformers counts ``histc(sort(ids)[0])``), else
    ``n``: a sort permutes its input, so the counts of its values are the counts of what it sorts."""
    if name_of(n) == "getitem" and n.args[1] == 0 and name_of(n.args[0]) == "sort":
        return n.args[0].args[0]
    return n


def last_bin_is_top_expert(bins: int, hi: Any) -> bool:
    """``histc(ids, bins=E, min=0, max=E - 1)`` (transformers' grouped_mm experts) counts integer ids in [0, E)
    per expert too: id ``v < E - 1`` falls in bin ``floor(v * E / (E - 1)) = v`` and ``E - 1``, the max, in the
    last; float32 rounding keeps that exact for E up to 4096 (checked for every id), not beyond."""
    return isinstance(hi, int) and 2 <= bins <= 4096 and hi == bins - 1


def topk_ids(n: Any) -> bool:
    """Whether ``n`` is ``topk(...)[1]`` along the last dim (each row's ids distinct)."""
    if name_of(n) != "getitem" or n.args[1] != 1 or name_of(n.args[0]) != "topk":
        return False
    ndim = len(shape_of(n) or ())
    return ndim > 0 and argument(n.args[0], 2, "dim", -1) in (-1, ndim - 1)


def one_hot_counts(n: fx.Node, root: Any, keys_shape: tuple | None) -> int | None:
    """E where ``n`` is ``zeros_like(s, dtype=bool).scatter_(-1, ids, True).sum(dim=(0, .., -2))`` over ``[.., E]``
    zeros (torchtitan's MoE counts its tokens per expert so): that is ``bincount(ids.view(-1), minlength=E)``
    only because each row of ``ids`` holds distinct experts, so ``ids`` must be a last-dim topk's indices
    (the keys' root), and the zeros must be fresh and read by the scatter alone (it writes them in place)."""
    if name_of(n) != "sum" or n.op != "call_method" or argument(n, 2, "keepdim", False) or shape_of(n) is None \
            or len(shape_of(n)) != 1:
        return None
    hot = n.args[0]
    if name_of(hot) not in ("scatter_", "scatter") or hot.op != "call_method" or len(hot.args) != 4 and \
            "value" not in hot.kwargs or "reduce" in hot.kwargs:  # scatter_(.., reduce="multiply") of zeros is zeros
        return None
    base, dim, index, value = hot.args[0], argument(hot, 1, "dim"), argument(hot, 2, "index"), argument(hot, 3, "value")
    shape = shape_of(base)
    if shape is None or index is not root or not topk_ids(index) or value not in (True, 1) \
            or name_of(base) not in ("zeros_like", "zeros", "new_zeros") or list(base.users) != [hot] \
            or dim not in (-1, len(shape) - 1) or shape_of(index)[:-1] != shape[:-1] or keys_shape is None \
            or math.prod(shape_of(index)) != math.prod(keys_shape):
        return None
    dims = argument(n, 1, "dim")
    dims = tuple(d % len(shape) for d in (dims if isinstance(dims, (tuple, list)) else (dims,)) if isinstance(d, int))
    return shape[-1] if sorted(dims) == list(range(len(shape) - 1)) and shape_of(n) == (shape[-1],) else None


def expanded_index(n: Any) -> Any:
    """The 1-D index ``i`` of ``i.view(-1, 1).expand(-1, d)`` (a gather's or scatter_add's index: each row
    ``p`` of it all ``i[p]``), or None for any other index (``i.view(1, -1).expand(n, -1)`` reads otherwise)."""
    if name_of(n) not in ("expand", "expand_as"):
        return None
    column = n.args[0]
    if shape_of(column) is None or len(shape_of(column)) != 2 or shape_of(column)[1] != 1 \
            or name_of(column) not in ("view", "reshape", "unsqueeze"):
        return None
    index = column.args[0]
    shape = shape_of(index)
    return index if shape is not None and len(shape) == 1 and shape[0] == shape_of(column)[0] else None


def runs_a_cumsum(offs: fx.Node) -> bool:
    """Whether the offsets are a running sum of the counts (a grouped matmul's ``offs``: each group's end)."""
    todo = [offs]
    while todo:
        n = todo.pop()
        if name_of(n) == "cumsum" and argument(n, 1, "dim", 0) in (0, -1):
            return True
        todo.extend(n.all_input_nodes)
    return False


def added_back(n: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node] | None:
    """(destination, index, source) of ``Z.index_add(0, i, s)`` / ``Z.scatter_add(0, i.expand, s)``."""
    name = name_of(n)
    if name == "index_add" and argument(n, 1, "dim") == 0 and argument(n, 4, "alpha", 1) == 1:
        return n.args[0], argument(n, 2, "index"), argument(n, 3, "source")
    if name == "scatter_add" and argument(n, 1, "dim") == 0:
        index, src = argument(n, 2, "index"), argument(n, 3, "src")
        if shape_of(index) == shape_of(src):
            return n.args[0], expanded_index(index), src
    schema = getattr(getattr(n.target, "_schema", None), "name", None) if n.op == "call_function" else None
    if schema in SCATTER_ADD_OPS and len(n.args) == 3 and not n.kwargs:
        dest, index, src = n.args
        if shape_of(index) == shape_of(src):
            return dest, expanded_index(index), src
    return None


def is_grouped_mm(n: fx.Node) -> bool:
    """``torch._grouped_mm(a, b, offs=offs)`` (``F.grouped_mm`` inlines to it), or an op in ``GROUPED_MM_OPS``."""
    return name_of(n) == "_grouped_mm" or schema_name(n) in GROUPED_MM_OPS


def schema_name(n: fx.Node) -> str | None:
    """A custom op's qualified name (Dynamo records ``torch.ops.ns.op(...)`` as the packet, which has no schema)."""
    if n.op != "call_function":
        return None
    return getattr(getattr(n.target, "_schema", None), "name", None) or getattr(n.target, "_qualified_op_name", None)


class TransformersGroupedMm(torch.autograd.Function):
    """``transformers::grouped_mm_fallback`` with an autograd torch.func can run: the body's vjp is torch.func's
    (fxshard/routing.py), and an op's ``register_autograd`` is an autograd.Function without ``setup_context``,
    which functorch refuses; this one runs transformers' own forward and backward ops."""

    @staticmethod
    def forward(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        return torch.ops.transformers.grouped_mm_fallback(x, w, offs=offs)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        x, w, offs = ctx.saved_tensors
        return (*torch.ops.transformers.grouped_mm_fallback_backward(x, w, offs, grad), None)


@kept_whole_by_dynamo  # Dynamo (the op's compiled kernels) would inline it under torch.func and fail as eager
def transformers_grouped_mm(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return TransformersGroupedMm.apply(input, weight, offs)


# a body's form of an op of the region (``_body``): the same values, differentiable by torch.func
BODY_FORMS = {"transformers::grouped_mm_fallback": transformers_grouped_mm}


def row_wise(n: fx.Node, inside: Callable[[Any], bool]) -> bool:
    """Whether ``n`` computes each row from the same row of its region inputs (and broadcast others)."""
    name, out = name_of(n), shape_of(n)
    if out is None or not out:  # a chunk or split of the rows' features (a tuple), or a scalar (not row-wise)
        return isinstance(example(n), (tuple, list)) and name in ("chunk", "split") and inside(n.args[0]) \
            and argument(n, 2, "dim", 0) not in (0, -len(shape_of(n.args[0])))
    rows = out[0]
    tensors = [a for a in n.all_input_nodes if isinstance(example(a), torch.Tensor)]
    if any(inside(a) and shape_of(a)[0] != rows for a in tensors):
        return False
    if name in ELEMENTWISE or name in IN_PLACE and inside(n.args[0]):
        return all(inside(a) or len(shape_of(a)) < len(out) or shape_of(a)[0] == 1 for a in tensors)
    source = n.args[0]
    if not inside(source) or [a for a in tensors if inside(a)] != [source] * len([a for a in tensors if inside(a)]):
        return False
    if name == "getitem":  # a chunk's part, or rows kept whole: x[:, None], x[..., ::2]
        index = n.args[1]
        if isinstance(example(source), (tuple, list)):
            return isinstance(index, int)
        index = index if isinstance(index, tuple) else (index,)
        first = index[0] if index else None
        return (first == slice(None) or first is Ellipsis and len(shape_of(source)) > len(index) - 1) \
            and not any(isinstance(i, fx.Node) for i in index)
    if name in ("view", "reshape", "flatten", "unsqueeze"):
        return out[0] == shape_of(source)[0] and (name != "unsqueeze" or argument(n, 1, "dim") not in (0, -len(out)))
    if name == "_grouped_mm":
        return False  # region.grow checks its operands
    return False


def strip_calls(n: Any, names: tuple) -> Any:
    while name_of(n) in names and n.op == "call_method":
        n = n.args[0]
    return n


def stack_source(n: fx.Node) -> fx.Node:
    """The tensor a weight stack is a view or cast of, as long as its dim 0 stays the experts'."""
    while name_of(n) in STACK_VIEWS:
        if name_of(n) in ("transpose", "permute"):
            ndim = len(shape_of(n))
            moved = [a % ndim for a in n.args[1:] if isinstance(a, int)]
            if name_of(n) == "permute" and moved[:1] != [0] or name_of(n) == "transpose" and 0 in moved:
                break
        n = n.args[0]
    return n
