"""``builtin:skewed``: a copy task whose answers run from 1 to 99 tokens, most of them short.

``"copy 7 : 1 2 ="`` → ``"7 7 7 7 7 7 7 7 7 7 7 7"``: repeat the digit as many
times as the number after ``:`` says. The count is log-uniform over 1..99
(median ~10, mean ~21), the long tail real jobs have: a batch's longest
response is several times its average, which is what trimmed responses,
dropping finished rows and token-budget micro-batches pay off on
(``benchmarks/tokens.py``, ``graphs/grpo_skewed.yaml``). The prompt stays 4-5
tokens, so the response dominates the cost. ``builtin:tiny`` learns the digit
quickly and the length slowly; the reward (positional match, extra tokens
cost as much as wrong ones) credits both.

Example::

    >>> rows = TaskRows("skewed", seed=0)
    >>> rows[0]["prompt"][0]["content"], len(rows[0]["reward_model"]["ground_truth"].split())
    ('copy 8 : 3 =', 3)
"""

from __future__ import annotations

import math

import numpy as np

from operators.data.tasks import TASKS, Task, TaskRows, _spaced  # noqa: F401  (TaskRows: the example)

MAX_COUNT = 99


def _skewed(rng: np.random.Generator) -> tuple[str, str]:
    digit = int(rng.integers(0, 10))
    count = min(MAX_COUNT, int(math.exp(rng.uniform(0.0, math.log(MAX_COUNT + 1)))))
    return f"copy {digit} : {count} =", _spaced([digit] * count)


TASKS["skewed"] = Task("skewed", "repeat a digit 1-99 times, log-uniform: 'copy 7 : 3 =' -> '7 7 7'", _skewed)
