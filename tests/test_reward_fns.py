"""Reward functions as verl writes them: float or dict results, batched functions, reward_model.style."""

from __future__ import annotations

import json
import pytest
import torch

from flowrl.data import DataProto
from operators.data import load_dataset
from operators.models import load_tokenizer
from operators import reward
from operators.rewards import compute_scores, extra_metrics

TOK = load_tokenizer("builtin:tiny")


def encode(*texts: str) -> tuple[torch.Tensor, torch.Tensor]:
    ids = [TOK.encode(t, add_special_tokens=False) + [TOK.eos_token_id] for t in texts]
    width = max(map(len, ids))
    responses = torch.tensor([r + [TOK.pad_token_id] * (width - len(r)) for r in ids])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in ids])
    return responses, mask


def reward_batch(texts, truths, styles=None) -> DataProto:
    responses, mask = encode(*texts)
    n = len(texts)
    non_tensors = {"data_source": ["my/task"] * n, "ground_truth": list(truths), "extra_info": [{}] * n}
    if styles is not None:
        non_tensors["reward_style"] = list(styles)
    return DataProto.from_dict({"responses": responses, "response_mask": mask}, non_tensors,
                               {"tokenizer": "builtin:tiny"})


def test_a_dict_result_scores_and_its_other_keys_become_metrics():
    out = reward.rule(reward_batch(["3 7", "3 5"], ["3 7", "3 7"]), fn="tests.userpkg.verl_rewards:compute_score")
    metrics = out.meta_info["metrics"]
    assert out["token_level_scores"].sum(-1).tolist() == [1.0, 0.0]
    assert float(metrics["reward/acc/mean"]) == 0.5
    assert float(metrics["reward/length/mean"]) == 3.0
    assert extra_metrics({"acc": [1.0, None, 0.0], "tag": ["x", "y", "z"]}) == {"reward/acc/mean": 0.5}


def test_a_batched_reward_function_is_called_once_for_the_batch():
    calls = []

    def batched(data_sources, solution_strs, ground_truths, extra_infos):
        calls.append(len(solution_strs))
        return [{"score": float(s == g), "hit": float(s == g)} for s, g in zip(solution_strs, ground_truths)]

    responses, mask = encode("3 7", "1 2", "3 7")
    scores, extras = compute_scores(responses, mask, data_source=["d"] * 3, ground_truth=["3 7"] * 3,
                                    tokenizer=TOK, fn=batched, batched=True)
    assert calls == [3] and scores.tolist() == [1.0, 0.0, 1.0] and extras["hit"] == [1.0, 0.0, 1.0]
    out = reward.rule(reward_batch(["3 7", "1"], ["3 7", "3 7"]),
                      fn="tests.userpkg.verl_rewards:compute_score_batched", batched=True)
    assert out["token_level_scores"].sum(-1).tolist() == [1.0, 0.0]
    with pytest.raises(ValueError, match="one per response"):
        compute_scores(responses, mask, data_source=["d"] * 3, ground_truth=["x"] * 3, tokenizer=TOK,
                       fn=lambda **kw: [1.0], batched=True)


def test_reward_model_style_routes_rows_to_a_reward_model(tmp_path):
    batch = reward_batch(["3 7", "3 7"], ["3 7", "3 7"], styles=["rule", "model"])
    with pytest.raises(ValueError, match=r"rows \[1\] have reward_model.style 'model'.*reward.model node"):
        reward.rule(batch, fn="exact")
    out = reward.rule(reward_batch(["3 7"], ["3 7"], styles=["rule"]), fn="exact")
    assert out["token_level_scores"].sum().item() == 1.0

    rows = [{"prompt": [{"role": "user", "content": "copy 3 7"}], "data_source": "d",
             "reward_model": {"style": style, "ground_truth": "3 7"}} for style in ("rule", "model", None)]
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    collated = load_dataset(str(path), TOK).collate([0, 1, 2])
    assert collated["reward_style"].tolist() == ["rule", "model", "rule"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({**rows[0], "reward_model": {"style": "human", "ground_truth": "1"}}))
    with pytest.raises(ValueError, match="reward_model.style is 'human'; use 'rule' or 'model'"):
        load_dataset(str(bad), TOK).collate([0])
