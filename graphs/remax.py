"""ReMax as Python: the twin of remax.yaml."""

from flowrl import graph
from operators import actor, advantage, reward, rollout

BASELINE = {name: f"baseline_{name}" for name in ("input_ids", "attention_mask", "position_ids", "responses",
                                                  "response_mask")}
BASELINE.update(rollout_log_probs="baseline_log_probs", weight_version="baseline_weight_version")


@graph(
    name="remax",
    roles={"actor": {"model": "builtin:tiny", "optim": {"lr": 5.0e-4, "grad_clip": 1.0}}},
    pools={"train": {"workers": 1, "cpus": 1, "roles": ["actor"]}},
    data={"source": "builtin:copy", "batch_size": 32},
    schedule={"micro_batches": 1, "staleness": 0},
    trainer={"steps": 300, "seed": 0, "out": "runs/remax"},
)
def remax(batch):
    batch = rollout.generate(batch, n=8, max_new_tokens=8)
    batch = reward.rule(batch)
    batch = rollout.generate(batch, name="baseline", greedy=True, max_new_tokens=8, outputs=BASELINE)
    batch = reward.rule(batch, name="baseline_reward",
                        inputs={"responses": "baseline_responses", "response_mask": "baseline_response_mask"},
                        outputs={"token_level_scores": "reward_baselines"})
    batch = advantage.remax(batch, inputs={"token_level_rewards": "token_level_scores"})
    return actor.update(batch, clip_ratio=0.2, inputs={"old_log_probs": "rollout_log_probs"})
