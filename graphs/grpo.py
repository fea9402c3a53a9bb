"""The default job as Python: the twin of grpo.yaml (tests check they build the same graph)."""

from flowrl import graph
from operators import actor, advantage, reward, rollout


@graph(
    name="grpo",
    roles={"actor": {"model": "builtin:tiny", "optim": {"lr": 1.0e-3, "grad_clip": 1.0, "schedule": "cosine",
                                                         "total_steps": 300, "min_lr_ratio": 0.1}}},
    pools={"train": {"workers": 1, "cpus": 1, "roles": ["actor"]}},
    data={"source": "builtin:copy", "batch_size": 32},
    schedule={"micro_batches": 1, "staleness": 0},
    trainer={"steps": 300, "seed": 0, "out": "runs/grpo", "val_every": 50, "checkpoint_every": 100},
)
def grpo(batch):
    batch = rollout.generate(batch, n=8, max_new_tokens=3, temperature=1.0)
    batch = reward.rule(batch, fn="task_eos")
    batch = advantage.grpo(batch, inputs={"token_level_rewards": "token_level_scores"})
    return actor.update(batch, clip_ratio=0.2, entropy_coeff=0.05, inputs={"old_log_probs": "rollout_log_probs"})
