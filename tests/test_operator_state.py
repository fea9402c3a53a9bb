"""Operator state (the adaptive KL β): declared, one value for every rank, checkpointed."""

from __future__ import annotations

import pytest

from flowrl.runtime.scheduler import Runtime
from tests.test_runtime import BIG, batches, graph_from


def _run(rt: Runtime, steps: int, start: int = 0, source=None):
    return list(rt.run(source or batches(4), steps=steps, start_step=start, checkpoint=lambda t: True))


def test_two_workers_see_one_beta_and_it_resumes(tmp_path):
    g = graph_from("ppo.yaml", tmp_path, pools__train__workers=2,
                   nodes__kl_reward={"op": "test.stateful_kl", "role": "actor"})
    with Runtime(g, backend="local", resources=BIG) as rt:
        results = _run(rt, 3)
        betas = []
        for r in results:
            records = rt.timeline.of_node("kl_reward", r.step)
            assert sorted(i.rank for i in records) == [0, 1]  # split across both workers
            assert len({i.metrics["beta"] for i in records}) == 1  # ... and both ran with one β
            betas.append(records[0].metrics["beta"])
        # each step starts from the β the step before left (rank 0's), which the checkpoint holds
        assert betas[0] == 1.0 and betas[0] < betas[1] < betas[2]
        assert [r.checkpoint["operator_state"] for r in results[:2]] == [{"kl_reward": {"beta": b}} for b in betas[1:]]
        payload = results[0].checkpoint
    source = batches(4)
    next(source)  # the batch of step 0, consumed before the checkpoint
    with Runtime(g, backend="local", resources=BIG) as rt:
        rt.restore(payload)
        (again,) = _run(rt, 1, start=1, source=source)
        assert rt.timeline.of_node("kl_reward", 1)[0].metrics["beta"] == betas[1]


def test_adaptive_kl_beta_is_one_value_updated_from_the_whole_batch(tmp_path):
    g = graph_from("ppo.yaml", tmp_path, pools__train__workers=2,
                   nodes__kl_reward={"op": "kl.adaptive_reward", "init_kl_coef": 0.1, "target_kl": 0.01,
                                     "horizon": 10})
    with Runtime(g, backend="local", resources=BIG) as rt:
        first, second = _run(rt, 2)
    kl0 = first.metrics["actor/reward_kl_penalty"]
    error = min(max(kl0 / 0.01 - 1, -0.2), 0.2)
    expected = 0.1 * (1 + error * 4 / 10)  # 4 rows: the whole batch, not one worker's half
    assert first.metrics["actor/kl_coef"] == pytest.approx(0.1)
    assert second.metrics["actor/kl_coef"] == pytest.approx(expected)
    assert first.checkpoint["operator_state"] == {"kl_reward": {"kl_coef": pytest.approx(expected)}}


def test_operator_state_is_saved_with_the_checkpoint(tmp_path):
    from flowrl.store.checkpoint import CheckpointStore

    store = CheckpointStore(tmp_path)
    store.save(4, {"workers": {}, "weights": {}, "source": None, "operator_state": {"kl_reward": {"kl_coef": 0.25}}},
               {"graph": {}})
    payload, _, _ = store.load_latest()
    assert payload["operator_state"] == {"kl_reward": {"kl_coef": 0.25}}
