"""Rollout correction: the train/inference mismatch, and importance sampling that bounds it.

The sampler's log-probs (``rollout_log_probs``) and the trainer's log-probs of
the same tokens differ — another engine, another precision, or (with
``staleness ≥ 1``) older weights. With ``log ρ = log π_train - log π_rollout``:

* :func:`mismatch_metrics` reports the gap every step: the mean and largest
  absolute log-prob difference, the KL ``KL(π_rollout ‖ π_train)`` (k1 and
  k3), the token-level χ², the largest ratio ρ and the share of tokens whose ρ
  lies outside ``[1/C, C]``.
* **TIS** (truncated importance sampling; ``is_level="token"`` or
  ``"sequence"``) weights each token's loss by ``sg(min(ρ, C))`` — the token's
  own ratio, or the product over its sequence.
* **MIS** (masked importance sampling; ``rs_level``) drops the tokens (or whole
  sequences) whose ratio lies outside ``[lower, upper]`` from the loss.

Same conventions as verl's ``rollout_corr_helper`` (ratios clamped to
``exp(±20)`` before exponentiating, weights zero on padding, detached).

Example::

    >>> train = torch.tensor([[-1.0, -1.0]]); rollout = torch.tensor([[-2.0, -1.0]])   # ρ = e, 1
    >>> out = rollout_correction(train, rollout, torch.ones(1, 2), is_level="token", is_threshold=2.0)
    >>> out.weights
    tensor([[2., 1.]])
    >>> round(out.metrics["rollout_corr/log_prob_abs_diff"], 4), out.metrics["rollout_corr/frac_outside_threshold"]
    (0.5, 0.5)
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import torch

from operators.algos.functional import masked_mean, masked_sum

SAFETY_BOUND = 20.0
Level = Literal["token", "sequence"]


class RolloutCorrection(NamedTuple):
    #: ``sg(min(ρ, C))`` per token (``None`` without TIS), zero on padding
    weights: torch.Tensor | None
    #: the response mask with MIS's rejected tokens removed (the input mask without MIS)
    response_mask: torch.Tensor
    metrics: dict[str, float]


def mismatch_metrics(train_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor,
                     threshold: float = 2.0) -> dict[str, float]:
    """How far the trainer's log-probs are from the sampler's, over the valid tokens."""
    log_ratio = (train_log_prob - rollout_log_prob).detach()
    safe = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    outside = safe.abs() > math.log(threshold)
    seq_log_ratio = masked_sum(log_ratio, response_mask, dim=-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    has_tokens = response_mask.sum(-1) > 0
    return {
        "rollout_corr/log_prob_abs_diff": float(masked_mean(log_ratio.abs(), response_mask)),
        "rollout_corr/log_prob_diff_max": float(masked_max(log_ratio.abs(), response_mask)),
        # the largest weight π_train/π_rollout uncorrected importance sampling would apply
        "rollout_corr/ratio_max": float(masked_max(safe.exp(), response_mask)),
        "rollout_corr/kl": float(masked_mean(-log_ratio, response_mask)),
        "rollout_corr/k3_kl": float(masked_mean(safe.exp() - safe - 1, response_mask)),
        "rollout_corr/chi2_token": float(masked_mean(safe.exp().square(), response_mask) - 1.0),
        "rollout_corr/seq_log_ratio_abs_mean": float(seq_log_ratio.abs()[has_tokens].mean()) if has_tokens.any()
        else 0.0,
        "rollout_corr/frac_outside_threshold": float(masked_mean(outside.float(), response_mask)),
    }


def masked_max(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The largest value under the mask (0 when the mask is empty)."""
    picked = values.masked_fill(~mask.bool(), float("-inf"))
    top = picked.max() if picked.numel() else torch.tensor(float("-inf"))
    return torch.where(torch.isinf(top), torch.zeros_like(top), top)


def rollout_correction(
    train_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    is_level: Level | None = None,
    is_threshold: float = 2.0,
    rs_level: Level | None = None,
    rs_threshold: float = 2.0,
    rs_threshold_lower: float | None = None,
) -> RolloutCorrection:
    """TIS weights and the MIS mask for one batch, with the mismatch metrics.

    ``is_threshold`` is TIS's cap ``C``; MIS keeps ``ρ ∈ [rs_threshold_lower,
    rs_threshold]`` (lower defaults to ``1 / rs_threshold``), per token or per
    sequence (``ρ_seq = Π_t ρ_t``). Metrics: see :func:`mismatch_metrics`,
    plus ``rollout_corr/is_weight_mean``/``max`` (what the loss is weighted
    by, after truncation) and ``rollout_corr/rs_masked_fraction``.
    """
    if is_threshold <= 0 or rs_threshold <= 0:
        raise ValueError(f"rollout correction thresholds must be > 0, got is={is_threshold}, rs={rs_threshold}")
    log_ratio = (train_log_prob - rollout_log_prob).detach()
    metrics = mismatch_metrics(train_log_prob, rollout_log_prob, response_mask, is_threshold)
    weights = None
    if is_level is not None:
        raw = torch.where(response_mask.bool(), _level_ratio(log_ratio, response_mask, is_level), 0.0)
        weights = raw.clamp(max=is_threshold)
        metrics["rollout_corr/is_weight_mean"] = float(masked_mean(weights, response_mask))
        metrics["rollout_corr/is_weight_max"] = float(masked_max(weights, response_mask))
        metrics["rollout_corr/is_raw_weight_max"] = float(masked_max(raw, response_mask))
    mask = response_mask
    if rs_level is not None:
        lower = 1.0 / rs_threshold if rs_threshold_lower is None else rs_threshold_lower
        if lower > rs_threshold:
            raise ValueError(f"MIS bounds: lower {lower} > upper {rs_threshold}")
        ratio = _level_ratio(log_ratio, response_mask, rs_level)
        keep = (ratio >= lower) & (ratio <= rs_threshold)
        mask = response_mask * keep.to(response_mask.dtype)
        metrics["rollout_corr/rs_masked_fraction"] = float(masked_mean((~keep).float(), response_mask))
    return RolloutCorrection(weights, mask, metrics)


def _level_ratio(log_ratio: torch.Tensor, response_mask: torch.Tensor, level: Level) -> torch.Tensor:
    """``ρ`` per token, or the sequence's ``Π ρ_t`` broadcast over its tokens."""
    if level == "token":
        return log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp()
    if level == "sequence":
        total = masked_sum(log_ratio, response_mask, dim=-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
        return total.exp().unsqueeze(-1).expand_as(log_ratio)
    raise ValueError(f"unknown rollout correction level {level!r}; use 'token' or 'sequence'")
