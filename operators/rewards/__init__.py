"""Rewards: rule rewards (token-id based for builtin tasks), user functions, reward models.

Example::

    >>> from operators.rewards import compute_scores, place_at_last_token
    >>> scores, extras = compute_scores(responses, response_mask, data_source=ds, ground_truth=gt,
    ...                                 tokenizer=tok, fn="auto")             # doctest: +SKIP
    >>> token_level_scores = place_at_last_token(scores, response_mask)       # doctest: +SKIP
"""

from flowrl.data.lazy import lazy_exports

#: where each public name lives: imported on first use (the CLI loads operators without torch's weight)
_HOME = {
    "RewardModelScorer": "operators.rewards.reward_model",
    "last_token_index": "operators.rewards.reward_model",
    "exact_match_score": "operators.rewards.rule",
    "extract_gsm8k_answer": "operators.rewards.rule",
    "gsm8k_score": "operators.rewards.rule",
    "partial_match_score": "operators.rewards.rule",
    "positional_match": "operators.rewards.rule",
    "task_token_score": "operators.rewards.rule",
    "task_eos_score": "operators.rewards.rule",
    "token_reward": "operators.rewards.rule",
    "NAMED_REWARDS": "operators.rewards.scoring",
    "TASK_REWARDS": "operators.rewards.scoring",
    "auto_reward_fn": "operators.rewards.scoring",
    "compute_scores": "operators.rewards.scoring",
    "extra_metrics": "operators.rewards.scoring",
    "named_score_max": "operators.rewards.scoring",
    "place_at_last_token": "operators.rewards.scoring",
    "resolve_reward_fn": "operators.rewards.scoring",
    "RewardFnError": "operators.rewards.user_fn",
    "load_reward_fn": "operators.rewards.user_fn",
    "split_score": "operators.rewards.user_fn",
    "extra_info_rows": "operators.rewards.scoring",
}
__getattr__, __dir__ = lazy_exports(__name__, _HOME)

__all__ = list(_HOME)  # every lazily exported name is public
