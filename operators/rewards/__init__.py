"""Rewards: rule rewards (token-id based for builtin tasks), user functions, reward models.

Example::

    >>> from operators.rewards import compute_scores, place_at_last_token
    >>> scores, extras = compute_scores(responses, response_mask, data_source=ds, ground_truth=gt,
    ...                                 tokenizer=tok, fn="auto")             # doctest: +SKIP
    >>> token_level_scores = place_at_last_token(scores, response_mask)       # doctest: +SKIP
"""

from operators.rewards.reward_model import RewardModelScorer, last_token_index
from operators.rewards.rule import (
    exact_match_score,
    extract_gsm8k_answer,
    gsm8k_score,
    partial_match_score,
    positional_match,
    task_token_score,
    token_reward,
)
from operators.rewards.scoring import (
    NAMED_REWARDS,
    auto_reward_fn,
    compute_scores,
    extra_info_rows,
    extra_metrics,
    place_at_last_token,
    resolve_reward_fn,
)
from operators.rewards.user_fn import RewardFnError, load_reward_fn, split_score

__all__ = [
    "RewardModelScorer", "last_token_index",
    "exact_match_score", "extract_gsm8k_answer", "gsm8k_score", "partial_match_score",
    "positional_match", "task_token_score", "token_reward",
    "NAMED_REWARDS", "auto_reward_fn", "compute_scores", "extra_info_rows", "extra_metrics", "place_at_last_token",
    "resolve_reward_fn",
    "RewardFnError", "load_reward_fn", "split_score",
]
