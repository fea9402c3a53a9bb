"""The rule reward of ``builtin:shapes``: the answer word, alone, is right.

verl's ``compute_score`` signature, so a graph names it by import path
(``fn: operators.rewards.shapes:compute_score``) and a verl user can reuse it::

    >>> compute_score("builtin:shapes", "red", "red"), compute_score("builtin:shapes", "red red", "red")
    (1.0, 0.0)
    >>> compute_score("builtin:shapes-count", "blue", "2")
    0.0
"""

from __future__ import annotations

from typing import Any


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """1.0 when the response (special tokens already dropped) is exactly the answer word, else 0.0."""
    return float(solution_str.split() == [str(ground_truth)])
