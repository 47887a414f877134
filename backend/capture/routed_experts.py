"""Stage 1: a dropless MoE's routed region in Dynamo's graph -> one ``fxshard::routed_experts`` call.

The region (fxshard/routing.py says why it may be one op): the pairs' expert ids ``keys`` sorted
(``order = argsort(keys)``, or ``sort(keys)[1]``, stable or not), rows gathered by ``order`` (pair space)
or ``order // k`` (token space: ``k`` choices per token), row-wise ops and grouped matmuls over them
whose offsets come from the keys' per-expert counts (``histc`` / ``bincount`` / torchtitan's one-hot sum
of topk ids, then ``cumsum``), expert stacks spread over the rows by those counts (``repeat_interleave``: GPT-OSS's
biases; ``S[sort(keys)[0]]``: transformers'), and the results added back into their tokens (``index_add`` /
``scatter_add`` / ``torchtitan::deterministic_scatter_add`` by the same indices) or put back in pair order by
the sort's inverse (transformers' ``inv[order] = arange``, ``rows[inv]``). The rewrite is made only when
every value of the region is read by the region or by those exits (so the rows' order is never
seen), and only when an expert weight stack arrives sharded by expert; anything else leaves the
graph as it is, which is exact (the routing then runs replicated and the experts are gathered).

``rewrite`` returns the graph with each such region replaced: the rows in pair order (a token row
repeated ``k`` times), the op, and each add written as a sum over the ``k`` choices.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx as fx

from fxshard.graph import copy_graph_module
from fxshard.layout import Layout
from fxshard.routing import ROUTED_OPS, register_body

from fxshard.backend.capture import routed_kernels  # noqa: F401  (the ops' compiled kernels)

__all__ = ["rewrite"]

_ELEMENTWISE = frozenset({
    "mul", "add", "sub", "truediv", "div", "neg", "silu", "gelu", "relu", "sigmoid", "tanh", "exp", "pow", "square",
    "sqrt", "rsqrt", "clamp", "float", "bfloat16", "half", "to", "type_as", "contiguous", "erf", "abs", "where",
    "addcmul",  # GPT-OSS's swiglu (torchtitan/models/gpt_oss/moe.py): out + out * linear, elementwise
})
# in-place elementwise ops on a region value (transformers' ``out.add_(bias)`` after a grouped matmul): the body
# copies the region's nodes in graph order, so the write lands before every later read of it there; region values
# never alias a tensor outside (its seeds are fresh gathers), and none is read outside, so no one else sees it
_IN_PLACE = frozenset({"add_", "sub_", "mul_", "div_"})
_COUNT_OPS = frozenset({"cumsum", "to", "int", "long", "float", "view", "reshape", "type"})  # safe on each rank's counts
_CASTS_AND_FLATS = frozenset({"to", "float", "long", "int", "view", "reshape", "flatten", "contiguous"})
_STACK_VIEWS = frozenset({"transpose", "to", "bfloat16", "float", "half", "contiguous", "permute"})
# custom ops that are ``out.scatter_add(0, index, src)`` called as ``op(out, index, src)``: torchtitan's combine
# (torchtitan/ops/scatter_add.py runs exactly that under deterministic algorithms; its autograd is scatter_add's)
_SCATTER_ADD_OPS = frozenset({"torchtitan::deterministic_scatter_add"})
# custom ops that are ``torch._grouped_mm(input, weight, offs=offs)``: transformers' fallback for weights not in bf16
# under torch.compile (integrations/moe.py: rows [offs[e-1], offs[e]) times weight[e], each group alone; called as
# ``op(input, weight, offs=offs)``), its autograd its own
_GROUPED_MM_OPS = frozenset({"transformers::grouped_mm_fallback"})


def _name(n: Any) -> str | None:
    if not isinstance(n, fx.Node):
        return None
    if n.op == "call_method":
        return n.target
    if n.op == "call_function":
        return getattr(n.target, "__name__", None)
    return None


def _val(n: Any) -> Any:
    return n.meta.get("example_value") if isinstance(n, fx.Node) else None


def _shape(n: Any) -> tuple | None:
    """A value's shape, or None for a non-tensor and for symbolic sizes (a graph Dynamo made dynamic: left as
    written, every check here being on static sizes)."""
    v = _val(n)
    if not isinstance(v, torch.Tensor) or not all(isinstance(d, int) for d in v.shape):
        return None
    return tuple(v.shape)


def _arg(n: fx.Node, i: int, key: str, default: Any = None) -> Any:
    """Argument ``i`` (or keyword ``key``) of a call, counting the tensor a method is called on as argument 0."""
    return n.args[i] if len(n.args) > i else n.kwargs.get(key, default)


def _stripped(n: Any) -> Any:
    """``n`` without casts and flattening views (``keys.view(-1).float()`` -> ``keys``' root)."""
    while _name(n) in _CASTS_AND_FLATS and n.op == "call_method" or (_name(n) == "flatten" and n.op == "call_function"):
        n = n.args[0]
    return n


@dataclass
class Region:
    order: fx.Node  # argsort of the keys
    keys: fx.Node
    counts: fx.Node
    experts: int
    indices: dict = field(default_factory=dict)  # node -> k: order (1) or order // k
    seeds: dict = field(default_factory=dict)  # gathered rows -> (source, k)
    rows: list = field(default_factory=list)  # the region's row-wise nodes, in graph order (seeds first)
    count_nodes: list = field(default_factory=list)  # nodes computed from the counts alone (offsets)
    exits: dict = field(default_factory=dict)  # add node -> (destination, index node, source row node)
    stacks: list = field(default_factory=list)  # grouped matmuls' expert weight stacks
    others: list = field(default_factory=list)  # other tensors the region reads (broadcast over rows)
    spreads: dict = field(default_factory=dict)  # a stack's rows repeated by the counts -> that stack (_spread)


def _sorts_by_expert(n: Any) -> bool:
    """Whether ``n`` is ``torch.sort(keys)`` ascending along dim 0 / -1, stable or not (transformers' grouped_mm
    experts sort without ``stable``): a sort that is not stable orders the rows of one expert arbitrarily, but the
    region's result does not depend on the order of the rows between sort and combine (the soundness check keeps
    that order unseen), only on each row's expert, which any ascending sort groups the same way."""
    return _name(n) == "sort" and _arg(n, 1, "dim", -1) in (0, -1) and not _arg(n, 2, "descending", False)


def _orders(gm: fx.GraphModule) -> list[tuple[fx.Node, fx.Node]]:
    """(order, keys) for each stable argsort (or sort's indices) of 1-D integer keys."""
    found = []
    for n in gm.graph.nodes:
        name = _name(n)
        if name == "argsort" and _arg(n, 1, "dim", -1) in (0, -1) and n.kwargs.get("stable"):
            keys = n.args[0]
            order = n
        elif name == "getitem" and _sorts_by_expert(n.args[0]) and n.args[1] == 1:
            keys, order = n.args[0].args[0], n
        else:
            continue
        v = _val(keys)
        if isinstance(v, torch.Tensor) and v.ndim == 1 and not v.dtype.is_floating_point:
            found.append((order, keys))
    return found


def _counts_of(gm: fx.GraphModule, keys: fx.Node) -> tuple[fx.Node, int] | None:
    """The per-expert counts of ``keys`` (histc over [0, E) in E bins, or bincount with minlength E)."""
    root = _stripped(keys)
    for n in gm.graph.nodes:
        name = _name(n)
        if name not in ("histc", "bincount") or _stripped(_unsorted(_stripped(n.args[0]))) is not root:
            continue
        if _shape(n.args[0]) != _shape(keys):
            continue
        if name == "histc":
            bins, lo, hi = _arg(n, 1, "bins", 100), _arg(n, 2, "min", 0), _arg(n, 3, "max", 0)
            if isinstance(bins, int) and lo == 0 and (hi == bins or _last_bin_is_top_expert(bins, hi)):
                return n, bins
        else:
            minlength = _arg(n, 2, "minlength", 0)
            if isinstance(minlength, int) and minlength > 0 and _arg(n, 1, "weights") is None:
                return n, minlength
    for n in gm.graph.nodes:
        experts = _one_hot_counts(n, root, _shape(keys))
        if experts is not None:
            return n, experts
    return None


def _unsorted(n: Any) -> Any:
    """``x`` where ``n`` is ``sort(x)[0]`` (the sorted values: transformers counts ``histc(sort(ids)[0])``), else
    ``n``: a sort permutes its input, so the counts of its values are the counts of what it sorts."""
    if _name(n) == "getitem" and n.args[1] == 0 and _name(n.args[0]) == "sort":
        return n.args[0].args[0]
    return n


def _last_bin_is_top_expert(bins: int, hi: Any) -> bool:
    """``histc(ids, bins=E, min=0, max=E - 1)`` (transformers' grouped_mm experts) counts integer ids in [0, E)
    per expert too: id ``v < E - 1`` falls in bin ``floor(v * E / (E - 1)) = v`` and ``E - 1``, the max, in the
    last; float32 rounding keeps that exact for E up to 4096 (checked for every id), not beyond."""
    return isinstance(hi, int) and 2 <= bins <= 4096 and hi == bins - 1


def _topk_ids(n: Any) -> bool:
    """Whether ``n`` is ``topk(...)[1]`` along the last dim (each row's ids distinct)."""
    if _name(n) != "getitem" or n.args[1] != 1 or _name(n.args[0]) != "topk":
        return False
    ndim = len(_shape(n) or ())
    return ndim > 0 and _arg(n.args[0], 2, "dim", -1) in (-1, ndim - 1)


def _one_hot_counts(n: fx.Node, root: Any, keys_shape: tuple | None) -> int | None:
    """E where ``n`` is ``zeros_like(s, dtype=bool).scatter_(-1, ids, True).sum(dim=(0, .., -2))`` over ``[.., E]``
    zeros (torchtitan's MoE counts its tokens per expert so): that is ``bincount(ids.view(-1), minlength=E)``
    only because each row of ``ids`` holds distinct experts, so ``ids`` must be a last-dim topk's indices
    (the keys' root), and the zeros must be fresh and read by the scatter alone (it writes them in place)."""
    if _name(n) != "sum" or n.op != "call_method" or _arg(n, 2, "keepdim", False) or _shape(n) is None \
            or len(_shape(n)) != 1:
        return None
    hot = n.args[0]
    if _name(hot) not in ("scatter_", "scatter") or hot.op != "call_method" or len(hot.args) != 4 and \
            "value" not in hot.kwargs or "reduce" in hot.kwargs:  # scatter_(.., reduce="multiply") of zeros is zeros
        return None
    base, dim, index, value = hot.args[0], _arg(hot, 1, "dim"), _arg(hot, 2, "index"), _arg(hot, 3, "value")
    shape = _shape(base)
    if shape is None or index is not root or not _topk_ids(index) or value not in (True, 1) \
            or _name(base) not in ("zeros_like", "zeros", "new_zeros") or list(base.users) != [hot] \
            or dim not in (-1, len(shape) - 1) or _shape(index)[:-1] != shape[:-1] or keys_shape is None \
            or math.prod(_shape(index)) != math.prod(keys_shape):
        return None
    dims = _arg(n, 1, "dim")
    dims = tuple(d % len(shape) for d in (dims if isinstance(dims, (tuple, list)) else (dims,)) if isinstance(d, int))
    return shape[-1] if sorted(dims) == list(range(len(shape) - 1)) and _shape(n) == (shape[-1],) else None


def _index_k(n: Any, region: Region) -> int | None:
    """``k`` where ``n`` is ``order`` (1) or ``order // k``."""
    if n is region.order:
        return 1
    if _name(n) == "floordiv" and n.args[0] is region.order and isinstance(n.args[1], int):
        return n.args[1]
    if _name(n) == "div" and n.args[0] is region.order and n.kwargs.get("rounding_mode") == "floor" \
            and isinstance(n.args[1], int):
        return n.args[1]
    return None


def _expanded_index(n: Any) -> Any:
    """The 1-D index ``i`` of ``i.view(-1, 1).expand(-1, d)`` (a gather's or scatter_add's index: each row
    ``p`` of it all ``i[p]``), or None for any other index (``i.view(1, -1).expand(n, -1)`` reads otherwise)."""
    if _name(n) not in ("expand", "expand_as"):
        return None
    column = n.args[0]
    if _shape(column) is None or len(_shape(column)) != 2 or _shape(column)[1] != 1 \
            or _name(column) not in ("view", "reshape", "unsqueeze"):
        return None
    index = column.args[0]
    shape = _shape(index)
    return index if shape is not None and len(shape) == 1 and shape[0] == _shape(column)[0] else None


def _adds_rows_into_tokens(added: tuple, region: Region) -> bool:
    """The add's destination has a row per token of the index (``order // k``: pairs / k rows) and the rows'
    features: what the sum over the k choices it becomes adds into."""
    dest, index, src = added
    k, pairs = region.indices[index], _shape(region.keys)[0]
    shape, rows = _shape(dest), _shape(src)
    return shape is not None and rows is not None and shape[0] * k == pairs and shape[1:] == rows[1:]


def _cumsum_in(offs: fx.Node) -> bool:
    """Whether the offsets are a running sum of the counts (a grouped matmul's ``offs``: each group's end)."""
    todo = [offs]
    while todo:
        n = todo.pop()
        if _name(n) == "cumsum" and _arg(n, 1, "dim", 0) in (0, -1):
            return True
        todo.extend(n.all_input_nodes)
    return False


def _gathered(n: fx.Node, region: Region) -> tuple[fx.Node, fx.Node] | None:
    """(source, index) of a row gather ``t[i]`` / ``index_select(t, 0, i)`` / ``gather(t, 0, i.expand)``."""
    name = _name(n)
    if name == "getitem" and isinstance(n.args[1], fx.Node):
        return n.args[0], n.args[1]
    if name == "index_select" and _arg(n, 1, "dim") == 0:
        return n.args[0], _arg(n, 2, "index")
    if name == "gather" and _arg(n, 1, "dim") == 0:
        index, src = _arg(n, 2, "index"), n.args[0]
        if _shape(index) is not None and _shape(src) is not None and _shape(index)[1:] == _shape(src)[1:]:
            return src, _expanded_index(index)
    return None


def _inverse_write(inv: Any, region: Region) -> fx.Node | None:
    """The ``inv[order] = arange(N)`` (``operator.setitem``) where ``inv`` is ``empty_like(order)`` written so and
    then only read by row gathers ``t[inv]``: the inverse permutation of the sort (transformers' grouped_mm experts
    restore the pairs' order so); None otherwise (another write or read of ``inv`` could see the order)."""
    pairs = _shape(region.keys)[0]
    if _name(inv) not in ("empty_like", "empty", "new_empty") or _shape(inv) != (pairs,):
        return None
    writes = [u for u in inv.users if u.target is operator.setitem]
    reads = [u for u in inv.users if _name(u) == "getitem" and u.args[1] is inv and u.args[0] is not inv]
    if len(writes) != 1 or len(writes) + len(reads) != len(inv.users):
        return None
    write = writes[0]
    _, index, value = write.args
    if index is not region.order or _name(value) != "arange" or not 1 <= len(value.args) <= 2 \
            or value.kwargs.get("step", 1) != 1 or tuple(value.args) not in ((pairs,), (0, pairs)):
        return None
    nodes = list(write.graph.nodes)
    return write if all(nodes.index(write) < nodes.index(r) for r in reads) else None


def _unsorts(n: fx.Node, region: Region) -> tuple[None, fx.Node, fx.Node] | None:
    """(None, inv, source) where ``n`` is ``source[inv]``, the sorted rows put back in pair order by the sort's
    inverse (``_inverse_write``): that is the op's own output for ``source``, so ``n`` becomes it (an exit with
    no add); the pairs' order is the keys', never the sort's, so it shows nothing of the rows' order."""
    if _name(n) != "getitem" or not isinstance(n.args[1], fx.Node) or _inverse_write(n.args[1], region) is None:
        return None
    return None, n.args[1], n.args[0]


def _eliminate_dead_code(graph: fx.Graph, kept: set) -> None:
    """Removes what the rewrite left unread, and nothing else: ``graph.eliminate_dead_code`` drops every unread
    ``call_method``, in-place ones too (DeepseekV3's attention writes ``key_states[..., :d].copy_(k_nope)`` and its
    router ``group_mask.scatter_(..)``, their results unread: dropped, its logits went wrong), and recurses into
    subgraphs; ``kept`` are the nodes unread before the rewrite (the region's own aside), left as they were."""
    for node in reversed(graph.nodes):
        if not node.users and node not in kept and not node.is_impure():
            graph.erase_node(node)


def _drop_inverses(graph: fx.Graph, inverses: list, kept: set) -> None:
    """After the exits that read them are gone: each inverse permutation's write (a setitem, which dead code
    elimination keeps) where nothing reads it, and then what computed it (the global sort)."""
    _eliminate_dead_code(graph, kept)
    for inv in dict.fromkeys(inverses):
        if all(u.target is operator.setitem for u in inv.users):
            for u in list(inv.users):
                graph.erase_node(u)
    _eliminate_dead_code(graph, kept)


def _added(n: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node] | None:
    """(destination, index, source) of ``Z.index_add(0, i, s)`` / ``Z.scatter_add(0, i.expand, s)``."""
    name = _name(n)
    if name == "index_add" and _arg(n, 1, "dim") == 0 and _arg(n, 4, "alpha", 1) == 1:
        return n.args[0], _arg(n, 2, "index"), _arg(n, 3, "source")
    if name == "scatter_add" and _arg(n, 1, "dim") == 0:
        index, src = _arg(n, 2, "index"), _arg(n, 3, "src")
        if _shape(index) == _shape(src):
            return n.args[0], _expanded_index(index), src
    schema = getattr(getattr(n.target, "_schema", None), "name", None) if n.op == "call_function" else None
    if schema in _SCATTER_ADD_OPS and len(n.args) == 3 and not n.kwargs:
        dest, index, src = n.args
        if _shape(index) == _shape(src):
            return dest, _expanded_index(index), src
    return None


def _is_grouped_mm(n: fx.Node) -> bool:
    """``torch._grouped_mm(a, b, offs=offs)`` (``F.grouped_mm`` inlines to it), or an op in ``_GROUPED_MM_OPS``."""
    return _name(n) == "_grouped_mm" or _op_name(n) in _GROUPED_MM_OPS


def _op_name(n: fx.Node) -> str | None:
    """A custom op's qualified name (Dynamo records ``torch.ops.ns.op(...)`` as the packet, which has no schema)."""
    if n.op != "call_function":
        return None
    return getattr(getattr(n.target, "_schema", None), "name", None) or getattr(n.target, "_qualified_op_name", None)


class _TransformersGroupedMm(torch.autograd.Function):
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


@torch._dynamo.allow_in_graph  # Dynamo (the op's compiled kernels) would inline it under torch.func and fail as eager
def _transformers_grouped_mm(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return _TransformersGroupedMm.apply(input, weight, offs)


# a body's form of an op of the region (``_body``): the same values, differentiable by torch.func
_BODY_FORMS = {"transformers::grouped_mm_fallback": _transformers_grouped_mm}


def _row_wise(n: fx.Node, inside: Callable[[Any], bool]) -> bool:
    """Whether ``n`` computes each row from the same row of its region inputs (and broadcast others)."""
    name, out = _name(n), _shape(n)
    if out is None or not out:  # a chunk or split of the rows' features (a tuple), or a scalar (not row-wise)
        return isinstance(_val(n), (tuple, list)) and name in ("chunk", "split") and inside(n.args[0]) \
            and _arg(n, 2, "dim", 0) not in (0, -len(_shape(n.args[0])))
    rows = out[0]
    tensors = [a for a in n.all_input_nodes if isinstance(_val(a), torch.Tensor)]
    if any(inside(a) and _shape(a)[0] != rows for a in tensors):
        return False
    if name in _ELEMENTWISE or name in _IN_PLACE and inside(n.args[0]):
        return all(inside(a) or len(_shape(a)) < len(out) or _shape(a)[0] == 1 for a in tensors)
    source = n.args[0]
    if not inside(source) or [a for a in tensors if inside(a)] != [source] * len([a for a in tensors if inside(a)]):
        return False
    if name == "getitem":  # a chunk's part, or rows kept whole: x[:, None], x[..., ::2]
        index = n.args[1]
        if isinstance(_val(source), (tuple, list)):
            return isinstance(index, int)
        index = index if isinstance(index, tuple) else (index,)
        first = index[0] if index else None
        return (first == slice(None) or first is Ellipsis and len(_shape(source)) > len(index) - 1) \
            and not any(isinstance(i, fx.Node) for i in index)
    if name in ("view", "reshape", "flatten", "unsqueeze"):
        return out[0] == _shape(source)[0] and (name != "unsqueeze" or _arg(n, 1, "dim") not in (0, -len(out)))
    if name == "_grouped_mm":
        return False  # region.grow checks its operands
    return False


def _grow(gm: fx.GraphModule, region: Region) -> bool:
    """The region's row nodes, count nodes and exits from its seeds; False where a value escapes it."""
    inside: set[fx.Node] = set(region.seeds)
    counted: set[fx.Node] = {region.counts}
    for n in gm.graph.nodes:
        if n in inside or n is region.counts:
            continue
        uses_rows = [a for a in n.all_input_nodes if a in inside]
        stack = (_spread(n, region, counted) or _by_sorted_keys(n, region)) if not uses_rows else None
        if stack is not None and stack not in inside:
            inside.add(n)
            region.spreads[n] = stack
            if stack not in region.stacks:
                region.stacks.append(stack)
            continue
        if not uses_rows:
            if _name(n) in _COUNT_OPS and n.all_input_nodes and all(a in counted for a in n.all_input_nodes) \
                    and _shape(n) is not None and len(_shape(n)) == 1:  # per expert still: [experts]
                counted.add(n)
            continue
        added = _added(n)
        if added is not None and added[2] in inside and added[0] not in inside and added[1] in region.indices \
                and _adds_rows_into_tokens(added, region):
            region.exits[n] = added
            continue
        unsorted = _unsorts(n, region)
        if unsorted is not None and unsorted[2] in inside:
            region.exits[n] = unsorted
            continue
        if _is_grouped_mm(n):
            a, b, offs = n.args[0], n.args[1], _arg(n, 2, "offs")
            extra = [x for x in list(n.args[3:]) + [v for k, v in n.kwargs.items() if k != "offs"] if x is not None]
            if a in inside and b not in inside and offs in counted and _cumsum_in(offs) and not extra \
                    and _shape(b) is not None \
                    and _shape(b)[0] == region.experts:
                inside.add(n)
                if b not in region.stacks:
                    region.stacks.append(b)
                continue
            return False
        if _row_wise(n, lambda a: a in inside):
            inside.add(n)
            continue
        return False
    for n in inside:  # nothing of the region is read outside it but by its exits
        if any(u not in inside and u not in region.exits for u in n.users):
            return False
        if any(u in region.exits and region.exits[u][2] is not n for u in n.users):
            return False
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    region.rows = sorted(inside, key=order.__getitem__)
    region.count_nodes = sorted((c for c in counted if c is not region.counts and _feeds(c, inside, counted)),
                                key=order.__getitem__)
    others = [a for n in region.rows if n not in region.seeds and n not in region.spreads for a in n.all_input_nodes
              if a not in inside and a not in counted and a not in region.stacks and isinstance(_val(a), torch.Tensor)]
    region.others = list(dict.fromkeys(others))
    return bool(region.exits) and bool(region.stacks)


def _strip(n: Any, names: tuple) -> Any:
    while _name(n) in names and n.op == "call_method":
        n = n.args[0]
    return n


def _spread(n: fx.Node, region: Region, counted: set) -> fx.Node | None:
    """The stack ``S`` where ``n`` gives each row its expert's row of ``S``: ``S.repeat_interleave(counts, dim=0)``
    (the rows sorted by expert, ``counts[e]`` of them expert ``e``'s), or as GPT-OSS writes it for a static size,
    ``cat([S, S.new_zeros(1, ..)]).repeat_interleave(cat([counts, (N - cumsum(counts)[-1]).unsqueeze(0)]),
    dim=0, output_size=N)`` with ``N`` the pairs: the counts sum to ``N``, so the padding row is repeated 0 times.
    On a rank that is its experts' rows of ``S`` repeated by their counts, as many as the rows it received."""
    if _name(n) != "repeat_interleave" or _arg(n, 2, "dim") != 0 or len(n.args) < 2 or _shape(n) is None:
        return None
    pairs = _shape(region.keys)[0]
    source, repeats = n.args[0], _strip(_arg(n, 1, "repeats"), ("long", "to", "int"))
    if _arg(n, 3, "output_size", pairs) != pairs or not isinstance(_shape(n)[0], int) or _shape(n)[0] != pairs:
        return None
    if repeats is region.counts:
        stack = source
    elif _name(source) == "cat" and _name(repeats) == "cat" and _arg(source, 1, "dim", 0) == 0 \
            and _arg(repeats, 1, "dim", 0) == 0 and len(source.args[0]) == 2 and len(repeats.args[0]) == 2:
        stack, pad = source.args[0]
        counts, tail = repeats.args[0]
        tail = _strip(tail, ("long", "to", "int", "unsqueeze", "view", "reshape"))
        last = tail.args[1] if _name(tail) == "sub" and tail.args[0] == pairs and len(tail.args) == 2 else None
        total = _strip(last.args[0], ("long", "to", "int")) if _name(last) == "getitem" else None
        if _strip(counts, ("long", "to", "int")) is not region.counts or total is None or last.args[1] != -1 \
                or last.args[0] not in counted or _name(total) != "cumsum" or _arg(total, 1, "dim", 0) not in (0, -1) \
                or _strip(total.args[0], ("long", "to", "int")) is not region.counts \
                or _name(pad) not in ("new_zeros", "zeros") or _shape(pad) is None or _shape(pad)[0] != 1:
            return None
    else:
        return None
    shape = _shape(stack)
    if not isinstance(stack, fx.Node) or shape is None or shape[0] != region.experts or shape[1:] != _shape(n)[1:]:
        return None
    return stack


def _by_sorted_keys(n: fx.Node, region: Region) -> fx.Node | None:
    """The stack ``S`` where ``n`` is ``S[sort(keys)[0]]``, each sorted row's expert's row of ``S`` (transformers'
    grouped_mm experts gather their biases so): the sorted keys are each expert ``e`` ``counts[e]`` times, so that
    is ``S.repeat_interleave(counts, dim=0)``, a spread (``_spread``) whatever order the sort left within an expert."""
    if _name(n) != "getitem" or n.op != "call_function" or not isinstance(n.args[1], fx.Node):
        return None
    stack, index = n.args
    sort = region.order.args[0] if _name(region.order) == "getitem" else None
    if _name(index) != "getitem" or index.args[0] is not sort or index.args[1] != 0 or sort.args[0] is not region.keys:
        return None
    shape = _shape(stack)
    if shape is None or shape[0] != region.experts or _shape(n) != (_shape(region.keys)[0], *shape[1:]):
        return None
    return stack


def _feeds(c: fx.Node, rows: set, counted: set) -> bool:
    """Whether count node ``c`` reaches a row node through count nodes."""
    todo, seen = [c], {c}
    while todo:
        n = todo.pop()
        for u in n.users:
            if u in rows:
                return True
            if u in counted and u not in seen:
                seen.add(u)
                todo.append(u)
    return False


def _find(gm: fx.GraphModule) -> list[Region]:
    regions = []
    for order, keys in _orders(gm):
        counted = _counts_of(gm, keys)
        if counted is None:
            continue
        region = Region(order, keys, counted[0], counted[1])
        if _shape(keys) is None:
            continue
        pairs = _shape(keys)[0]
        region.indices = {n: k for n in gm.graph.nodes if (k := _index_k(n, region)) is not None}
        for n in gm.graph.nodes:
            got = _gathered(n, region)
            if got is None or got[1] not in region.indices:
                continue
            source, index = got
            k = region.indices[index]
            if _shape(source) is not None and _shape(source)[0] * k == pairs and source not in region.seeds:
                region.seeds[n] = (source, k)
        if region.seeds and _grow(gm, region):
            regions.append(region)
    return regions


def _stack_source(n: fx.Node) -> fx.Node:
    """The tensor a weight stack is a view or cast of, as long as its dim 0 stays the experts'."""
    while _name(n) in _STACK_VIEWS:
        if _name(n) in ("transpose", "permute"):
            ndim = len(_shape(n))
            moved = [a % ndim for a in n.args[1:] if isinstance(a, int)]
            if _name(n) == "permute" and moved[:1] != [0] or _name(n) == "transpose" and 0 in moved:
                break
        n = n.args[0]
    return n


def _sharded_by_expert(region: Region, layouts: Mapping[fx.Node, Layout]) -> bool:
    for stack in region.stacks:
        layout = layouts.get(_stack_source(stack))
        if layout is not None and layout.ndim and layout.dim_is_sharded(0):
            return True
    return False


def _body(gm: fx.GraphModule, region: Region) -> tuple[fx.GraphModule, list[fx.Node]]:
    """The region as a graph: (sorted rows of each seed, the counts, stacks, others) -> the exits' sources."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for k, seed in enumerate(region.seeds):
        env[seed] = graph.placeholder(f"rows_{k}")
    env[region.counts] = graph.placeholder("counts")
    for k, x in enumerate(region.stacks + region.others):
        env[x] = graph.placeholder(f"extra_{k}")
    for n in sorted(region.count_nodes + [r for r in region.rows if r not in region.seeds],
                    key=list(gm.graph.nodes).index):
        if n in region.spreads:  # the rank's experts' rows of the stack: as many as the rows it received
            rows = graph.call_method("size", (env[next(iter(region.seeds))], 0))
            repeats = graph.call_method("long", (env[region.counts],))
            env[n] = graph.call_method("repeat_interleave", (env[region.spreads[n]], repeats),
                                       {"dim": 0, "output_size": rows})
            continue
        env[n] = graph.node_copy(n, lambda a: env[a])
        env[n].target = _BODY_FORMS.get(_op_name(n), env[n].target)
    sources = list(dict.fromkeys(src for _, _, src in region.exits.values()))
    graph.output(tuple(env[s] for s in sources))
    return fx.GraphModule(torch.nn.Module(), graph), sources


def _pairs(graph: fx.Graph, source: fx.Node, k: int) -> fx.Node:
    """A token-space tensor in pair space: each row repeated ``k`` times (a view of a broadcast: no gather)."""
    if k == 1:
        return source
    shape = _shape(source)
    wide = graph.call_method("expand", (graph.call_method("unsqueeze", (source, 1)), shape[0], k, *shape[1:]))
    return graph.call_method("reshape", (wide, shape[0] * k, *shape[1:]))


def _replace(gm: fx.GraphModule, region: Region) -> None:
    body, sources = _body(gm, region)
    key = register_body(body)
    graph = gm.graph
    unread = {n for n in graph.nodes if not n.users and n not in region.rows}  # kept: _eliminate_dead_code
    first_exit = min(region.exits, key=list(graph.nodes).index)
    counts_dtype = _val(region.counts).dtype
    with graph.inserting_before(first_exit):
        rows = [_pairs(graph, source, k) for source, k in region.seeds.values()]
        call = graph.call_function(ROUTED_OPS[0], (key, rows, region.keys, region.stacks + region.others,
                                                    region.experts, len(region.stacks), counts_dtype))
        outs = {s: graph.call_function(operator.getitem, (call, i)) for i, s in enumerate(sources)}
    for node, (dest, index, source) in region.exits.items():
        k = 1 if dest is None else region.indices[index]  # an unsorting gather's rows are the op's (_unsorts)
        shape = _shape(source)
        with graph.inserting_before(node):
            out = outs[source]
            if k > 1:
                out = graph.call_method("sum", (graph.call_method("view", (out, shape[0] // k, k, *shape[1:])), 1))
            new = out if dest is None else graph.call_function(operator.add, (dest, out))
        node.replace_all_uses_with(new)
    _drop_inverses(graph, [index for dest, index, _ in region.exits.values() if dest is None], unread)


def rewrite(gm: fx.GraphModule, layouts: Mapping[fx.Node, Layout]) -> fx.GraphModule:
    """``gm`` with each dropless routed region whose experts are sharded by expert as a routed-experts op
    (a copy; ``gm`` itself where there is none). ``layouts``: the placeholders' layouts."""
    regions = [r for r in _find(gm) if _sharded_by_expert(r, layouts)]
    if not regions:
        return gm
    out = copy_graph_module(gm)
    mapping = dict(zip(gm.graph.nodes, out.graph.nodes))
    for region in _find(out):
        if any(mapping.get(r.order) is region.order for r in regions):
            _replace(out, region)
    out.recompile()
    return out
