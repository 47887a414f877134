"""Stage 6's one call into Inductor: ``compile_local``, with collectives bucketed and waits overlapped.

fxshard lowers each redistribution to its own functional collective, its wait right behind it
(FSDP: one all_gather per parameter). ``compile_local(gm, inputs, policy)`` fixes both for one
lowered program (the whole program, or one region of it: nothing here looks past the graph given):

- buckets aligned to blocks (``backend/inductor/buckets.py``): the all_gathers of one block's parameters
  (the first indexed module in their names, ``layers.0``; parameters in none are the ``root``
  block), forward and backward regathers, and the reduce_scatters of its gradients are merged into
  one collective per (kind, process group, dtype, block) by an Inductor post-grad pass calling
  Inductor's own merge functions (``torch/_inductor/fx_passes/bucketing.py``): FSDP2's grouping, one
  gather and one reduce_scatter per block. A group is cut where a member depends on another;
- the other all_gathers and reduce_scatters, and all all_reduces, are bucketed by Inductor's greedy
  passes: runs of independent collectives of one kind, group and dtype in program order, capped at
  ``block_bytes`` (the largest block's parameter bytes: one bucket for the whole model would
  gather every parameter before the first layer and give up FSDP's memory bound);
- Inductor's scheduler passes (``torch/_inductor/comms.py``) sink each wait below the compute that
  does not need its result and raise collectives earlier, as far as peak memory allows: a block's
  merged gather, placed before the first use of its weights, is prefetched during the block before;
- a lone collective (TP's all_reduces, TP + SP's reduce_scatters and gathers: none of its kind independent
  of it) gets the matmuls that do not need it between its start and its wait by ordering edges
  (``backend/inductor/collective_windows.py``), where Inductor's order and fusion would leave none.

Every rank must issue the same collectives, of the same sizes, in the same order, or the job
hangs. Here, also for uneven layouts whose local programs differ by rank:

- a block bucket's members come from parameter names and the program's structure (which input a
  gather reads, which gradient a reduce_scatter makes), never from local sizes; greedy buckets from
  collectives' global sizes (gathered, or before scattering), which a collective's contract makes
  equal on every rank (fxshard pads uneven gathers);
- the scheduler passes may move compute across collectives, never one collective past another
  (the ``*_unsafe_collectives_reorder`` switches of ``config_comms`` are off), and use no measured
  runtimes, so they synchronize nothing across ranks at compile time.

Inductor's FX graph cache keys an entry by the graph's code, its inputs' shapes and this config
(the block pass by its code and the blocks it was given): two ranks share an entry only where their
local programs are the same program. ``tests/test_overlap.py`` checks the counts, the wait
placement, the buckets of every rank of an uneven program, and the cache keys.
"""
from __future__ import annotations

import functools
import logging
from collections import defaultdict
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx as fx

from fxshard.graph import copy_graph_module
from fxshard.lowering.collective_ops import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER
from fxshard.lowering.localize import complete_fake_values

from fxshard.backend.inductor.bucket_traces import traces_reused, users_kept
from fxshard.layer_names import ROOT, block_of
from fxshard.backend.inductor.buckets import _TAGGED, BlockBuckets, _placeholders_of, _tag, tag_blocks
from fxshard.backend.inductor.collective_windows import CollectiveWindows
from fxshard.backend.inductor.collector import collector_paused
from fxshard.backend.inductor.cpu_wrapper import cpu_wrapper_mended, cpu_wrapper_patches, use_cpu_wrapper
from fxshard.backend.inductor.compile_inner import compile_direct, takes_directly
from fxshard.backend.inductor.flex_inputs import with_fresh_flex_inputs

__all__ = ["BucketPolicy", "TRAINING_PATCHES", "compile_local", "cacheable_inputs", "bucketed_uncompiled", "block_bytes",
           "inductor_patches", "start_compile_workers"]

log = logging.getLogger("fxshard")
# A training step's forward and backward, compiled as AOTAutograd compiles a training graph. fxshard gives
# Inductor each as a graph of its own, which Inductor takes for an inference graph and runs its
# inference-only ``reorder_for_locality`` on: that pass pulls each of the query, key and value projections
# down to its first reader, so the rotations of q and k and the expansion of v (which read the three
# projections) become three kernels where the training compile fuses them into one (a Llama layer's
# forward: 7 C++ kernels against DTensor + FSDP2's 5, and about a second more to compile).
TRAINING_PATCHES: Mapping[str, Any] = MappingProxyType({"reorder_for_locality": False})
# the collectives compile_local buckets
BUCKETED = (ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE)  # a subset: an all_to_all is bucketed nowhere


@dataclass(frozen=True)
class BucketPolicy:
    """How ``compile_local`` buckets one program's collectives: a block's parameter gathers and gradient
    reduce_scatters one each (``backend/inductor/buckets.py``), the rest greedily under ``cap`` bytes."""

    cap: int  # bytes per bucket of the collectives of no block (all_reduces, activations): ``block_bytes``
    output_names: tuple[str | None, ...] = ()  # per output, the input it is the gradient of (a backward)
    tagged: bool = False  # the collectives carry their blocks already: a region of a program ``tag_blocks`` saw


def start_compile_workers() -> None:
    """Start Inductor's pool of compile workers now, so it is ready when stage 6 compiles.

    Inductor compiles a Triton kernel in a worker only once the pool answers; until then each kernel is
    compiled in this process, one after another. ``torch.compile``'s own backend starts the pool when
    Dynamo first calls it; fxshard calls Inductor's inner compiler itself, so without this the pool
    began starting at the first kernel, and a GPU program's first region compiled its kernels serially.
    Started before the planning stages, the pool comes up while they run. Inductor's own switch decides
    (no pool without Triton, with one compile thread, or under ``TORCH_WARM_POOL=0``)."""
    try:
        from torch._inductor.async_compile import maybe_warm_pool
    except ImportError:  # a torch without it: Inductor starts its pool when it first needs it
        return
    maybe_warm_pool()


def compile_local(gm: fx.GraphModule, inputs: Sequence[torch.Tensor], policy: BucketPolicy | None,
                  training: bool = False) -> Callable:
    """Inductor on one rank's lowered local program; ``policy`` turns bucketing and overlap on, None
    leaves the collectives as fxshard lowered them. A program without all_gathers, reduce_scatters or
    all_reduces is compiled without the passes. ``training``: the forward or backward of a training
    step, or a region of one (``TRAINING_PATCHES``)."""
    if not any(node.target in BUCKETED for node in gm.graph.nodes):
        policy = None  # nothing to bucket or overlap: the passes would only cost compile time
    patches, comms = inductor_patches(policy, _blocks(gm, policy))
    if training:
        patches = {**patches, **TRAINING_PATCHES}
    example_inputs = cacheable_inputs(inputs)
    gm = with_fresh_flex_inputs(gm)  # Inductor's CPU flex template reads a view from its buffer's start
    if use_cpu_wrapper(gm, example_inputs):  # two C++ compiles per program, not one per kernel (cpu_wrapper.py)
        try:
            with cpu_wrapper_mended():
                return _compile(_inputs_as_given(gm, example_inputs), example_inputs,
                                {**patches, **cpu_wrapper_patches()}, comms)
        except Exception as error:  # noqa: BLE001 (any failure of the C++ wrapper: the Python one instead)
            log.warning("fxshard: Inductor's C++ wrapper could not compile a program (%s: %s); compiling it with "
                        "the Python wrapper. FXSHARD_CPU_WRAPPER=0 skips the attempt.", type(error).__name__,
                        str(error).splitlines()[0] if str(error) else "")
    return _compile(gm, example_inputs, patches, comms)


def _inputs_as_given(gm: fx.GraphModule, example_inputs: list[Any]) -> fx.GraphModule:
    """A copy of ``gm`` whose placeholders' values are ``example_inputs``: ``compile_fx`` reads a C++-wrapped
    program's inputs from its placeholders, and wants them all of one fake mode (a program ``make_fx``
    traced from real tensors has one mode per placeholder)."""
    program = copy_graph_module(gm)
    for node, value in zip(program.graph.find_nodes(op="placeholder"), example_inputs):
        if isinstance(value, torch.Tensor):
            node.meta["val"] = value
    return program


def _compile(gm: fx.GraphModule, example_inputs: list[Any], patches: Mapping[str, Any],
             comms: Mapping[str, Any]) -> Callable:
    from torch._inductor import config, config_comms
    from torch._inductor.compile_fx import compile_fx

    with config_comms.patch(comms), collector_paused(), traces_reused(), users_kept():  # cheap bucket merges
        if takes_directly(gm, example_inputs):  # no second trace through AOTAutograd (compile_inner.py)
            with config.patch(patches):
                return compile_direct(gm, example_inputs)  # computes the fake values it reads
        complete_fake_values(gm, example_inputs)  # a region a second run loaded comes without them
        return compile_fx(gm, example_inputs, config_patches=dict(patches))


def cacheable_inputs(inputs: Sequence[Any]) -> list[Any]:
    """``inputs`` as Inductor's caches take them: fake tensors of a fake mode with a shape environment.

    Given real tensors, ``compile_fx`` makes a fake mode without one, and its FX graph cache and
    AOTAutograd's cache then bypass every program ("No shape env"): a second run of the same script
    compiles every region again, where DTensor + ``torch.compile`` loads its kernels from the cache.
    Static shapes: the programs are specialized to their local shapes as they are. Inputs that are
    fake already (Dynamo's, through the ``fxshard`` backend) are kept."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    if any(isinstance(x, FakeTensor) for x in inputs):
        return list(inputs)
    mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)
    return [mode.from_tensor(x, static_shapes=True) if isinstance(x, torch.Tensor) else x for x in inputs]


def bucketed_uncompiled(gm: fx.GraphModule, policy: BucketPolicy | None) -> fx.GraphModule:
    """``gm`` to run as it is, without Inductor, its collectives bucketed by the passes ``compile_local``
    gives Inductor (the same buckets; no overlap: the graph runs in its order). For a
    region of collectives alone, with nothing for Inductor to compile (regional compilation's regions
    between two layers, ``prefetch.py``)."""
    if policy is not None and any(node.target in BUCKETED for node in gm.graph.nodes):
        from torch._inductor.fx_passes.bucketing import bucket_all_reduce
        from torch._inductor.pattern_matcher import stable_topological_sort

        with traces_reused(), users_kept():
            BlockBuckets(policy.cap, _blocks(gm, policy))(gm.graph)
            bucket_all_reduce(gm, functools.partial(_cap_mb, policy.cap))  # as ``bucket_all_reduces_fx`` in Inductor
        stable_topological_sort(gm.graph)  # a merged collective's users may precede it (Inductor sorts too)
        gm.recompile()
    return gm


def _blocks(gm: fx.GraphModule, policy: BucketPolicy | None) -> tuple[str | None, ...]:
    """The block of each all_gather / reduce_scatter of ``gm``, in program order (``buckets.tag_blocks``)."""
    if policy is None:
        return ()
    if policy.tagged:
        return tuple(_tag(n) for n in gm.graph.nodes if n.op == "call_function" and n.target in _TAGGED)
    return tag_blocks(gm, policy.output_names)


def inductor_patches(policy: BucketPolicy | None, tags: Sequence[str | None] = ()) -> tuple[dict[str, Any], dict[str, Any]]:
    """(Inductor config patches, ``config_comms`` patches) for a policy and the blocks ``tag_blocks``
    gave the program's all_gathers and reduce_scatters; none for None."""
    if policy is None:
        return {}, {}
    cap = functools.partial(_cap_mb, policy.cap)  # picklable: the FX graph cache hashes it with the config
    patches: dict[str, Any] = {
        # all_gathers and reduce_scatters: by block, and the others capped, in one pass of ours; then the
        # lone collectives' windows (collective_windows.py), before Inductor buckets the other all_reduces
        "post_grad_custom_post_pass": [BlockBuckets(policy.cap, tags), CollectiveWindows()],
        "bucket_all_reduces_fx": "all", "bucket_all_reduces_fx_bucket_size_determinator": cap,
        "reorder_for_compute_comm_overlap": True,
        "reorder_for_compute_comm_overlap_passes": [
            "reorder_communication_preserving_peak_memory", "sink_waits_iterative",
            "reorder_communication_preserving_peak_memory"],
    }
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
        block = block_of(sources[0].name)
        if block != ROOT:
            indexed[node.target, block] += global_bytes(node)
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

