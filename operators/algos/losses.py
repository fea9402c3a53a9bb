"""PPO-family losses over ``[B, R]`` token matrices with a ``response_mask``.

Aggregation (:func:`agg_loss`) turns a loss matrix into a scalar. A row with
no valid token counts in none of the means (verl's rejection sampling masks
whole rows out this way):

===========================  ================================================================
``token-mean``               mean over all valid tokens of the batch
``token-sum``                sum over all valid tokens
``seq-mean-token-sum``       per sequence, sum its tokens; mean over sequences
``seq-mean-token-mean``      per sequence, mean its tokens; mean over sequences
``seq-mean-token-sum-norm``  ``seq-mean-token-sum`` divided by a constant (the response length)
===========================  ================================================================

With gradient accumulation the mean must be the *mini-batch's*, not each
micro-batch's: pass ``norm_tokens`` (the mini-batch's valid tokens) and
``norm_seqs`` (its rows with at least one valid token) and sum the
micro-batches' losses — the step then equals the whole mini-batch's.

Policy losses (:data:`POLICY_LOSSES`, selected by name as verl's
``policy_loss.loss_mode``): ``vanilla`` (PPO clip + dual clip), ``gspo``,
``sapo``, ``gpg``, ``clip_cov``, ``kl_cov``, ``geo_mean`` (GMPO), ``dro``,
``cispo``, ``dppo_tv``, ``dppo_kl``. Each returns a :class:`PolicyLoss`.

Example::

    >>> loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
    >>> mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])      # row 3: no valid token
    >>> [round(float(agg_loss(loss, mask, m)), 4) for m in AGG_MODES]
    [2.5, 10.0, 5.0, 3.0, 1.6667]
    >>> float(agg_loss(loss, mask, "token-mean", norm_tokens=8))     # 10 / the mini-batch's 8 tokens
    1.25
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, NamedTuple

import torch

from operators.algos.functional import masked_mean, masked_sum
from operators.algos.kl import KLEstimator, kl_penalty

AggMode = Literal["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
AGG_MODES: tuple[str, ...] = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                              "seq-mean-token-sum-norm")


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    mode: AggMode = "token-mean",
    *,
    norm_tokens: float | torch.Tensor | None = None,
    norm_seqs: float | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Reduce ``loss_mat[B, R]`` to a scalar over the valid tokens, as ``mode`` says.

    ``norm_tokens`` / ``norm_seqs`` replace this batch's own token / sequence
    count as the divisor of ``token-mean`` / the ``seq-mean-*`` modes (the
    mini-batch's counts when ``loss_mat`` is one micro-batch of it).
    ``loss_scale_factor`` is ``seq-mean-token-sum-norm``'s divisor (default:
    the response length ``R``). An empty batch gives 0, not NaN.
    """
    if mode == "token-mean":
        tokens = loss_mask.sum() if norm_tokens is None else norm_tokens
        return masked_sum(loss_mat, loss_mask) / _at_least_one(tokens)
    if mode == "token-sum":
        return masked_sum(loss_mat, loss_mask)
    if mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean"):
        lengths = loss_mask.sum(-1)
        seq_losses = masked_sum(loss_mat, loss_mask, dim=-1)
        if mode == "seq-mean-token-mean":
            seq_losses = seq_losses / (lengths + 1e-8)
        has_tokens = (lengths > 0).to(seq_losses.dtype)
        seqs = has_tokens.sum() if norm_seqs is None else norm_seqs
        loss = (seq_losses * has_tokens).sum() / _at_least_one(seqs)
        if mode == "seq-mean-token-sum-norm":
            loss = loss / (loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
        return loss
    raise ValueError(f"unknown loss aggregation {mode!r}; use one of {', '.join(AGG_MODES)}")


def _at_least_one(count: float | torch.Tensor) -> float | torch.Tensor:
    return count.clamp(min=1) if torch.is_tensor(count) else max(count, 1)


class PolicyLoss(NamedTuple):
    pg_loss: torch.Tensor
    #: fraction of valid tokens where the clip (or the loss's own truncation) was active
    pg_clipfrac: torch.Tensor
    #: ``mean(old_log_prob - log_prob)``: how far the policy moved (k1; ``|k1|`` for kl_cov)
    ppo_kl: torch.Tensor
    #: fraction of valid tokens bounded from below (the dual clip; 0 where the loss has none)
    pg_clipfrac_lower: torch.Tensor


@dataclass(frozen=True)
class PolicyLossParams:
    """Every knob of every policy loss, with verl's defaults (``actor`` / ``policy_loss`` config)."""

    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    #: dual clip (vanilla) / IS truncation (dppo_*); ``None`` turns the dual clip off
    clip_ratio_c: float | None = 3.0
    tau_pos: float = 1.0            # sapo
    tau_neg: float = 1.05           # sapo
    clip_cov_ratio: float = 0.0002  # clip_cov
    clip_cov_lb: float = 1.0        # clip_cov
    clip_cov_ub: float = 5.0        # clip_cov
    kl_cov_ratio: float = 0.0002    # kl_cov
    ppo_kl_coef: float = 0.1        # kl_cov
    dro_beta: float | None = None   # dro (required)

    @property
    def low(self) -> float:
        return self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low

    @property
    def high(self) -> float:
        return self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high


PolicyLossFn = Callable[..., PolicyLoss]
#: name → loss function ``(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, params,
#: rollout_is_weights=None, **agg) -> PolicyLoss``; ``agg`` is passed on to :func:`agg_loss`
POLICY_LOSSES: dict[str, PolicyLossFn] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Add a policy loss under ``name`` (what ``actor.update``'s ``policy_loss`` selects)."""

    def add(fn: PolicyLossFn) -> PolicyLossFn:
        POLICY_LOSSES[name] = fn
        return fn

    return add


def _zero(like: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), device=like.device)


def _weighted(pg_losses: torch.Tensor, rollout_is_weights: torch.Tensor | None) -> torch.Tensor:
    return pg_losses if rollout_is_weights is None else pg_losses * rollout_is_weights


def _log_ratio(log_prob: torch.Tensor, old_log_prob: torch.Tensor) -> torch.Tensor:
    return (log_prob - old_log_prob).clamp(-20.0, 20.0)  # exp() must not overflow


@register_policy_loss("vanilla")
def vanilla_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                 params: PolicyLossParams = PolicyLossParams(), rollout_is_weights=None, **agg) -> PolicyLoss:
    """PPO's clipped surrogate (https://arxiv.org/abs/1707.06347), with dual clip.

    ``loss = max(-A·r, -A·clip(r, 1 - ε_low, 1 + ε_high))``; with ``clip_ratio_c = c``
    (dual-clip PPO, https://arxiv.org/abs/1912.09729) a negative-advantage token's
    loss is also capped at ``-A·c``, so one huge ratio cannot dominate.
    """
    log_ratio = _log_ratio(log_prob, old_log_prob)
    ratio = log_ratio.exp()
    ppo_kl = masked_mean(-log_ratio, response_mask)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * ratio.clamp(1 - params.low, 1 + params.high)
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = masked_mean((pg_losses2 > pg_losses1).float(), response_mask)
    pg_clipfrac_lower = _zero(pg_losses)
    if params.clip_ratio_c is not None:
        if params.clip_ratio_c <= 1.0:
            raise ValueError(f"dual-clip clip_ratio_c must be > 1, got {params.clip_ratio_c}")
        pg_losses3 = -advantages * params.clip_ratio_c
        pg_clipfrac_lower = masked_mean(((pg_losses > pg_losses3) & (advantages < 0)).float(), response_mask)
        pg_losses = torch.where(advantages < 0, torch.minimum(pg_losses, pg_losses3), pg_losses)
    pg_loss = agg_loss(_weighted(pg_losses, rollout_is_weights), response_mask, loss_agg_mode, **agg)
    return PolicyLoss(pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)


def _dppo(valid: Callable, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, params,
          rollout_is_weights, agg) -> PolicyLoss:
    """DPPO (https://arxiv.org/abs/2602.04879): ``-A·sg(min(r, c))·log π`` on tokens inside the
    divergence trust region ``valid(prob, old_prob, A)``; ``clip_ratio`` is the divergence bound."""
    log_ratio = _log_ratio(log_prob, old_log_prob)
    ratio = log_ratio.exp()
    ppo_kl = masked_mean(-log_ratio, response_mask)
    c = 3.0 if params.clip_ratio_c is None else params.clip_ratio_c
    truncated = ratio.clamp(max=c).detach()
    inside = valid(log_prob.exp(), old_log_prob.exp(), advantages).detach().float()
    pg_losses = -advantages * truncated * log_prob * inside
    pg_loss = agg_loss(_weighted(pg_losses, rollout_is_weights), response_mask, loss_agg_mode, **agg)
    pg_clipfrac = masked_mean(1.0 - inside, response_mask)
    pg_clipfrac_lower = masked_mean((ratio > c).float() * inside, response_mask)
    return PolicyLoss(pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)


@register_policy_loss("dppo_tv")
def dppo_tv_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                 params: PolicyLossParams = PolicyLossParams(), rollout_is_weights=None, **agg) -> PolicyLoss:
    """DPPO-Binary-TV: a token counts while ``π - π_old`` stays within ``[-ε_low, ε_high]`` in
    the direction its advantage pushes."""

    def valid(prob, old_prob, adv):
        return torch.where(adv > 0, prob - old_prob <= params.high, prob - old_prob >= -params.low)

    return _dppo(valid, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, params,
                 rollout_is_weights, agg)


@register_policy_loss("dppo_kl")
def dppo_kl_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                 params: PolicyLossParams = PolicyLossParams(), rollout_is_weights=None, **agg) -> PolicyLoss:
    """DPPO-Binary-KL: as ``dppo_tv`` with the binary KL ``KL(Bern(π_old) ‖ Bern(π))`` as divergence."""

    def valid(prob, old_prob, adv):
        binary_kl = old_prob * (old_log_prob - log_prob) + (1 - old_prob) * torch.log(
            (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8))
        return torch.where(adv > 0, (binary_kl <= params.high) | (prob <= old_prob),
                           (binary_kl <= params.low) | (prob >= old_prob))

    return _dppo(valid, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, params,
                 rollout_is_weights, agg)


@register_policy_loss("gspo")
def gspo_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
              params: PolicyLossParams = PolicyLossParams(), rollout_is_weights=None, **agg) -> PolicyLoss:
    """GSPO (https://arxiv.org/abs/2507.18071): the clip acts on the sequence ratio
    ``s = exp(mean_t log r_t)``; each token carries ``sg(s)·π/sg(π)`` so gradients stay per token."""
    log_ratio = log_prob - old_log_prob
    seq_log_ratio = masked_sum(log_ratio, response_mask, dim=-1) / response_mask.sum(-1).clamp(min=1)
    log_seq_ratio = (log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)).clamp(max=10.0)
    seq_ratio = log_seq_ratio.exp()
    pg_losses1 = -advantages * seq_ratio
    pg_losses2 = -advantages * seq_ratio.clamp(1 - params.low, 1 + params.high)
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    pg_loss = agg_loss(_weighted(pg_losses, rollout_is_weights), response_mask, loss_agg_mode, **agg)
    pg_clipfrac = masked_mean((pg_losses2 > pg_losses1).float(), response_mask)
    return PolicyLoss(pg_loss, pg_clipfrac, masked_mean(-log_ratio, response_mask), _zero(pg_loss))


@register_policy_loss("sapo")
def sapo_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="seq-mean-token-mean",
              params: PolicyLossParams = PolicyLossParams(), rollout_is_weights=None, **agg) -> PolicyLoss:
    """SAPO (https://arxiv.org/abs/2511.20347): a smooth gate ``4/τ·σ(τ(r - 1))`` instead of a hard
    clip, ``τ_pos`` for positive advantages and ``τ_neg`` otherwise. Always ``seq-mean-token-mean``
    (as verl: ``loss_agg_mode`` is ignored)."""
    log_ratio = _log_ratio(log_prob, old_log_prob)
    ratio = log_ratio.exp()
    tau = torch.where(advantages > 0, torch.as_tensor(params.tau_pos, dtype=advantages.dtype),
                      torch.as_tensor(params.tau_neg, dtype=advantages.dtype))
    gates = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    pg_losses = -gates * advantages
    pg_loss = agg_loss(_weighted(pg_losses, rollout_is_weights), response_mask, "seq-mean-token-mean", **agg)
    return PolicyLoss(pg_loss, _zero(pg_loss), masked_mean(-log_ratio, response_mask), _zero(pg_loss))


@register_policy_loss("gpg")
def gpg_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
             params: PolicyLossParams = PolicyLossParams(), rollout_is_weights=None, **agg) -> PolicyLoss:
    """GPG (https://arxiv.org/abs/2504.02546): plain policy gradient ``-A·log π``, no ratio."""
    pg_losses = -log_prob * advantages
    pg_loss = agg_loss(_weighted(pg_losses, rollout_is_weights), response_mask, loss_agg_mode, **agg)
    zero = _zero(pg_loss)
    return PolicyLoss(pg_loss, zero, masked_mean(old_log_prob - log_prob, response_mask).detach(), zero)


def _flat_valid(response_mask: torch.Tensor) -> torch.Tensor:
    return torch.nonzero(response_mask.reshape(-1) > 0, as_tuple=True)[0]


@register_policy_loss("clip_cov")
def clip_cov_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                  params: PolicyLossParams = PolicyLossParams(), rollout_is_weights=None, *,
                  generator: torch.Generator | None = None, **agg) -> PolicyLoss:
    """Clip-Cov (https://arxiv.org/abs/2505.22617): PPO clip, plus the gradient of a random
    ``clip_cov_ratio`` share of the tokens whose ``cov(A, log π)`` lies in ``(lb, ub)`` is cut.

    The random pick draws ``torch.randperm`` from ``generator`` (the global RNG when None), as verl.
    """
    if params.clip_cov_ratio <= 0:
        raise ValueError(f"clip_cov_ratio must be > 0, got {params.clip_cov_ratio}")
    log_ratio = log_prob - old_log_prob
    ratio = log_ratio.exp()
    ppo_kl = masked_mean(-log_ratio, response_mask)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * ratio.clamp(1 - params.low, 1 + params.high)
    valid = response_mask > 0
    clipped_by_ppo = (pg_losses2 > pg_losses1) & valid
    cov = (advantages - masked_mean(advantages, response_mask)) * (
        log_prob - masked_mean(log_prob.detach(), response_mask))
    eligible = (cov < params.clip_cov_ub) & (cov > params.clip_cov_lb) & valid & ~clipped_by_ppo
    candidates = torch.nonzero(eligible)
    keep = torch.ones_like(advantages)
    if len(candidates):
        n_clip = max(int(params.clip_cov_ratio * response_mask.sum().item()), 1)
        pick = candidates[torch.randperm(len(candidates), generator=generator)[:n_clip]]
        keep[pick[:, 0], pick[:, 1]] = 0
    pg_losses = torch.maximum(pg_losses1, pg_losses2) * keep
    pg_loss = agg_loss(_weighted(pg_losses, rollout_is_weights), response_mask, loss_agg_mode, **agg)
    return PolicyLoss(pg_loss, masked_mean((keep == 0).float(), response_mask), ppo_kl, _zero(pg_loss))


@register_policy_loss("kl_cov")
def kl_cov_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                params: PolicyLossParams = PolicyLossParams(), rollout_is_weights=None, **agg) -> PolicyLoss:
    """KL-Cov (https://arxiv.org/abs/2505.22617): ``-A·r``, plus ``ppo_kl_coef·|log r|`` on the
    ``kl_cov_ratio`` share of tokens with the largest ``cov(A, log π)``. ``ppo_kl`` is ``mean|log r|``."""
    if params.kl_cov_ratio <= 0:
        raise ValueError(f"kl_cov_ratio must be > 0, got {params.kl_cov_ratio}")
    log_ratio = log_prob - old_log_prob
    ratio = log_ratio.exp()
    pg_losses = -advantages * ratio
    flat = _flat_valid(response_mask)
    if len(flat):
        adv = advantages.reshape(-1)[flat].detach()
        logp = log_prob.reshape(-1)[flat].detach()
        cov = (adv - adv.mean()) * (logp - logp.mean())
        top = flat[torch.topk(cov, max(1, int(len(cov) * params.kl_cov_ratio))).indices]
        penalised = torch.zeros(pg_losses.numel(), dtype=torch.bool, device=pg_losses.device)
        penalised[top] = True
        penalty = params.ppo_kl_coef * log_ratio.abs()
        pg_losses = pg_losses + penalty * penalised.view_as(pg_losses)
    pg_loss = agg_loss(_weighted(pg_losses, rollout_is_weights), response_mask, loss_agg_mode, **agg)
    zero = _zero(pg_loss)
    return PolicyLoss(pg_loss, zero, masked_mean(log_ratio.abs(), response_mask), zero)


@register_policy_loss("geo_mean")
def geo_mean_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                  params: PolicyLossParams = PolicyLossParams(), rollout_is_weights=None, **agg) -> PolicyLoss:
    """GMPO (https://arxiv.org/abs/2507.20673): the sequence ratio is the geometric mean of the
    token ratios clipped in log space; ``-Ā·ratio`` averaged over sequences (a fixed mean over
    rows, as verl: ``loss_agg_mode`` and the normalisers are not used). Needs sequence-level
    advantages. Sequence IS weights are the geometric mean of the token weights."""
    log_ratio = log_prob - old_log_prob
    ppo_kl = masked_mean(-log_ratio, response_mask)
    sign = torch.sign(advantages)
    clamped = log_ratio.clamp(-params.low, params.high)
    log_ratio_min = sign * torch.minimum(sign * log_ratio, sign * clamped)
    lengths = response_mask.sum(-1)
    ratio = torch.exp(masked_sum(log_ratio_min, response_mask, dim=-1) / (lengths + 1e-8))
    advantage = masked_sum(advantages, response_mask, dim=-1) / (lengths + 1e-8)
    pg_losses = -advantage * ratio
    if rollout_is_weights is not None:
        pg_losses = pg_losses * torch.exp(
            masked_sum(torch.log(rollout_is_weights + 1e-10), response_mask, dim=-1) / (lengths + 1e-8))
    pg_loss = pg_losses.mean()
    clipped = log_ratio != clamped
    return PolicyLoss(pg_loss, masked_mean((clipped & (advantages > 0)).float(), response_mask), ppo_kl,
                      masked_mean((clipped & (advantages < 0)).float(), response_mask))


@register_policy_loss("dro")
def dro_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
             params: PolicyLossParams = PolicyLossParams(), rollout_is_weights=None, **agg) -> PolicyLoss:
    """DRO (https://arxiv.org/abs/2405.19107): ``-(A·log π - β/2·(log r)²)``; needs ``dro_beta > 0``."""
    if params.dro_beta is None or params.dro_beta <= 0:
        raise ValueError("policy_loss 'dro' needs dro_beta > 0; set dro_beta on actor.update")
    log_ratio = log_prob - old_log_prob
    pg_losses = -(log_prob * advantages - 0.5 * params.dro_beta * log_ratio.square())
    pg_loss = agg_loss(_weighted(pg_losses, rollout_is_weights), response_mask, loss_agg_mode, **agg)
    zero = _zero(pg_loss)
    return PolicyLoss(pg_loss, zero, masked_mean(-log_ratio, response_mask), zero)


@register_policy_loss("cispo")
def cispo_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
               params: PolicyLossParams = PolicyLossParams(), rollout_is_weights=None, **agg) -> PolicyLoss:
    """CISPO (https://arxiv.org/abs/2506.13585): ``-sg(clip(r, 1 - ε_low, 1 + ε_high))·A·log π`` —
    the clip bounds the weight, every token keeps its gradient."""
    log_ratio = _log_ratio(log_prob, old_log_prob)
    ratio = log_ratio.exp()
    clipped = ratio.clamp(1 - params.low, 1 + params.high)
    pg_losses = -clipped.detach() * advantages * log_prob
    pg_loss = agg_loss(_weighted(pg_losses, rollout_is_weights), response_mask, loss_agg_mode, **agg)
    return PolicyLoss(pg_loss, masked_mean((ratio != clipped).float(), response_mask),
                      masked_mean(-log_ratio, response_mask), _zero(pg_loss))


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
    """PPO's clipped surrogate (:func:`vanilla_loss`) from loose arguments; dual clip off by default.

    Example::

        >>> out = policy_loss(torch.zeros(1, 2), torch.tensor([[0.5, -0.5]]),
        ...                   torch.ones(1, 2), torch.ones(1, 2))
        >>> float(out.pg_clipfrac)    # the first token's ratio e^0.5 is clipped to 1.2
        0.5
    """
    params = PolicyLossParams(clip_ratio, clip_ratio_low, clip_ratio_high, clip_ratio_c)
    return vanilla_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, params,
                        norm_tokens=norm_tokens, norm_seqs=norm_seqs)


def get_policy_loss(name: str) -> PolicyLossFn:
    """The loss registered as ``name``; a clear error listing the names otherwise."""
    if name not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {name!r}; use one of {', '.join(POLICY_LOSSES)}")
    return POLICY_LOSSES[name]


def value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: AggMode = "token-mean",
    **agg,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped value loss: ``½·agg(max((V - G)², (clip(V, V_old ± ε) - G)²))``.

    Returns ``(vf_loss, vf_clipfrac)``, the latter the fraction of valid tokens
    where the clipped error was the larger. ``agg`` (``norm_tokens``,
    ``norm_seqs``, ``loss_scale_factor``) goes to :func:`agg_loss`.

    Example::

        >>> vf_loss, frac = value_loss(torch.tensor([[2.0]]), torch.tensor([[0.0]]),
        ...                            torch.tensor([[0.0]]), torch.ones(1, 1), cliprange_value=0.5)
        >>> float(vf_loss), float(frac)       # ½·max(2², 0.5²)
        (2.0, 0.0)
    """
    vpred_clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    vf_losses1 = (vpreds - returns) ** 2
    vf_losses2 = (vpred_clipped - returns) ** 2
    vf_loss = 0.5 * agg_loss(torch.maximum(vf_losses1, vf_losses2), response_mask, loss_agg_mode, **agg)
    vf_clipfrac = masked_mean((vf_losses2 > vf_losses1).float(), response_mask)
    return vf_loss, vf_clipfrac


def entropy_loss(entropy: torch.Tensor, response_mask: torch.Tensor,
                 loss_agg_mode: AggMode = "token-mean", **agg) -> torch.Tensor:
    """The aggregated token entropy; subtract ``coef·entropy_loss`` from the loss as a bonus."""
    return agg_loss(entropy, response_mask, loss_agg_mode, **agg)


def kl_loss(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, response_mask: torch.Tensor,
            kind: KLEstimator = "k3", loss_agg_mode: AggMode = "token-mean", **agg) -> torch.Tensor:
    """KL to the reference as a loss term (GRPO's ``use_kl_loss``): ``agg(kl_penalty(...))``."""
    return agg_loss(kl_penalty(log_prob, ref_log_prob, kind), response_mask, loss_agg_mode, **agg)
