"""fxshard: SPMD sharding of global-shape PyTorch programs as an FX pass (torch.compile backend "fxshard")."""
from typing import Any

from .costs import CostModel
from .layout import Layout, LayoutError, Piece
from .load import ShardPlan, load_sharded, register_transform
from .load_balance import causal_mask, head_tail_order
from .lower_bound import lower_bound_bytes
from .mesh import MeshAxis, MeshSpec
from .ops import constrain
from .placements import layout_from_placements, placements_from_layout
from .planner import plan_redistribute
from .plans import Plan, Step
from .policies import MixedPrecision, TrainingSplit

__all__ = ["auto_placements", "CostModel", "Layout", "LayoutError", "MeshAxis", "MeshSpec", "Piece", "Plan", "Step", "ShardPlan",
           "compile", "causal_mask", "constrain", "explain", "explain_pipeline", "head_tail_order",
           "layout_from_placements", "load_sharded", "lower_bound_bytes", "MixedPrecision", "placements_from_layout",
           "plan_redistribute", "register_transform", "simulate", "simulate_plan", "TrainingSplit", "with_mixed_precision"]


def __getattr__(name: str) -> Any:
    # explain and simulate drive Dynamo (and simulate a fake process group): import them on first use
    if name == "explain":
        from .backend.explain import explain

        return explain
    if name == "simulate":
        from .backend.simulate import simulate

        return simulate
    if name == "compile":
        from .backend.compile_function import compile

        return compile
    if name == "explain_pipeline":
        from .backend.pipelining import explain_pipeline

        return explain_pipeline
    if name == "with_mixed_precision":
        from .backend.capture.mixed_precision import with_mixed_precision

        return with_mixed_precision
    if name == "auto_placements":
        from .backend.auto_placements import auto_placements

        return auto_placements
    if name == "simulate_plan":
        from .backend.simulate_plan import simulate_plan

        return simulate_plan
    raise AttributeError(f"module 'fxshard' has no attribute {name!r}")
