"""Stage 6's one call into Inductor: ``compile_local``, with collectives bucketed and waits overlapped.

fxshard lowers each redistribution to its own functional collective, its wait right behind it
(FSDP: one all_gather per parameter). Inductor's own passes fix both, given the config here:
its FX bucketing passes (``torch/_inductor/fx_passes/bucketing.py``) merge independent
all_gathers, reduce_scatters and all_reduces of one process group and dtype into one collective
each, and its scheduler passes (``torch/_inductor/comms.py``) sink each wait below the compute
that does not need its result and raise collectives earlier, as far as peak memory allows.

A bucket holds about one block (``block_bytes``): one bucket for the whole model would gather
every parameter before the first layer and give up FSDP's memory bound.

Every rank must issue the same collectives, of the same sizes, in the same order, or the job
hangs. The passes keep that here, also for uneven layouts whose local programs differ by rank:

- a bucket is a run of collectives taken in program order with the same (kind, group, dtype,
  reduce op), cut where the next one's bytes would pass the cap or depend on the bucket. The
  bytes are a collective's global (gathered, or before scattering) size, which a collective's
  contract makes equal on every rank (fxshard pads uneven gathers); the cap comes from those
  sizes and the parameters' names: nothing rank-local decides a bucket;
- the scheduler passes may move compute across collectives, never one collective past another
  (the ``*_unsafe_collectives_reorder`` switches of ``config_comms`` are off), and use no measured
  runtimes, so they synchronize nothing across ranks at compile time.

Inductor's FX graph cache keys an entry by the graph's code, its inputs' shapes and this
config: two ranks share an entry only where their local programs are the same program.
``tests/test_overlap.py`` checks the counts, the wait placement, the buckets of every rank of an
uneven program, and the cache keys.
"""
from __future__ import annotations

import functools
import re
from collections import defaultdict
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

__all__ = ["compile_local", "block_bytes", "inductor_patches"]

_c10d = torch.ops._c10d_functional
# bucketed collective -> the Inductor config that buckets it (inductor config key prefix)
BUCKETED = {
    _c10d.all_gather_into_tensor.default: "bucket_all_gathers_fx",
    _c10d.reduce_scatter_tensor.default: "bucket_reduce_scatters_fx",
    _c10d.all_reduce.default: "bucket_all_reduces_fx",
}
# the first indexed module in a parameter's name: "s_layers_0_attention_wq_weight" -> "s_layers_0"
_BLOCK = re.compile(r"^(.*?_\d+)(?:_|$)")


def compile_local(gm: fx.GraphModule, inputs: Sequence[torch.Tensor], bucket_cap: int | None) -> Callable:
    """Inductor on one rank's lowered local program; ``bucket_cap`` (bytes per bucket, see
    ``block_bytes``) turns bucketing and overlap on, None leaves the collectives as fxshard lowered them.
    A program without all_gathers, reduce_scatters or all_reduces is compiled without the passes."""
    from torch._inductor import config_comms
    from torch._inductor.compile_fx import compile_fx

    if not any(node.target in BUCKETED for node in gm.graph.nodes):
        bucket_cap = None  # nothing to bucket or overlap: the passes would only cost compile time
    patches, comms = inductor_patches(bucket_cap)
    with config_comms.patch(comms):
        return compile_fx(gm, list(inputs), config_patches=patches)


def inductor_patches(bucket_cap: int | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(Inductor config patches, ``config_comms`` patches) for a bucket cap in bytes; none for None."""
    if bucket_cap is None:
        return {}, {}
    cap = functools.partial(_cap_mb, bucket_cap)  # picklable: the FX graph cache hashes it with the config
    patches: dict[str, Any] = {}
    for key in BUCKETED.values():
        patches[key] = "all"
        patches[f"{key}_bucket_size_determinator"] = cap
    patches["reorder_for_compute_comm_overlap"] = True
    patches["reorder_for_compute_comm_overlap_passes"] = [
        "reorder_communication_preserving_peak_memory", "sink_waits_iterative",
        "reorder_communication_preserving_peak_memory"]
    comms = {"reorder_iterative_unsafe_collectives_reorder": False,
             "sink_waits_iterative_unsafe_collectives_reorder": False,
             "runtime_estimations_align_across_all_distributed_ranks": False}
    return patches, comms


def _cap_mb(cap_bytes: int, bucket_index: int) -> float:
    """Inductor's bucket-size callback: the same cap, in MiB, for every bucket."""
    return cap_bytes / 2**20


def block_bytes(gm: fx.GraphModule) -> int:
    """The cap of a bucket: the most bytes one block's parameters put through one kind of collective.

    A block is the parameters whose names share their first index (``layers.0``); a model without
    indexed modules is one block. A parameter's collective is one whose input comes from that
    parameter alone. Without any, Inductor's default cap (nothing here needs a memory bound).
    """
    from torch._inductor.fx_passes.bucketing import bucket_cap_mb_by_bucket_idx_default

    indexed: dict[tuple[Any, str], int] = defaultdict(int)
    whole: dict[Any, int] = defaultdict(int)
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in BUCKETED:
            continue
        sources = _placeholders_of(node, stop_after=2)
        if len(sources) != 1:
            continue
        match = _BLOCK.match(sources[0].name)
        if match:
            indexed[node.target, match.group(1)] += global_bytes(node)
        whole[node.target] += global_bytes(node)
    blocks = indexed or whole
    if blocks:
        return max(blocks.values())
    return int(bucket_cap_mb_by_bucket_idx_default(0) * 2**20)


def global_bytes(node: fx.Node) -> int:
    """A collective's size as Inductor's bucketing counts it: the larger of its input and output."""
    def nbytes(value: Any) -> int:
        return value.numel() * value.element_size()

    return max(nbytes(node.meta["val"]), nbytes(node.all_input_nodes[0].meta["val"]))


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
