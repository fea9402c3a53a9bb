"""Rule rewards: builtin tasks (on token ids), gsm8k, exact and partial match.

Two kinds of function, both returning a float in [0, 1]:

- **token rewards** (marked with :func:`token_reward`) see the response's token
  ids, so special tokens cannot hide: the builtin tasks use
  :func:`task_token_score`.
- **text rewards** have verl's signature
  ``compute_score(data_source, solution_str, ground_truth, extra_info)`` and
  see the decoded response (special tokens skipped).

Example::

    >>> task_token_score([7, 11, 2], target_ids=[7, 11], eos_token_id=2)   # "3 7 <eos>"
    1.0
    >>> gsm8k_score("openai/gsm8k", "so 3 + 4 = 7 #### 7", "7")
    1.0
"""

from __future__ import annotations

import re
from typing import Any, Callable, Sequence

TextReward = Callable[[str, str, Any, dict], "float | dict"]


def token_reward(fn: Callable) -> Callable:
    """Mark ``fn(response_ids, target_ids, eos_token_id) -> float`` as scoring token ids."""
    fn.scores_token_ids = True
    return fn


def positional_match(predicted: Sequence, target: Sequence) -> float:
    """Matching positions ÷ ``max(len(target), len(predicted))``: extra items cost as much as wrong ones.

    Example::

        >>> positional_match([3, 7], [3, 7]), positional_match([3, 9], [3, 7]), positional_match([3, 7, 7], [3, 7])
        (1.0, 0.5, 0.6666666666666666)
    """
    matches = sum(p == t for p, t in zip(predicted, target))
    return matches / max(len(target), len(predicted), 1)


@token_reward
def task_token_score(response_ids: Sequence[int], target_ids: Sequence[int], eos_token_id: int) -> float:
    """The builtin tasks' reward: :func:`positional_match` of the tokens before the first EOS.

    ``response_ids`` are the valid response tokens (no padding). A response
    without EOS is scored on all its tokens, so rambling to the length limit
    scores low; any special token before EOS (``<bos>``, ``<pad>``) is a miss.

    Example::

        >>> eos = 2
        >>> task_token_score([7, 11, eos], [7, 11], eos)         # "3 7" then EOS: exact
        1.0
        >>> task_token_score([7, 11, 7, 11], [7, 11], eos)       # no EOS: 2 matches of 4
        0.5
        >>> task_token_score([1, 7, 11, eos], [7, 11], eos)      # junk <bos> first
        0.0
        >>> task_token_score([7, 11, eos, 9, 9], [7, 11], eos)   # after EOS does not count
        1.0
    """
    response_ids = list(response_ids)
    if eos_token_id in response_ids:
        response_ids = response_ids[: response_ids.index(eos_token_id)]
    return positional_match(response_ids, list(target_ids))


@token_reward
def task_eos_score(response_ids: Sequence[int], target_ids: Sequence[int], eos_token_id: int) -> float:
    """:func:`task_token_score` with the stop scored: EOS is one more target token, after the answer.

    Under :func:`task_token_score` a response that stops one token early
    (``"3 <eos>"`` for ``"3 7"``) scores as much as one with a wrong token in
    that place (both 1/2), so a policy that has learned the first token and to
    stop can settle there: every sample of a prompt agrees, and a group-relative
    advantage is zero. Here stopping early costs more than guessing (1/3
    against 2/3), so the policy keeps trying the next token until it is right.

    Example::

        >>> eos = 2
        >>> task_eos_score([7, 11, eos], [7, 11], eos), task_eos_score([7, eos], [7, 11], eos)
        (1.0, 0.3333333333333333)
        >>> task_eos_score([7, 9, eos], [7, 11], eos), task_eos_score([7, 11], [7, 11], eos)   # no EOS: 2 of 3
        (0.6666666666666666, 0.6666666666666666)
    """
    response_ids = list(response_ids)
    if eos_token_id in response_ids:
        response_ids = response_ids[: response_ids.index(eos_token_id) + 1]
    return positional_match(response_ids, [*target_ids, eos_token_id])


_GSM8K_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_NUMBER = re.compile(r"-?[0-9\.\,]+")


def extract_gsm8k_answer(solution_str: str, method: str = "strict") -> str | None:
    """The final answer of a gsm8k-style solution, commas removed, or ``None``.

    ``strict``: the last ``#### <number>``; ``flexible``: the last number anywhere.

    Example::

        >>> extract_gsm8k_answer("... #### 1,234")
        '1234'
        >>> extract_gsm8k_answer("the answer is 42.", method="flexible")
        '42'
        >>> extract_gsm8k_answer("the answer is 42") is None
        True
    """
    if method == "strict":
        found = _GSM8K_STRICT.findall(solution_str)
    elif method == "flexible":
        found = [n for n in _NUMBER.findall(solution_str) if n.strip(".,")]
    else:
        raise ValueError(f"method must be 'strict' or 'flexible', got {method!r}")
    if not found:
        return None
    return found[-1].replace(",", "").rstrip(".")


def gsm8k_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None,
                *, method: str = "strict", format_score: float = 0.0, score: float = 1.0) -> float:
    """``score`` for the right answer, ``format_score`` for a wrong one in the right format, else 0.

    Example::

        >>> gsm8k_score("gsm8k", "#### 8", "7", format_score=0.1), gsm8k_score("gsm8k", "8", "7")
        (0.1, 0.0)
    """
    answer = extract_gsm8k_answer(solution_str, method)
    if answer is None:
        return 0.0
    return score if answer == str(ground_truth).replace(",", "").strip() else format_score


def exact_match_score(data_source: str, solution_str: str, ground_truth: Any,
                      extra_info: dict | None = None) -> float:
    """1.0 when the response equals the ground truth up to surrounding whitespace.

    Example::

        >>> exact_match_score("x", " 3 7 ", "3 7"), exact_match_score("x", "3 7 7", "3 7")
        (1.0, 0.0)
    """
    return float(solution_str.strip() == str(ground_truth).strip())


def partial_match_score(data_source: str, solution_str: str, ground_truth: Any,
                        extra_info: dict | None = None) -> float:
    """:func:`positional_match` over whitespace-separated words.

    Example::

        >>> partial_match_score("x", "3 9", "3 7")
        0.5
    """
    return positional_match(solution_str.split(), str(ground_truth).split())
