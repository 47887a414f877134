"""Stage 6's compiler: a lowered local program (or one region of it) handed to Inductor.

In the order a program meets them:

1. ``compile_local``: the one call into Inductor, with its patches; ``collector`` pauses Python's GC meanwhile.
2. ``compile_inner``: Inductor's inner compile without AOTAutograd's second trace, where the program allows it;
   ``prepared_cache`` keeps what it prepared on disk, in ``cache_files``' directory and keys.
3. ``buckets``: a block's parameter all_gathers and gradient reduce_scatters merged into one each
   (``bucket_traces`` makes Inductor's merges cheap, ``bucket_copies`` their copies one library call).
4. ``collective_windows``: each collective's start and wait placed around the compute that does not need it.
5. ``cpu_wrapper``: on the CPU, Inductor's C++ wrapper with one C++ compile per program; ``flex_inputs`` copies
   the views a CPU FlexAttention call reads (Inductor's C++ flex template drops their offsets).

(Steps 3-4 and ``layers/prefetch`` do what torch's own ``schedule_overlap_bucketing`` and
``manual_overlap_bucketing`` passes do for FSDP2. On fxshard's training programs (session 43) torch's make more
calls per step or gather past FSDP's per-block bound, mostly take more compile time (1.16-1.37x the CPU
seconds with FSDP), and need stand-ins to run on them at all: bench/overlap_passes.py,
bench/results/overlap_passes.md.)

``inductor_calls`` holds the private Inductor names the caches, the bucket merges and the plain compile need.
This folder and ``capture/`` are the only ones that talk to torch's private compiler internals
(tests/test_architecture.py fences them).
"""
