"""REINFORCE++ as Python: the twin of reinforce_pp.yaml."""

from flowrl import graph
from operators import actor, advantage, kl, logprob, reward, rollout


@graph(
    name="reinforce_pp",
    roles={"actor": {"model": "builtin:tiny", "optim": {"lr": 5.0e-4, "grad_clip": 1.0}},
           "ref": {"from": "actor", "frozen": True}},
    pools={"train": {"workers": 1, "cpus": 1, "roles": ["actor", "ref"]}},
    data={"source": "builtin:copy", "batch_size": 32},
    schedule={"micro_batches": 1, "staleness": 0},
    trainer={"steps": 300, "seed": 0, "out": "runs/reinforce_pp"},
)
def reinforce_pp(batch):
    batch = rollout.generate(batch, n=8, max_new_tokens=8)
    batch = reward.rule(batch)
    batch = logprob.ref(batch)
    batch = kl.reward(batch, kl_coef=0.001, inputs={"old_log_probs": "rollout_log_probs"})
    batch = advantage.reinforce_pp(batch, gamma=1.0)
    return actor.update(batch, clip_ratio=0.2, inputs={"old_log_probs": "rollout_log_probs"})
