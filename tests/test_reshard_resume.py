"""A 2-worker run's checkpoint resumes exactly, and with another worker count: sharded roles reshard.

A 2-worker GRPO run writes its actor with ``torch.distributed.checkpoint``
(each rank its shards); a 2-worker run resumes from it bit for bit, a 1-worker
run resumes from it, and a 2-worker pool loads the whole state a 1-worker run
wrote. Every comparison is with the uninterrupted run (the session's
``two_worker_grpo_run``) or with what the checkpoint holds, read back
independently of the runtime that loads it. Each test resumes a copy of the
uninterrupted run cut back to a checkpoint: what a run killed after it leaves.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flowrl.graph import load_graph
from flowrl.store.checkpoint import CheckpointStore
from flowrl.store.checkpoint_state import read_full
from flowrl.runtime.scheduler import Runtime
from flowrl.store.sinks import read_metrics
from flowrl.run.trainer import Trainer
from flowrl.runtime.worker import RoleContext
from operators.roles import Actor, ActorConfig
from tests.shared_runs import STEPS, TWO, copy_run

ray = pytest.importorskip("ray")

VALUES = ("reward/mean", "actor/pg_loss", "actor/entropy", "actor/grad_norm", "response_length/mean")


def grpo(workers: int):
    return load_graph("grpo", overrides={**TWO, "pools.train.workers": workers})


def values(rows) -> list[dict[str, float]]:
    return [{k: r[k] for k in VALUES} for r in rows]


def test_two_worker_grpo_resumes_exactly(two_worker_grpo_run, tmp_path):
    full_dir, full = two_worker_grpo_run
    out = copy_run(full_dir, tmp_path / "part", keep_through=2)  # "killed" after its step-2 checkpoint
    rest = Trainer(grpo(2), backend="ray", steps=STEPS, out=out, resume=True, say=lambda m: None).run()
    assert [r["step"] for r in rest] == [3, 4, 5]
    assert values(rest) == values(full[2:])  # exact equality, not approximate
    # the metrics file: the rows before the checkpoint kept, those after it cut back and written again
    assert values(row for _, row in read_metrics(out / "metrics.jsonl", warn=print)) == values(full)
    assert all(r["reward/mean"] == r["reward/mean"] for r in full)  # finite, every step


def written_state(directory: Path, state: dict) -> dict:
    """The actor state a worker's ``get_state`` wrote under ``directory``, whole, read in this process."""
    return read_full(directory, "actor", state["roles"]["actor"])


def test_a_two_worker_checkpoint_resumes_on_one_and_a_whole_one_on_two(two_worker_grpo_run, tmp_path):
    full_dir, straight = two_worker_grpo_run
    out = copy_run(full_dir, tmp_path / "run", keep_through=2)
    said: list[str] = []
    step2 = out / "checkpoints" / "step_00000002"
    # one directory the two ranks wrote together, each its shards: the format one process writes
    assert len(list((step2 / "roles" / "actor").glob("*.safetensors"))) == 2
    assert [p.name for p in (step2 / "roles").iterdir()] == ["actor"]

    # 2 → 1 through the CLI's path: accepted, said, and the run goes on from step 3 with the samples
    # the uninterrupted 2-worker run draws (a prompt's sampling is keyed by its uid, not by its rank)
    said.clear()
    rows = Trainer(grpo(1), backend="ray", steps=3, out=out, resume=True, say=said.append).run()
    assert [r["step"] for r in rows] == [3]
    assert any("workers changed" in m and "train: 2 → 1" in m for m in said)
    for key in ("reward/mean", "response_length/mean"):
        assert rows[0][key] == pytest.approx(straight[2][key], abs=1e-6), key

    names = [n for n, _ in Actor(ActorConfig(), RoleContext("actor", 0, 1, 0)).model.named_parameters()]
    store = CheckpointStore(out / "checkpoints")
    saved, _, _ = store.read_role("actor", step=2)
    payload, _ = store.load(step2)
    with Runtime(grpo(1), backend="ray") as rt:
        rt.restore(payload)
        (weights, _), state = rt.backend.get_many([rt.backend.call("train", 0, "get_weights", "actor"),
                                                   rt.backend.call("train", 0, "get_state", str(tmp_path / "one"))])
    assert all(torch.equal(weights[k], v) for k, v in saved["model"].items())
    loaded = written_state(tmp_path / "one", state)
    assert sorted(loaded["optimizer"]["state"]) == sorted(names)
    for name in names:
        for moment in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(loaded["optimizer"]["state"][name][moment],
                               saved["optimizer"]["state"][name][moment]), (name, moment)
        assert float(loaded["optimizer"]["state"][name]["step"]) == 2.0
    assert loaded["updates"] == 2

    # 1 → 2: the checkpoint one process wrote at step 3 loads into two ranks, each holding its half
    whole, _, _ = store.read_role("actor", step=3)
    payload, _ = store.load(out / "checkpoints" / "step_00000003")
    with Runtime(grpo(2), backend="ray") as rt:
        rt.restore(payload)
        (gathered, _), _ = rt.backend.get_many([rt.backend.call("train", r, "get_weights", "actor")
                                                for r in range(2)])
        held = rt.backend.get_many([rt.backend.call("train", r, "held_bytes") for r in range(2)])
        state, _ = rt.backend.get_many([rt.backend.call("train", r, "get_state", str(tmp_path / "again"))
                                        for r in range(2)])  # a collective: every rank writes its shards
    assert all(torch.equal(gathered[k], v) for k, v in whole["model"].items())
    full_optim = sum(t.numel() * t.element_size() for s in whole["optimizer"]["state"].values()
                     for t in s.values() if t.dim() > 0)
    assert [h["actor"]["optimizer"] for h in held] == [pytest.approx(full_optim / 2, rel=0.01)] * 2
    # and it checkpoints again, sharded, with the same moments it loaded
    again = written_state(tmp_path / "again", state)
    for name in names:
        assert torch.equal(again["optimizer"]["state"][name]["exp_avg"],
                           whole["optimizer"]["state"][name]["exp_avg"]), name
    assert again["updates"] == 3


def test_a_two_worker_checkpoint_without_rank_0s_shard_falls_back_to_the_previous_one(two_worker_grpo_run,
                                                                                      tmp_path):
    out = copy_run(two_worker_grpo_run[0], tmp_path / "run", keep_through=4)
    newest = out / "checkpoints" / "step_00000004"
    first = sorted((newest / "roles" / "actor").glob("*.safetensors"))[0]  # rank 0's half of the actor
    first.unlink()
    said: list[str] = []
    rows = Trainer(grpo(2), backend="ray", steps=5, out=out, resume=True, say=said.append).run()
    assert any("step_00000004 is unreadable" in m and f"{first.name} is missing" in m for m in said)
    assert any("resuming from" in m and "step_00000002" in m for m in said)
    assert [r["step"] for r in rows] == [3, 4, 5]
