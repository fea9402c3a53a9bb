"""Checkpoints and resume: exactness, atomic writes, corrupt and foreign checkpoints."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flowrl.graph import load_graph
from flowrl.store.checkpoint import CheckpointError, CheckpointStore
from flowrl.run.trainer import Trainer

TINY = {"data.batch_size": 4, "nodes.generate.n": 2, "nodes.generate.max_new_tokens": 4,
        "trainer.checkpoint_every": 3}
VALUES = ("reward/mean", "actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/approx_kl",
          "response_length/mean")


def train(out: Path, steps: int, resume: bool = False, backend: str = "local", graph: str = "grpo", **extra):
    g = load_graph(graph, overrides={**TINY, **extra})
    return Trainer(g, backend=backend, steps=steps, out=out, resume=resume, say=lambda m: None).run()


def values(rows):
    return [{k: r[k] for k in VALUES if k in r} for r in rows]


def read_metrics(out: Path):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def sample_versions(out: Path) -> list[set[int]]:
    """The weight versions the samples of each step carry, from the run's rollout dumps, step by step."""
    return [{json.loads(x)["weight_version"] for x in path.read_text().splitlines()}
            for path in sorted((out / "rollouts").iterdir())]


def test_resume_is_bit_exact(tmp_path):
    full = train(tmp_path / "full", steps=6)
    part = train(tmp_path / "part", steps=3, **{"trainer.dump_rollouts": True})  # "killed" after its checkpoint
    assert [r["step"] for r in part] == [1, 2, 3]
    rest = train(tmp_path / "part", steps=6, resume=True, **{"trainer.dump_rollouts": True})
    assert [r["step"] for r in rest] == [4, 5, 6]
    assert values(part + rest) == values(full)  # exact equality, not approximate
    assert values(read_metrics(tmp_path / "part")) == values(full)
    # the resumed run goes on from the versions it saved: step t samples version t - 1, no repeat, no gap
    assert sample_versions(tmp_path / "part") == [{v} for v in range(6)]


def test_resume_is_bit_exact_with_a_critic_and_reference(tmp_path):
    full = train(tmp_path / "full", steps=4, graph="ppo", **{"trainer.checkpoint_every": 2})
    train(tmp_path / "part", steps=2, graph="ppo", **{"trainer.checkpoint_every": 2})
    rest = train(tmp_path / "part", steps=4, resume=True, graph="ppo", **{"trainer.checkpoint_every": 2})
    keys = VALUES + ("critic/vf_loss",)
    assert [[r[k] for k in keys] for r in read_metrics(tmp_path / "part")] == [[r[k] for k in keys] for r in full]
    assert len(rest) == 2


def test_resume_after_staleness_one_keeps_the_in_flight_weights(tmp_path):
    full = train(tmp_path / "full", steps=6, graph="grpo_async")
    train(tmp_path / "part", steps=3, graph="grpo_async", **{"trainer.dump_rollouts": True})
    train(tmp_path / "part", steps=6, resume=True, graph="grpo_async", **{"trainer.dump_rollouts": True})
    assert values(read_metrics(tmp_path / "part")) == values(full)
    # one version behind, across the resume too: the weights in flight are loaded with their version
    assert sample_versions(tmp_path / "part") == [{0}, {0}, {1}, {2}, {3}, {4}]


def test_a_checkpoint_of_another_graph_is_refused_naming_the_difference(tmp_path):
    train(tmp_path / "run", steps=3)
    with pytest.raises(CheckpointError) as exc:
        train(tmp_path / "run", steps=6, resume=True, **{"nodes.generate.n": 4})
    assert "nodes.generate.n: 2 → 4" in str(exc.value)


def test_a_corrupt_checkpoint_falls_back_to_the_previous_one(tmp_path):
    train(tmp_path / "run", steps=6, **{"trainer.checkpoint_every": 2})
    store = CheckpointStore(tmp_path / "run" / "checkpoints")
    newest = store.complete()[0]
    assert newest.name == "step_00000006"
    (shard,) = (newest / "roles" / "actor").glob("*.safetensors")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10  # one flipped bit in the middle of a weight: loads, silently wrong
    shard.write_bytes(bytes(data))
    said = []
    g = load_graph("grpo", overrides={**TINY, "trainer.checkpoint_every": 2})
    trainer = Trainer(g, backend="local", steps=8, out=tmp_path / "run", resume=True, say=said.append)
    rows = trainer.run()
    assert any("step_00000006 is unreadable" in m and f"{shard.name} is corrupt" in m and "falling back" in m
               for m in said)
    assert any("resuming from" in m and "step_00000004" in m for m in said)
    assert [r["step"] for r in rows] == [5, 6, 7, 8]


def test_nothing_to_resume_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError) as exc:
        train(tmp_path / "empty", steps=3, resume=True)
    assert "no complete checkpoint" in str(exc.value)


def test_kill_during_save_leaves_the_last_checkpoint_loadable(tmp_path):
    """A process killed (SIGKILL) mid-save leaves only a temporary directory behind."""
    out = tmp_path / "run"
    train(out, steps=3)
    store = CheckpointStore(out / "checkpoints")
    payload, _, _ = store.load_latest(warn=lambda m: None)
    big = {**payload, "weights": {("actor", 0): ({"x": __import__("torch").zeros(64 * 1024 * 1024 // 4)}, 0)}}
    script = (
        "import sys, torch, pickle; from flowrl.store.checkpoint import CheckpointStore; "
        "payload = pickle.load(open(sys.argv[1], 'rb')); "
        "CheckpointStore(sys.argv[2]).save(99, payload, {'graph': {}})"
    )
    pkl = tmp_path / "payload.pkl"
    pkl.write_bytes(__import__("pickle").dumps(big))
    proc = subprocess.Popen([sys.executable, "-c", script, str(pkl), str(out / "checkpoints")])
    deadline = time.time() + 60
    while time.time() < deadline and not list((out / "checkpoints").glob(".tmp_step_00000100_*")):
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (out / "checkpoints" / "step_00000100").exists()
    payload2, meta, path = store.load_latest(warn=lambda m: None)
    assert path.name == "step_00000003" and meta["step"] == 2
    rows = train(out, steps=5, resume=True)  # and the run continues from it
    assert [r["step"] for r in rows] == [4, 5]
    assert not list((out / "checkpoints").glob(".tmp_*"))  # the next save cleaned up
    shutil.rmtree(out)


def test_resume_is_bit_exact_on_ray_with_weights_in_flight(ray_session, tmp_path):
    full = train(tmp_path / "full", steps=6, backend="ray", graph="grpo_async")
    train(tmp_path / "part", steps=3, backend="ray", graph="grpo_async")
    train(tmp_path / "part", steps=6, resume=True, backend="ray", graph="grpo_async")
    assert values(read_metrics(tmp_path / "part")) == values(full)
