"""Rule rewards that fail on chosen prompts (a flaky reward server), for tests/test_on_error.py."""

from __future__ import annotations

import zlib

#: ground truths ``compute_score`` refuses (in this process: the local backend); the tests set it
FAIL_ON: set[str] = set()


def fails(ground_truth) -> bool:
    """The prompts ``flaky_score`` refuses, the same in every process (a Ray worker too)."""
    return zlib.crc32(str(ground_truth).encode()) % 3 == 0


def score(solution_str: str) -> float:
    # a score that varies within a group, so group-normalised advantages are not all zero
    return (len(solution_str) + sum(map(ord, solution_str))) % 5 / 4


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if ground_truth in FAIL_ON:
        raise ConnectionError(f"the reward server refused {ground_truth!r}")
    return score(solution_str)


def flaky_score(data_source, solution_str, ground_truth, extra_info=None):
    if fails(ground_truth):
        raise ConnectionError(f"the reward server refused {ground_truth!r}")
    return score(solution_str)
