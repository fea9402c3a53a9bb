"""Shared test fixtures: one torch thread, one session-scoped local Ray."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def ray_session():
    """A local Ray (2 CPUs) shared by every test that needs one; shut down at the end."""
    ray = pytest.importorskip("ray")
    started = False
    if not ray.is_initialized():
        # a Ray of its own (address="local"): a bare ray.init() joins any cluster another process
        # on the machine started, and then refuses num_cpus
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
        started = True
    yield ray
    if started:
        ray.shutdown()


def pytest_collection_modifyitems(config, items):
    has_cuda = torch.cuda.is_available()
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device; none here"))
