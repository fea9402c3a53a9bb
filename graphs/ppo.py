"""PPO as Python: the twin of ppo.yaml."""

from flowrl import graph
from operators import actor, advantage, critic, kl, logprob, reward, rollout


@graph(
    name="ppo",
    roles={"actor": {"model": "builtin:tiny", "optim": {"lr": 5.0e-4, "grad_clip": 1.0}},
           "ref": {"from": "actor", "frozen": True},
           "critic": {"model": "builtin:tiny", "optim": {"lr": 1.0e-3, "grad_clip": 1.0}}},
    pools={"train": {"workers": 1, "cpus": 1, "roles": ["actor", "ref"]},
           "critic": {"workers": 1, "cpus": 1, "roles": ["critic"]}},
    data={"source": "builtin:copy", "batch_size": 32},
    schedule={"micro_batches": 2, "staleness": 0},
    trainer={"steps": 300, "seed": 0, "out": "runs/ppo"},
)
def ppo(batch):
    batch = rollout.generate(batch, n=4, max_new_tokens=8)
    batch = reward.rule(batch)
    batch = logprob.old(batch)
    batch = logprob.ref(batch)
    batch = critic.values(batch)
    batch = kl.reward(batch, kl_coef=0.001)
    batch = advantage.gae(batch, gamma=1.0, lam=0.95)
    critic.update(batch, cliprange_value=0.5)
    return actor.update(batch, clip_ratio=0.2)
