"""Token-level building blocks: log-probs and entropy from logits, masked statistics.

Masked statistics read only what sits under a non-zero mask: a NaN or an inf
in a padded position never reaches the result.

Example::

    >>> logits = torch.tensor([[[0.0, 0.0]]])           # one token, two equally likely choices
    >>> logprobs_from_logits(logits, torch.tensor([[1]]))
    tensor([[-0.6931]])
    >>> entropy_from_logits(logits)
    tensor([[0.6931]])
    >>> masked_mean(torch.tensor([1.0, 3.0, float("nan")]), torch.tensor([1, 1, 0]))
    tensor(2.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flowrl.data.metrics import Metric, mean


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``log softmax(logits)[..., label]``: ``logits[..., V]``, ``labels[...]`` → ``[...]`` in fp32."""
    logits = logits.float()
    return -F.cross_entropy(logits.flatten(0, -2), labels.flatten(), reduction="none").view(labels.shape)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """``H = logsumexp(z) - Σ softmax(z)·z``, per position: ``logits[..., V]`` → ``[...]``."""
    logits = logits.float()
    probs = logits.softmax(-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)


def sum_pi_squared_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """``Σ_v π(v)²`` with ``π = softmax(logits)``, per position: ``logits[..., V]`` → ``[...]`` in fp32.

    Computed in log space, ``exp(logsumexp(2z) - 2·logsumexp(z))``, so large logits do not overflow.
    """
    logits = logits.float()
    return torch.exp(torch.logsumexp(2.0 * logits, dim=-1) - 2.0 * torch.logsumexp(logits, dim=-1))


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``Σ values·mask`` (over ``dim``, or everything); positions where the mask is 0 are never read."""
    valid = torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device)) * mask
    return valid.sum() if dim is None else valid.sum(dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``Σ values·mask / Σ mask``; 0 where the mask is empty.

    Example::

        >>> masked_mean(torch.tensor([1.0, 2.0, 9.0]), torch.tensor([1, 1, 0]))
        tensor(1.5000)
    """
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1e-8)


def token_mean(values: torch.Tensor, mask: torch.Tensor) -> Metric:
    """A metric: the mean of ``values`` over the tokens under ``mask``, declared a mean over those
    tokens, so that micro-batches and ranks reduce it weighted by their token counts.

    Example::

        >>> m = token_mean(torch.tensor([[1.0, 2.0], [4.0, 0.0]]), torch.tensor([[1, 1], [1, 0]]))
        >>> float(m), m.weight
        (2.3333332538604736, 3.0)
    """
    return mean(masked_mean(values, mask), mask.sum())


def sequence_mean(values: torch.Tensor, sequences: torch.Tensor | None = None) -> Metric:
    """A metric: the mean of per-sequence ``values`` ``[B]`` over the sequences ``sequences`` selects
    (all by default), declared a mean over those sequences (0 with no weight when there are none)."""
    chosen = torch.ones_like(values, dtype=torch.bool) if sequences is None else sequences.bool()
    return mean(values[chosen].float().mean() if chosen.any() else 0.0, chosen.sum())


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the masked values; ``unbiased`` divides by ``n - 1`` (needs ``n ≥ 2``).

    Example::

        >>> masked_var(torch.tensor([1.0, 3.0, 100.0]), torch.tensor([1, 1, 0]))
        tensor(2.)
    """
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        n = mask.sum()
        if n < 2:
            raise ValueError(f"unbiased masked variance needs at least 2 unmasked values, got {int(n)}")
        variance = variance * n / (n - 1)
    return variance


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """``(x - mean) / sqrt(var + 1e-8)`` over the masked values (keep the mean if not ``shift_mean``).

    Masked-out positions are transformed too; multiply by the mask to zero them.
    """
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean
