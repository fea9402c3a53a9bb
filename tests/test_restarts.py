"""A dead worker of a pool that only generates is replaced and the run goes on, unchanged."""

from __future__ import annotations

import pytest

from flowrl.graph import load_graph
from flowrl.recovery.recovery import Recovery
from flowrl.runtime.scheduler import Runtime
from tests.test_on_error import BIG, prompts

SMALL = {"data.batch_size": 4, "nodes.generate.n": 4, "nodes.generate.max_new_tokens": 4, "trainer.val_every": 0,
         "trainer.checkpoint_every": 0}
STEPS = 6


def _same(metrics: dict[str, float]) -> dict[str, float]:
    """Every metric that does not measure time (or count the faults)."""
    return {k: v for k, v in metrics.items() if k.split("/")[0] not in ("timing", "scheduler", "faults", "perf")}


@pytest.fixture(scope="module")
def runs(ray_session):
    out = {}
    for name, fault in (("clean", None), ("killed", "node=generate,step=5,kind=kill")):
        g = load_graph("grpo_async", overrides={**SMALL, "pools.gen.max_restarts": 1, "trainer.fault": fault})
        rt = Runtime(g, backend="ray", resources=BIG, recovery=Recovery())
        try:
            # a checkpoint behind the step the worker died in: taken after the tasks run again
            results = list(rt.run(iter(prompts(g, STEPS)), steps=STEPS, checkpoint=lambda t: t == 4))
            out[name] = ([r.metrics for r in results], list(rt.recovery.restarts.events), dict(rt.backend.pids),
                         {k: s["versions"] for k, s in results[4].checkpoint["workers"].items()})
        finally:
            rt.close()
    return out


def test_the_killed_rollout_worker_is_replaced_and_every_metric_is_unchanged(runs):
    clean, _, _, clean_versions = runs["clean"]
    killed, events, _, versions = runs["killed"]
    assert versions == clean_versions and versions[("gen", 0)]["rollout"] >= 3
    assert len(killed) == STEPS
    assert [m.get("faults/restarts", 0) for m in killed] == [0, 0, 0, 0, 1, 0]
    for step, (got, want) in enumerate(zip(killed, clean)):
        assert _same(got).keys() == _same(want).keys() and "actor/pg_loss" in got
        for k, v in _same(want).items():
            assert got[k] == pytest.approx(v, rel=1e-6, abs=1e-7), (step, k)


def test_the_restart_names_the_worker_the_cause_and_the_step(runs):
    _, events, pids, _ = runs["killed"]
    [event] = events
    assert event.worker.startswith("gen[0] (pid ") and event.step == 4 and event.rerun >= 1
    assert str(pids[("gen", 0)]) not in event.worker  # the new process took its place
    text = str(event)
    assert "died at step 5" in text and "replaced" in text and event.cause


def test_max_restarts_on_a_trained_or_sharded_pool_needs_checkpoints_to_roll_back_to():
    report = load_graph("grpo_async", overrides={"pools.train.max_restarts": 1}).check(resources=BIG)
    [problem] = report.errors
    assert problem.field == "max_restarts" and "'actor' is updated" in problem.message
    assert "trainer.checkpoint_every is 0" in problem.message
    report = load_graph("grpo_async", overrides={"pools.gen.max_restarts": 1, "pools.gen.workers": 2}).check(
        resources=BIG)
    assert any("one process group" in p.message for p in report.errors)
    for pool in ("train", "gen"):
        ok = load_graph("grpo_async", overrides={f"pools.{pool}.max_restarts": 1, "pools.gen.workers": 2,
                                                 "trainer.checkpoint_every": 2})
        assert not ok.check(resources=BIG).errors
