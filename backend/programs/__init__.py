"""Stages 2-6 per kind of program: what runs behind the callable the backend returns.

In the order they run:

1. ``joint`` (training): the joint forward+backward graph planned, then split into a forward and a backward.
2. ``fold`` / ``fold_lowered``: a model's repeated layers planned and lowered once, on a four-layer program,
   its layer stamped out (``same_values``: whether two layers' values are made alike).
3. ``lower_for_rank``: stages 4-5 for one rank (localize, then lower), the one place they are composed.
4. ``inference`` / ``training``: this rank's lowered program(s) behind a callable that speaks DTensor;
   ``stage6.cut_into_regions`` cuts them into the regions that compile, at the first call.
5. ``sizes`` / ``size_generic``: one compiled program per set of input sizes, or one for every length of a dim
   that grows.
6. ``lowered_cache``: each rank's lowered programs kept on disk (as ``graph_records``), so that a second run
   skips stages 1-5.
"""
