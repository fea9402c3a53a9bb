"""The reward of a reasoning-gym task (``reasoning_gym:<task>`` rows): the task's own verifier.

verl's ``compute_score`` signature, so ``fn: auto`` picks it for these rows and a graph may also name
it by import path (``fn: operators.rewards.reasoning:compute_score``). The answer is what the row's
answer format (``extra_info["answer_format"]``, ``data.answer_format``: :mod:`operators.data.answer_formats`)
reads from the response, by default the text of the last ``<answer>...</answer>`` span (what the prompt
asks for); the task's ``score_answer`` grades it against the row's answer and metadata. A response with
no answer the format reads scores 0; one with an answer scores
at least the row's ``extra_info["format_score"]`` (``data.format_score``), a small reward for
answering in the format. The result is a dict: ``score``, and ``correct`` (the verifier's own score)
and ``formatted`` (1 when an answer was read), which become ``reward/correct/mean`` and
``reward/formatted/mean``.

Example::

    >>> compute_score("reasoning_gym:chain_sum", "<answer>7</answer>", "7", {"format_score": 0.1})   # doctest: +SKIP
    {'score': 1.0, 'correct': 1.0, 'formatted': 1.0}
    >>> compute_score("reasoning_gym:chain_sum", "7", "7", {"format_score": 0.1})["score"]          # doctest: +SKIP
    0.0
    >>> compute_score("reasoning_gym:chain_sum", "It is 7.", "7", {"answer_format": "number"})["score"]  # doctest: +SKIP
    1.0
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any, Callable

from operators.data.answer_formats import DEFAULT_FORMAT, answer_format
from operators.data.reasoning_tasks import task_dataset, task_of


def extract_answer(response: str, format_name: str = DEFAULT_FORMAT) -> str | None:
    """The answer ``response`` gives in the answer format ``format_name`` (by default the stripped text of
    the last ``<answer>...</answer>`` span), or None when it gives none.

    Example::

        >>> extract_answer("I think <answer>3</answer> no, <answer> 4 </answer>"), extract_answer("4")
        ('4', None)
    """
    return answer_format(format_name).parse(response)


@lru_cache(maxsize=32)
def _verifier(task: str, config_json: str) -> Callable[[str, dict], float]:
    return task_dataset(task, config_json, 0, 1).score_answer


def compute_score(data_source: str, solution_str: str, ground_truth: Any,
                  extra_info: dict | None = None) -> dict[str, float]:
    """The task's verifier on the answer ``solution_str`` gives in the row's format; see the module doc."""
    extra = extra_info or {}
    answer = extract_answer(solution_str, extra.get("answer_format", DEFAULT_FORMAT))
    if answer is None:
        return {"score": 0.0, "correct": 0.0, "formatted": 0.0}
    entry = {"question": extra.get("question", ""), "answer": ground_truth, "metadata": extra.get("metadata", {})}
    verifier = _verifier(task_of(data_source), json.dumps(dict(extra.get("config") or {}), sort_keys=True))
    correct = float(verifier(answer, entry))
    return {"score": max(correct, float(extra.get("format_score", 0.0))), "correct": correct, "formatted": 1.0}
