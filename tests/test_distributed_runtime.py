"""The runtime trains across a pool's workers: the default GRPO graph at ``workers: 2`` on Ray.

The two ranks form one gloo group, shard the actor with FSDP2 and split the
update (balanced dispatch). Every comparison is with one process doing the
same work on the whole batch — never FSDP with FSDP. The session's Ray has 2
CPUs: each pool of two 1-CPU workers is the only thing holding them, so the
hung-rank test's pool is gone before the pool the last two tests share starts.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch

from flowrl.data import DataProto, DataProtoFuture
from flowrl.data.dispatch import RowKeys, get_mode, task_rows
from flowrl.graph import load_graph, make_source
from flowrl.errors import RuntimeFailure
from flowrl.runtime.scheduler import Runtime
from flowrl.runtime.worker import Call, RoleContext
from operators.logprob import SEQUENCE_IN
from operators.roles import Actor, ActorConfig

ray = pytest.importorskip("ray")

TWO = {"pools.train.workers": 2, "data.batch_size": 8, "nodes.generate.n": 4, "nodes.generate.max_new_tokens": 6,
       "trainer.checkpoint_every": 2, "trainer.val_every": 0}
UPDATE_IN = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask", "rollout_log_probs",
             "advantages")
#: gloo sums the two ranks' gradient shards in another order than one process adds its rows
TOLERANCE = 1e-5


def first_batch(g) -> DataProto:
    source = make_source(g.config)
    return next(iter(source))


def single_process_actor(g, weights: dict[str, torch.Tensor] | None = None) -> Actor:
    """The same actor (seed 0) in this process, optionally holding ``weights``."""
    actor = Actor(ActorConfig(model="builtin:tiny", optim=dict(g.config.roles["actor"].optim)),  # as the graph
                  RoleContext("actor", 0, 1, g.config.trainer.seed))
    if weights is not None:
        actor.model.load_state_dict(weights)
    return actor


def single_process_update(g, batch: DataProto) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """The reference: the same actor (seed 0) takes the update on the whole batch in this process."""
    node = g.nodes["update_actor"]
    actor = single_process_actor(g)
    batch = batch.select(list(UPDATE_IN))
    batch.rename([g_name for g_name in node.config.inputs.values()], list(node.config.inputs))
    _, metrics = node.op.run(actor, batch, node.params)
    return actor.model.state_dict(), metrics


def single_process_log_probs(g, actor: Actor, batch: DataProto) -> torch.Tensor:
    node = g.nodes["old_logprob"]
    out, _ = node.op.run(actor, batch.select(list(SEQUENCE_IN)), node.params)
    return out["old_log_probs"]


def balanced_forward_on_ranks(rt: Runtime, batch: DataProto) -> list[DataProto]:
    """``old_logprob`` on ``batch`` as one balanced task of the pool's two ranks: each rank's output."""
    read = DataProtoFuture([rt.backend.put(batch.select(list(SEQUENCE_IN)))])
    keys = RowKeys(tokens="attention_mask")
    handles = [rt.backend.submit("train", r, Call("old_logprob", 1, None, read.shape(), 0, r, 2, "balanced", keys),
                                 read.handles()) for r in range(2)]
    return rt.backend.get_many([data for data, _ in handles])


def same_on_responses(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    """Max abs difference over real response tokens (ranks pad their outputs to a common width)."""
    width = mask.shape[1]
    return float(((a[:, :width] - b[:, :width]) * mask).abs().max())


def test_a_hung_rank_fails_the_step_naming_the_pool_the_rank_and_the_collective(ray_session):
    g = load_graph("grpo", overrides={**TWO, "pools.train.timeout_s": 6})
    rt = Runtime(g, backend="ray").start()
    try:
        os.kill(rt.backend.pids[("train", 1)], signal.SIGSTOP)  # rank 1 stops answering, without dying
        with pytest.raises(RuntimeFailure) as err:
            rt.run_step(first_batch(g))
        text = " ".join(str(err.value).split())
        # rank 0 waits in the step's first collective (the rollout's unshard) for the timeout, then names it
        assert "pool 'train': collective 'unshard for rollout" in text and "failed on rank 0" in text
        assert "(timeout 6s)" in text and "rank 1 never reached it" in text
    finally:
        rt.close()  # SIGKILL reaches a stopped process


def actor_bytes() -> int:
    return sum(p.numel() * p.element_size()
               for p in Actor(ActorConfig(), RoleContext("actor", 0, 1, 0)).model.parameters())


@pytest.fixture(scope="module")
def first_step(ray_session):
    """A started 2-worker pool that took its first step: the runtime, its graph, each rank's held bytes
    before the step, and the step's result. Its two worker processes serve both tests below (each start
    costs seconds of imports); the second one kills rank 1, so it runs last."""
    # an entropy bonus: a gradient even when the first rewards are all equal (zero advantages);
    # a forward pass (old log-probs) in two streamed micro-batches, balanced over the ranks
    g = load_graph("grpo", overrides={**TWO, "nodes.update_actor.entropy_coeff": 0.01,
                                      "nodes.old_logprob.op": "logprob.old", "schedule.micro_batches": 2,
                                      "pools.train.timeout_s": 20})
    rt = Runtime(g, backend="ray", fetch=UPDATE_IN + ("old_log_probs",)).start()
    try:
        held = [rt.backend.get(rt.backend.call("train", r, "held_bytes")) for r in range(2)]
        yield rt, g, held, rt.run_step(first_batch(g))
    finally:
        rt.close()


def test_two_ranks_take_the_step_one_process_takes_on_the_whole_batch(first_step):
    rt, g, _, result = first_step
    assert [t.dispatch for t in rt.plan.node_tasks("old_logprob")] == ["balanced", "balanced"]
    # what another pool or validation loads: gathered by both ranks, landing on rank 0
    (gathered, version), (nothing, _) = rt.backend.get_many(
        [rt.backend.call("train", r, "get_weights", "actor") for r in range(2)])
    # ragged rows, longest first: a contiguous split would give rank 0 every long row
    tokens = result.data["attention_mask"].sum(-1)
    skewed = result.data[torch.argsort(tokens, descending=True, stable=True).tolist()]
    parts = balanced_forward_on_ranks(rt, skewed)
    # each rank about the same real tokens: within one row's of each other, closer than a contiguous split
    real = skewed["attention_mask"].sum(-1)
    loads = [int(real[task_rows(p)].sum()) for p in parts]
    contiguous = [int(real[:16].sum()), int(real[16:].sum())]
    assert sorted(int(i) for p in parts for i in task_rows(p)) == list(range(32))
    assert abs(loads[0] - loads[1]) <= int(real.max()) and abs(loads[0] - loads[1]) < contiguous[0] - contiguous[1]
    # collected in row order, the values one process computes on the whole batch
    mask = skewed["response_mask"]
    stepped = single_process_actor(g, gathered)
    collected = get_mode("balanced").collect(parts)["old_log_probs"]
    assert same_on_responses(collected, single_process_log_probs(g, stepped, skewed), mask) <= TOLERANCE
    # the step's own forward (two micro-batches, initial weights) came back in the batch's row order too
    fresh = single_process_log_probs(g, single_process_actor(g), result.data)
    assert same_on_responses(result.data["old_log_probs"], fresh, result.data["response_mask"]) <= TOLERANCE
    # the ranks sampled what one process samples on the whole batch: a prompt's stream is keyed by its uid
    node = g.nodes["generate"]
    sampled, _ = node.op.run(single_process_actor(g), first_batch(g), node.params)
    ours = result.data["responses"]
    assert ours.shape == sampled["responses"].shape and torch.equal(ours, sampled["responses"])
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


def test_each_rank_holds_half_the_parameters_and_a_killed_rank_is_named(first_step):
    rt, g, held, result = first_step
    whole = actor_bytes()
    assert [h["actor"]["params"] for h in held] == [pytest.approx(whole / 2, rel=0.01)] * 2
    assert all(h["actor"]["optimizer"] == 0 for h in held)  # no step yet
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
    # rank 0 meets a dead peer in its first collective: the pool, the collective, the dead rank;
    # or, when Ray fails the dead rank's own task first, that worker: the pool, the rank, the pid
    collective = ("pool 'train'" in text and "failed on rank 0" in text and "collective 'unshard for rollout"
                  in text and f"rank 1 (pid {pid}) is dead" in text)
    assert collective or f"worker train[1] (pid {pid}) died while running node 'generate'" in text, text
