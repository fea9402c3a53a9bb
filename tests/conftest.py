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
    """A local Ray (2 CPUs) shared by every test that needs one; shut down at the end.

    Started as ``flowrl.runtime.ray_start`` starts a run's own Ray: a new local cluster
    (``address="local"``: ``ray.init()`` alone joins any cluster another process on the
    machine started), no idle worker processes started ahead (every actor asks for
    resources of its own and never runs in one), and the workers' environment inherited
    rather than given as a runtime_env (each worker's start would wait on Ray's
    runtime-env agent)."""
    ray = pytest.importorskip("ray")
    started = False
    if not ray.is_initialized():
        os.environ["OMP_NUM_THREADS"] = "1"  # the worker processes' one torch thread
        os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
        started = True
    yield ray
    if started:
        ray.shutdown()


@pytest.fixture(scope="session")
def two_worker_grpo_run(ray_session, tmp_path_factory):
    """The default GRPO job on a 2-worker train pool (``tests.shared_runs.TWO``), ``STEPS`` steps on Ray,
    uninterrupted: its run directory and metrics rows. Tests read it, or resume a copy (``copy_run``)."""
    from flowrl.graph import load_graph
    from flowrl.run.trainer import Trainer
    from tests.shared_runs import STEPS, TWO

    out = tmp_path_factory.mktemp("two_worker_grpo") / "run"
    rows = Trainer(load_graph("grpo", overrides=TWO), backend="ray", steps=STEPS, out=out,
                   say=lambda _: None).run()
    return out, rows


def pytest_collection_modifyitems(config, items):
    has_cuda = torch.cuda.is_available()
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device; none here"))
