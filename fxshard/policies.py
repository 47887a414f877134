"""Parallelism policies: the choices the generic passes leave to a strategy, named and documented.

Propagation (fxshard/propagate.py) is greedy and exact per op; planning the joint graph and
splitting it (backend/programs/joint.py) is mechanical. What is a *policy* sits here: which second
opinions refinement asks for (``Refinement``), which gathered values the training split
keeps between forward and backward instead of gathering again (``TrainingSplit``), and in which
dtypes parameters are computed with and gradients summed (``MixedPrecision``). A pass takes
its policy as an argument; the defaults are the strategies the tests and benchmarks measure.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class Pin(str, enum.Enum):
    """Pins that are not one input: ``refine.py`` pins placeholders by name, and these."""

    ACTIVATIONS = "<activations>"  # every value that is not a view of an input: only inputs may move (FSDP's plan)
    REDUCE_SHARED = "<reduce shared partials>"  # a Partial value with several consumers is reduced once, where made


@dataclass(frozen=True)
class Refinement:
    """Which re-propagations refine.py tries, keeping the cheapest plan.

    ``reduce_shared``: first, a plan that reduces a Partial value with several consumers once
    where it is made (Megatron's backward all-reduces each block's input gradient once; kept
    Partial, each view of it a consumer needs is reduced on its own). Then up to ``rounds``
    rounds from the best plan so far: every activation pinned (``pin_activations``: FSDP's plan,
    only inputs move), each of the ``max_singles`` smallest inputs the plan moved pinned alone
    (the greedy choice moves small operands, token ids say, and pays for it at every later
    layer), or rather with the same input of the other layers (one try for every layer's norm
    weight: ``refine.smallest_classes``), and all of them pinned. A round that finds nothing cheaper ends the search. Last,
    ``foresee``: the best plan propagated once more with the redistributions it asks for known
    from the start (propagation chooses in program order: an op cannot know that a later consumer
    will gather the value, or a relabelling of the value, it could use).
    """

    reduce_shared: bool = True
    pin_activations: bool = True
    max_singles: int = 6
    rounds: int = 2
    foresee: bool = True


@dataclass(frozen=True)
class TrainingSplit:
    """What the forward keeps for the backward among values the plan gathered.

    A parameter the plan gathers (an FSDP weight) is gathered again in the backward, so no rank
    holds it between the passes, except: parameters gathered to a size ``keep_below_fraction``
    times smaller than the largest gathered one (a norm's weight: gathering it again costs a
    collective's latency to save a few KiB), and, with ``keep_first_backward_gather``, the root
    parameter (outside the repeated layers) the backward gathers first (the output projection: it
    would be gathered again at once, while every saved activation is alive, so keeping it raises
    no peak; FSDP2 keeps its root module unsharded after forward for the same reason; a layer's
    would make that layer's program differ from the others' and cost a compile).

    A gathered activation (a sequence-parallel block's input) is kept for the backward with
    ``keep_gathered_activations``, as DTensor's and torchtitan's sequence parallelism keep it: no
    collective and no byte more than they move. Off, it is gathered again where the backward reads
    it, as Megatron-LM does: one all_gather more per gathered input each step, for a peak lower by
    the gathered activations (tp - 1 of every tp parts of them).

    With ``recompute_pointwise`` a saved value the backward can rebuild from values it keeps anyway
    by pointwise ops and views alone (a normalization's output from its input and statistics,
    SwiGLU's product from its projections) is rebuilt there, as AOTAutograd's min-cut partitioner
    does: fewer bytes held between the passes, no collective and no byte moved more.
    """

    keep_below_fraction: int = 64
    keep_first_backward_gather: bool = True
    keep_gathered_activations: bool = True
    recompute_pointwise: bool = True


@dataclass(frozen=True)
class MixedPrecision:
    """FSDP2's ``MixedPrecisionPolicy``, for every parallelism: the parameters stay what they are (fp32, sharded),
    the program computes with them cast to ``param_dtype``, and their gradients are summed in ``reduce_dtype``.

    Each floating parameter is cast where the program reads it (``backend/capture/trace.py``), on the rank's
    shard: the planner then gathers the cast values (an FSDP gather of bf16 bytes, half the fp32 ones, as FSDP2
    casts before its all-gather). A parameter's gradient is the cast's backward: cast to ``reduce_dtype`` and
    summed over the ranks there (an FSDP reduce-scatter, a replicated weight's all-reduce), then cast to the
    parameter's dtype, so the fp32 parameters receive fp32 gradients; ``reduce_dtype`` None sums in
    ``param_dtype``, as FSDP2 does. With ``cast_forward_inputs`` the floating arguments of the function are cast
    to ``param_dtype`` too (FSDP2's default); ``output_dtype`` casts its floating outputs. Buffers are not cast.
    The optimizer step is the user's, on the fp32 parameters and gradients."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            dtype = getattr(self, name)
            if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
                raise TypeError(f"MixedPrecision({name}={dtype!r}): expected a floating torch.dtype "
                                "(torch.bfloat16, torch.float16, torch.float32) or None")

    @property
    def summed_in(self) -> torch.dtype | None:
        """The dtype gradients are summed in: ``reduce_dtype``, else ``param_dtype``."""
        return self.reduce_dtype or self.param_dtype


DEFAULT_REFINEMENT = Refinement()
# what ``fxshard.auto_placements`` prices each candidate with (placement_search.py): FSDP's pinned activations
# and the one reduction of shared partial sums, one round; the answer is priced with ``DEFAULT_REFINEMENT``
QUICK_REFINEMENT = Refinement(max_singles=0, rounds=1, foresee=False)
DEFAULT_TRAINING_SPLIT = TrainingSplit()
