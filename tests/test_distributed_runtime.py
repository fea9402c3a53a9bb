"""The runtime trains across a pool's workers: the default GRPO graph at ``workers: 2`` on Ray.

The two ranks form one gloo group, shard the actor with FSDP2 and split the
update (balanced dispatch). Every comparison is with one process doing the
same work on the whole batch — never FSDP with FSDP. The session's Ray has 2
CPUs: each test's pool of two 1-CPU workers is the only thing holding them.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from flowrl.data import DataProto
from flowrl.graph import REGISTRY, load_graph
from flowrl.runtime.errors import RuntimeFailure
from flowrl.runtime.scheduler import Runtime
from flowrl.runtime.trainer import Trainer
from flowrl.runtime.worker import RoleContext
from operators.roles import Actor, ActorConfig

ray = pytest.importorskip("ray")

TWO = {"pools.train.workers": 2, "data.batch_size": 8, "nodes.generate.n": 4, "nodes.generate.max_new_tokens": 6,
       "trainer.checkpoint_every": 2, "trainer.val_every": 0}
UPDATE_IN = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask", "rollout_log_probs",
             "advantages")
#: gloo sums the two ranks' gradient shards in another order than one process adds its rows
TOLERANCE = 1e-5


def first_batch(g) -> DataProto:
    cfg = g.config
    spec = REGISTRY.source(cfg.data.source.split(":", 1)[0])
    source = spec.factory(spec.config.model_validate(cfg.data.dump()), seed=cfg.trainer.seed, roles=cfg.roles)
    return next(iter(source))


def single_process_update(g, batch: DataProto) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """The reference: the same actor (seed 0) takes the update on the whole batch in this process."""
    node = g.nodes["update_actor"]
    actor = Actor(ActorConfig(model="builtin:tiny", optim={"lr": 5.0e-4, "grad_clip": 1.0}),  # as grpo.yaml
                  RoleContext("actor", 0, 1, g.config.trainer.seed))
    batch = batch.select(list(UPDATE_IN))
    batch.rename([g_name for g_name in node.config.inputs.values()], list(node.config.inputs))
    _, metrics = node.op.run(actor, batch, node.params)
    return actor.model.state_dict(), metrics


def test_two_ranks_take_the_step_one_process_takes_on_the_whole_batch(ray_session):
    # an entropy bonus: a gradient even when the first rewards are all equal (zero advantages)
    g = load_graph("grpo", overrides={**TWO, "nodes.update_actor.entropy_coeff": 0.01})
    with Runtime(g, backend="ray", fetch=UPDATE_IN) as rt:
        result = rt.run_step(first_batch(g))
        # what another pool or validation loads: gathered by both ranks, landing on rank 0
        (gathered, version), (nothing, _) = rt.backend.get_many(
            [rt.backend.call("train", r, "get_weights", "actor") for r in range(2)])
    updates = {i.rank: i for i in result.infos if i.node == "update_actor"}
    assert sorted(updates) == [0, 1] and sum(i.rows for i in updates.values()) == 32
    assert all(12 <= i.rows <= 20 for i in updates.values())  # each rank its share, not the whole batch
    weights, metrics = single_process_update(g, result.data)
    assert version == 1 and nothing is None
    assert set(gathered) == set(weights)
    diff = max(float((gathered[k] - weights[k]).abs().max()) for k in weights)
    assert diff <= TOLERANCE
    assert any(float((gathered[k] - fresh).abs().max()) > 1e-4  # ... and the step did move them
               for k, fresh in Actor(ActorConfig(), RoleContext("actor", 0, 1, 0)).model.state_dict().items())
    for name in ("pg_loss", "entropy", "grad_norm", "approx_kl"):
        assert result.metrics[f"actor/{name}"] == pytest.approx(metrics[f"actor/{name}"], abs=TOLERANCE, rel=TOLERANCE)


def train(out: Path, steps: int, resume: bool = False, **extra):
    g = load_graph("grpo", overrides={**TWO, **extra})
    return Trainer(g, backend="ray", steps=steps, out=out, resume=resume, say=lambda m: None).run()


VALUES = ("reward/mean", "actor/pg_loss", "actor/entropy", "actor/grad_norm", "response_length/mean")


def test_two_worker_grpo_resumes_exactly(ray_session, tmp_path):
    full = train(tmp_path / "full", steps=4)
    part = train(tmp_path / "part", steps=2)  # "killed" after its step-2 checkpoint
    rest = train(tmp_path / "part", steps=4, resume=True)
    assert [r["step"] for r in part + rest] == [1, 2, 3, 4]
    assert [{k: r[k] for k in VALUES} for r in part + rest] == [{k: r[k] for k in VALUES} for r in full]
    assert all(r["reward/mean"] == r["reward/mean"] for r in full)  # finite, every step


def test_each_rank_holds_half_the_parameters_and_a_killed_rank_is_named(ray_session):
    g = load_graph("grpo", overrides={**TWO, "pools.train.timeout_s": 20})
    whole = sum(p.numel() * p.element_size()
                for p in Actor(ActorConfig(), RoleContext("actor", 0, 1, 0)).model.parameters())
    rt = Runtime(g, backend="ray").start()
    try:
        held = [rt.backend.get(rt.backend.call("train", r, "held_bytes")) for r in range(2)]
        assert [h["actor"]["params"] for h in held] == [pytest.approx(whole / 2, rel=0.01)] * 2
        assert all(h["actor"]["optimizer"] == 0 for h in held)  # no step yet
        result = rt.run_step(first_batch(g))
        # the colocated rollout generated on gathered weights: it took the other half, and gave it back
        half_mb = whole / 2 / 2**20
        assert result.metrics["rollout/unshard_taken_mb"] == pytest.approx(half_mb, rel=0.01)
        assert result.metrics["rollout/unshard_freed_mb"] == pytest.approx(half_mb, rel=0.01)
        after = [rt.backend.get(rt.backend.call("train", r, "held_bytes")) for r in range(2)]
        assert [h["actor"]["optimizer"] for h in after] == [pytest.approx(2 * whole / 2, rel=0.01)] * 2  # Adam
        # full weights from elsewhere (another pool's gather) load into the shards, and gather back the same
        gather = lambda: rt.backend.get_many([rt.backend.call("train", r, "get_weights", "actor")  # noqa: E731
                                              for r in range(2)])[0]  # a collective: every rank
        weights, _ = gather()
        moved = {k: v + 0.5 for k, v in weights.items()}
        rt.backend.get_many([rt.backend.call("train", r, "set_weights", "actor", (moved, 7)) for r in range(2)])
        again, version = gather()
        assert version == 7 and all(torch.equal(again[k], moved[k]) for k in moved)
        os.kill(rt.backend.pids[("train", 1)], signal.SIGKILL)  # rank 1 dies between steps; rank 0 meets no one
        with pytest.raises(RuntimeFailure) as err:
            rt.run_step(first_batch(g), step=1)
        text = " ".join(str(err.value).split())
        pid = rt.backend.pids[("train", 1)]
        # whichever the driver hears first: rank 0 meeting a dead peer in its first collective
        # (the pool, the collective, the dead rank), or the dead worker's own task
        assert (("pool 'train'" in text and "failed on rank 0" in text and f"rank 1 (pid {pid}) is dead" in text)
                or f"worker train[1] (pid {pid}) died" in text), text
    finally:
        rt.close()
