"""Shared fixtures: a fake process group (no real communication) and meshes on it."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist


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


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", help="also run the tests marked slow (longer variants)")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: a longer variant of a test that has a fast default; run with --slow")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--slow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
