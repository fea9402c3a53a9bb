"""Images in the loop as Python: the twin of grpo_vision.yaml (tests check they build the same graph)."""

from flowrl import graph
from operators import actor, advantage, reward, rollout


@graph(
    name="grpo_vision",
    roles={"actor": {"model": "builtin:tiny-vl", "optim": {"lr": 1.0e-3, "grad_clip": 1.0}}},
    pools={"train": {"workers": 1, "cpus": 1, "roles": ["actor"]}},
    data={"source": "builtin:shapes", "batch_size": 16, "val_size": 64},
    schedule={"micro_batches": 1, "staleness": 0},
    trainer={"steps": 100, "seed": 0, "out": "runs/grpo_vision", "val_every": 25, "checkpoint_every": 100},
)
def grpo_vision(batch):
    batch = rollout.generate(batch, n=16, max_new_tokens=2, temperature=1.0)
    batch = reward.rule(batch, fn="operators.rewards.shapes:compute_score")
    batch = advantage.grpo(batch, inputs={"token_level_rewards": "token_level_scores"})
    return actor.update(batch, clip_ratio=0.2, entropy_coeff=0.03, inputs={"old_log_probs": "rollout_log_probs"})
