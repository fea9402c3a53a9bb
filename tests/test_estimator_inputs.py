"""The inputs verl's less common estimators read, produced by built-in nodes: GDPO's reward
components (compute_score's dict → reward.rule_extras' reward_extra_info) and the optimal
token baseline's Σπ² (logprob.old_sum_pi_squared), each tested by hand and run end to end
through the local backend."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from flowrl.data import DataProto
from flowrl.graph import load_graph
from flowrl.run.trainer import Trainer
from operators import advantage, logprob, reward
from operators.algos import grpo_advantages, masked_whiten
from tests.test_reward_fns import reward_batch

USER_FN = "tests.userpkg.verl_rewards:compute_score"


def test_reward_rule_keeps_each_responses_extras():
    out = reward.rule_extras(reward_batch(["3 7", "3 5", "1"], ["3 7"] * 3), fn=USER_FN)
    assert list(out["reward_extra_info"]) == [{"acc": 1.0, "length": 3}, {"acc": 0.0, "length": 3},
                                              {"acc": 0.0, "length": 1}]
    plain = reward.rule_extras(reward_batch(["3 7"], ["3 7"]), fn="exact")            # a float result: no extras
    assert list(plain["reward_extra_info"]) == [{}]


def test_gdpo_normalises_each_component_in_its_group_then_whitens_the_weighted_sum():
    texts = ["3 7", "3 5", "1", "3 7 7 7", "3 7", "9"]
    batch = reward.rule_extras(reward_batch(texts, ["3 7"] * 6), fn=USER_FN)
    uid = np.array(["a", "a", "a", "b", "b", "b"], dtype=object)
    batch = batch.union(DataProto.from_dict(non_tensors={"uid": uid}))
    batch.rename(["token_level_scores"], ["token_level_rewards"])
    out = advantage.gdpo(batch, reward_keys=["acc", "length"], reward_weights=[1.0, 0.5])
    mask = batch["response_mask"]
    acc = torch.tensor([[1.0], [0.0], [0.0], [0.0], [1.0], [0.0]])
    length = torch.tensor([[3.0], [3.0], [1.0], [7.0], [3.0], [1.0]])  # characters of each decoded response
    total = grpo_advantages(acc, mask, uid)[0] + 0.5 * grpo_advantages(length, mask, uid)[0]
    torch.testing.assert_close(out["advantages"], masked_whiten(total, mask) * mask)
    m = out.meta_info["metrics"]
    assert m["gdpo/length/max"] == 7.0 and m["gdpo/acc/mean"] == pytest.approx(2 / 6)


def test_gdpo_says_what_is_missing():
    batch = reward.rule_extras(reward_batch(["3 7", "3 5"], ["3 7"] * 2), fn=USER_FN)
    batch = batch.union(DataProto.from_dict(non_tensors={"uid": np.array(["a", "a"], dtype=object)}))
    batch.rename(["token_level_scores"], ["token_level_rewards"])
    with pytest.raises(ValueError, match="no numeric reward component 'format'.*acc, length"):
        advantage.gdpo(batch, reward_keys=["acc", "format"])
    with pytest.raises(ValueError, match="no reward_extra_info"):
        advantage.gdpo(batch.select(batch_keys=["token_level_rewards", "response_mask"], non_tensor_batch_keys=["uid"]),
                       reward_keys=["acc"])
    with pytest.raises(ValidationError, match="1 weights for 2 reward_keys"):
        advantage.GDPO(reward_keys=["acc", "length"], reward_weights=[1.0])


def test_old_log_probs_with_sum_pi_squared_match_the_distribution():
    from flowrl.runtime.worker import RoleContext
    from operators.roles import Actor, ActorConfig

    role = Actor(ActorConfig(), RoleContext("actor", 0, 1, seed=0))
    ids = torch.tensor([[1, 20, 7, 11, 16, 7, 11, 2], [0, 1, 20, 8, 16, 9, 2, 0]])
    attention = torch.tensor([[1] * 8, [0] + [1] * 6 + [0]])
    batch = DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": attention,
                                         "position_ids": (attention.cumsum(-1) - 1).clamp(min=0),
                                         "responses": ids[:, -3:]})
    both = logprob.old_sum_pi_squared(role, batch, temperature=0.7)
    torch.testing.assert_close(both["old_log_probs"], logprob.old(role, batch, temperature=0.7)["old_log_probs"])
    model = role.model
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention, position_ids=batch["position_ids"]).logits
    probs = (logits[:, -4:-1].float() / 0.7).softmax(-1)
    real = attention[:, -3:].bool()  # past a row's last token the forward reads nothing
    torch.testing.assert_close(both["sum_pi_squared"][real], probs.square().sum(-1)[real])
    assert ((both["sum_pi_squared"] > 0) & (both["sum_pi_squared"] <= 1)).all()


@pytest.mark.parametrize("graph,metric", [("tests/data/otb.yaml", "critic/advantages/mean"),
                                          ("tests/data/gdpo.yaml", "gdpo/length/mean")])
def test_graphs_feeding_these_estimators_train(graph, metric, tmp_path):
    history = Trainer(load_graph(graph), backend="local", steps=2, out=tmp_path).run()
    assert len(history) == 2
    assert all(math.isfinite(row[metric]) and math.isfinite(row["actor/pg_loss"]) for row in history)
