"""Stage 1 and the program's two ends: from what the user's program is to a global-shape ATen graph.

In the order they run:

1. ``capture``: Dynamo captures a user function (explain, simulate, ``fxshard.compile``) on global-shape fakes;
   under ``torch.compile`` Dynamo hands the graph over itself.
2. ``inputs``: the graph's inputs, their names, the one mesh they live on and their layouts
   (``dynamo_compat`` reads torch 2.11's DTensor calls as 2.13's).
3. ``trace``: make_fx on the global-shape fakes, functionalized: the ATen graph stages 2-5 plan and lower.
   While it traces: ``dtensor_reads`` (a DTensor's attributes read in the program), ``dtensor_rules`` (fxshard's
   rules lent to DTensor for its own ops), ``custom_functions`` and ``functional_copy`` (autograd Functions and
   ``copy_`` in a joint trace), ``block_joint`` (a repeated block's forward+backward traced once);
   ``trace_hints`` names the fix where a program cannot be read in global shapes.
4. ``outputs``: what the compiled program returns, DTensors and plain tensors as the user's program has them.

``dynamo_calls`` holds every private Dynamo and functorch name the others call: this folder and ``inductor/``
(whose ``inductor_calls`` does the same for Inductor) are the only ones that talk to torch's private compiler internals
(tests/test_architecture.py fences them).
"""
