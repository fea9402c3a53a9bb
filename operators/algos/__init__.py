"""RL math on tensors: log-probs, masked statistics, advantages, KL, and PPO-family losses.

Example (one GRPO update, cleanrl style)::

    >>> from operators.algos import grpo_advantages, logprobs_from_logits, policy_loss
    >>> advantages, _ = grpo_advantages(token_level_rewards, response_mask, index=uid)   # doctest: +SKIP
    >>> log_prob = logprobs_from_logits(logits / temperature, responses)                  # doctest: +SKIP
    >>> out = policy_loss(old_log_prob, log_prob, advantages, response_mask, clip_ratio=0.2)  # doctest: +SKIP
    >>> out.pg_loss.backward()                                                             # doctest: +SKIP
"""

from operators.algos.advantages import (
    GroupStats,
    gae_advantages,
    gdpo_advantages,
    gpg_advantages,
    group_ids,
    group_stats,
    grpo_advantages,
    grpo_passk_advantages,
    opo_advantages,
    optimal_token_baseline_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    remax_advantages,
    rloo_advantages,
    tir_optimal_token_baseline_advantages,
)
from operators.algos.functional import (
    entropy_from_logits,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    sum_pi_squared_from_logits,
)
from operators.algos.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    KLController,
    apply_kl_penalty,
    build_kl_controller,
    kl_penalty,
)
from operators.algos.losses import (
    AGG_MODES,
    POLICY_LOSSES,
    PolicyLoss,
    PolicyLossParams,
    agg_loss,
    entropy_loss,
    get_policy_loss,
    kl_loss,
    policy_loss,
    register_policy_loss,
    value_loss,
)
from operators.algos.rollout_correction import (
    RS_OPTIONS,
    RolloutCorrection,
    divergence_rejection,
    mismatch_metrics,
    parse_is_threshold,
    parse_rs_thresholds,
    rollout_correction,
)

__all__ = [
    "GroupStats", "gae_advantages", "gdpo_advantages", "gpg_advantages", "group_ids", "group_stats",
    "grpo_advantages", "grpo_passk_advantages", "opo_advantages", "optimal_token_baseline_advantages",
    "reinforce_pp_advantages", "reinforce_pp_baseline_advantages", "remax_advantages", "rloo_advantages",
    "tir_optimal_token_baseline_advantages",
    "entropy_from_logits", "logprobs_from_logits", "masked_mean", "masked_sum", "masked_var", "masked_whiten",
    "sum_pi_squared_from_logits",
    "KL_ESTIMATORS", "AdaptiveKLController", "FixedKLController", "KLController", "apply_kl_penalty", "build_kl_controller",
    "kl_penalty",
    "AGG_MODES", "POLICY_LOSSES", "PolicyLoss", "PolicyLossParams", "agg_loss", "entropy_loss",
    "get_policy_loss", "kl_loss", "policy_loss", "register_policy_loss", "value_loss",
    "RS_OPTIONS", "RolloutCorrection", "divergence_rejection", "mismatch_metrics", "parse_is_threshold",
    "parse_rs_thresholds", "rollout_correction",
]
