"""``builtin:skewed``: answers from 1 to 100 tokens, most of them short.

``"copy 3 :"`` → ``"3 3 3 ... 3"``: repeat the digit ``(d + 1)²`` times, so
``0`` → 1 token and ``9`` → 100. Digits are drawn with probability ∝
``1 / (d + 1)``: half the answers are at most 4 tokens, the mean is ~19, the
tail reaches 100 — the long tail real jobs have, where a batch's longest
response is several times its average. That is what trimmed responses,
dropping finished rows and token-budget micro-batches pay off on
(``benchmarks/tokens.py``, ``graphs/grpo_skewed.yaml``). The prompt is 4
tokens, so the response dominates the cost. The length is a function of the
digit the model reads, so ``builtin:tiny`` learns it: short answers first,
longer ones as it learns where to stop (the reward, a positional match,
charges extra tokens as much as wrong ones).

Example::

    >>> from operators.data.tasks import TaskRows
    >>> rows = TaskRows("skewed", seed=0)
    >>> rows[0]["prompt"][0]["content"], len(rows[0]["reward_model"]["ground_truth"].split())
    ('copy 3 :', 16)
"""

from __future__ import annotations

import numpy as np

#: probability of each digit: ∝ 1 / (d + 1), so short answers are common and long ones rare
DIGIT_PROBS = np.array([1.0 / (d + 1) for d in range(10)]) / sum(1.0 / (d + 1) for d in range(10))


def answer_length(digit: int) -> int:
    """``(digit + 1)²``: 1 to 100 tokens."""
    return (digit + 1) ** 2


def skewed_sample(rng: np.random.Generator) -> tuple[str, str]:
    """One ``(prompt, answer)`` pair (registered as ``builtin:skewed`` in :mod:`operators.data.tasks`)."""
    digit = int(rng.choice(10, p=DIGIT_PROBS))
    return f"copy {digit} :", " ".join([str(digit)] * answer_length(digit))
