"""flowrl replay: a step rebuilt from its checkpoint and records, run again from one node with overrides."""

from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from flowrl.cli import app
from flowrl.graph import load_graph
from flowrl.store.checkpoint import CheckpointStore
from flowrl.provenance.record import recorded_steps
from flowrl.run.replay import replay_step
from flowrl.run.trainer import Trainer

STD = {"nodes.advantage.norm_adv_by_std_in_grpo": False}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The default job, 3 steps, a checkpoint after each, generate and reward recorded every step."""
    out = tmp_path_factory.mktemp("replay") / "a"
    g = load_graph("grpo", overrides={"trainer.val_every": 0, "trainer.checkpoint_every": 1,
                                      "trainer.record": {"nodes": ["generate", "reward"]}})
    Trainer(g, backend="local", steps=3, out=out, say=lambda m: None).run()
    return out


@pytest.fixture(scope="module")
def fresh(run, tmp_path_factory):
    """Step 3 as a run that used the other estimator from step 3 on would take it: the run's checkpoint
    after step 2 loaded (weights, optimizer, data position), then step 3 generated afresh and trained."""
    g = load_graph(run / "config.yaml", overrides=STD)
    trainer = Trainer(g, backend="local", steps=3, out=tmp_path_factory.mktemp("fresh"), say=lambda m: None)
    payload, _ = CheckpointStore(run / "checkpoints").load(run / "checkpoints" / "step_00000002")
    try:
        trainer.runtime.restore(payload)
        trainer.source.load_state_dict(payload["source"])
        result = next(trainer.runtime.run(trainer.source, steps=1, start_step=2))
    finally:
        trainer.runtime.close()
    return result.metrics


def _logged(run, step):
    return next(r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["step"] == step)


def _files(root):
    return {p: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _assert_fresh(report, fresh, logged):
    assert report["metrics"] and {"actor/pg_loss", "actor/grad_norm", "critic/advantages/mean"} <= {
        r["metric"] for r in report["metrics"]}
    for row in report["metrics"]:  # exactly, not approximately
        assert row["replay"] == fresh[row["metric"]], row["metric"]
    # the fresh run generated the very rollouts the run did, and the estimator changed the update
    assert fresh["reward/mean"] == logged["reward/mean"]
    assert fresh["response_length/mean"] == logged["response_length/mean"]
    assert report["metrics"][0]["run"] == logged[report["metrics"][0]["metric"]]
    assert not report["same"] and any(r["diff"] != 0 for r in report["metrics"] if r["metric"] == "actor/pg_loss")


def test_records_every_step_of_the_run(run):
    assert recorded_steps(run) == [1, 2, 3]


def test_replay_from_advantage_with_another_estimator_gives_the_fresh_runs_numbers(run, fresh):
    report = replay_step(run, 3, "advantage", STD, backend="local", say=lambda m: None)
    assert report["rolled_forward"] == [] and report["checkpoint"].endswith("step_00000002")
    assert report["nodes"] == ["advantage", "update_actor"]
    _assert_fresh(report, fresh, _logged(run, 3))


def test_replay_rolls_forward_through_recorded_steps_from_an_older_checkpoint(run, fresh, tmp_path):
    older = tmp_path / "older"
    shutil.copytree(run, older)
    shutil.rmtree(older / "checkpoints" / "step_00000002")
    report = replay_step(older, 3, "advantage", STD, backend="local", say=lambda m: None)
    assert report["rolled_forward"] == [2] and report["checkpoint"].endswith("step_00000001")
    _assert_fresh(report, fresh, _logged(run, 3))


def test_replay_without_overrides_gives_the_logged_numbers_and_changes_nothing_of_the_run(run):
    before = _files(run)
    res = CliRunner().invoke(app, ["replay", str(run), "--step", "2", "--from", "reward", "--backend", "local",
                                   "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["nodes"] == ["advantage", "reward", "update_actor"] and report["same"]
    assert {r["metric"] for r in report["metrics"]} >= {"reward/mean", "actor/pg_loss"}
    table = CliRunner().invoke(app, ["replay", str(run), "--step", "2", "--from", "reward", "--backend", "local"],
                               env={"COLUMNS": "80"})
    assert table.exit_code == 0, table.output
    lines = table.output.splitlines()  # piped: every metric's whole name and both values on one row
    for r in report["metrics"]:
        assert any(r["metric"] in line and f"{r['run']:.6g}" in line for line in lines), (r, table.output)
    assert _files(run) == before


def test_what_the_records_and_checkpoints_do_not_cover_is_refused_naming_the_file(run, tmp_path):
    def replay(where, *args):
        return CliRunner().invoke(app, ["replay", str(where), "--backend", "local", *args])

    # advantage is not recorded: replaying update_actor alone needs its output
    res = replay(run, "--step", "3", "--from", "update_actor")
    assert res.exit_code == 2 and str(run / "records" / "step_00000003") in res.stderr and "advantage" in res.stderr
    res = replay(run, "--step", "1", "--from", "advantage")
    assert res.exit_code == 2 and str(run / "checkpoints") in res.stderr
    res = replay(run, "--step", "3", "--from", "advantage", "--set", "nodes.generate.n=4")
    assert res.exit_code == 2 and "nodes.generate.n" in res.stderr
    broken = tmp_path / "broken"
    shutil.copytree(run, broken)
    tensors = broken / "records" / "step_00000003" / "tensors.safetensors"
    tensors.write_bytes(tensors.read_bytes()[:100])
    res = replay(broken, "--step", "3", "--from", "advantage")
    assert res.exit_code == 2 and str(tensors) in res.stderr and "Traceback" not in res.output
