"""A run's checkpoint written by N workers resumes with M: sharded roles reshard.

A 2-worker GRPO run writes its actor with ``torch.distributed.checkpoint``
(each rank its shards); a 1-worker run resumes from it, and a 2-worker pool
loads the whole state a 1-worker run wrote. Every comparison is with what the
checkpoint holds, read back independently of the runtime that loads it.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from flowrl.graph import load_graph
from flowrl.runtime.checkpoint import CheckpointStore
from flowrl.runtime.scheduler import Runtime
from flowrl.runtime.trainer import Trainer
from flowrl.runtime.worker import RoleContext
from operators.models.export import checkpoint_weights
from operators.roles import Actor, ActorConfig

ray = pytest.importorskip("ray")

BASE = {"data.batch_size": 8, "nodes.generate.n": 4, "nodes.generate.max_new_tokens": 6,
        "trainer.checkpoint_every": 2, "trainer.val_every": 0}


def grpo(workers: int):
    return load_graph("grpo", overrides={**BASE, "pools.train.workers": workers})


def sharded_optimizer_state(path: Path) -> dict[str, torch.Tensor]:
    """Every ``optim.<param>.<name>`` tensor of a sharded checkpoint, whole, read in this process."""
    reader = dcp.HuggingFaceStorageReader(str(path))
    meta = reader.read_metadata().state_dict_metadata
    tensors = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items() if k.startswith("optim.")}
    with warnings.catch_warnings():  # one process, no group, on purpose
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(tensors, storage_reader=reader, no_dist=True)
    return tensors


def test_a_two_worker_checkpoint_resumes_on_one_and_a_whole_one_on_two(ray_session, tmp_path):
    out = tmp_path / "run"
    said: list[str] = []
    Trainer(grpo(2), backend="ray", steps=2, out=out, say=said.append).run()
    step2 = out / "checkpoints" / "step_00000002"
    assert (step2 / "actor" / "sharded.json").is_file()  # the ranks' shards, not per-rank pickles
    assert "model" not in torch.load(step2 / "workers.pt", weights_only=True)[("train", 0)]["roles"]["actor"]

    # 2 → 1 through the CLI's path: accepted, said, and the run goes on from step 3 with the samples
    # the uninterrupted 2-worker run draws (a prompt's sampling is keyed by its uid, not by its rank)
    said.clear()
    rows = Trainer(grpo(1), backend="ray", steps=3, out=out, resume=True, say=said.append).run()
    assert [r["step"] for r in rows] == [3]
    assert any("workers changed" in m and "train: 2 → 1" in m for m in said)
    straight = Trainer(grpo(2), backend="ray", steps=3, out=tmp_path / "straight", say=lambda _: None).run()
    for key in ("reward/mean", "response_length/mean"):
        assert rows[0][key] == pytest.approx(straight[-1][key], abs=1e-6), key

    names = [n for n, _ in Actor(ActorConfig(), RoleContext("actor", 0, 1, 0)).model.named_parameters()]
    saved_weights = checkpoint_weights(step2)
    saved_optim = sharded_optimizer_state(step2 / "actor")
    payload, _ = CheckpointStore(out / "checkpoints").load(step2)
    with Runtime(grpo(1), backend="ray") as rt:
        rt.restore(payload)
        (weights, _), state = rt.backend.get_many([rt.backend.call("train", 0, "get_weights", "actor"),
                                                   rt.backend.call("train", 0, "get_state")])
    assert set(weights) >= set(saved_weights)
    assert all(torch.equal(weights[k], saved_weights[k]) for k in saved_weights)
    optim = state["roles"]["actor"]["optimizer"]["state"]
    assert len(optim) == len(names)
    for i, name in enumerate(names):
        for moment in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(optim[i][moment], saved_optim[f"optim.{name}.{moment}"]), (name, moment)
        assert float(optim[i]["step"]) == 2.0
    assert state["roles"]["actor"]["updates"] == 2

    # 1 → 2: the whole checkpoint of step 3 loads into two ranks, each holding its half
    step3 = out / "checkpoints" / "step_00000003"
    whole = torch.load(step3 / "workers.pt", weights_only=True)[("train", 0)]["roles"]["actor"]
    payload, _ = CheckpointStore(out / "checkpoints").load(step3)
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
    again = sharded_optimizer_state(tmp_path / "again" / "actor")
    for i, name in enumerate(names):
        assert torch.equal(again[f"optim.{name}.exp_avg"], whole["optimizer"]["state"][i]["exp_avg"]), name
    assert state["roles"]["actor"]["updates"] == 3
