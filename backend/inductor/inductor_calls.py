"""The private torch names that Inductor's caches, bucket merges and plain compiles need, in one module.

torch promises nothing of these names from one release to the next. fxshard's own Inductor entry and passes
(``compile_local``, ``compile_inner``, ``cpu_wrapper``, ``buckets``, ``collective_windows``) name Inductor
themselves; every other module asks here, so a new torch's hunt reads this folder and
``backend/capture/dynamo_calls.py`` only (tests/test_architecture.py fences them). Dynamo's counters and
global-state guard are here too: the caches below ``capture/`` read them. Each name is imported where it is
called, as its callers imported it before.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.fx as fx
from torch._dynamo.utils import counters  # fxshard's events (``counters["fxshard"]``), beside Dynamo's own

__all__ = ["counters", "dynamo_global_state", "functorch_portable_config", "cache_dir", "fx_graph_cache_on",
           "custom_joint_passes", "portable_config", "compile_plain", "BUCKETING", "RECORDED_MERGES", "REBOUND",
           "register_bucketing_ops", "bucketing_function", "bucketing_rebound", "dtype_index", "converts_dtype",
           "resolve_group_name", "merge_all_gather_bucket", "process_collective_bucket",
           "merge_reduce_scatter_bucket"]


# ---- what the caches read ----------------------------------------------------------------------------
def dynamo_global_state() -> Any:
    """Dynamo's global-state guard's reading of this process (autocast, grad mode, default dtype, ...), as text."""
    from torch._C._dynamo.guards import GlobalStateGuard

    return GlobalStateGuard().__getstate__()


def functorch_portable_config() -> dict[str, Any]:
    return torch._functorch.config.save_config_portable()


def cache_dir() -> str:
    """Inductor's cache directory (``TORCHINDUCTOR_CACHE_DIR``)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir as inductor_cache_dir

    return inductor_cache_dir()


def fx_graph_cache_on() -> bool:
    """Whether Inductor's FX graph cache is on: fxshard's stores are on exactly when it is."""
    from torch._inductor import config

    return bool(config.fx_graph_cache) and not config.force_disable_caches


def custom_joint_passes() -> bool:
    """Whether a custom joint-graph pass is set (which Inductor's portable config leaves out)."""
    from torch._inductor import config

    return any(getattr(config, k, None) for k in ("joint_custom_pre_pass", "joint_custom_post_pass"))


def portable_config() -> dict[str, Any]:
    """Inductor's config as the same values in every process (its cache key's part)."""
    from torch._inductor import config

    return config.save_config_portable()


def compile_plain(gm: fx.GraphModule, example_inputs: Sequence[Any], mode: str | None) -> Callable:
    """``gm`` compiled as ``backend="inductor"`` compiles it (through AOTAutograd), under ``mode``'s options."""
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs, config_patches=list_mode_options(mode) if mode else None)


# ---- Inductor's bucket merges (torch/_inductor/fx_passes/bucketing.py) --------------------------------------
BUCKETING = "torch._inductor.fx_passes.bucketing"
# its merge functions bucket_traces records instead of tracing (each checked against make_fx's trace of it)
RECORDED_MERGES = ("torch._inductor.fx_passes.bucketing.all_gather_merge_fn_to_trace",
                   "torch._inductor.fx_passes.bucketing.all_gather_merge_fn_to_trace_custom_ops",
                   "torch._inductor.fx_passes.bucketing.reduce_scatter_merge_fn_to_trace",
                   "torch._inductor.fx_passes.bucketing.reduce_scatter_merge_fn_to_trace_custom_ops",
                   "torch._inductor.fx_passes.bucketing.all_reduce_merge_fn_to_trace")
# its functions bucket_traces rebinds within a block (``bucketing_rebound``), and the one it reads
REBOUND = ("_trace", "_sort_bucket_region", "_insert_fn_trace_before_node", "_recompute_changed_user_metadata")
_READ = REBOUND + ("_same_metadata",)


def _bucketing() -> Any:
    from torch._inductor.fx_passes import bucketing

    return bucketing


def register_bucketing_ops() -> None:
    """Inductor's ``torch.ops.bucketing`` ops, registered (its module registers them when imported)."""
    _bucketing()


def bucketing_function(name: str) -> Callable | None:
    """Inductor's bucketing function ``name`` (one of ``REBOUND`` or ``_same_metadata``); None on a torch
    without it (one that merges otherwise)."""
    assert name in _READ, name
    return getattr(_bucketing(), name, None)


@contextlib.contextmanager
def bucketing_rebound(name: str, fn: Callable) -> Iterator[None]:
    """Within the block, Inductor's bucket merges call ``fn`` where they call their ``name`` (one of ``REBOUND``)."""
    assert name in REBOUND, name
    bucketing = _bucketing()
    original = getattr(bucketing, name)
    setattr(bucketing, name, fn)
    try:
        yield
    finally:
        setattr(bucketing, name, original)


def dtype_index(dtype: torch.dtype) -> int:
    """``dtype``'s number among the dtypes Inductor's bucketing ops take as ints."""
    from torch._inductor.fx_passes.bucketing import _ALL_DTYPES

    return _ALL_DTYPES.index(dtype)


def converts_dtype(node: fx.Node) -> bool:
    """Whether an all_gather converts its input's dtype on the way in (Inductor merges those by dtype)."""
    return _bucketing().has_mergeable_all_gather_convert_dtype(node)


def resolve_group_name(name: Any) -> Any:
    """A collective's group as a name: torch 2.13 may name it by a node (compile on one rank) and resolves
    it; 2.11's names are strings already (and it has no ``_resolve_group_name``)."""
    return getattr(_bucketing(), "_resolve_group_name", lambda n: n)(name)


def merge_all_gather_bucket(graph: fx.Graph, bucket: list[fx.Node], insert_before: fx.Node | None) -> None:
    """Inductor's default merge of an all_gather bucket."""
    _bucketing().merge_all_gather_bucket(graph, bucket, insert_before=insert_before)


def process_collective_bucket(graph: fx.Graph, bucket: list[fx.Node], fn: Callable, trace_args: Callable,
                              insert_before: fx.Node | None) -> None:
    """Inductor's merge of ``bucket`` into one call of ``fn`` (traced on ``trace_args(members)``)."""
    _bucketing().process_collective_bucket(graph, bucket, fn, trace_args, insert_before=insert_before)


def merge_reduce_scatter_bucket(graph: fx.Graph, bucket: list[fx.Node], mode: str,
                                insert_before: fx.Node | None) -> None:
    """Inductor's merge of a reduce_scatter bucket (``mode``: how its input is packed)."""
    _bucketing().merge_reduce_scatter_bucket(graph, bucket, mode=mode, insert_before=insert_before)
