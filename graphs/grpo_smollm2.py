"""The demo on real weights as Python: the twin of grpo_smollm2.yaml (tests check they build the same graph)."""

from flowrl import graph
from operators import actor, advantage, reward, rollout


@graph(
    name="grpo_smollm2",
    roles={"actor": {"model": "builtin:smollm2-135m", "optim": {"lr": 1.0e-4, "grad_clip": 1.0},
                     "lora": {"r": 16, "alpha": 32, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj",
                                                                       "gate_proj", "up_proj", "down_proj"]},
                     "rollout": {"engine": "auto"}}},
    pools={"train": {"workers": 1, "cpus": 1, "roles": ["actor"]}},
    data={"source": "reasoning_gym:basic_arithmetic",
          "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2, "operators": ["+"],
                     "allow_parentheses": False, "allow_negation": False},
          "answer_format": "number", "format_score": 0.0, "batch_size": 8, "task_size": 4096, "val_size": 64},
    schedule={"micro_batches": 1, "staleness": 0},
    trainer={"steps": 50, "seed": 0, "out": "runs/grpo_smollm2", "val_every": 10, "checkpoint_every": 10},
)
def grpo_smollm2(batch):
    batch = rollout.generate(batch, n=8, max_new_tokens=16, temperature=0.7)
    batch = reward.rule(batch, fn="auto")
    batch = advantage.grpo(batch, inputs={"token_level_rewards": "token_level_scores"})
    return actor.update(batch, clip_ratio=0.2, temperature=0.7, micro_batch_size=16,
                        inputs={"old_log_probs": "rollout_log_probs"})
