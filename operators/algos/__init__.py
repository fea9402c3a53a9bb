"""RL math on tensors: log-probs, masked statistics, advantages, KL, and PPO-family losses.

Example (one GRPO update, cleanrl style)::

    >>> from operators.algos import grpo_advantages, logprobs_from_logits, policy_loss
    >>> advantages, _ = grpo_advantages(token_level_rewards, response_mask, index=uid)   # doctest: +SKIP
    >>> log_prob = logprobs_from_logits(logits / temperature, responses)                  # doctest: +SKIP
    >>> out = policy_loss(old_log_prob, log_prob, advantages, response_mask, clip_ratio=0.2)  # doctest: +SKIP
    >>> out.pg_loss.backward()                                                             # doctest: +SKIP
"""

from flowrl.data.lazy import lazy_exports

#: where each public name lives: imported on first use (the CLI loads operators without torch's weight)
_HOME = {
    "GroupStats": "operators.algos.advantages",
    "gae_advantages": "operators.algos.advantages",
    "gdpo_advantages": "operators.algos.advantages",
    "gpg_advantages": "operators.algos.advantages",
    "group_ids": "operators.algos.advantages",
    "group_stats": "operators.algos.advantages",
    "grpo_advantages": "operators.algos.advantages",
    "grpo_passk_advantages": "operators.algos.advantages",
    "opo_advantages": "operators.algos.advantages",
    "optimal_token_baseline_advantages": "operators.algos.advantages",
    "reinforce_pp_advantages": "operators.algos.advantages",
    "reinforce_pp_baseline_advantages": "operators.algos.advantages",
    "remax_advantages": "operators.algos.advantages",
    "rloo_advantages": "operators.algos.advantages",
    "tir_optimal_token_baseline_advantages": "operators.algos.advantages",
    "chunked_token_stats": "operators.algos.functional",
    "entropy_from_logits": "operators.algos.functional",
    "logprobs_from_logits": "operators.algos.functional",
    "masked_mean": "operators.algos.functional",
    "masked_sum": "operators.algos.functional",
    "masked_var": "operators.algos.functional",
    "masked_whiten": "operators.algos.functional",
    "KL_ESTIMATORS": "operators.algos.kl",
    "AdaptiveKLController": "operators.algos.kl",
    "FixedKLController": "operators.algos.kl",
    "KLController": "operators.algos.kl",
    "apply_kl_penalty": "operators.algos.kl",
    "build_kl_controller": "operators.algos.kl",
    "kl_penalty": "operators.algos.kl",
    "AGG_MODES": "operators.algos.losses",
    "POLICY_LOSSES": "operators.algos.losses",
    "PolicyLoss": "operators.algos.losses",
    "PolicyLossParams": "operators.algos.losses",
    "agg_loss": "operators.algos.losses",
    "entropy_loss": "operators.algos.losses",
    "get_policy_loss": "operators.algos.losses",
    "kl_loss": "operators.algos.losses",
    "policy_loss": "operators.algos.losses",
    "register_policy_loss": "operators.algos.losses",
    "value_loss": "operators.algos.losses",
    "RolloutCorrection": "operators.algos.correction",
    "mismatch_metrics": "operators.algos.correction",
    "rollout_correction": "operators.algos.correction",
    "sum_pi_squared_from_logits": "operators.algos.functional",
    "RS_OPTIONS": "operators.algos.correction",
    "divergence_rejection": "operators.algos.correction",
    "parse_is_threshold": "operators.algos.correction",
    "parse_rs_thresholds": "operators.algos.correction",
}
__getattr__, __dir__ = lazy_exports(__name__, _HOME)

__all__ = list(_HOME)  # every lazily exported name is public
