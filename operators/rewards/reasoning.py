"""The reward of a reasoning-gym task (``reasoning_gym:<task>`` rows): the task's own verifier.

verl's ``compute_score`` signature, so ``fn: auto`` picks it for these rows and a graph may also name
it by import path (``fn: operators.rewards.reasoning:compute_score``). The answer is the text of the
last ``<answer>...</answer>`` span of the response (what the prompt asks for:
:data:`~operators.data.reasoning_tasks.ANSWER_INSTRUCTION`); the task's ``score_answer`` grades it
against the row's answer and metadata. A response with no such span scores 0; one with a span scores
at least the row's ``extra_info["format_score"]`` (``data.format_score``), a small reward for
answering in the format. The result is a dict: ``score``, and ``correct`` (the verifier's own score)
and ``formatted`` (1 when a span was found), which become ``reward/correct/mean`` and
``reward/formatted/mean``.

Example::

    >>> compute_score("reasoning_gym:chain_sum", "<answer>7</answer>", "7", {"format_score": 0.1})   # doctest: +SKIP
    {'score': 1.0, 'correct': 1.0, 'formatted': 1.0}
    >>> compute_score("reasoning_gym:chain_sum", "7", "7", {"format_score": 0.1})["score"]          # doctest: +SKIP
    0.0
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import Any, Callable

from operators.data.reasoning_tasks import task_dataset, task_of

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def extract_answer(response: str) -> str | None:
    """The stripped text of the last ``<answer>...</answer>`` span, or None when there is none.

    Example::

        >>> extract_answer("I think <answer>3</answer> no, <answer> 4 </answer>"), extract_answer("4")
        ('4', None)
    """
    spans = _ANSWER.findall(response)
    return spans[-1].strip() if spans else None


@lru_cache(maxsize=32)
def _verifier(task: str, config_json: str) -> Callable[[str, dict], float]:
    return task_dataset(task, config_json, 0, 1).score_answer


def compute_score(data_source: str, solution_str: str, ground_truth: Any,
                  extra_info: dict | None = None) -> dict[str, float]:
    """The task's verifier on the answer span of ``solution_str``; see the module doc."""
    extra = extra_info or {}
    answer = extract_answer(solution_str)
    if answer is None:
        return {"score": 0.0, "correct": 0.0, "formatted": 0.0}
    entry = {"question": extra.get("question", ""), "answer": ground_truth, "metadata": extra.get("metadata", {})}
    verifier = _verifier(task_of(data_source), json.dumps(dict(extra.get("config") or {}), sort_keys=True))
    correct = float(verifier(answer, entry))
    return {"score": max(correct, float(extra.get("format_score", 0.0))), "correct": correct, "formatted": 1.0}
