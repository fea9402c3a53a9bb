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
  With a ``"lower_upper"`` threshold (``"0.5_2.0"``) the weights are verl's
  two-sided **IcePop**: ``ρ`` where it lies in ``[lower, upper]``, 0 elsewhere.
* **MIS** (masked importance sampling; ``rs_level``) drops the tokens (or whole
  sequences) whose ratio lies outside ``[lower, upper]`` from the loss.
* **Divergence-based rejection** (``rs_level`` one or more of verl's
  ``rollout_rs`` options, comma separated, all of which must pass):
  ``token_k{1,2,3}``, ``seq_sum_k{1,2,3}``, ``seq_mean_k{1,2,3}``,
  ``seq_max_k{2,3}`` bound a KL estimator of ``π_rollout ‖ π_train`` per token,
  or its sum / mean / max over the sequence: k1 ``= -log ρ`` within
  ``[log lower, log upper]`` (threshold ``"lower_upper"``, or ``upper`` with
  ``lower = 1/upper``), k2 ``= ½ log² ρ`` and k3 ``= ρ - 1 - log ρ`` at most
  the threshold. ``rs_threshold`` is one spec shared by every option or one per
  option, comma separated (``"0.01,2.0"``).

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

from flowrl.data.metrics import Metric, maximum, mean
from operators.algos.functional import masked_mean, masked_sum, sequence_mean, token_mean

SAFETY_BOUND = 20.0
Level = Literal["token", "sequence"]
#: verl's divergence-based rejection options (``algorithm.rollout_correction.rollout_rs``)
RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
              "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")


class RolloutCorrection(NamedTuple):
    #: ``sg(min(ρ, C))`` per token (``None`` without TIS), zero on padding
    weights: torch.Tensor | None
    #: the response mask with MIS's rejected tokens removed (the input mask without MIS)
    response_mask: torch.Tensor
    metrics: dict[str, Metric]


def mismatch_metrics(train_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor,
                     threshold: float = 2.0) -> dict[str, Metric]:
    """How far the trainer's log-probs are from the sampler's: means over the valid tokens (over the
    sequences with one for ``seq_log_ratio_abs_mean``), maxima, each declared as such."""
    log_ratio = (train_log_prob - rollout_log_prob).detach()
    safe = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    outside = safe.abs() > math.log(threshold)
    seq_log_ratio = masked_sum(log_ratio, response_mask, dim=-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    has_tokens = response_mask.sum(-1) > 0
    return {
        "rollout_corr/log_prob_abs_diff": token_mean(log_ratio.abs(), response_mask),
        "rollout_corr/log_prob_diff_max": maximum(masked_max(log_ratio.abs(), response_mask)),
        # the largest weight π_train/π_rollout uncorrected importance sampling would apply
        "rollout_corr/ratio_max": maximum(masked_max(safe.exp(), response_mask)),
        "rollout_corr/kl": token_mean(-log_ratio, response_mask),
        "rollout_corr/k3_kl": token_mean(safe.exp() - safe - 1, response_mask),
        # E[ρ²] - 1 is linear in the token mean: it reduces as one
        "rollout_corr/chi2_token": mean(masked_mean(safe.exp().square(), response_mask) - 1.0, response_mask.sum()),
        "rollout_corr/seq_log_ratio_abs_mean": sequence_mean(seq_log_ratio.abs(), has_tokens),
        "rollout_corr/frac_outside_threshold": token_mean(outside.float(), response_mask),
    }


def masked_max(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The largest value under the mask (0 when the mask is empty)."""
    top = masked_max_rows(values.reshape(1, -1), mask.reshape(1, -1))[0] if values.numel() \
        else torch.tensor(float("-inf"))
    return torch.where(torch.isinf(top), torch.zeros_like(top), top)


def rollout_correction(
    train_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    is_level: Level | None = None,
    is_threshold: float | str = 2.0,
    rs_level: str | None = None,
    rs_threshold: float | str = 2.0,
    rs_threshold_lower: float | None = None,
) -> RolloutCorrection:
    """TIS (or IcePop) weights and the rejection mask for one batch, with the mismatch metrics.

    ``is_threshold`` is TIS's cap ``C``, or ``"lower_upper"`` for IcePop. With
    ``rs_level`` ``"token"`` / ``"sequence"``, MIS keeps ``ρ ∈ [rs_threshold_lower,
    rs_threshold]`` (lower defaults to ``1 / rs_threshold``) per token or per
    sequence (``ρ_seq = Π_t ρ_t``); any other ``rs_level`` is a comma-separated
    list of :data:`RS_OPTIONS` (see the module doc). Metrics: see
    :func:`mismatch_metrics`, plus ``rollout_corr/is_weight_mean``/``max`` (what
    the loss is weighted by, after truncation), ``rollout_corr/rs_masked_fraction``
    and, per divergence option, ``rollout_corr/rs_<option>_{mean,max,masked_fraction,seq_masked_fraction}``.
    """
    is_upper, is_lower = parse_is_threshold(is_threshold)
    log_ratio = (train_log_prob - rollout_log_prob).detach()
    metrics = mismatch_metrics(train_log_prob, rollout_log_prob, response_mask, is_upper)
    weights = None
    if is_level is not None:
        raw = torch.where(response_mask.bool(), _level_ratio(log_ratio, response_mask, is_level), 0.0)
        if is_lower is None:
            weights = raw.clamp(max=is_upper)
        else:  # IcePop: a token (sequence) outside the band gets no weight at all
            weights = torch.where((raw >= is_lower) & (raw <= is_upper), raw, 0.0)
            metrics["rollout_corr/is_oob_fraction"] = token_mean(((raw < is_lower) | (raw > is_upper)).float(),
                                                                 response_mask)
        metrics["rollout_corr/is_weight_mean"] = token_mean(weights, response_mask)
        metrics["rollout_corr/is_weight_max"] = maximum(masked_max(weights, response_mask))
        metrics["rollout_corr/is_raw_weight_max"] = maximum(masked_max(raw, response_mask))
    mask = response_mask
    if rs_level in ("token", "sequence"):
        upper = float(rs_threshold)
        if upper <= 0:
            raise ValueError(f"MIS threshold must be > 0, got {upper}")
        lower = 1.0 / upper if rs_threshold_lower is None else rs_threshold_lower
        if lower > upper:
            raise ValueError(f"MIS bounds: lower {lower} > upper {upper}")
        ratio = _level_ratio(log_ratio, response_mask, rs_level)
        keep = (ratio >= lower) & (ratio <= upper)
        mask = response_mask * keep.to(response_mask.dtype)
        metrics["rollout_corr/rs_masked_fraction"] = token_mean((~keep).float(), response_mask)
    elif rs_level is not None:
        mask, rs_metrics = divergence_rejection(log_ratio, response_mask, rs_level, rs_threshold)
        metrics.update(rs_metrics)
    return RolloutCorrection(weights, mask, metrics)


def parse_is_threshold(spec: float | str) -> tuple[float, float | None]:
    """``(upper, lower or None)`` from TIS's cap (``2.0``) or IcePop's band (``"0.5_2.0"``)."""
    if isinstance(spec, bool):
        raise ValueError("rollout_is_threshold is a number (TIS cap) or 'lower_upper' (IcePop), not a boolean")
    text = str(spec).strip()
    try:
        lower, upper = (float(x) for x in text.split("_", 1)) if "_" in text else (None, float(text))
    except ValueError:
        raise ValueError(f"rollout_is_threshold {spec!r}: give a number (TIS cap, e.g. 2.0) or "
                         "'lower_upper' (IcePop band, e.g. '0.5_2.0')") from None
    if upper <= 0 or (lower is not None and not 0 < lower <= upper):
        raise ValueError(f"rollout_is_threshold {spec!r}: bounds must be positive with lower <= upper")
    return upper, lower


def parse_rs_thresholds(options: str, spec: float | str) -> dict[str, tuple[float | None, float]]:
    """``{option: (lower or None, upper)}`` for a comma-separated list of :data:`RS_OPTIONS`.

    ``spec`` is one threshold shared by every option or one per option
    (comma separated); k1 options take ``"lower_upper"`` or ``upper`` (lower =
    1/upper), the others one upper bound.
    """
    names = list(dict.fromkeys(o.strip() for o in str(options).split(",") if o.strip()))
    unknown = [n for n in names if n not in RS_OPTIONS]
    if not names or unknown:
        raise ValueError(f"rollout_rs {options!r}: unknown option(s) {', '.join(unknown) or '(none given)'}; "
                         f"use 'token' or 'sequence' (ratio bounds) or any of {', '.join(RS_OPTIONS)}, "
                         "comma separated")
    specs = [s.strip() for s in str(spec).split(",") if s.strip()]
    if len(specs) not in (1, len(names)):
        raise ValueError(f"rollout_rs_threshold {spec!r}: give one threshold for all {len(names)} rollout_rs "
                         "options, or one per option (comma separated)")
    out = {}
    for name, text in zip(names, specs * len(names) if len(specs) == 1 else specs):
        try:
            if name.endswith("k1"):
                lower, upper = (float(x) for x in text.split("_", 1)) if "_" in text else (1 / float(text),
                                                                                          float(text))
            elif "_" in text:
                raise ValueError
            else:
                lower, upper = None, float(text)
        except (ValueError, ZeroDivisionError):
            raise ValueError(f"rollout_rs_threshold {text!r} for {name}: "
                             + ("'lower_upper' or one number" if name.endswith("k1") else "one number")) from None
        if upper <= 0 or (lower is not None and not 0 < lower <= upper):
            raise ValueError(f"rollout_rs_threshold {text!r} for {name}: bounds must be positive, lower <= upper")
        out[name] = (lower, upper)
    return out


def divergence_rejection(log_ratio: torch.Tensor, response_mask: torch.Tensor, options: str,
                         thresholds: float | str) -> tuple[torch.Tensor, dict[str, Metric]]:
    """The response mask without the tokens (sequences) some option rejects, and per-option metrics."""
    safe = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    per_token = {"k1": -safe, "k2": 0.5 * safe.square(), "k3": safe.exp() - 1.0 - safe}
    valid = response_mask.bool()
    has_tokens = valid.any(-1)
    keep_all = torch.ones_like(valid)
    metrics: dict[str, Metric] = {}
    for name, (lower, upper) in parse_rs_thresholds(options, thresholds).items():
        level, kind = name.rsplit("_", 1)
        token_stat = per_token[kind]
        if level == "token":
            stat = token_stat
        elif level == "seq_sum":
            stat = masked_sum(token_stat, response_mask, dim=-1)
        elif level == "seq_mean":
            stat = masked_mean(token_stat, response_mask, dim=-1)
        else:
            stat = torch.where(has_tokens, masked_max_rows(token_stat, response_mask), 0.0)
        lo, hi = (math.log(lower), math.log(upper)) if kind == "k1" else (None, upper)
        keep = (stat <= hi) if lo is None else (stat >= lo) & (stat <= hi)
        if level != "token":
            keep, stat = keep.unsqueeze(-1).expand_as(valid), stat.unsqueeze(-1).expand_as(log_ratio)
        keep_all &= keep
        rejected_rows = (~keep & valid).any(-1)
        prefix = f"rollout_corr/rs_{name}"
        metrics[f"{prefix}_mean"] = token_mean(stat, response_mask)
        metrics[f"{prefix}_max"] = maximum(masked_max(stat, response_mask))
        metrics[f"{prefix}_masked_fraction"] = token_mean((~keep).float(), response_mask)
        metrics[f"{prefix}_seq_masked_fraction"] = sequence_mean(rejected_rows, has_tokens)
    metrics["rollout_corr/rs_masked_fraction"] = token_mean((~keep_all).float(), response_mask)
    # verl's share counts every sequence, an empty one too
    metrics["rollout_corr/rs_seq_masked_fraction"] = sequence_mean((~keep_all & valid).any(-1))
    return response_mask * keep_all.to(response_mask.dtype), metrics


def masked_max_rows(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each row's largest value under the mask (-inf for a row without one)."""
    return values.masked_fill(~mask.bool(), float("-inf")).max(-1).values


def _level_ratio(log_ratio: torch.Tensor, response_mask: torch.Tensor, level: Level) -> torch.Tensor:
    """``ρ`` per token, or the sequence's ``Π ρ_t`` broadcast over its tokens."""
    if level == "token":
        return log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp()
    if level == "sequence":
        total = masked_sum(log_ratio, response_mask, dim=-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
        return total.exp().unsqueeze(-1).expand_as(log_ratio)
    raise ValueError(f"unknown rollout correction level {level!r}; use 'token' or 'sequence'")
