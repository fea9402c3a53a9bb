"""The built-in graphs and the RL operators through the public API."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from flowrl.data import DataProto
from flowrl.graph import builtin_graphs, load_graph
from flowrl.run.trainer import Trainer
from operators.models.optim import OptimConfig, lr_multiplier

GRAPHS = ["grpo", "grpo_async", "ppo", "rloo", "reinforce_pp", "remax", "grpo_skewed"]
ROOT = Path(__file__).resolve().parents[1]
TINY = {"data.batch_size": 4, "nodes.generate.n": 2, "nodes.generate.max_new_tokens": 4}


def test_builtin_graphs_are_found():
    assert set(GRAPHS) <= set(builtin_graphs())


@pytest.mark.parametrize("name", GRAPHS)
def test_yaml_and_python_twin_are_the_same_graph(name):
    a = load_graph(ROOT / "graphs" / f"{name}.yaml")
    b = load_graph(str(ROOT / "graphs" / f"{name}.py"))
    assert a.check().ok, [str(p) for p in a.check().errors]
    assert a.to_dict() == b.to_dict()


@pytest.mark.parametrize("name", GRAPHS)
def test_every_graph_runs_a_few_steps(name, tmp_path):
    overrides = dict(TINY)
    if name == "remax":
        overrides["nodes.baseline.max_new_tokens"] = 4
    g = load_graph(name, overrides=overrides)
    history = Trainer(g, backend="local", steps=2, out=tmp_path).run()
    assert [row["step"] for row in history] == [1, 2]
    last = history[-1]
    assert 0.0 <= last["reward/mean"] <= 1.0
    assert math.isfinite(last["actor/pg_loss"])
    optim = OptimConfig(**g.config.roles["actor"].optim)
    assert last["actor/lr"] == pytest.approx(optim.lr * lr_multiplier(1, optim))   # the graph's own lr, at update 2
    assert last["timing/update_actor"] > 0
    # tokens per second count the tokens the generator declares it reports (its mean response length)
    assert last["throughput/tokens_per_s"] == pytest.approx(
        last["throughput/samples_per_s"] * last[g.token_metrics().mean], rel=1e-9)
    if name == "ppo":
        assert math.isfinite(last["critic/vf_loss"])
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]
    assert (tmp_path / "config.yaml").is_file()


def test_default_graph_is_seeded_and_deterministic(tmp_path):
    def rewards(out):
        g = load_graph("grpo", overrides=TINY)
        return [row["reward/mean"] for row in Trainer(g, backend="local", steps=3, out=out).run()]

    assert rewards(tmp_path / "a") == rewards(tmp_path / "b")


def test_actor_update_learns_on_a_fixed_batch():
    """The operator's PPO step raises the log-prob of positively-advantaged tokens."""
    from flowrl.runtime.worker import RoleContext
    from operators import actor as actor_ops
    from operators import logprob, rollout
    from operators.roles import Actor, ActorConfig

    role = Actor(ActorConfig(optim={"lr": 1e-2, "grad_clip": 1.0}), RoleContext("actor", 0, 1, seed=0))
    prompts = torch.tensor([[1, 20, 7, 11, 16], [1, 20, 8, 12, 16]])
    batch = DataProto.from_dict(tensors={"prompts": prompts, "prompt_mask": torch.ones_like(prompts)})
    batch = rollout.generate(role, batch, n=2, max_new_tokens=3)
    batch = logprob.old(role, batch)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])[:, None].expand(-1, 3).contiguous()
    batch = batch.union(DataProto.from_dict(tensors={"advantages": adv}))
    out = actor_ops.update(role, batch, clip_ratio=0.2, epochs=4)
    assert out.meta_info["metrics"]["actor/lr"] == pytest.approx(1e-2)
    after = logprob.old(role, batch.select(batch_keys=["input_ids", "attention_mask", "position_ids",
                                                      "responses"]))
    delta = (after.batch["old_log_probs"] - batch.batch["old_log_probs"]) * batch.batch["response_mask"]
    assert (delta.sum(-1)[[0, 2]] > 0).all() and (delta.sum(-1)[[1, 3]] < 0).all()
    assert role.updates == 4


def test_grpo_operator_matches_a_hand_computation():
    from operators import advantage

    scores = torch.zeros(4, 2)
    scores[:, 1] = torch.tensor([1.0, 0.0, 0.5, 0.5])
    batch = DataProto.from_dict(
        tensors={"token_level_rewards": scores, "response_mask": torch.ones(4, 2, dtype=torch.int64)},
        non_tensors={"uid": np.array(["a", "a", "b", "b"], dtype=object)},
    )
    out = advantage.grpo(batch)
    # group a: mean 0.5, std (unbiased) 0.7071 → ±0.7071; group b: equal scores → 0
    expected = torch.tensor([0.70710, -0.70710, 0.0, 0.0])
    assert torch.allclose(out.batch["advantages"][:, 0], expected, atol=1e-4)
    assert torch.allclose(out.batch["advantages"][:, 0], out.batch["advantages"][:, 1])


def test_reward_rule_scores_the_copy_task_on_token_ids():
    from operators import reward
    from operators.models import load_tokenizer

    tok = load_tokenizer("builtin:tiny")
    right = tok.encode("3 7", add_special_tokens=False) + [tok.eos_token_id]
    wrong = tok.encode("3 9", add_special_tokens=False) + [tok.eos_token_id]
    batch = DataProto.from_dict(
        tensors={"responses": torch.tensor([right, wrong]), "response_mask": torch.ones(2, 3, dtype=torch.int64)},
        non_tensors={"data_source": np.array(["builtin:copy"] * 2, dtype=object),
                     "ground_truth": np.array(["3 7"] * 2, dtype=object),
                     "extra_info": np.array([{}, {}], dtype=object)},
        meta_info={"tokenizer": "builtin:tiny"},
    )
    out = reward.rule(batch)
    assert out.batch["token_level_scores"].tolist() == [[0.0, 0.0, 1.0], [0.0, 0.0, 0.5]]
    assert out.meta_info["metrics"]["reward/mean"] == pytest.approx(0.75)


def test_missing_model_directory_and_dataset_fail_the_check(tmp_path):
    from flowrl.graph import GraphError, ParameterError

    g = load_graph("grpo", overrides={**TINY, "roles.actor.model": str(tmp_path / "no_model"),
                                      "data.source": str(tmp_path / "train.parquet")})
    report = g.check()
    (model_err,) = [p for p in report.of(ParameterError) if "role 'actor'" in str(p)]
    assert "role 'actor'" in str(model_err) and "no model directory" in str(model_err)
    assert "no_model" in str(model_err) and "grpo.yaml:" in str(model_err)
    assert any("no such dataset file" in str(p) and "train.parquet" in str(p) for p in report.errors)
    with pytest.raises(GraphError):
        Trainer(g, backend="local", steps=1, out=tmp_path / "run")
    assert not (tmp_path / "run").exists()


def _sequences(n: int = 2):
    from flowrl.runtime.worker import RoleContext  # noqa: F401  (roles take a context)

    ids = torch.tensor([[1, 20, 7, 11, 16, 7, 11, 2]] * n)
    mask = torch.ones_like(ids)
    response_mask = torch.tensor([[1, 1, 1]] * n)
    response_mask[-1, -1] = 0  # the last row's response is one token shorter
    return DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": mask,
                                        "position_ids": mask.cumsum(-1) - 1, "response_mask": response_mask})


def test_reward_model_operator_scores_on_the_last_response_token():
    from flowrl.runtime.worker import RoleContext
    from operators import reward
    from operators.roles import RewardModel, RewardModelConfig

    rm = RewardModel(RewardModelConfig(model="builtin:tiny"), RoleContext("reward_model", 0, 1, seed=0))
    out = reward.model(rm, _sequences())
    scores = out.batch["token_level_scores"]
    direct = rm.scorer.score(out.batch["input_ids"], out.batch["attention_mask"], out.batch["position_ids"])
    assert scores.shape == (2, 3)
    assert torch.allclose(scores[0], torch.tensor([0.0, 0.0, float(direct[0])]))
    assert torch.allclose(scores[1], torch.tensor([0.0, float(direct[1]), 0.0]))


def test_adaptive_kl_reward_moves_beta_toward_the_target():
    from operators import kl

    mask = torch.ones(4, 2, dtype=torch.int64)
    batch = DataProto.from_dict(tensors={
        "token_level_scores": torch.zeros(4, 2), "response_mask": mask,
        "old_log_probs": torch.zeros(4, 2), "ref_log_prob": torch.full((4, 2), -1.0),  # k1 KL = 1 per token
    })
    first = kl.adaptive_reward(batch, init_kl_coef=0.1, target_kl=0.5, horizon=100)
    assert first.meta_info["metrics"]["actor/kl_coef"] == pytest.approx(0.1)
    assert torch.allclose(first.batch["token_level_rewards"], torch.full((4, 2), -0.1))
    batch.meta_info["operator_state"] = first.meta_info["operator_state"]  # the declared state, carried on
    second = kl.adaptive_reward(batch, init_kl_coef=0.1, target_kl=0.5, horizon=100)
    # KL 1.0 > target 0.5: error clipped to +0.2, β ← 0.1 · (1 + 0.2 · 4/100)
    assert second.meta_info["metrics"]["actor/kl_coef"] == pytest.approx(0.1 * (1 + 0.2 * 4 / 100))
    assert second.meta_info["operator_state"]["kl_coef"] == pytest.approx(0.1 * (1 + 0.2 * 4 / 100) ** 2)


def test_a_local_model_directory_and_a_verl_parquet_file_train_end_to_end(tmp_path):
    """The route for a real model: a Hugging Face directory and a parquet file in verl's schema."""
    import pandas as pd

    from operators.models import load_model, save_model

    model, tok = load_model("builtin:tiny", seed=1)
    model_dir = save_model(model, tok, tmp_path / "my-model")
    rows = [{"prompt": [{"role": "user", "content": f"copy {a} {b} ="}], "data_source": "builtin:copy",
             "reward_model": {"ground_truth": f"{a} {b}", "style": "rule"}, "extra_info": {"index": i}}
            for i, (a, b) in enumerate([(1, 2), (3, 4), (5, 6), (7, 8), (9, 0), (2, 4)])]
    data = tmp_path / "train.parquet"
    pd.DataFrame(rows).to_parquet(data)
    g = load_graph("grpo", overrides={**TINY, "roles.actor.model": str(model_dir), "data.source": str(data),
                                      "trainer.val_every": 0, "trainer.checkpoint_every": 0})
    assert g.check().ok, [str(p) for p in g.check().errors]
    history = Trainer(g, backend="local", steps=2, out=tmp_path / "run", say=lambda m: None).run()
    assert [r["step"] for r in history] == [1, 2]
    assert 0.0 <= history[-1]["reward/mean"] <= 1.0
