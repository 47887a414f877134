"""One inference program for every length of a dim that grows, where the plan never shards it.

fxshard plans for concrete sizes (``sizes.py``), so a graph Dynamo made dynamic got one program per
set of sizes: ``generate()`` on Hugging Face's default cache (``DynamicCache``, one position more per
token) compiled all six stages and Inductor once per token. Yet the program such a dim passes
through does not depend on its length when no layout shards it: no collective, slice or view of
the local program names that length, and every rank holds all of it.

So ``PerSizePrograms`` compares each program it compiles with the one before (``generalize``): two
inference programs whose local code is the same op for op and argument for argument, but for int
arguments that move with one input's length on a line (a view's or an expand's sizes after a matmul's
decomposition; ``SizeArguments``, checked at a third program too, since a product of two lengths agrees
with a line at two points), whose values have the same layouts but for the sizes that changed, and every
dim whose size changed unsharded in both, on every value. The sizes that changed between the two calls
must also change together, affinely (``Affine``: each one moves with the first by an integer slope, the
cache length ``n``, a mask's ``n + 1``, a stride's ``64 n``), and Dynamo's graph may compute with its
symbolic sizes only by sums and products (``affine_sizes_only``: no ``min``, ``//`` or comparison, whose
values two samples could agree on where others do not, a ``max(0, n - window)`` that is 0 at both). Then
one program, the earlier one's local code with its moving arguments read from that input's size, is
compiled by Inductor for symbolic sizes of those dims, whole (``SizeGenericProgram``), and serves every
later call whose sizes the affine relation predicts; its shape guards (what Inductor assumed of the
symbols) are checked on every call, and a call that fails any check compiles a program of its own as
before. The checks read global sizes and unsharded ones, alike on every rank; and whichever program a
rank runs, it issues the same collectives, the program for symbolic sizes being the same local code.
Until then each size's first call runs its local program uncompiled (``sizes.py``): the samples cost
stages 1-5, not an Inductor compile each.
"""
from __future__ import annotations

import logging
import operator
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Sequence

import torch
import torch.fx as fx

from fxshard.graph import LAYOUT
from fxshard.layout import Layout

log = logging.getLogger("fxshard")

# what Dynamo's graph may compute from its symbolic sizes for a program to serve them all: reads of a
# size, sums and products (``sym_sum`` is Dynamo's n-ary sum)
AFFINE_SIZE_OPS = {operator.add, operator.sub, operator.mul, operator.neg, operator.getitem, torch.sym_sum,
                   torch.ops.aten.sym_size.int, torch.ops.aten.sym_numel.default, torch.ops.aten.sym_stride.int}
SIZE_METHODS = {"size", "numel", "stride", "dim"}
# a dim of length 0 or 1 is special to the traces (broadcasting, squeezing): the program serves lengths from 2
SMALLEST = 2
# readers and writers kept per size (a decode step's sizes recur in the next generate() call); past this, dropped
KEPT = 4096


def affine_sizes_only(gm: fx.GraphModule) -> bool:
    """Whether every symbolic number of Dynamo's graph is a size read, a sum or a product of them."""
    for node in gm.graph.nodes:
        value = node.meta.get("example_value")
        if node.op in ("placeholder", "output") or not isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            continue
        if isinstance(value, (torch.SymFloat, torch.SymBool)):
            return False
        if not (node.op == "call_function" and node.target in AFFINE_SIZE_OPS
                or node.op == "call_method" and node.target in SIZE_METHODS):
            return False
    return True


def flat_key(key: Sequence[Any]) -> tuple:
    """A sizes key (``sizes.sizes_key``) as one flat tuple of numbers (and None where an argument has none)."""
    out: list[Any] = []
    for entry in key:
        if isinstance(entry, tuple):
            for part in entry:
                out.extend(part)
        else:
            out.append(entry)
    return tuple(out)


def whole_slope(change: int, step: int) -> int | None:
    """``change / step`` where it is an integer, else None (a size that moves by a fraction of the length's move)."""
    slope, rest = divmod(change, step)
    return None if rest else slope


@dataclass(frozen=True)
class Affine:
    """Which numbers of a sizes key vary, as ``base[i] + slopes[i] * (key[driver] - base[driver])``."""

    base: tuple
    driver: int
    slopes: tuple[tuple[int, int], ...]  # (index, slope) of every varying number, the driver's slope 1

    @classmethod
    def between(cls, a: Sequence[Any], b: Sequence[Any]) -> "Affine | None":
        """The relation two flat keys ``a`` and ``b`` fit, or None: entries that differ are all ints, each
        a whole multiple of the first one's change."""
        if len(a) != len(b):
            return None
        varying = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
        if not varying or not all(type(a[i]) is int and type(b[i]) is int for i in varying):
            return None
        driver = varying[0]
        slopes = [(i, whole_slope(b[i] - a[i], b[driver] - a[driver])) for i in varying]
        if any(slope is None for _, slope in slopes):
            return None
        return cls(tuple(a), driver, tuple(slopes))

    def predicts(self, key: Sequence[Any]) -> bool:
        """Whether ``key`` (flat) is on the line: fixed numbers equal, varying ones where the slopes put
        them, each varying size at least ``SMALLEST``."""
        if len(key) != len(self.base):
            return False
        moved = key[self.driver]
        if type(moved) is not int:
            return False
        delta = moved - self.base[self.driver]
        varying = dict(self.slopes)
        for i, (x, y) in enumerate(zip(self.base, key)):
            slope = varying.get(i)
            if slope is None:
                if x != y:
                    return False
            elif type(y) is not int or y != x + slope * delta or y < SMALLEST:
                return False
        return True


@dataclass(frozen=True)
class SizeArguments:
    """The int arguments of a local program that move with its lengths (a view's, an expand's): each
    ``slope * n + offset``, ``n`` the size of dim ``dim`` of the program's input ``source``."""

    source: str | None = None
    dim: int = 0
    terms: tuple[tuple[str, int, int, int], ...] = ()  # (node name, leaf of its (args, kwargs), slope, offset)


def compare_programs(a: fx.GraphModule, b: fx.GraphModule) -> tuple[dict[str, tuple[int, ...]], SizeArguments] | None:
    """Two local programs of the same ops, inputs and constants: per value, the dims whose sizes differ, and
    the int arguments that differ, each an integer-affine function of one input dim's size. None if the
    programs differ otherwise, or a value's layouts differ but for those sizes, or shard one."""
    from torch.utils._pytree import tree_flatten

    nodes_a, nodes_b = list(a.graph.nodes), list(b.graph.nodes)
    if len(nodes_a) != len(nodes_b):
        return None
    dims: dict[str, tuple[int, ...]] = {}
    moved: list[tuple[str, int, int, int]] = []  # (node, leaf, value in a, value in b)
    for x, y in zip(nodes_a, nodes_b):
        if (x.op, x.target, x.name) != (y.op, y.target, y.name):
            return None
        leaves_x, spec_x = tree_flatten((x.args, x.kwargs))
        leaves_y, spec_y = tree_flatten((y.args, y.kwargs))
        if spec_x != spec_y:
            return None
        for k, (u, v) in enumerate(zip(leaves_x, leaves_y)):
            if isinstance(u, fx.Node) or isinstance(v, fx.Node):
                if not (isinstance(u, fx.Node) and isinstance(v, fx.Node) and u.name == v.name):
                    return None
            elif type(u) is int and type(v) is int and u != v:
                moved.append((x.name, k, u, v))
            elif type(u) is not type(v) or u != v:
                return None
        if x.op == "get_attr":
            cx, cy = getattr(a, x.target), getattr(b, y.target)
            if not (isinstance(cx, torch.Tensor) and isinstance(cy, torch.Tensor) and cx.shape == cy.shape
                    and cx.dtype == cy.dtype and torch.equal(cx, cy)):
                return None
        vx, vy = x.meta.get("val"), y.meta.get("val")
        if isinstance(vx, torch.Tensor) != isinstance(vy, torch.Tensor):
            return None
        if not isinstance(vx, torch.Tensor):
            continue
        if vx.dim() != vy.dim() or vx.dtype != vy.dtype:
            return None
        changed = tuple(d for d in range(vx.dim()) if vx.shape[d] != vy.shape[d])
        if not same_but_sizes(x.meta.get(LAYOUT), y.meta.get(LAYOUT), changed):
            return None
        if changed:
            dims[x.name] = changed
    if not moved:
        return dims, SizeArguments()
    source = next((n for n in nodes_a if n.op == "placeholder" and n.name in dims), None)
    if source is None:
        return None
    dim = dims[source.name][0]
    size_a = int(source.meta["val"].shape[dim])
    size_b = int(next(n for n in nodes_b if n.name == source.name).meta["val"].shape[dim])
    slopes = [whole_slope(v - u, size_b - size_a) for _, _, u, v in moved]
    if any(slope is None for slope in slopes):
        return None
    terms = tuple((name, leaf, slope, u - slope * size_a) for (name, leaf, u, _), slope in zip(moved, slopes))
    return dims, SizeArguments(source.name, dim, terms)


def with_size_arguments(gm: fx.GraphModule, sizes: SizeArguments) -> fx.GraphModule:
    """``gm`` with each moving int argument computed from its input's size (``sizes``), in place."""
    from torch.utils._pytree import tree_flatten, tree_unflatten

    if not sizes.terms:
        return gm
    nodes = {n.name: n for n in gm.graph.nodes}
    first = next(n for n in gm.graph.nodes if n.op != "placeholder")
    with gm.graph.inserting_before(first):
        length = gm.graph.call_function(torch.ops.aten.sym_size.int, (nodes[sizes.source], sizes.dim))
    for name, leaf, slope, offset in sizes.terms:
        node = nodes[name]
        with gm.graph.inserting_before(node):
            value = length if slope == 1 else gm.graph.call_function(operator.mul, (length, slope))
            if offset:
                value = gm.graph.call_function(operator.add, (value, offset))
        leaves, spec = tree_flatten((node.args, node.kwargs))
        leaves[leaf] = value
        node.args, node.kwargs = tree_unflatten(leaves, spec)
    gm.recompile()
    return gm


def same_but_sizes(a: Layout | None, b: Layout | None, dims: Sequence[int]) -> bool:
    """Two layouts alike but for the sizes of ``dims``, which neither shards; or no layouts at all (a
    collective stage 5 wrote: the values it reads and its users' carry the layouts)."""
    if a is None or b is None:
        return a is b
    if a.ndim != b.ndim or a.partial != b.partial or a.mesh != b.mesh:
        return False
    changed = set(dims) | {d for d in range(a.ndim) if a.shape[d] != b.shape[d]}
    return all(not a.dim_is_sharded(d) and not b.dim_is_sharded(d) if d in changed else a.dims[d] == b.dims[d]
               for d in range(a.ndim))


def alike_layouts(a: Any, b: Any) -> bool:
    """Two layouts of the same placements whose sizes differ only on dims neither shards."""
    return (isinstance(a, Layout) and isinstance(b, Layout) and a.ndim == b.ndim
            and same_but_sizes(a, b, [d for d in range(a.ndim) if a.shape[d] != b.shape[d]]))


def resized(layout: Layout, shape: Sequence[int]) -> Layout:
    """``layout`` for a tensor of ``shape``, whose sizes differ from the layout's only on unsharded dims."""
    if tuple(shape) == tuple(layout.shape):
        return layout
    dims = [pieces if size == layout.shape[d] else () for d, (size, pieces) in enumerate(zip(shape, layout.dims))]
    return Layout(layout.mesh, tuple(shape), dims, layout.partial)


def generalize(samples: Sequence[tuple[Hashable, Any]], affine_sizes: bool) -> "SizeGenericProgram | None":
    """One program for every size on the line through the sizes of the last two of ``samples`` ((sizes key,
    program), in the order compiled), if they allow it (above). Where int arguments move with the sizes,
    the line through two programs' must hold at a third's too (a product of two lengths agrees with a
    line at two points, not at three)."""
    from fxshard.backend.programs.inference import InferenceProgram

    if not affine_sizes or len(samples) < 2:
        return None
    (earlier_key, earlier), (later_key, later) = samples[-2], samples[-1]
    if not (isinstance(earlier, InferenceProgram) and isinstance(later, InferenceProgram)
            and earlier.inductor == later.inductor):
        return None
    line = Affine.between(flat_key(earlier_key), flat_key(later_key))
    if line is None or earlier.positions != later.positions or len(earlier.eager) != len(later.eager):
        return None
    compared = compare_programs(earlier.local_graph, later.local_graph)
    if compared is None:
        return None
    dims, sizes = compared
    if sizes.terms:
        if len(samples) < 3 or not isinstance(samples[-3][1], InferenceProgram) or not line.predicts(
                flat_key(samples[-3][0])):
            return None
        third = compare_programs(earlier.local_graph, samples[-3][1].local_graph)
        if third is None or third[1] != sizes:
            return None
    eager = [(x, y) for x, y in zip(earlier.eager, later.eager) if isinstance(x, Layout) or isinstance(y, Layout)]
    if any(x != y for x, y in zip(earlier.eager, later.eager) if not (isinstance(x, Layout) or isinstance(y, Layout))):
        return None
    pairs = list(zip(earlier.input_layouts, later.input_layouts)) + list(
        zip(earlier.output_layouts, later.output_layouts)) + eager
    if len(earlier.input_layouts) != len(later.input_layouts) or not all(alike_layouts(x, y) for x, y in pairs):
        return None
    return SizeGenericProgram(earlier, line, dims, sizes)


class SizeGenericProgram:
    """The local code of ``sample`` (an ``InferenceProgram``), compiled for symbolic sizes of the dims that
    vary (``dims``, by value name), for every call whose sizes ``line`` predicts."""

    def __init__(self, sample: Any, line: Affine, dims: dict[str, tuple[int, ...]], sizes: SizeArguments):
        self.sample = sample
        self.line = line
        self.dims = dims
        self.sizes = sizes
        self.readers: dict[Hashable, Any] = {}  # sizes key -> InputReader of those global sizes
        self.writers: dict[tuple, Any] = {}  # local output shapes -> OutputWriter
        self._compiled: Callable | None = None
        self._guards: Callable[[Sequence[torch.Tensor]], bool] | None = None  # Inductor's assumptions hold

    def accepts(self, key: Hashable) -> bool:
        return key in self.readers or self.line.predicts(flat_key(key))  # a reader: sizes accepted before

    def __call__(self, key: Hashable, args: Sequence[Any]) -> tuple | None:
        """The program's outputs on ``args`` (of sizes ``key``), or None where its shape guards fail."""
        local = self._reader(key, args)(args, differentiable=False)
        if self._compiled is None:
            self._compile(local)
        if self._guards is not None and not self._guards(local):
            log.info("fxshard: sizes %s fail the guards of the program compiled for symbolic sizes", key)
            return None
        with torch.no_grad():
            outs = self._compiled(*local)
        if isinstance(outs, torch.Tensor):
            outs = (outs,)
        return self._writer(outs)(outs)

    def _reader(self, key: Hashable, args: Sequence[Any]) -> Any:
        from fxshard.backend.capture.inputs import InputReader

        reader = self.readers.get(key)
        if reader is None:
            sample = self.sample
            layouts = [resized(layout, tuple(args[p].shape)) for p, layout in zip(sample.positions, sample.input_layouts)]
            if len(self.readers) == KEPT:
                self.readers.clear()
            reader = self.readers[key] = InputReader(sample.positions, layouts, sample.coordinate)
        return reader

    def _writer(self, outs: Sequence[torch.Tensor]) -> Any:
        from fxshard.backend.capture.outputs import OutputWriter

        shapes = tuple(tuple(o.shape) for o in outs)
        writer = self.writers.get(shapes)
        if writer is None:
            sample = self.sample
            sizes = [self._global_shape(layout, shape) for layout, shape in zip(sample.output_layouts, shapes)]
            layouts = [resized(layout, size) for layout, size in zip(sample.output_layouts, sizes)]
            eager = [resized(e, size) if isinstance(e, Layout) else e for e, size in zip(sample.eager, sizes)]
            if len(self.writers) == KEPT:
                self.writers.clear()
            writer = self.writers[shapes] = OutputWriter(layouts, sample.device_mesh, eager)
        return writer

    @staticmethod
    def _global_shape(layout: Layout, local_shape: Sequence[int]) -> tuple[int, ...]:
        """The global shape of a local block of ``layout`` whose unsharded dims may have other sizes."""
        return tuple(int(size) if layout.dim_is_sharded(d) else local
                     for d, (size, local) in enumerate(zip(layout.shape, local_shape)))

    def _compile(self, local: Sequence[torch.Tensor]) -> None:
        """Inductor on the sample's local code, each varying dim of an input a symbol (the others static);
        the whole program, not regions: the guards are read on its inputs."""
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

        from fxshard.backend.inductor.compile_local import compile_local

        sample = self.sample
        from fxshard.backend.layers.regions import program_copy

        program = with_size_arguments(program_copy(sample.local_graph), self.sizes)
        if not sample.inductor:  # the local code, its moving sizes read from its input
            self._compiled = program
            return
        mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)
        names = [n.name for n in sample.local_graph.graph.nodes if n.op == "placeholder"]
        fakes = []
        for name, x in zip(names, local):
            varying = self.dims.get(name, ())
            context = StatelessSymbolicContext(
                dynamic_sizes=[DimDynamic.DYNAMIC if d in varying else DimDynamic.STATIC for d in range(x.dim())])
            fakes.append(mode.from_tensor(x, symbolic_context=context))
        with sample.reporter.timed("compiling the local program with Inductor, sizes symbolic"):
            self._compiled = compile_local(program, fakes, sample.buckets)
        self._guards = compiled_guards(mode.shape_env.produce_guards_expression(fakes))


def compiled_guards(code: str | None) -> Callable[[Sequence[torch.Tensor]], bool] | None:
    """``ShapeEnv.evaluate_guards_expression`` of ``code`` as a function of the inputs, the expression
    compiled once (evaluating its text costs 0.2 ms a call)."""
    if code is None:
        return None
    from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP

    expression = compile(code, "<fxshard size guards>", "eval")
    return lambda inputs: bool(eval(expression, SYMPY_INTERP, {"L": {f"t{i}": x for i, x in enumerate(inputs)}}))
