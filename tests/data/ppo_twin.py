"""The Python twin of tests/data/ppo.yaml: must build the identical IR."""

from flowrl import graph
from tests import graph_ops as t


@graph(
    name="test_ppo",
    imports=["tests.graph_ops"],
    roles={"actor": {"kind": "test_actor", "width": 4, "lr": 0.1},
           "ref": {"from": "actor", "frozen": True},
           "critic": {"kind": "test_critic"}},
    pools={"train": {"workers": 1, "cpus": 1, "roles": ["actor", "ref"]},
           "critic": {"workers": 1, "cpus": 1, "roles": ["critic"]}},
    data={"source": "testdata:prompts", "batch_size": 4},
    schedule={"micro_batches": 2, "staleness": 0},
    trainer={"steps": 3},
)
def ppo(batch):
    batch = t.generate(batch, role="actor", n=1, max_new_tokens=4)
    batch = t.reward(batch)
    batch = t.old_logprob(batch, role="actor")
    batch = t.ref_logprob(batch, role="ref")
    batch = t.values(batch, role="critic")
    batch = t.kl_reward(batch)
    batch = t.gae(batch, gamma=1.0, lam=0.95)
    t.update_critic(batch, role="critic")
    return t.update_actor(batch, role="actor", clip_ratio=0.2)
