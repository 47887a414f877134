"""Block-aligned buckets: a block's parameter all_gathers, and its gradients' reduce_scatters, as one each.

``tag_blocks`` names, on fxshard's lowered program, the block of each all_gather that moves one
parameter (its only graph input) and of each reduce_scatter that makes one gradient (the one output
it flows to): the first indexed module in the parameter's name (``layers_0``), else ``"root"``.
``BlockBuckets``, an Inductor post-grad pass, merges each (kind, process group, dtype, block)'s
collectives into one with Inductor's own merge functions (``torch/_inductor/fx_passes/bucketing.py``),
split where one depends on another, and buckets the untagged ones greedily under a byte cap.

Rank independence: a bucket's members come from names and program structure (the tags travel with
the nodes through AOTAutograd as ``node.meta["custom"]``); its place from program order. Local sizes
decide nothing, so ranks whose local shapes differ (uneven shards) issue the same buckets.
"""
from __future__ import annotations

import contextlib
import hashlib
import pathlib
from collections import defaultdict
from typing import Any, Iterable, Iterator, Sequence

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from fxshard.layer_names import block_of
from fxshard.graph import reachable
from fxshard.lowering.collective_ops import ALL_GATHER, ALL_GATHER_OUT, REDUCE_SCATTER

from fxshard.backend.inductor.bucket_copies import gather_key, merge_all_gathers, merge_reduce_scatters
from fxshard.backend.inductor.bucket_traces import inputs_not_sorted, traces_reused, users_kept

__all__ = ["BLOCK_KEY", "BlockBuckets", "merge_blocks", "tag_blocks"]

BLOCK_KEY = "fxshard_block"  # the key of a collective's block in node.meta["custom"]
_MERGED_KEY = "fxshard_merged"  # in node.meta["custom"]: a block's merged collective
_c10d = torch.ops._c10d_functional
_TAGGED = (ALL_GATHER, REDUCE_SCATTER)  # a subset: the collectives a block's parameters and gradients make
_MERGED = (ALL_GATHER_OUT, ALL_GATHER, REDUCE_SCATTER)  # what a bucket's merge makes


def tag_blocks(gm: fx.GraphModule, output_names: Sequence[str | None] = ()) -> tuple[str | None, ...]:
    """Tag each all_gather / reduce_scatter of ``gm`` with its block; returns the tags in program order.

    An all_gather whose value comes from one graph input takes that input's block; a reduce_scatter
    whose result reaches one output through single-input ops takes the block of ``output_names`` at
    that output (the backward: the parameter whose gradient it is). Others get None: no block.
    """
    output = next(n for n in gm.graph.nodes if n.op == "output")
    tags = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in _TAGGED:
            continue
        block = _input_block(node) if node.target is _TAGGED[0] else _output_block(node, output, output_names)
        custom = dict(node.meta.get("custom") or {})
        custom[BLOCK_KEY] = block
        node.meta["custom"] = custom
        tags.append(block)
    return tuple(tags)


def _input_block(node: fx.Node) -> str | None:
    """The block of the one graph input a collective's value is computed from; None for several."""
    sources = _placeholders_of(node, stop_after=2)
    return block_of(sources[0].name) if len(sources) == 1 else None


def _output_block(node: fx.Node, output: fx.Node, names: Sequence[str | None]) -> str | None:
    """The block named at the one output a collective's result flows to through single-input ops."""
    value = node
    while len(value.users) == 1:
        user = next(iter(value.users))
        if user is output:
            positions = [k for k, a in enumerate(output.args[0]) if a is value]
            if len(positions) == 1 and positions[0] < len(names) and names[positions[0]] is not None:
                return block_of(names[positions[0]])
            return None
        if len(user.all_input_nodes) != 1:
            return None
        value = user
    return None


def _placeholders_of(node: fx.Node, stop_after: int) -> list[fx.Node]:
    """The graph inputs a node's value is computed from, up to ``stop_after`` of them."""
    seen: set[fx.Node] = set()
    stack, found = list(node.all_input_nodes), []
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            found.append(n)
            if len(found) == stop_after:
                break
        stack.extend(n.all_input_nodes)
    return found


class BlockBuckets(CustomGraphPass):
    """Inductor's ``post_grad_custom_post_pass``: one all_gather and one reduce_scatter per block and
    process group, the untagged ones bucketed greedily under ``cap`` bytes (Inductor's own pass).

    A block's merged all_gather is placed right before the first use of any of its results (the
    scheduler then raises it over earlier compute, as far as peak memory allows: a block's weights
    are prefetched while the previous block computes, not all gathered up front); a merged
    reduce_scatter where Inductor places it, behind the last gradient of its block.
    """

    def __init__(self, cap: int, tags: Sequence[str | None]):
        self.cap, self.tags = cap, tuple(tags)

    def __call__(self, graph: fx.Graph) -> None:
        from torch._inductor.fx_passes import bucketing as b

        gm = graph.owning_module
        for kind, is_kind, key, merge in _kinds():
            ours = _ours(graph, is_kind)
            # the others, capped; a collective merged already (``merge_blocks`` before a regional cut) is neither
            rest = set(n for n in graph.nodes if is_kind(n) and not _merged(n)) - set(ours)
            capped = b.greedy_bucket_collective_by_mb(gm, lambda _: self.cap / 2**20, lambda n: n in rest, key) \
                if rest else []
            _merge_blocks(graph, kind, ours)
            for bucket in capped:
                merge(graph, bucket)

    def uuid(self) -> str:
        """The FX graph cache's key of this pass: its code (and its merges'), the cap and the blocks."""
        here = pathlib.Path(__file__)
        text = here.read_bytes() + (here.parent / "bucket_copies.py").read_bytes() + repr((self.cap, self.tags)).encode()
        return hashlib.sha256(text).hexdigest()


def merge_blocks(gm: fx.GraphModule, region: dict[fx.Node, Any]) -> None:
    """Each block's bucket merged on a whole program before regional compilation cuts it, as
    ``BlockBuckets`` merges it inside Inductor: only a bucket whose members share a region (``region``:
    node -> region), and every node its merge makes joins that region. The merged collective keeps
    the block's tag (``BlockBuckets`` then leaves it as it is)."""
    from torch._inductor.pattern_matcher import stable_topological_sort

    # every layer's buckets are alike: each kind is traced once; no merge walks the program or recomputes what
    # it cannot change (bucket_traces.py)
    with traces_reused(), inputs_not_sorted(), users_kept():
        for kind, is_kind, _, _ in _kinds():
            ours = _ours(gm.graph, is_kind)
            for home in dict.fromkeys(region[n] for n in ours):  # in program order: the same on every rank
                _merge_blocks(gm.graph, kind, [n for n in ours if region[n] == home], region, home)
    stable_topological_sort(gm.graph)  # a merged collective's users may precede it (Inductor sorts too)
    gm.recompile()


def _kinds() -> tuple:
    """(kind, is it one, bucket key, merge) for all_gathers (any dtypes together) and reduce_scatters (one)."""
    from torch._inductor.fx_passes import bucketing as b

    return (("all_gather", b.is_all_gather_into_tensor, gather_key, merge_all_gathers),
            ("reduce_scatter", b.is_reduce_scatter_tensor, b._rs_group_key, merge_reduce_scatters))


def _ours(graph: fx.Graph, is_kind: Any) -> list[fx.Node]:
    """The tagged collectives of a kind that a block bucket can take (each read by its wait alone)."""
    return [n for n in graph.nodes if _tag(n) is not None and is_kind(n) and _single_wait(n) and not _merged(n)]


def _merge_blocks(graph: fx.Graph, kind: str, ours: list[fx.Node], region: dict[fx.Node, Any] | None = None,
                  home: Any = None) -> None:
    """One collective per (process group, dtype, block) bucket of ``ours``, tagged with its block; with
    ``region``, the nodes a merge makes are put in ``home``."""
    _, _, key, merge = next(k for k in _kinds() if k[0] == kind)
    for bucket in block_buckets(ours, lambda n: (key(n), _tag(n))):
        block = _tag(bucket[0])
        with nodes_made(graph) as made:
            merge(graph, bucket, insert_before=_first_use(graph, bucket) if kind == "all_gather" else None)
        for node in made:
            if region is not None:
                region[node] = home
            if node.op == "call_function" and node.target in _MERGED:
                node.meta["custom"] = dict(node.meta.get("custom") or {}) | {BLOCK_KEY: block, _MERGED_KEY: True}


@contextlib.contextmanager
def nodes_made(graph: fx.Graph) -> Iterator[list[fx.Node]]:
    """The nodes made in ``graph`` within the block, still in it at its end, in the list it yields (filled
    on exit). Told by the graph module as each is made (its create-node hook): comparing the graph's nodes
    before and after, once per bucket, took time quadratic in the layers (0.3 s of a 64-layer program's
    merges under the profiler)."""
    made: list[fx.Node] = []
    module = graph.owning_module
    if module is None or not hasattr(module, "_register_create_node_hook"):  # compared, as before
        before = set(graph.nodes)
        yield made
        made.extend(node for node in graph.nodes if node not in before)
        return
    created: list[fx.Node] = []
    hook = created.append
    module._register_create_node_hook(hook)
    try:
        yield made
    finally:
        module._unregister_create_node_hook(hook)
    made.extend(node for node in created if not node._erased)


def _merged(node: fx.Node) -> bool:
    return bool((node.meta.get("custom") or {}).get(_MERGED_KEY))


def _tag(node: fx.Node) -> str | None:
    return (node.meta.get("custom") or {}).get(BLOCK_KEY) if node.op == "call_function" else None


def _single_wait(node: fx.Node) -> bool:
    """Inductor merges a collective whose one user is its wait."""
    return len(node.users) == 1 and next(iter(node.users)).target is _c10d.wait_tensor.default


def block_buckets(collectives: Iterable[fx.Node], key: Any) -> list[list[fx.Node]]:
    """The collectives grouped by ``key`` in program order, a group cut before a member that depends
    on an earlier one of its bucket (it could not start with them); buckets of one are left out."""
    groups: dict[Any, list[fx.Node]] = defaultdict(list)
    for node in collectives:
        groups[key(node)].append(node)
    buckets = []
    for members in groups.values():
        last = members[-1]  # nothing after it in program order can be a member: the search stops there
        bucket: list[fx.Node] = []
        below: set[fx.Node] = set()  # what the bucket's members compute, up to the group's last member
        for node in members:
            if node in below:
                buckets.append(bucket)
                bucket, below = [], set()
            bucket.append(node)
            below |= reachable(node, lambda n: [u for u in n.users if not u > last])
        buckets.append(bucket)
    return [bucket for bucket in buckets if len(bucket) > 1]




def _first_use(graph: fx.Graph, bucket: Sequence[fx.Node]) -> fx.Node | None:
    """Where a merged all_gather goes: before the first user of any member's result, or, when an
    input of the bucket comes later, right after the last input (None: Inductor's default place)."""
    from torch._inductor.fx_passes.bucketing import has_mergeable_all_gather_convert_dtype

    users = [u for n in bucket for u in next(iter(n.users)).users]
    if not users:
        return None
    first = min(users)  # nodes compare by their place in the program (fx.Node's sort key)
    inputs = [n.args[0].args[0] if has_mergeable_all_gather_convert_dtype(n) else n.args[0] for n in bucket]
    last_input = max(inputs)
    return first if last_input < first else last_input.next
