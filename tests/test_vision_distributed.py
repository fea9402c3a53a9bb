"""A vision-language model on a pool of two workers (FSDP2 over gloo) takes the steps one process takes."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowrl.graph import load_graph
from flowrl.store.checkpoint import CheckpointStore
from flowrl.run.trainer import Trainer
from operators.models import load_model

pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parents[1]
# an entropy bonus: every step moves the weights, whatever the (sparse) rewards of a random policy
SMALL = {"data.batch_size": 4, "nodes.generate.n": 2, "trainer.checkpoint_every": 2, "trainer.val_every": 100,
         "nodes.update_actor.entropy_coeff": 0.05}


def _run(out: Path, workers: int, backend: str):
    g = load_graph(ROOT / "graphs" / "grpo_vision.yaml", overrides={**SMALL, "pools.train.workers": workers})
    rows = Trainer(g, backend=backend, steps=2, out=out, say=lambda m: None).run()
    state, _, _ = CheckpointStore(out / "checkpoints").read_role("actor", step=2)
    return rows, state["model"]


def test_two_worker_update_equals_one_process(ray_session, tmp_path):
    one_rows, one = _run(tmp_path / "one", 1, "local")
    two_rows, two = _run(tmp_path / "two", 2, "ray")
    start = load_model("builtin:tiny-vl")[0].state_dict()
    assert max(float((one[k] - start[k]).abs().max()) for k in one) > 1e-4  # the steps moved the weights
    assert max(float((one[k] - two[k]).abs().max()) for k in one) <= 1e-5
    for a, b in zip(one_rows, two_rows):  # same samples (keyed by uid), same rewards, same gradients
        assert a["reward/mean"] == b["reward/mean"]
        assert a["actor/grad_norm"] == pytest.approx(b["actor/grad_norm"], rel=1e-4)
