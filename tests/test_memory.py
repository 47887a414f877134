"""Compiling never allocates a tensor of a global shape: a model built on the meta device, whose
parameters would not fit at global size in this test's budget, compiles through fxshard.compile and
explain within 10% of the memory torch.compile needs for the same model with DTensor parameters.

Each measurement runs in a fresh process (tests/memory_programs.py) that first warms Dynamo and
Inductor up, then resets the peak resident size and reads how far it rose.
"""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent


def measure(how: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, str(HERE / "memory_programs.py"), how], env=env, capture_output=True,
                         text=True, timeout=600, check=True)
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not pathlib.Path("/proc/self/clear_refs").exists(), reason="needs Linux's peak-RSS reset")
def test_compiling_a_model_too_large_for_global_tensors_stays_within_torch_compile_memory():
    fx, dt = measure("fxshard"), measure("dtensor")
    budget = fx["global_mib"] / 2  # the parameters at global size would not fit in it
    assert fx["explain_growth_mib"] < budget, fx
    assert fx["compile_growth_mib"] < budget, fx
    assert fx["compile_growth_mib"] <= 1.10 * dt["compile_growth_mib"], (fx, dt)
