"""Signatures: einsum-like declarations of how an op's dims relate, and the rules that compute them.

Most ops are one declaration over named factors (``mm: "m k, k n -> m n"``): a factor that
appears in inputs but not in the output is contracted, so sharding it makes the output
Partial with the rule's reduce op. ``partial_groups`` says through which inputs the op is
linear: the output may stay Partial when every input of one group is Partial on the same axes
and the others are not (mm: either operand; add: both together). Pointwise ops, reductions and
permutes get their declaration computed from shapes by the rules below; which op uses which
rule is the op registry's (fxshard/registry.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

aten = torch.ops.aten

LINEAR_OPS = ("sum", "avg")  # partial reduce ops that pass through linear maps
ALL_OPS = ("sum", "avg", "max", "min", "product")  # ... and through pure data movement (and zero fills)


@dataclass(frozen=True)
class Signature:
    """Factor names per dim of each tensor input and of the output (None: a size-1 broadcast dim)."""

    inputs: tuple[tuple[str | None, ...], ...]
    output: tuple[str | None, ...]
    reduce: str = "sum"
    partial_groups: tuple[tuple[int, ...], ...] = ()
    partial_ops: tuple[str, ...] = LINEAR_OPS
    whole: frozenset[str] = frozenset()  # factors that must not be sharded (softmax dim)
    addends: tuple[int, ...] = ()  # inputs added outside the contraction (addmm's bias): Partial with it
    extra_outputs: tuple[tuple[str | None, ...], ...] = ()  # further outputs of a multi-output op
    # outputs (0: the first) whose dims smaller than their factor's pieces sum over the group those
    # pieces leave out (grouped-query attention's grad_key, grad_value): Partial(sum) on the axes left out
    group_sums: tuple[int, ...] = ()
    # per output (0: the first), factors it sums over that another output keeps (a grouped matmul's
    # backward: grad_input sums over n, grad_weight is indexed by it): Partial(sum) on their axes there
    summed: tuple[tuple[str, ...], ...] = ()
    # inputs whose dims must hold all of their factors' pieces, never a major part of them (a block mask's query
    # blocks: each rank's rows whole blocks, or the factor stays whole)
    exact: tuple[int, ...] = ()

    @property
    def contracted(self) -> set[str]:
        ins = {f for dims in self.inputs for f in dims if f is not None}
        return ins - {f for dims in (self.output,) + self.extra_outputs for f in dims if f is not None}


def einsum(spec: str, reduce: str = "sum", partial_groups: Sequence[Sequence[int]] = (),
           partial_ops: Sequence[str] = LINEAR_OPS) -> Signature:
    """Parse ``"m k, k n -> m n"`` (``1`` marks a broadcast size-1 dim)."""
    lhs, rhs = spec.split("->")

    def dims(text: str) -> tuple[str | None, ...]:
        return tuple(None if t == "1" else t for t in text.split())

    return Signature(tuple(dims(t) for t in lhs.split(",")), dims(rhs), reduce,
                     tuple(tuple(g) for g in partial_groups), tuple(partial_ops))


def _letters(n: int, offset: int = 0) -> list[str]:
    return [f"d{i + offset}" for i in range(n)]


def broadcast(shapes: Sequence[Sequence[int] | None], out_shape: Sequence[int],
              partial_groups: Sequence[Sequence[int]] = (), partial_ops: Sequence[str] = LINEAR_OPS) -> Signature:
    """Pointwise with numpy broadcasting: output dims are factors; stretched size-1 dims are None."""
    out = _letters(len(out_shape))
    ins = []
    for shape in shapes:
        if shape is None:
            continue
        k = len(out_shape) - len(shape)
        ins.append(tuple(None if (s == 1 and out_shape[k + i] != 1) else out[k + i] for i, s in enumerate(shape)))
    return Signature(tuple(ins), tuple(out), "sum", tuple(tuple(g) for g in partial_groups), tuple(partial_ops))


def reduction(ndim: int, dims: Sequence[int] | None, keepdim: bool, reduce: str,
              partial_ops: Sequence[str] = LINEAR_OPS) -> Signature:
    names = _letters(ndim)
    reduced = set(range(ndim)) if not dims else {d % ndim for d in dims} if ndim else set()
    out = tuple(None if i in reduced else names[i] for i in range(ndim) if keepdim or i not in reduced)
    # a linear reduction passes a sum or avg Partial (the output may then mix them: they commute)
    ok_ops = tuple(op for op in partial_ops if op == reduce or {op, reduce} <= set(LINEAR_OPS)) or ()
    return Signature((tuple(names),), out, reduce, ((0,),) if ok_ops else (), ok_ops)


def permutation(ndim: int, perm: Sequence[int]) -> Signature:
    names = _letters(ndim)
    return Signature((tuple(names),), tuple(names[p % ndim] for p in perm), "sum", ((0,),), ALL_OPS)


def _shape(x: Any) -> tuple[int, ...] | None:
    v = x.meta.get("val") if hasattr(x, "meta") else None
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def _out_shape(node: Any) -> tuple[int, ...]:
    return tuple(node.meta["val"].shape)


# ---- rules: a node's signature, computed from its shapes and arguments ------------------------
RuleFn = Callable[[Any], Signature | None]


def pointwise(partial_groups_of: Callable[[int], Sequence[Sequence[int]]] = lambda n: (),
               partial_ops: Sequence[str] = LINEAR_OPS) -> RuleFn:
    def rule(node: Any) -> Signature:
        shapes = [_shape(a) for a in node.args if _shape(a) is not None]
        return broadcast(shapes, _out_shape(node), partial_groups_of(len(shapes)), partial_ops)
    return rule


def _tensor_positions(node: Any) -> list[int]:
    return [i for i, a in enumerate(node.args) if _shape(a) is not None]


def mul_like(node: Any) -> Signature:
    # linear in each tensor operand separately; a python scalar operand is not a tensor input
    n = len(_tensor_positions(node))
    return broadcast([_shape(a) for a in node.args if _shape(a) is not None], _out_shape(node), [(i,) for i in range(n)])


def div_like(node: Any) -> Signature:
    return broadcast([_shape(a) for a in node.args if _shape(a) is not None], _out_shape(node),
                     [(0,)] if _tensor_positions(node)[:1] == [0] else [])


def select(node: Any) -> Signature:
    """where(cond, x, y): each element is x's or y's, chosen by a cond every rank holds whole, so
    x and y Partial together (over any reduce op) give a Partial output; a replicated one is made
    Partial on the spot (local_partial: the identity on all ranks but the first)."""
    return broadcast([_shape(a) for a in node.args], _out_shape(node), [(1, 2)], ALL_OPS)


SHIFT_OPS = ("avg", "max", "min")  # partial reduce ops that commute with adding the same constant on every rank


def add_like(node: Any) -> Signature:
    n = len(_tensor_positions(node))
    shapes = [_shape(a) for a in node.args if _shape(a) is not None]
    if n < 2:  # x + c with a python scalar: every rank would add c, so a Partial(sum) would count it n times
        return broadcast(shapes, _out_shape(node), [(0,)] if n else [], SHIFT_OPS)
    return broadcast(shapes, _out_shape(node), [tuple(range(n))])


def identity(node: Any) -> Signature:
    return permutation(len(_out_shape(node)), range(len(_out_shape(node))))


def summed_here(node: Any) -> Signature:
    """``fxshard.summed``: the identity no Partial passes (it is reduced before, in the value's dtype)."""
    names = tuple(_letters(len(_out_shape(node))))
    return Signature((names,), names, partial_ops=())


def broadcast_into(shape: Sequence[int], target: Sequence[int], names: Sequence[str]) -> tuple[str | None, ...]:
    """The factors of a tensor of ``shape`` broadcast into ``target``, whose dims are ``names``."""
    return tuple(names[int(f[1:])] if f else None for f in broadcast([shape], target).inputs[0])


def addmm(node: Any) -> Signature:
    bias_f = broadcast_into(_shape(node.args[0]), _out_shape(node), ("m", "n"))
    return Signature((bias_f, ("m", "k"), ("k", "n")), ("m", "n"), "sum", ((0, 1), (0, 2)), addends=(0,))


def scaled_mm(node: Any) -> Signature:
    """``_scaled_mm(a, b, scale_a, scale_b, bias, scale_result)`` (float8 matmuls, torchao's Float8Linear): mm
    whose output is scaled by ``scale_a`` (one value, or one per row of a: [m, 1]) and ``scale_b`` (one, or one per
    column of b: [1, n]). Scaling commutes with the sum over k, so a sharded k gives a Partial(sum) output, the
    bias an addend; a Partial operand does not pass (a float8 value sums no partial)."""
    m, n = _out_shape(node)

    def scale(x: Any, rows: bool) -> tuple[str | None, ...]:
        shape = _shape(x) or ()
        if len(shape) != 2:
            return tuple(None for _ in shape)
        return ("m", None) if rows and shape[0] == m != 1 else (None, "n") if not rows and shape[1] == n != 1 \
            else (None, None)

    args = list(node.args) + [None] * (6 - len(node.args))
    bias = args[4] if args[4] is not None else node.kwargs.get("bias")
    scale_result = args[5] if args[5] is not None else node.kwargs.get("scale_result")
    ins: list[tuple[str | None, ...]] = [("m", "k"), ("k", "n"), scale(args[2], True), scale(args[3], False)]
    addends: tuple[int, ...] = ()
    if _shape(bias) is not None:
        addends = (len(ins),)
        ins.append(broadcast_into(_shape(bias), (m, n), ("m", "n")))
    if _shape(scale_result) is not None:
        ins.append(tuple(None for _ in _shape(scale_result)))
    return Signature(tuple(ins), ("m", "n"), "sum", addends=addends)


def baddbmm(node: Any) -> Signature:
    """beta * self + alpha * (b1 @ b2), batched (ALiBi attention scores): bmm with self as an addend."""
    bias_f = broadcast_into(_shape(node.args[0]), _out_shape(node), ("b", "m", "n"))
    return Signature((bias_f, ("b", "m", "k"), ("b", "k", "n")), ("b", "m", "n"), "sum", ((0, 1), (0, 2)),
                     addends=(0,))


def convolution(node: Any) -> Signature | None:
    """A convolution (not transposed, one group): batch and output channels are independent, input
    channels contract (Partial(sum), the bias an addend); spatial dims stay whole (halos: no rule)."""
    x, w = _shape(node.args[0]), _shape(node.args[1])
    transposed, groups = node.args[6], node.args[8]
    if x is None or w is None or transposed or groups != 1:
        return None
    spatial = len(x) - 2
    x_f = ("n", "c") + tuple(f"x{i}" for i in range(spatial))
    w_f = ("o", "c") + tuple(f"k{i}" for i in range(spatial))
    out = ("n", "o") + tuple(f"y{i}" for i in range(spatial))
    ins = [x_f, w_f] + ([("o",)] if _shape(node.args[2]) is not None else [])
    addends = (2,) if len(ins) == 3 else ()
    return Signature(tuple(ins), out, "sum", ((0,) + addends, (1,) + addends), addends=addends,
                     whole=frozenset(x_f[2:] + w_f[2:]))


def histc(node: Any) -> Signature:
    """Counts of values in fixed bins: a sum over every element, so a sharded input counts its part
    (Partial(sum)); with min == max the range is the data's own, and the input stays whole."""
    ndim = len(_shape(node.args[0]) or ())
    names = tuple(_letters(ndim))
    lo = node.args[2] if len(node.args) > 2 else node.kwargs.get("min", 0)
    hi = node.args[3] if len(node.args) > 3 else node.kwargs.get("max", 0)
    whole = frozenset(names) if lo == hi else frozenset()
    return Signature((names,), ("bins",), "sum", whole=whole)


def reduce_whole(node: Any) -> Signature:
    """A reduction whose partial results fxshard does not combine (all, any: booleans): the reduced
    dims stay whole, the others are independent."""
    ndim = len(_shape(node.args[0]) or ())
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    dims = [dims] if isinstance(dims, int) else dims
    sig = reduction(ndim, dims, keepdim, "sum", partial_ops=())
    return Signature(sig.inputs, sig.output, whole=frozenset(sig.contracted))


def flip_dims(node: Any) -> list[int]:
    return list(node.args[1] if len(node.args) > 1 else node.kwargs["dims"])


def roll_dims(node: Any) -> list[int]:
    """roll's dims; without any it rolls the flattened tensor, which moves elements along every dim."""
    dims = node.args[2] if len(node.args) > 2 else node.kwargs.get("dims", ())
    return list(dims) or list(range(len(_shape(node.args[0]) or ())))


def padded_dims(node: Any) -> list[int]:
    """constant_pad_nd's pad pairs run from the last dim backwards; a (0, 0) pair leaves its dim alone."""
    ndim, pad = len(_shape(node.args[0]) or ()), node.args[1]
    return [ndim - 1 - i for i in range(len(pad) // 2) if pad[2 * i] or pad[2 * i + 1]]


def scan_dim(node: Any) -> list[int]:
    return [node.args[1]]


def pad_partial_ops(node: Any) -> Sequence[str]:
    """A pad's fill is written once per rank: a Partial(sum) passes only a zero fill."""
    fill = node.args[2] if len(node.args) > 2 else node.kwargs.get("value", 0)
    return ALL_OPS if fill == 0 else SHIFT_OPS


def moves_along(dims_of: Callable[[Any], Sequence[int]],
                partial_ops_of: Callable[[Any], Sequence[str]] = lambda node: (), outputs: int = 1) -> RuleFn:
    """An op that moves elements along the dims ``dims_of(node)`` only (flip, roll, pad, scans): those
    stay whole, every other dim is independent, so a block sharded off them is computed where it lies.
    ``partial_ops_of``: the Partial reduce ops that pass through (moving elements keeps shares apart)."""
    def rule(node: Any) -> Signature:
        names = tuple(_letters(len(_shape(node.args[0]) or ())))
        whole = frozenset(names[d % len(names)] for d in dims_of(node)) if names else frozenset()
        ops = tuple(partial_ops_of(node))
        return Signature((names,), names, partial_groups=((0,),) if ops else (), partial_ops=ops, whole=whole,
                         extra_outputs=(names,) * (outputs - 1))
    return rule


def index_add(node: Any) -> Signature:
    """x.index_add(dim, index, source) (index_select's backward): as ``index_copy``, and a sum of
    shares: x and source Partial(sum) together give the Partial(sum) of the result."""
    sig = index_copy(node)
    return Signature(sig.inputs, sig.output, partial_groups=((0, 2),), whole=sig.whole)


def scatter_add(node: Any) -> Signature | None:
    """scatter_add(x, dim, index, src) (cummax's backward): as ``scatter``, and linear in x and src together."""
    sig = scatter(node)
    return None if sig is None else Signature(sig.inputs, sig.output, partial_groups=((0, 2),), whole=sig.whole)


def index_select(node: Any) -> Signature:
    """x.index_select(dim, index): ``dim`` and the index stay whole, x's other dims are independent;
    picking elements keeps a Partial's shares apart. A 0-d x (and index) has no dim to shard."""
    names = tuple(_letters(len(_shape(node.args[0]))))
    if not names:
        return Signature(((), ()), (), partial_groups=((0,),), partial_ops=ALL_OPS)
    d = names[node.args[1] % len(names)]
    return Signature((names, (d,)), names, partial_groups=((0,),), partial_ops=ALL_OPS, whole=frozenset({d}))


def reduce_whole_indexed(node: Any) -> Signature:
    """max/min along a dim -> (values, indices): as ``reduce_whole``, with the indices shaped alike."""
    sig = reduce_whole(node)
    return Signature(sig.inputs, sig.output, whole=sig.whole, extra_outputs=(sig.output,))


def index_copy(node: Any) -> Signature:
    """x.index_copy(dim, index, source) (a static KV cache's write): dim ``dim`` and the index stay
    whole, every other dim of x and source is independent (a cache sharded on heads writes its heads).
    A 0-d x, index and source have no dim to shard."""
    x = _shape(node.args[0])
    if not x:
        return Signature(((), (), ()), ())
    d = node.args[1] % len(x)
    names = tuple(_letters(len(x)))
    source = tuple("i" if k == d else f for k, f in enumerate(names))
    return Signature((names, ("i",), source), names, whole=frozenset({names[d], "i"}))


def softmax(node: Any) -> Signature:
    ndim = len(_out_shape(node))
    dim = node.args[1] % max(ndim, 1)
    names = _letters(ndim)
    return Signature((tuple(names),), tuple(names), whole=frozenset({names[dim]}))


def scan(node: Any) -> Signature:
    """cumsum along ``dim``: every other dim is independent; a sum of shares scans to the sum of scans."""
    ndim = len(_out_shape(node))
    names = _letters(ndim)
    whole = frozenset({names[node.args[1] % ndim]}) if ndim else frozenset()
    return Signature((tuple(names),), tuple(names), partial_groups=((0,),), whole=whole)


def select_along(node: Any) -> Signature:
    """topk / sort along ``dim`` -> (values, indices): that dim stays whole (its output size may
    differ, k of n; a whole factor is never sharded, so one name serves both), the others are
    independent rows."""
    ndim = len(_shape(node.args[0]) or ())
    names = _letters(ndim)
    if node.target is aten.topk.default:
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", -1)
    else:
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", -1)
    whole = frozenset({names[dim % ndim]}) if ndim else frozenset()
    return Signature((tuple(names),), tuple(names), partial_ops=(), whole=whole, extra_outputs=(tuple(names),))


def index(node: Any) -> Signature | None:
    """x[i0, :, i2] (aten.index.Tensor): the indexed dims of x stay whole, its other dims and the
    broadcast dims of the index tensors are independent. The index block goes where torch puts it:
    in place of the indexed dims when they are adjacent, else in front."""
    x_shape, indices = _shape(node.args[0]), node.args[1]
    if x_shape is None:
        return None
    ndim = len(x_shape)
    at = [i for i, ix in enumerate(indices) if ix is not None]
    shapes = [_shape(indices[i]) for i in at]
    if not at or any(sh is None for sh in shapes):
        return None
    b_ndim = max(len(sh) for sh in shapes)
    b = [f"i{j}" for j in range(b_ndim)]
    b_size = [max((sh[j - (b_ndim - len(sh))] for sh in shapes if j >= b_ndim - len(sh)), default=1)
              for j in range(b_ndim)]
    x_names = _letters(ndim)
    index_inputs = tuple(tuple(None if (s == 1 and b_size[b_ndim - len(sh) + k] != 1) else b[b_ndim - len(sh) + k]
                               for k, s in enumerate(sh)) for sh in shapes)
    rest = [x_names[d] for d in range(ndim) if d not in at]
    adjacent = at == list(range(at[0], at[-1] + 1))
    if adjacent:
        out = [x_names[d] for d in range(at[0])] + b + [x_names[d] for d in range(at[-1] + 1, ndim)]
    else:
        out = b + rest
    # picking elements moves data: a Partial x (of any reduce op) stays Partial, its shares picked alike
    return Signature((tuple(x_names),) + index_inputs, tuple(out), partial_groups=((0,),), partial_ops=ALL_OPS,
                     whole=frozenset(x_names[d] for d in at))


def reduce_dims(reduce: str) -> RuleFn:
    def rule(node: Any) -> Signature:
        ndim = len(_shape(node.args[0]) or ())
        dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
        if isinstance(dims, int):
            dims = [dims]
        return reduction(ndim, dims, keepdim, reduce)
    return rule


def reduce_all(reduce: str) -> RuleFn:
    """sum/mean of every element: one output, every dim contracted."""
    return lambda node: reduction(len(_shape(node.args[0]) or ()), None, False, reduce)


def permute(node: Any) -> Signature:
    return permutation(len(_out_shape(node)), node.args[1])


def transpose(node: Any) -> Signature:
    ndim = len(_out_shape(node))
    perm = list(range(ndim))
    if ndim >= 2:
        a, b = (node.args[1] % ndim, node.args[2] % ndim) if len(node.args) > 1 else (0, 1)
        perm[a], perm[b] = perm[b], perm[a]
    return permutation(ndim, perm)


def var_mean(node: Any) -> Signature:
    """var_mean(x, dims, correction, keepdim) -> (var, mean): the reduced dims stay whole."""
    ndim = len(_shape(node.args[0]) or ())
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    keepdim = node.kwargs.get("keepdim", False)
    sig = reduction(ndim, [dims] if isinstance(dims, int) else dims, keepdim, "sum", partial_ops=())
    whole = frozenset(sig.contracted)
    return Signature(sig.inputs, sig.output, whole=whole, extra_outputs=(sig.output,))


def embedding(node: Any) -> Signature:
    """embedding(weight [V, D], indices) = one_hot(indices) @ weight: sharding V contracts it.

    A rank holding rows [lo, hi) of the table looks up the indices that fall there and
    writes zeros elsewhere (lowering/localize.py), so the output is Partial(sum) over the
    axes sharding V and the table is never gathered.
    """
    idx = _letters(len(_shape(node.args[1]) or ()))
    return Signature((("vocab", "emb"), tuple(idx)), tuple(idx) + ("emb",), "sum", ((0,),))


def _indexed_dim(node: Any) -> int | None:
    """For gather/scatter(x, dim, index, ...): ``dim`` when index spans all of x off that dim, else None."""
    x, index = _shape(node.args[0]), _shape(node.args[2])
    if x is None or index is None or len(x) != len(index):
        return None
    dim = node.args[1] % max(len(x), 1)
    if any(a != b for d, (a, b) in enumerate(zip(x, index)) if d != dim):
        return None
    return dim


def gather(node: Any) -> Signature | None:
    """gather(x, dim, index): a sharded ``dim`` of x is looked up locally and masked (Partial(sum))."""
    dim = _indexed_dim(node)
    if dim is None:
        return None
    names = _letters(len(_shape(node.args[0])))
    xs = tuple("looked_up" if d == dim else f for d, f in enumerate(names))
    return Signature((xs, tuple(names)), tuple(names), "sum", ((0,),))


def view_as_complex(node: Any) -> Signature:
    names = _letters(len(_out_shape(node)))
    return Signature(((*names, "re_im"),), tuple(names), whole=frozenset({"re_im"}), partial_groups=((0,),))


def view_as_real(node: Any) -> Signature:
    names = _letters(len(_out_shape(node)) - 1)
    return Signature((tuple(names),), (*names, "re_im"), whole=frozenset({"re_im"}), partial_groups=((0,),))


def triangle(node: Any) -> Signature:
    """triu/tril keep elements by their global (row, col): the last two dims stay whole."""
    names = _letters(len(_out_shape(node)))
    return Signature((tuple(names),), tuple(names), whole=frozenset(names[-2:]), partial_groups=((0,),),
                     partial_ops=ALL_OPS)


def to_copy(node: Any) -> Signature:
    """A dtype/device copy: Partial values stay Partial between floating dtypes, float8 aside (a cast to float8
    is a quantization of the whole value: a partial sum of float8 values is not one). Into a narrower dtype only
    a max or min passes (rounding keeps order): partial sums rounded before they are summed would round on every
    rank what one device rounds once, so they are summed in the wider dtype first."""
    src = node.args[0].meta["val"].dtype
    dst = node.meta["val"].dtype
    groups = [(0,)] if src.is_floating_point and dst.is_floating_point and dst.itemsize > 1 else []
    return pointwise(lambda n: groups, ALL_OPS if dst.itemsize >= src.itemsize else ("max", "min"))(node)


def scatter(node: Any) -> Signature | None:
    """scatter(x, dim, index, value|src): rows along ``dim`` are written by position, so ``dim``
    stays whole; the other dims are independent where index (and src) span all of x."""
    dim = _indexed_dim(node)
    if dim is None:
        return None
    names = _letters(len(_shape(node.args[0])))
    along = tuple("index" if d == dim else f for d, f in enumerate(names))
    inputs = [tuple(names), along] + [along for a in node.args[3:4] if _shape(a) is not None]
    return Signature(tuple(inputs), tuple(names), partial_ops=(), whole=frozenset({names[dim], "index"}))


def slice_scatter(node: Any) -> Signature | None:
    """slice_scatter / select_scatter(x, src, dim, ...): a block of ``dim`` is overwritten, so that dim
    stays whole; the others are independent. Linear in (x, src) together."""
    x, src = _shape(node.args[0]), _shape(node.args[1])
    if x is None or src is None:
        return None
    dim = (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)) % max(len(x), 1)
    names = _letters(len(x))
    if node.target is aten.select_scatter.default:
        src_names = tuple(f for d, f in enumerate(names) if d != dim)
    else:
        src_names = tuple("block" if d == dim else f for d, f in enumerate(names))
    return Signature((tuple(names), src_names), tuple(names), partial_groups=((0, 1),), partial_ops=ALL_OPS,
                     whole=frozenset({names[dim], "block"}))


def index_put_accumulate(node: Any) -> Signature | None:
    """x.index_put_((i,), v, accumulate=True) on dim 0 (embedding's backward): every indexed row sums
    into x, so the index dims contract (sharded: Partial(sum), with x as an addend); x's other dims and
    v's trailing dims are independent.

    x's rows may be sharded too (a vocab-parallel embedding's gradient): each rank accumulates only the
    indices that fall in its rows, shifted into its block (``localization.MaskedAccumulate``), so the
    indices and values come whole on that axis and the full-size gradient is never built."""
    masked = node.target is aten._unsafe_masked_index_put_accumulate.default
    x = _shape(node.args[0])
    indices = node.args[2] if masked else node.args[1]
    values = node.args[3] if masked else node.args[2]
    if not masked and not (node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)):
        return index_put_write(node)
    if x is None or len(indices) != 1 or _shape(indices[0]) is None or _shape(values) is None:
        return None
    idx = _shape(indices[0])
    if tuple(_shape(values)) != tuple(idx) + tuple(x[1:]):
        return None
    rows = tuple(f"i{j}" for j in range(len(idx)))
    rest = tuple(_letters(len(x) - 1, 1))
    x_names = ("rows",) + rest
    mask: list[tuple[str | None, ...]] = []
    if masked:
        mask_shape = _shape(node.args[1])
        if mask_shape is None or tuple(mask_shape)[:len(idx)] != tuple(idx):
            return None
        mask = [rows + tuple(r if s != 1 or x[1 + k] == 1 else None
                             for k, (r, s) in enumerate(zip(rest, mask_shape[len(idx):])))]
    ins = [x_names] + mask + [rows, rows + rest]
    value_pos = len(ins) - 1
    return Signature(tuple(ins), x_names, "sum", ((0, value_pos),), addends=(0,))


def index_put_write(node: Any) -> Signature | None:
    """x.index_put((i,), v) (no accumulate) on dim 0: rows written by index, so the rows and the
    index stay whole; x's other dims and v's trailing dims are independent."""
    x, indices, values = _shape(node.args[0]), node.args[1], node.args[2]
    if x is None or len(indices) != 1 or _shape(indices[0]) is None or _shape(values) is None:
        return None
    idx = _shape(indices[0])
    rest = tuple(_letters(len(x) - 1, 1))
    rows = tuple(f"i{j}" for j in range(len(idx)))
    if len(_shape(values)) > len(idx) + len(rest):
        return None
    v_names = broadcast_into(_shape(values), tuple(idx) + tuple(x[1:]), rows + rest)
    return Signature((("rows",) + rest, rows, v_names), ("rows",) + rest, whole=frozenset(("rows",) + rows))
