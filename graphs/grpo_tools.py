"""Multi-turn GRPO with a calculator tool, as Python: the twin of grpo_tools.yaml."""

from flowrl import graph
from operators import actor, advantage, rollout
from operators.rollout import agent_reward

ADD_TOOL = {"class_name": "operators.rollout.tools.AddTool", "config": {"reward": 0.2}}


@graph(
    name="grpo_tools",
    roles={"actor": {"model": "builtin:tiny-tools", "optim": {"lr": 1.0e-3, "grad_clip": 1.0}}},
    pools={"train": {"workers": 1, "cpus": 1, "roles": ["actor"]}},
    data={"source": "builtin:tool_add", "batch_size": 16},
    schedule={"micro_batches": 1, "staleness": 0},
    trainer={"steps": 60, "seed": 0, "out": "runs/grpo_tools", "val_every": 20, "checkpoint_every": 60},
)
def grpo_tools(batch):
    batch = rollout.multi_turn(batch, n=8, max_response_length=32, max_tokens_per_turn=16, max_assistant_turns=3,
                               temperature=1.0, tools=[ADD_TOOL])
    batch = agent_reward(batch)
    batch = advantage.grpo(batch, inputs={"token_level_rewards": "token_level_scores"})
    return actor.update(batch, clip_ratio=0.2, inputs={"old_log_probs": "rollout_log_probs"})
