"""Score a batch of responses with a rule or user function, and place scores on tokens.

``fn`` names the reward: ``"auto"`` (by ``data_source``: ``builtin:*`` → the
task's token reward, anything containing ``gsm8k`` → :func:`gsm8k_score`,
``reasoning_gym:<task>`` → the task's own verifier, ``"reasoning_gym"`` by name),
``"task"`` (or a builtin task's name: ``"copy"``, ``"add"``...), ``"task_eos"`` (the
same with the stop scored: EOS is one more target token), ``"gsm8k"``,
``"exact"``, ``"partial"``, or an import path ``"pkg.mod:fn"`` /
``"file.py:fn"`` (see :mod:`operators.rewards.user_fn`).

A user function scores one response (verl's ``compute_score``) or, with
``batched=True``, the whole batch at once (verl's batch reward manager:
``fn(data_sources=, solution_strs=, ground_truths=, extra_infos=)`` returning
one float or dict per response). A dict's keys other than ``score`` come back
as ``extras`` (metrics). Rows whose ``reward_model.style`` is ``"model"`` are a
reward model's to score: a rule reward refuses them.

Example::

    >>> from operators.models import load_tokenizer
    >>> tok = load_tokenizer("builtin:tiny")
    >>> responses = torch.tensor([[7, 11, 2, 0], [7, 9, 9, 2]])     # "3 7 <eos>", "3 5 5 <eos>"
    >>> mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    >>> scores, extras = compute_scores(responses, mask, data_source=["builtin:copy"] * 2,
    ...                                 ground_truth=["3 7", "3 7"], tokenizer=tok)
    >>> scores
    tensor([1.0000, 0.3333])
    >>> place_at_last_token(scores, mask)
    tensor([[0.0000, 0.0000, 1.0000, 0.0000],
            [0.0000, 0.0000, 0.0000, 0.3333]])
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np
import torch

from operators.data.tasks import TASKS
from operators.rewards.rule import (
    exact_match_score,
    gsm8k_score,
    partial_match_score,
    task_eos_score,
    task_token_score,
)
from operators.rewards.reasoning import compute_score as reasoning_gym_score
from operators.rewards.user_fn import RewardFnError, load_reward_fn, split_score

# type hints only: declaring operators (``flowrl validate``) does not import transformers
if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

NAMED_REWARDS: dict[str, Callable[..., Any]] = {
    "task": task_token_score,
    "task_eos": task_eos_score,   # the stop scored too (the default job's: graphs/grpo.yaml says why)
    **{name: task_token_score for name in TASKS},   # every builtin task scores the same way
    "gsm8k": gsm8k_score,
    "exact": exact_match_score,
    "partial": partial_match_score,
    "reasoning_gym": reasoning_gym_score,   # the task named by each row's data_source, its own verifier
}
def named_score_max(fn: str, source: str) -> float | None:
    """The highest score reward ``fn`` gives on data ``source``: every named reward scores in [0, 1]; ``auto``
    is a named one on builtin sources; a user's function is unknown (None)."""
    if fn == "auto":
        return 1.0 if source.startswith("builtin:") else None
    return 1.0 if fn in NAMED_REWARDS else None


#: the rewards that match a builtin task's answer tokens (what a free-form answer scores near zero on)
TASK_REWARDS = frozenset(name for name, fn in NAMED_REWARDS.items() if fn in (task_token_score, task_eos_score))


def resolve_reward_fn(fn: str | Callable[..., Any]) -> Callable[..., Any] | None:
    """The callable ``fn`` names; ``None`` for ``"auto"`` (chosen per row from ``data_source``)."""
    if callable(fn):
        return fn
    if fn == "auto":
        return None
    if fn.removeprefix("builtin:") in NAMED_REWARDS:
        return NAMED_REWARDS[fn.removeprefix("builtin:")]
    if ":" in fn:
        return load_reward_fn(fn)
    raise ValueError(
        f"unknown reward function {fn!r}; use 'auto', {', '.join(repr(k) for k in NAMED_REWARDS)}, "
        "or an import path 'pkg.module:fn' / 'path/to/file.py:fn'"
    )


def auto_reward_fn(data_source: str) -> Callable[..., Any]:
    """The rule reward for a ``data_source``; an error that says what to pass when there is none."""
    if data_source.startswith("builtin:"):
        return task_token_score
    if "gsm8k" in data_source.lower():
        return gsm8k_score
    if data_source.startswith("reasoning_gym:"):
        return reasoning_gym_score
    raise ValueError(
        f"no builtin rule reward for data_source {data_source!r}; pass fn='exact', 'partial' "
        "or your own 'pkg.module:compute_score'"
    )


def compute_scores(
    responses: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    data_source: Sequence[str],
    ground_truth: Sequence[Any],
    tokenizer: PreTrainedTokenizerBase,
    extra_info: Sequence[dict | None] | None = None,
    fn: str | Callable[..., Any] = "auto",
    batched: bool = False,
    reward_style: Sequence[str] | None = None,
) -> tuple[torch.Tensor, dict[str, list]]:
    """One scalar per response: ``(scores float32[B], extras)``.

    ``extras`` gathers the non-score keys of dict results (``None`` where a row
    had none), for metrics. Token rewards see ``responses[i][response_mask[i]]``;
    text rewards see it decoded with special tokens skipped. ``batched`` calls a
    user function once for the batch (see the module doc).
    """
    _refuse_model_style(reward_style)
    chosen = resolve_reward_fn(fn)
    extra_info = [e or {} for e in extra_info] if extra_info is not None else [{}] * len(responses)
    response_ids = [ids[mask.bool()].tolist() for ids, mask in zip(responses, response_mask)]
    if batched:
        if chosen is None or getattr(chosen, "scores_token_ids", False):
            raise ValueError("batched=True needs a user function 'pkg.module:fn' taking data_sources=, "
                             "solution_strs=, ground_truths=, extra_infos= (verl's batch reward manager)")
        results = chosen(data_sources=list(data_source),
                         solution_strs=[tokenizer.decode(ids, skip_special_tokens=True) for ids in response_ids],
                         ground_truths=list(ground_truth), extra_infos=list(extra_info))
        results = list(results)
        if len(results) != len(responses):
            raise RewardFnError(f"a batched reward function returned {len(results)} scores for "
                                f"{len(responses)} responses; return one per response")
    else:
        target_cache: dict[str, list[int]] = {}
        results = []
        for i, ids in enumerate(response_ids):
            row_fn = chosen if chosen is not None else auto_reward_fn(str(data_source[i]))
            if getattr(row_fn, "scores_token_ids", False):
                truth = str(ground_truth[i])
                if truth not in target_cache:
                    target_cache[truth] = tokenizer.encode(truth, add_special_tokens=False)
                results.append(row_fn(ids, target_cache[truth], tokenizer.eos_token_id))
            else:
                solution = tokenizer.decode(ids, skip_special_tokens=True)
                results.append(row_fn(data_source[i], solution, ground_truth[i], extra_info[i]))
    scores, extras = [], defaultdict(lambda: [None] * len(responses))
    for i, result in enumerate(results):
        score, row_extras = split_score(result)
        scores.append(score)
        for key, value in row_extras.items():
            extras[key][i] = value
    return torch.tensor(scores, dtype=torch.float32), dict(extras)


def _refuse_model_style(reward_style: Sequence[str] | None) -> None:
    if reward_style is None:
        return
    model_rows = [i for i, style in enumerate(reward_style) if style == "model"]
    if model_rows:
        raise ValueError(
            f"rows {model_rows[:8]}{'...' if len(model_rows) > 8 else ''} have reward_model.style 'model': a "
            "reward model scores them, not a rule. Use a reward.model node, or set their style to 'rule'"
        )


def extra_metrics(extras: dict[str, list], prefix: str = "reward") -> dict[str, float]:
    """``{prefix}/{key}/mean`` of each numeric extra a reward function returned (rows without it skipped).

    Example::

        >>> extra_metrics({"acc": [1.0, 0.0, None], "note": ["a", "b", "c"]})
        {'reward/acc/mean': 0.5}
    """
    out = {}
    for key, values in extras.items():
        numbers = [float(v) for v in values if isinstance(v, (int, float, bool)) and not isinstance(v, str)]
        if numbers:
            out[f"{prefix}/{key}/mean"] = sum(numbers) / len(numbers)
    return out


def extra_info_rows(extras: dict[str, list], rows: int) -> np.ndarray:
    """``object[B]``: each response's own extras as a dict (keys its result did not have are left out).

    Example::

        >>> extra_info_rows({"acc": [1.0, None], "fmt": [0.5, 1.0]}, 2).tolist()
        [{'acc': 1.0, 'fmt': 0.5}, {'fmt': 1.0}]
    """
    out = np.empty(rows, dtype=object)
    for i in range(rows):
        out[i] = {key: values[i] for key, values in extras.items() if values[i] is not None}
    return out


def place_at_last_token(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """``token_level_scores[B, R]``: each score at its response's last valid token (mask 1), 0 elsewhere.

    A response with no valid token gets nothing (its score is dropped).
    """
    token_level_scores = torch.zeros(response_mask.shape, dtype=torch.float32, device=response_mask.device)
    valid = response_mask.long() > 0
    rows = torch.nonzero(valid.any(-1)).squeeze(-1)
    # the last valid position, not sum - 1: multi-turn masks have interior zeros (tool turns)
    last = response_mask.shape[-1] - 1 - valid.flip(-1).long().argmax(-1)
    token_level_scores[rows, last[rows]] = scores.to(token_level_scores)[rows]
    return token_level_scores
