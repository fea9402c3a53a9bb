"""A node that makes chosen steps slow: the plan check's tests (one slow step, a lasting slowdown)."""

import time

from pydantic import Field

from flowrl.graph import Params, StateSpec, operator

#: the steps run so far, kept as the node's state (a run in the same process starts again at 0)
STEPS = StateSpec(init=lambda p: {"steps": 0})


class SlowSteps(Params):
    seconds: float = Field(1.0, ge=0, description="how long a slow step waits")
    base_seconds: float = Field(0.0, ge=0, description="how long every step waits (a step the load cannot stretch)")
    steps: list[int] = Field(default_factory=list, description="1-based steps that wait")
    from_step: int = Field(0, ge=0, description="every step from this one waits (0: none)")


@operator(
    "userpkg.slow_steps",
    inputs={"token_level_scores": "float32[B, R]"},
    outputs={"token_level_rewards": "float32[B, R]"},
    params=SlowSteps,
    node_name="slow",
    state=STEPS,
)
def slow_steps(batch, p: SlowSteps):
    state = batch.meta_info[STEPS.key]
    state["steps"] += 1
    step = state["steps"]
    slow = step in p.steps or (p.from_step and step >= p.from_step)
    time.sleep(p.base_seconds + (p.seconds if slow else 0.0))
    return {"token_level_rewards": batch["token_level_scores"]}, {}
