"""GRPO one step off-policy, as Python: the twin of grpo_async.yaml."""

from flowrl import graph
from operators import actor, advantage, reward, rollout


@graph(
    name="grpo_async",
    roles={"actor": {"model": "builtin:tiny", "optim": {"lr": 5.0e-4, "grad_clip": 1.0}},
           "rollout": {"from": "actor"}},
    pools={"gen": {"workers": 1, "cpus": 1, "roles": ["rollout"]},
           "train": {"workers": 1, "cpus": 1, "roles": ["actor"]}},
    data={"source": "builtin:copy", "batch_size": 32},
    schedule={"micro_batches": 1, "staleness": 1},
    trainer={"steps": 300, "seed": 0, "out": "runs/grpo_async"},
)
def grpo_async(batch):
    batch = rollout.generate(batch, role="rollout", n=8, max_new_tokens=8, temperature=1.0)
    batch = reward.rule(batch)
    batch = advantage.grpo(batch, inputs={"token_level_rewards": "token_level_scores"})
    return actor.update(batch, clip_ratio=0.2, inputs={"old_log_probs": "rollout_log_probs"})
