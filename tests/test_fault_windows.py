"""A rank of a 2-worker trained pool killed in each window of a step, inside ``max_restarts``: the run goes
through the one recovery path (``Recovery``: a rollback) and ends with the metrics of the uninterrupted run
(issue 36, item 2). Windows the fault switch names besides a node's task: ``node=checkpoint``, while the
driver collects every worker's state for a checkpoint (a kill there ended the run with a 25-frame
``ActorDiedError`` traceback despite ``max_restarts: 1``), and ``node=validation``, a task of the validation
run. In the first step, before any checkpoint, the run goes back to its start (it failed, naming the worker).
And ``node=sync``: a worker of the generation pool killed while it loads the train pool's weights is replaced
in place."""

from __future__ import annotations

import pytest

from flowrl.data.metrics import measured
from flowrl.graph import load_graph
from flowrl.run.trainer import Trainer
from flowrl.store.sinks import read_metrics

from tests.shared_runs import STEPS, TWO

pytest.importorskip("ray")
# each window is a 2-worker Ray run with a pool restarted in it (minutes on a loaded 2-core machine)
pytestmark = pytest.mark.timeout(1800)

#: window → (the fault, the 0-based step whose checkpoint the run rolls back to, the job's other settings)
WINDOWS = {
    # step 4's checkpoint: its state is being collected, so the run goes back to step 2's
    "checkpoint": ("node=checkpoint,step=4,rank=1,kind=kill", 1, {}),
    # the first step's update, before any checkpoint: the run goes back to its start (-1: before step 1)
    "first_step": ("node=update_actor,step=1,rank=1,kind=kill", -1, {}),
    # the validation after step 4 (step 4's checkpoint is saved only once its validation is done): to step 2's
    "validation": ("node=validation,step=4,rank=1,kind=kill", 1, {"trainer.val_every": 2}),
}


def _train(out, say, **overrides) -> Trainer:
    trainer = Trainer(load_graph("grpo", overrides={**TWO, **overrides}), backend="ray", steps=STEPS, out=out, say=say)
    trainer.run()  # a traceback here is the failure this test is for
    return trainer


def _computed(row: dict) -> dict:
    """Every metric that does not measure the machine (or count the faults)."""
    return {k: v for k, v in row.items() if not measured(k) and not k.startswith("faults/")}


@pytest.fixture(scope="module")
def clean_runs(two_worker_grpo_run, tmp_path_factory):
    """The uninterrupted run of each job the windows need (the session's 2-worker run for the default one)."""
    made = {(): two_worker_grpo_run[0]}

    def clean(extra: dict):
        key = tuple(sorted(extra.items()))
        if key not in made:
            made[key] = tmp_path_factory.mktemp("clean") / "run"
            _train(made[key], lambda _: None, **extra)
        return made[key]

    return clean


@pytest.fixture(scope="module", params=list(WINDOWS))
def killed(request, clean_runs, tmp_path_factory):
    fault, _, extra = WINDOWS[request.param]
    clean_dir = clean_runs(extra)
    out = tmp_path_factory.mktemp(f"window_{request.param}") / "run"
    said: list[str] = []
    trainer = _train(out, said.append, **extra, **{"trainer.fault": fault, "pools.train.max_restarts": 1})
    return request.param, trainer, said, out, clean_dir


def test_a_rank_killed_in_each_window_rolls_back_and_ends_with_the_uninterrupted_metrics(killed):
    window, trainer, said, out, clean_dir = killed
    [event] = trainer.recovery.restarts.events
    assert event.worker.startswith("train[1] (pid ") and event.rolled_back_to == WINDOWS[window][1], event
    assert any("rolled back" in m for m in said), said
    clean = [row for _, row in read_metrics(clean_dir / "metrics.jsonl", warn=print)]
    got = [row for _, row in read_metrics(out / "metrics.jsonl", warn=print)]
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert sum(r.get("faults/rollbacks", 0) for r in got) == 1
    for step, (a, b) in enumerate(zip(got, clean), 1):
        assert "actor/pg_loss" in a and _computed(a) == _computed(b), step
    prints = [row for _, row in read_metrics(out / "fingerprints.jsonl", warn=print) if "step" in row]
    assert [r["step"] for r in prints] == list(range(1, STEPS + 1))  # cut back as --resume cuts them


def test_a_worker_killed_while_it_loads_another_pools_weights_is_replaced_and_the_run_is_unchanged(tmp_path):
    """The weight-sync window (``node=sync``): the generation pool's worker dies loading the train pool's
    weights for step 3; it is replaced in place, the sync and the tasks that waited on it run again, and
    every metric equals the uninterrupted run's."""
    small = {k: v for k, v in TWO.items() if k != "pools.train.workers"}

    def run(out, **extra) -> Trainer:
        trainer = Trainer(load_graph("grpo_async", overrides={**small, **extra}), backend="ray", steps=STEPS,
                          out=out, say=lambda _: None)
        trainer.run()
        return trainer

    run(tmp_path / "clean")
    killed = run(tmp_path / "killed", **{"trainer.fault": "node=sync,step=3,rank=0,kind=kill",
                                         "pools.gen.max_restarts": 1})
    [event] = killed.recovery.restarts.events
    assert event.worker.startswith("gen[0] (pid ") and event.step == 2 and event.rolled_back_to is None, event
    clean = [row for _, row in read_metrics(tmp_path / "clean" / "metrics.jsonl", warn=print)]
    got = [row for _, row in read_metrics(tmp_path / "killed" / "metrics.jsonl", warn=print)]
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert [r.get("faults/restarts", 0) for r in got] == [0, 0, 1, 0, 0]
    for step, (a, b) in enumerate(zip(got, clean), 1):
        assert "actor/pg_loss" in a and _computed(a) == _computed(b), step
