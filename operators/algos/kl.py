"""KL between the policy and the reference: per-token estimators, controllers, KL-in-reward.

Estimators of ``KL(π‖π_ref)`` from the sampled token's log-probs, with
``log r = ref_logprob - logprob`` (http://joschu.net/blog/kl-approx.html):

=======================  ===============================  ================================
``k1`` / ``kl``          ``logprob - ref_logprob``         unbiased, high variance, can be < 0
``abs``                  ``|logprob - ref_logprob|``
``k2`` / ``mse``         ``½ (logprob - ref_logprob)²``
``k3`` / ``low_var_kl``  ``r - log r - 1``                 unbiased, ≥ 0; clamped to [-10, 10]
=======================  ===============================  ================================

A ``+`` suffix (``k1+``, ``abs+``, ``k3+``, ``low_var_kl+``...) keeps the value
of the estimator but takes the gradient of ``k2`` (straight-through): k1's and
k3's *values* estimate the KL without bias, their gradients do not; k2's
gradient does. ``k2+`` is ``k2``. Names and values follow verl's ``kl_penalty``.

Example::

    >>> kl_penalty(torch.tensor([-1.0]), torch.tensor([-2.0]), "k1")
    tensor([1.])
    >>> kl_penalty(torch.tensor([-1.0]), torch.tensor([-2.0]), "k3")   # e^-1 + 1 - 1
    tensor([0.3679])
"""

from __future__ import annotations

from typing import Literal, Protocol

import torch

from operators.algos.functional import masked_mean

KLEstimator = Literal["k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl",
                      "k1+", "kl+", "abs+", "k2+", "mse+", "k3+", "low_var_kl+"]
#: every estimator name :func:`kl_penalty` accepts
KL_ESTIMATORS: tuple[str, ...] = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl",
                                  "k1+", "kl+", "abs+", "k2+", "mse+", "k3+", "low_var_kl+")


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: KLEstimator = "k1") -> torch.Tensor:
    """Per-token KL estimate of the chosen ``kind`` (see the table above).

    Example (``k3+``: k3's value, k2's gradient)::

        >>> lp = torch.tensor([-1.0], requires_grad=True)
        >>> kl = kl_penalty(lp, torch.tensor([-2.0]), "k3+")
        >>> kl.backward(); round(float(kl), 4), float(lp.grad)      # d/dlp ½(lp - ref)² = 1
        (0.3679, 1.0)
    """
    value = _kl_value(logprob, ref_logprob, kind.removesuffix("+"))
    if not kind.endswith("+") or kind in ("k2+", "mse+"):
        return value
    surrogate = 0.5 * (logprob - ref_logprob).square()
    return surrogate - surrogate.detach() + value.detach()


def _kl_value(logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: str) -> torch.Tensor:
    if kind in ("k1", "kl"):
        return logprob - ref_logprob
    if kind == "abs":
        return (logprob - ref_logprob).abs()
    if kind in ("k2", "mse"):
        return 0.5 * (logprob - ref_logprob).square()
    if kind in ("k3", "low_var_kl"):
        log_ratio = (ref_logprob - logprob).clamp(-20, 20)  # exp() must not overflow
        return (log_ratio.exp() - log_ratio - 1).clamp(-10, 10)
    raise ValueError(
        f"unknown KL estimator {kind!r}; use k1 (kl), abs, k2 (mse) or k3 (low_var_kl), "
        "optionally with a '+' suffix (straight-through k2 gradient)"
    )


class KLController(Protocol):
    value: float

    def update(self, current_kl: float, n_steps: int) -> None: ...


class FixedKLController:
    """A constant KL coefficient ``β``."""

    def __init__(self, kl_coef: float):
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        pass


class AdaptiveKLController:
    """PPO's adaptive ``β`` (Ziegler et al., https://arxiv.org/abs/1909.08593).

    ``e = clip(KL / target - 1, -0.2, 0.2)`` and ``β ← β·(1 + e·n_steps / horizon)``:
    β grows when the KL overshoots its target and shrinks when it undershoots.

    Example::

        >>> ctl = AdaptiveKLController(init_kl_coef=0.1, target_kl=1.0, horizon=100)
        >>> ctl.update(current_kl=2.0, n_steps=10)     # e = +0.2 → β·(1 + 0.02)
        >>> round(ctl.value, 6)
        0.102
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        if horizon <= 0:
            raise ValueError(f"adaptive KL horizon must be positive, got {horizon}")
        self.value = init_kl_coef
        self.target = target_kl
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1, -0.2), 0.2)
        self.value *= 1 + error * n_steps / self.horizon


def build_kl_controller(kind: Literal["fixed", "adaptive"], kl_coef: float,
                        target_kl: float | None = None, horizon: int | None = None) -> KLController:
    """``fixed`` or ``adaptive`` (which needs ``target_kl`` and ``horizon``)."""
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        if target_kl is None or horizon is None:
            raise ValueError("an adaptive KL controller needs target_kl and horizon")
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"unknown KL controller {kind!r}; use 'fixed' or 'adaptive'")


def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    old_log_probs: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    kind: KLEstimator = "k1",
) -> tuple[torch.Tensor, float]:
    """KL in the reward: ``token_level_rewards = scores - β·KL``; also the batch's mean KL.

    The mean KL (per sequence, then over the batch) is what a controller's
    ``update(current_kl, n_steps=batch_size)`` takes.
    """
    kl = kl_penalty(old_log_probs, ref_log_prob, kind) * response_mask
    token_level_rewards = token_level_scores - kl_coef * kl
    current_kl = masked_mean(kl, response_mask, dim=-1).mean()
    return token_level_rewards, float(current_kl)
