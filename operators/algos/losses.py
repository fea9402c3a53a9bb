"""PPO-family losses over ``[B, R]`` token matrices with a ``response_mask``.

Aggregation (:func:`agg_loss`) turns a loss matrix into a scalar:

=========================  ==============================================
``token-mean``             mean over all valid tokens of the batch
``seq-mean-token-sum``     per sequence, sum its tokens; mean over sequences
``seq-mean-token-mean``    per sequence, mean its tokens; mean over sequences
=========================  ==============================================

Example::

    >>> loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    >>> mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    >>> [float(agg_loss(loss, mask, m)) for m in AGG_MODES]      # 10/4, (6+4)/2, (2+4)/2
    [2.5, 5.0, 3.0]
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch

from operators.algos.functional import masked_mean
from operators.algos.kl import KLEstimator, kl_penalty

AggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]
AGG_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")


def agg_loss(loss_mat: torch.Tensor, loss_mask: torch.Tensor, mode: AggMode = "token-mean", *,
             norm_tokens: float | torch.Tensor | None = None,
             norm_seqs: float | torch.Tensor | None = None) -> torch.Tensor:
    """Reduce ``loss_mat[B, R]`` to a scalar over the valid tokens, as ``mode`` says.

    ``norm_tokens`` / ``norm_seqs``, when given, replace this batch's own token
    and sequence counts as the divisor: a micro-batch then contributes its share
    of its mini-batch's loss, and the micro-batches' losses sum to the
    mini-batch's (gradient accumulation over ragged micro-batches is exact).
    """
    if mode == "token-mean":
        if norm_tokens is None:
            return masked_mean(loss_mat, loss_mask)
        return (loss_mat * loss_mask).sum() / max(float(norm_tokens), 1.0)
    if mode == "seq-mean-token-sum":
        per_seq = (loss_mat * loss_mask).sum(-1)
    elif mode == "seq-mean-token-mean":
        per_seq = (loss_mat * loss_mask).sum(-1) / loss_mask.sum(-1).clamp(min=1)
    else:
        per_seq = None
    if per_seq is not None:
        return per_seq.mean() if norm_seqs is None else per_seq.sum() / max(float(norm_seqs), 1.0)
    raise ValueError(f"unknown loss aggregation {mode!r}; use one of {', '.join(AGG_MODES)}")


class PolicyLoss(NamedTuple):
    pg_loss: torch.Tensor
    #: fraction of valid tokens where the clipped term was the one used
    pg_clipfrac: torch.Tensor
    #: ``mean(old_log_prob - log_prob)``: how far the policy moved (k1)
    ppo_kl: torch.Tensor
    #: fraction of valid tokens bounded by the dual clip (0 when it is off)
    pg_clipfrac_lower: torch.Tensor


def policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float | None = None,
    loss_agg_mode: AggMode = "token-mean",
    *,
    norm_tokens: float | torch.Tensor | None = None,
    norm_seqs: float | torch.Tensor | None = None,
) -> PolicyLoss:
    """PPO's clipped surrogate (https://arxiv.org/abs/1707.06347), with optional dual clip.

    ``ratio = exp(log_prob - old_log_prob)``;
    ``loss = max(-A·ratio, -A·clip(ratio, 1 - ε_low, 1 + ε_high))``.
    With ``clip_ratio_c = c > 1`` (dual-clip PPO, https://arxiv.org/abs/1912.09729)
    a negative-advantage token's loss is also capped at ``-A·c``, so one huge
    ratio cannot dominate.

    Example::

        >>> out = policy_loss(torch.zeros(1, 2), torch.tensor([[0.5, -0.5]]),
        ...                   torch.ones(1, 2), torch.ones(1, 2))
        >>> float(out.pg_clipfrac)    # the first token's ratio e^0.5 is clipped to 1.2
        0.5
    """
    clip_low = clip_ratio if clip_ratio_low is None else clip_ratio_low
    clip_high = clip_ratio if clip_ratio_high is None else clip_ratio_high
    log_ratio = (log_prob - old_log_prob).clamp(-20.0, 20.0)  # exp() must not overflow
    ratio = log_ratio.exp()
    ppo_kl = masked_mean(-log_ratio, response_mask)

    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = masked_mean((pg_losses2 > pg_losses1).float(), response_mask)

    pg_clipfrac_lower = torch.zeros((), device=pg_losses.device)
    if clip_ratio_c is not None:
        if clip_ratio_c <= 1.0:
            raise ValueError(f"dual-clip clip_ratio_c must be > 1, got {clip_ratio_c}")
        pg_losses3 = -advantages * clip_ratio_c
        dual_clipped = (advantages < 0) & (pg_losses > pg_losses3)
        pg_clipfrac_lower = masked_mean(dual_clipped.float(), response_mask)
        pg_losses = torch.where(advantages < 0, torch.minimum(pg_losses, pg_losses3), pg_losses)

    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, norm_tokens=norm_tokens, norm_seqs=norm_seqs)
    return PolicyLoss(pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)


def value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: AggMode = "token-mean",
    *,
    norm_tokens: float | torch.Tensor | None = None,
    norm_seqs: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped value loss: ``½·agg(max((V - G)², (clip(V, V_old ± ε) - G)²))``.

    Returns ``(vf_loss, vf_clipfrac)``, the latter the fraction of valid tokens
    where the clipped error was the larger.

    Example::

        >>> vf_loss, frac = value_loss(torch.tensor([[2.0]]), torch.tensor([[0.0]]),
        ...                            torch.tensor([[0.0]]), torch.ones(1, 1), cliprange_value=0.5)
        >>> float(vf_loss), float(frac)       # ½·max(2², 0.5²)
        (2.0, 0.0)
    """
    vpred_clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    vf_losses1 = (vpreds - returns) ** 2
    vf_losses2 = (vpred_clipped - returns) ** 2
    vf_loss = 0.5 * agg_loss(torch.maximum(vf_losses1, vf_losses2), response_mask, loss_agg_mode,
                             norm_tokens=norm_tokens, norm_seqs=norm_seqs)
    vf_clipfrac = masked_mean((vf_losses2 > vf_losses1).float(), response_mask)
    return vf_loss, vf_clipfrac


def entropy_loss(entropy: torch.Tensor, response_mask: torch.Tensor,
                 loss_agg_mode: AggMode = "token-mean", *,
                 norm_tokens: float | torch.Tensor | None = None,
                 norm_seqs: float | torch.Tensor | None = None) -> torch.Tensor:
    """The aggregated token entropy; subtract ``coef·entropy_loss`` from the loss as a bonus."""
    return agg_loss(entropy, response_mask, loss_agg_mode, norm_tokens=norm_tokens, norm_seqs=norm_seqs)


def kl_loss(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, response_mask: torch.Tensor,
            kind: KLEstimator = "k3", loss_agg_mode: AggMode = "token-mean",
            *, norm_tokens: float | torch.Tensor | None = None,
            norm_seqs: float | torch.Tensor | None = None) -> torch.Tensor:
    """KL to the reference as a loss term (GRPO's ``use_kl_loss``): ``agg(kl_penalty(...))``."""
    return agg_loss(kl_penalty(log_prob, ref_log_prob, kind), response_mask, loss_agg_mode,
                    norm_tokens=norm_tokens, norm_seqs=norm_seqs)
