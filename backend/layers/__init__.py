"""A lowered program's layers: where it is cut so that each distinct layer compiles once.

In the order they run:

1. ``block_regions``: Dynamo traces the model's repeated blocks once, as nested compile regions.
2. ``regions``: a lowered local program cut at its layers into regions, each distinct region compiled once;
   ``regional_program``: the regions as data (``RegionRole``, keys) and as they run (``RegionalProgram``).
3. ``prefetch``: collectives across the cuts: a layer's gathers started a layer early, its reductions waited late.
4. ``end_regions``: whether a training step's prologue and epilogue are worth compiling at all.
"""
