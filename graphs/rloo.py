"""RLOO as Python: the twin of rloo.yaml."""

from flowrl import graph
from operators import actor, advantage, reward, rollout


@graph(
    name="rloo",
    roles={"actor": {"model": "builtin:tiny", "optim": {"lr": 5.0e-4, "grad_clip": 1.0}}},
    pools={"train": {"workers": 1, "cpus": 1, "roles": ["actor"]}},
    data={"source": "builtin:copy", "batch_size": 32},
    schedule={"micro_batches": 1, "staleness": 0},
    trainer={"steps": 300, "seed": 0, "out": "runs/rloo"},
)
def rloo(batch):
    batch = rollout.generate(batch, n=8, max_new_tokens=8)
    batch = reward.rule(batch)
    batch = advantage.rloo(batch, inputs={"token_level_rewards": "token_level_scores"})
    return actor.update(batch, clip_ratio=0.2, inputs={"old_log_probs": "rollout_log_probs"})
