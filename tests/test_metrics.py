"""Metrics reduce as they declare: over micro-batches, ranks and the tasks of a step."""

from __future__ import annotations

import json
import pickle

import pytest

from flowrl.data.metrics import Metric, Reduction, maximum, mean, minimum, reduce_metrics, total
from flowrl.graph import load_graph
from flowrl.run.trainer import Trainer


def test_each_metric_reduces_by_its_declared_kind():
    parts = [{"m": 1.0, "tok": mean(2.0, weight=10), "n": total(3), "hi": maximum(5), "lo": minimum(-1)},
             {"m": 4.0, "tok": mean(4.0, weight=30), "n": total(4), "hi": maximum(7), "lo": minimum(2)}]
    out = reduce_metrics(parts, weights=[1, 3])
    assert out["m"] == pytest.approx((1.0 + 3 * 4.0) / 4)  # a plain number: a mean weighted by rows
    assert out["tok"] == pytest.approx((20 + 120) / 40)  # its own weight (tokens), not the rows
    assert (out["n"], out["hi"], out["lo"]) == (7.0, 7.0, -1.0)
    # the result reduces again at the next level, the same way
    again = reduce_metrics([out, {"hi": maximum(9), "tok": mean(0.0, weight=40), "n": total(1)}])
    assert (again["hi"], again["n"], again["tok"]) == (9.0, 8.0, pytest.approx(140 / 80))


def test_a_padding_pass_adds_names_but_no_values():
    r = Reduction()
    r.add({"hi": maximum(3), "tok": mean(1.0, weight=2), "n": total(5)})
    r.add({"hi": maximum(100), "tok": mean(50.0, weight=7), "n": total(9)}, real=False)
    assert r.values() == {"hi": 3.0, "tok": 1.0, "n": 5.0}
    empty = Reduction()
    empty.add({"hi": maximum(1)}, real=False)
    assert empty.values() == {}  # a max nobody gave a value to is not reported as -inf


def test_a_metric_declared_two_ways_is_refused_by_name():
    with pytest.raises(ValueError, match="'reward/max' is reduced as max in one part and as mean"):
        reduce_metrics([{"reward/max": maximum(1)}, {"reward/max": 2.0}])
    with pytest.raises(ValueError, match="not 'median'"):
        Metric(1.0, "median")


def test_a_metric_is_a_float_that_keeps_its_reduction_across_processes():
    m = maximum(0.5)
    assert m == 0.5 and json.dumps({"x": m}) == '{"x": 0.5}'
    back = pickle.loads(pickle.dumps(m))
    assert (back, back.reduce) == (0.5, "max")
    assert type(m + 1) is float  # arithmetic gives a plain number


def test_reward_extremes_over_micro_batches_are_the_batch_extremes(tmp_path):
    # four micro-batches each report their own max and min; the step reports the batch's
    g = load_graph("grpo", overrides={"data.batch_size": 8, "nodes.generate.n": 4, "nodes.generate.max_new_tokens": 4,
                                      "schedule.micro_batches": 4, "trainer.dump_rollouts": True})
    history = Trainer(g, backend="local", steps=2, out=tmp_path).run()
    for row in history:
        lines = (tmp_path / "rollouts" / f"step_{row['step']:06d}.jsonl").read_text().splitlines()
        scores = [sum(json.loads(line)["token_level_scores"]) for line in lines]
        assert len(scores) == 32
        assert row["reward/max"] == pytest.approx(max(scores))
        assert row["reward/min"] == pytest.approx(min(scores))
        assert row["reward/mean"] == pytest.approx(sum(scores) / len(scores))
    # the micro-batches' maxima differ somewhere, so a mean of them would not be the max
    per_mb = [max(sum(json.loads(line)["token_level_scores"]) for line in lines[k * 8:(k + 1) * 8]) for k in range(4)]
    assert len(set(per_mb)) > 1, per_mb


def test_an_advantages_token_means_over_a_steps_group_tasks_are_the_batchs():
    # two groups of two rows, one with 1 + 2 response tokens, one with 4 + 4: the step's tasks (one per
    # group) reduce the advantage and return means by their tokens, not their rows
    import torch

    from flowrl.data import DataProto
    from operators import advantage

    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]])
    rewards = torch.zeros(4, 4)
    rewards[torch.arange(4), mask.sum(-1) - 1] = torch.tensor([1.0, 0.0, 0.5, 0.0])
    batch = DataProto.from_dict(tensors={"token_level_rewards": rewards, "response_mask": mask},
                                non_tensors={"uid": ["a", "a", "b", "b"]})
    whole = advantage.grpo(batch).meta_info["metrics"]
    parts = [advantage.grpo(batch[torch.tensor(rows)]).meta_info["metrics"] for rows in ([0, 1], [2, 3])]
    assert parts[0]["critic/advantages/mean"] != parts[1]["critic/advantages/mean"]
    reduced = reduce_metrics(parts, weights=[2, 2])  # a plain number would be weighted by these rows
    for key in ("critic/advantages/mean", "critic/returns/mean"):
        assert reduced[key] == pytest.approx(whole[key], abs=1e-6), key
