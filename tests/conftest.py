"""Shared fixtures: a fake process group (no real communication) and meshes on it.

Tests marked ``@pytest.mark.slow`` (minutes each, covering what a faster test covers in part)
run only with ``--slow`` or ``FXSHARD_SLOW=1`` in the environment: CI's default run stays lean.
Tests that sample random cases (tests/test_conformance.py, tests/test_view_properties.py) draw their slow
tier's full count with ``FXSHARD_SLOW=1`` only: they read it when imported, before options are parsed.
"""
from __future__ import annotations

import logging
import os

import pytest
import torch
import torch.distributed as dist

# each test plans what it compiles: a program an earlier test (or run) compiled is not loaded from disk
# (backend/programs/lowered_cache.py; tests/test_lowered_cache.py turns it on for its own tests)
os.environ["FXSHARD_LOWERED_CACHE"] = "0"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--slow", action="store_true", help="also run the tests marked slow (FXSHARD_SLOW=1 too)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: minutes long, a fast variant runs by default; --slow or FXSHARD_SLOW=1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--slow") or os.environ.get("FXSHARD_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow: run with --slow or FXSHARD_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def fxshard_logger_restored():
    """The ``fxshard`` logger as it was before the test. ``torch._logging.set_logs()`` (tests of TORCH_LOGS) leaves
    it not propagating, with a handler on the stderr pytest captured for that test: a later test's ``caplog``
    would see none of its records."""
    logger = logging.getLogger("fxshard")
    propagate, handlers, level = logger.propagate, list(logger.handlers), logger.level
    yield
    logger.propagate, logger.handlers[:] = propagate, handlers
    logger.setLevel(level)


@pytest.fixture(scope="module")
def fake_mesh_4():
    """A 1-D DeviceMesh 'tp' of 4 ranks on a fake process group; this process is rank 0."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized(), "a process group leaked from another test module"
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        yield init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    finally:
        dist.destroy_process_group()


class MLP(torch.nn.Module):
    """The 2-layer MLP of the tests: up projection, activation, down projection."""

    def __init__(self, dim: int = 8, hidden: int = 16, activation=torch.relu):
        super().__init__()
        self.up = torch.nn.Linear(dim, hidden)
        self.down = torch.nn.Linear(hidden, dim)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.activation(self.up(x)))


@pytest.fixture
def make_mlp():
    """The MLP class, as a factory: ``make_mlp(dim, hidden, activation)``."""
    return MLP
