"""How stage 4 rewrites an op's non-tensor arguments for one rank: recipes, as data.

A global graph bakes global facts into op arguments: a view's target shape, a factory's
size, a slice's start, the rows of a table an index refers to. On each rank those become local
facts, computed from the node's layouts and the rank's coordinate. The op registry
(fxshard/registry.py) names the recipe of each op; stage 3 copies it into the node's meta
(``graph.LOCALIZE``); lowering/localize.py carries out whatever recipe it finds. So lowering
reads recipes, never op names, and an op with a new kind of argument is one new recipe.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LocalShape:
    """Argument ``index`` holds the op's output shape: it becomes the rank's local shape.

    ``becomes``: the op to call instead (a view of a collective's output, which may be a strided
    block, is a reshape; ``as_strided`` with row-major strides is a view), with only the first
    argument kept before the shape when ``only_input`` is set.
    """

    index: int
    becomes: Any = None
    only_input: bool = False


@dataclass(frozen=True)
class LocalArange:
    """``arange`` sharded in contiguous blocks: the rank's run of it (start, end, step rewritten)."""


@dataclass(frozen=True)
class SliceRange:
    """``slice(x, dim, start, end, step)``: the rank's part of the range, in its local block; a range
    stage 2 took where it lies (a Partial output) becomes the rank's rows padded with zeros."""


@dataclass(frozen=True)
class SelectIndex:
    """``select(x, dim, index)``: the index in the rank's block; taken where it lies when stage 2
    made the output Partial (zeros on the ranks that do not hold it)."""


@dataclass(frozen=True)
class SplitSizes:
    """``split(x, sizes, dim)``: each part's local size, as ``split_with_sizes``."""

    dim_index: int = 2


@dataclass(frozen=True)
class MaskedLookup:
    """Rows looked up by index from a table sharded along ``dim``: the rank looks up the indices it
    holds (shifted into its block) and writes zeros elsewhere, a Partial(sum) of the lookup.

    ``table``/``index``: argument positions; ``dim``: the table's looked-up dim, or None to read it
    from argument ``dim_index``; ``mask_unsqueeze``: where the index mask gains a size-1 dim to
    broadcast against the output (embedding: -1, its trailing row dim).
    """

    table: int
    index: int
    dim: int | None = 0
    dim_index: int | None = None
    mask_unsqueeze: int | None = None


@dataclass(frozen=True)
class MaskedAccumulate:
    """Rows accumulated by index into a target sharded along dim 0 (``index_put(accumulate=True)``, the
    embedding's backward): the rank accumulates the indices it holds, shifted into its block, and drops
    the others; the lookup of ``MaskedLookup`` run backwards.

    ``target``/``indices``/``values``: argument positions (``indices`` a one-element list); ``mask``:
    the position of a boolean mask the op already applies to the values (it gains the rank's), or None.
    Sharded, the op becomes ``_unsafe_masked_index_put_accumulate`` (``index_put`` has no mask).
    """

    target: int
    indices: int
    values: int
    mask: int | None = None


@dataclass(frozen=True)
class GlobalIndices:
    """Subgraphs the op calls with indices into the dims of its tensor argument ``of`` (flex attention's
    score_mod and mask_mod get each score's batch and head index): the rank calls a copy of each whose
    index arguments are shifted by the rank's first index of their dim, so it computes on global indices,
    as one device does; ``lengths`` and ``blocks`` name the ints that say the dim's length and block size.
    ``subgraphs``: per subgraph, its path in the arguments (positions) and its
    (placeholder position, dim of ``of``) pairs."""

    of: int
    subgraphs: tuple[tuple[tuple[int, ...], tuple[tuple[int, int], ...]], ...]
    # ints in the arguments (path, dim of ``of``) that are the dim's length (a block mask's Q_LEN): the rank's
    lengths: tuple[tuple[tuple[int, ...], int], ...] = ()
    # ints (path, dim) that are a block size of the dim: the rank's rows must start and end on a block
    blocks: tuple[tuple[tuple[int, ...], int], ...] = ()


@dataclass(frozen=True)
class RoutedGroup:
    """A routed-experts op (fxshard/routing.py) whose expert stacks lie in blocks on mesh axes: its
    ``group_size`` becomes their size, and stage 5 names their (flattened) process group as its ``group``
    (``GROUP_AXES``). ``axes(node)`` reads them from the node's planned layouts."""

    axes: Any = None  # node -> the dispatch group's axes (fxshard.routing.group_axes)


@dataclass(frozen=True)
class QueryRows:
    """A causal attention kernel (``rules_attention.QUERY_ROWS_OPS``) whose query rows are sharded, its keys
    whole: each contiguous run of the rank's rows sees the keys before it whole and its own block
    causally, so the rank calls the kernel once per (run, block) and combines: the outputs weighted by
    their logsumexps (``backward`` False), or the query gradients summed and the key gradients placed at
    their keys (a Partial(sum) over the sequence's axes). ``kernel``: the kernel's name in
    fxshard/causal_rows.py's tables. lowering/query_rows.py writes it."""

    backward: bool = False
    kernel: str = "cpu_flash"


Recipe = (LocalShape | LocalArange | SliceRange | SelectIndex | SplitSizes | MaskedLookup | MaskedAccumulate
          | GlobalIndices | RoutedGroup | QueryRows)
