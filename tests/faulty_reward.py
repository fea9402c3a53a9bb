"""A rule reward that fails on chosen prompts (a flaky reward server), for tests/test_on_error.py."""

from __future__ import annotations

#: ground truths the reward refuses; the tests set it
FAIL_ON: set[str] = set()


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if ground_truth in FAIL_ON:
        raise ConnectionError(f"the reward server refused {ground_truth!r}")
    # a score that varies within a group, so group-normalised advantages are not all zero
    return (len(solution_str) + sum(map(ord, solution_str))) % 5 / 4
