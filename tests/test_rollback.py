"""A rank of a 2-worker FSDP pool killed at step 5: the pool starts anew, the run rolls back to its last
checkpoint in the same driver and ends with the uninterrupted run's metrics. (Without a restart left, the
run stops naming the dead rank: test_distributed_runtime's killed-rank test, max_restarts being 0 there.)"""

from __future__ import annotations

import pytest

from flowrl.data.metrics import measured
from flowrl.graph import load_graph
from flowrl.errors import RuntimeFailure
from flowrl.store.sinks import read_metrics
from flowrl.run.trainer import Trainer

from tests.shared_runs import STEPS, TWO

pytest.importorskip("ray")
# a 2-worker Ray run whose pool is started anew in it: past the default 300 s on a loaded 2-core machine
pytestmark = pytest.mark.timeout(1200)

KILL = "node=update_actor,step=5,rank=1,kind=kill"


def _train(out, fault: str, said: list[str], **extra):
    g = load_graph("grpo", overrides={**TWO, "trainer.fault": fault, **extra})
    trainer = Trainer(g, backend="ray", steps=STEPS, out=out, say=said.append)
    try:
        return trainer, trainer.run(), None
    except RuntimeFailure as e:
        return trainer, None, e


@pytest.fixture(scope="module")
def runs(two_worker_grpo_run, tmp_path_factory):
    """The killed run, and the uninterrupted one (the session's: the same job without the restart)."""
    root = tmp_path_factory.mktemp("rollback")
    said: list[str] = []
    trainer, history, error = _train(root / "killed", KILL, said, **{"pools.train.max_restarts": 1})
    clean_dir, clean_rows = two_worker_grpo_run
    return {"clean": (None, clean_rows, None, [], clean_dir),
            "killed": (trainer, history, error, said, root / "killed")}


def _computed(row: dict) -> dict:
    """Every metric that does not measure the machine (or count the faults)."""
    return {k: v for k, v in row.items() if not measured(k) and not k.startswith("faults/")}


def test_a_killed_rank_rolls_the_run_back_and_it_ends_with_the_uninterrupted_metrics(runs):
    *_, clean_dir = runs["clean"]
    trainer, history, error, said, killed_dir = runs["killed"]
    assert error is None, error
    clean = [row for _, row in read_metrics(clean_dir / "metrics.jsonl", warn=print)]
    killed = [row for _, row in read_metrics(killed_dir / "metrics.jsonl", warn=print)]
    assert [r["step"] for r in killed] == list(range(1, STEPS + 1))  # steps after the checkpoint cut back
    assert [r.get("faults/restarts", 0) for r in killed] == [0, 0, 0, 0, 1]
    assert [r.get("faults/rollbacks", 0) for r in killed] == [0, 0, 0, 0, 1]
    for step, (got, want) in enumerate(zip(killed, clean), 1):
        assert _computed(got).keys() == _computed(want).keys() and "actor/pg_loss" in got
        assert _computed(got) == _computed(want), step  # bit for bit, as --resume is
    assert [r["step"] for r in history] == list(range(1, STEPS + 1))
    # fingerprints cut back as --resume cuts them: one record per step
    prints = [row for _, row in read_metrics(killed_dir / "fingerprints.jsonl", warn=print) if "step" in row]
    assert [r["step"] for r in prints] == list(range(1, STEPS + 1))


def test_the_rollback_names_the_worker_the_cause_and_the_step(runs):
    trainer, _, _, said, _ = runs["killed"]
    [event] = trainer.recovery.restarts.events
    assert event.worker.startswith("train[1] (pid ") and event.step == 4 and event.rolled_back_to == 3
    assert "ActorDiedError" in event.cause or "RayActorError" in event.cause  # Ray's words for how it ended
    line = next(m for m in said if "rolled back" in m)
    assert "died at step 5" in line and "checkpoint of step 4" in line and "restart 1 of 1" in line


def test_a_rollback_without_a_run_to_resume_fails_naming_the_worker(tmp_path):
    """(Before the first checkpoint, flowrl run goes back to its start: test_fault_windows' first step.)"""
    from flowrl.errors import WorkerDiedError
    from flowrl.recovery.recovery import Recovery
    from flowrl.runtime.backend import Death
    from flowrl.runtime.scheduler import Runtime
    from flowrl.runtime.steps import Fail, Failure, StepRun

    g = load_graph("grpo", overrides={**TWO, "pools.train.max_restarts": 1})
    died = Failure(RuntimeError("ActorDiedError"), {("train", 1): Death("train[1] (pid 7)", "ActorDiedError: …")})
    by_hand = Runtime(g, backend="local", recovery=Recovery())  # no run to resume: a rollback cannot happen
    outcome = by_hand.recovery.failed(StepRun(0, 0.0, by_hand.plan), died, (None, "train", 1))
    assert isinstance(outcome, Fail) and isinstance(outcome.error, WorkerDiedError)
    assert "flowrl run does that itself (pools.train.max_restarts)" in str(outcome.error)
    assert str(outcome.error).startswith("worker train[1] (pid 7) died at step 1 (ActorDiedError: …)")
    assert not by_hand.recovery.restarts.events
