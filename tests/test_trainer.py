"""flowrl run as people live with it: validation, rollout dumps, bad runs, a real kill and resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

import torch

from flowrl.graph import load_graph, operator
from flowrl.graph.problems import SchemaError
from flowrl.run.trainer import Trainer
from flowrl.plan.validation import validation_graph

TINY = {"data.batch_size": 4, "nodes.generate.n": 2, "nodes.generate.max_new_tokens": 4}


@operator("test.unscored_reward", inputs={"responses": "int64[B, R]"},
          outputs={"token_level_scores": "float32[B, R]"}, node_name="reward")
def unscored_reward(batch, p):
    """Writes token_level_scores but declares no score: nothing in the graph scores for validation."""
    return {"token_level_scores": torch.zeros(batch["responses"].shape)}


def test_validation_graph_is_the_greedy_scoring_subgraph():
    val = validation_graph(load_graph("ppo"))
    assert list(val.nodes) == ["generate", "reward"]
    assert val.nodes["generate"].params.n == 1 and val.nodes["generate"].params.greedy is True
    assert val.check().ok


def test_validate_and_the_trainer_use_one_rule_for_what_scores(tmp_path):
    # a field named like a reward is not a score: the operator's declaration is
    g = load_graph("grpo", overrides={**TINY, "trainer.val_every": 2, "nodes.reward": {"op": "test.unscored_reward"}})
    (problem,) = g.check().of(SchemaError)
    assert "trainer.val_every" in str(problem) and "declares a score" in str(problem)
    with pytest.raises(Exception, match="declares a score"):
        Trainer(g, backend="local", steps=1, out=tmp_path, say=lambda m: None)
    # a reward renamed to another field still scores, and validation runs on it
    renamed = load_graph("grpo", overrides={**TINY, "trainer.val_every": 1,
                                            "nodes.reward.outputs": {"token_level_scores": "score"},
                                            "nodes.advantage.inputs": {"token_level_rewards": "score"}})
    assert renamed.check().ok
    rows = Trainer(renamed, backend="local", steps=1, out=tmp_path / "renamed", say=lambda m: None).run()
    assert 0.0 <= rows[0]["val/reward/mean"] <= 1.0


def test_val_metrics_every_n_steps_and_rollout_dumps(tmp_path):
    g = load_graph("grpo", overrides={**TINY, "trainer.val_every": 2, "trainer.dump_rollouts": True,
                                      "data.val_size": 6})
    rows = Trainer(g, backend="local", steps=3, out=tmp_path, say=lambda m: None).run()
    assert ["val/reward/mean" in r for r in rows] == [False, True, True]  # steps 2 and 3 (the last)
    assert 0.0 <= rows[1]["val/reward/mean"] <= 1.0
    assert rows[1]["val/response_length/mean"] > 0
    dumps = sorted(p.name for p in (tmp_path / "rollouts").iterdir())
    assert dumps == ["step_000001.jsonl", "step_000002.jsonl", "step_000003.jsonl"]
    samples = [json.loads(x) for x in (tmp_path / "rollouts" / "step_000002.jsonl").read_text().splitlines()]
    assert len(samples) == 4 * 2
    # the columns the graph's operators declare dumped, by type: token ids as text, [B] as numbers
    assert set(samples[0]) == {"prompts", "responses", "weight_version", "token_level_scores", "uid", "advantages"}
    assert samples[0]["prompts"].startswith("copy ") and samples[0]["uid"] == samples[1]["uid"] == "1-0"
    assert isinstance(samples[0]["responses"], str) and len(samples[0]["token_level_scores"]) == 4  # max_new_tokens
    assert all(s["weight_version"] == 1 for s in samples)


def test_greedy_validation_is_deterministic(tmp_path):
    def val(out):
        g = load_graph("grpo", overrides={**TINY, "trainer.val_every": 1, "data.val_size": 6})
        return [r["val/reward/mean"] for r in Trainer(g, backend="local", steps=2, out=out, say=lambda m: None).run()]

    assert val(tmp_path / "a") == val(tmp_path / "b")


def test_nan_reward_stops_at_the_node_and_keeps_the_last_good_checkpoint(tmp_path):
    from flowrl.errors import NodeError

    bad = load_graph("grpo", overrides={**TINY, "trainer.checkpoint_every": 1,
                                        "nodes.reward": {"op": "tests.userpkg.faults:nan_reward"}})
    with pytest.raises(NodeError) as exc:
        Trainer(bad, backend="local", steps=3, out=tmp_path, say=lambda m: None).run()
    msg = str(exc.value)
    assert "node 'reward' failed at step 2" in msg and "non-finite values in token_level_scores" in msg
    saved = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert saved == ["step_00000001"]  # the good step, nothing after it
    rows = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 1


def _cli(*args: str, **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "flowrl.cli", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **kw)


def test_kill_9_then_resume_matches_an_uninterrupted_run(tmp_path):
    common = ["--backend", "local", "--set", "data.batch_size=4", "--set", "nodes.generate.n=2",
              "--set", "trainer.checkpoint_every=2"]
    full = _cli("run", "grpo", "--steps", "8", "--out", str(tmp_path / "full"), *common)
    victim = _cli("run", "grpo", "--steps", "8", "--out", str(tmp_path / "cut"), *common)
    ckpt = tmp_path / "cut" / "checkpoints" / "step_00000004"
    deadline = time.time() + 120
    while time.time() < deadline and not ckpt.is_dir():
        time.sleep(0.02)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert full.wait(timeout=120) == 0
    resumed = _cli("run", "grpo", "--steps", "8", "--out", str(tmp_path / "cut"), "--resume", *common)
    out, _ = resumed.communicate(timeout=120)
    assert resumed.returncode == 0, out
    assert "resuming from" in out

    def metrics(d):
        rows = [json.loads(x) for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
        return [(r["step"], r["reward/mean"], r["actor/pg_loss"], r["actor/entropy"]) for r in rows]

    assert metrics("cut") == metrics("full")
    assert len(metrics("full")) == 8


def test_ctrl_c_finishes_the_step_saves_and_exits_130(tmp_path):
    proc = _cli("run", "grpo", "--steps", "200", "--out", str(tmp_path), "--backend", "local",
                "--set", "data.batch_size=4", "--set", "nodes.generate.n=2")
    deadline = time.time() + 120
    while time.time() < deadline and not (tmp_path / "metrics.jsonl").is_file():
        time.sleep(0.05)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out
    assert "checkpoint saved, continue with --resume" in out
    rows = (tmp_path / "metrics.jsonl").read_text().splitlines()
    saved = sorted((tmp_path / "checkpoints").iterdir())
    assert saved[-1].name == f"step_{len(rows):08d}"  # after the last finished step


def test_tensorboard_gets_the_same_scalars_when_installed(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (pip install -e '.[tensorboard]')")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    g = load_graph("grpo", overrides=TINY)
    rows = Trainer(g, backend="local", steps=2, out=tmp_path, say=lambda m: None).run()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    events = acc.Scalars("reward/mean")
    assert [e.step for e in events] == [1, 2]
    assert [e.value for e in events] == pytest.approx([r["reward/mean"] for r in rows])
