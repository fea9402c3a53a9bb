"""flowrl operators: the RL math and the things it needs.

Each subpackage is plain Python/torch, usable without the graph runtime:

- ``operators.models``  — model/tokenizer loading (``builtin:tiny`` or a local HF directory),
  the value model, optimizers and LR schedules.
- ``operators.data``    — builtin synthetic tasks and the verl-format prompt dataset.
- ``operators.rewards`` — rule rewards, user reward functions, reward-model scoring.
- ``operators.algos``   — log-probs, advantages, KL, and the PPO-family losses.
- ``operators.rollout`` — rollout engines (transformers; sglang on GPU).

Importing this package declares flowrl's RL operators, role kinds and data
sources (it is announced under the ``flowrl.operators`` entry point):

    from operators import rollout, reward, logprob, critic, advantage, actor, kl
"""

from operators import actor, advantage, critic, kl, logprob, reward, roles, rollout, sources  # noqa: F401

__all__ = ["actor", "advantage", "critic", "kl", "logprob", "reward", "roles", "rollout", "sources"]
