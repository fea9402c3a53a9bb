"""Advantage estimators: GAE, GRPO, RLOO, REINFORCE++ and ReMax.

Every estimator takes ``token_level_rewards[B, R]`` and ``response_mask[B, R]``
and returns ``(advantages[B, R], returns[B, R])``, zero on masked positions.
The outcome estimators (GRPO, RLOO, ReMax) use the sequence score
``Σ_t token_level_rewards``; GRPO and RLOO compare it within a group — the
samples of one prompt, named by ``index`` (a uid per row).

Example::

    >>> rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0]])    # two samples of one prompt
    >>> mask = torch.ones(2, 2)
    >>> adv, _ = grpo_advantages(rewards, mask, index=["p0", "p0"])
    >>> adv.round(decimals=4)
    tensor([[ 0.7071,  0.7071],
            [-0.7071, -0.7071]])
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import torch

from operators.algos.functional import masked_whiten


def group_ids(index: Sequence[Any] | torch.Tensor) -> torch.Tensor:
    """Dense group numbers ``0..G-1`` for arbitrary group keys, in order of first appearance.

    Example::

        >>> group_ids(["b", "a", "b"])
        tensor([0, 1, 0])
    """
    keys = index.tolist() if hasattr(index, "tolist") else list(index)
    numbering: dict[Any, int] = {}
    return torch.tensor([numbering.setdefault(k, len(numbering)) for k in keys], dtype=torch.long)


class GroupStats(NamedTuple):
    """Per-row statistics of the row's group (all tensors ``[B]``)."""

    count: torch.Tensor
    total: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor


def group_stats(scores: torch.Tensor, index: Sequence[Any] | torch.Tensor) -> GroupStats:
    """Count, sum, mean and unbiased std (``n - 1``) of each row's group of ``scores``.

    A group of one has mean 0 and std 1, as in verl, so GRPO gives it its raw score.

    Example::

        >>> group_stats(torch.tensor([1.0, 3.0, 5.0]), ["a", "a", "b"]).mean
        tensor([2., 2., 0.])
    """
    groups = group_ids(index).to(scores.device)
    count = torch.bincount(groups).to(scores.dtype)
    total = torch.zeros_like(count).index_add_(0, groups, scores)
    mean = total / count
    squares = torch.zeros_like(count).index_add_(0, groups, (scores - mean[groups]) ** 2)
    std = (squares / (count - 1).clamp(min=1)).sqrt()
    alone = count == 1
    mean, std = mean.masked_fill(alone, 0.0), std.masked_fill(alone, 1.0)
    return GroupStats(count[groups], total[groups], mean[groups], std[groups])


@torch.no_grad()
def gae_advantages(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation (https://arxiv.org/abs/1506.02438), token by token.

    ``δ_t = r_t + γ·V_{t+1} - V_t`` and ``A_t = δ_t + γλ·A_{t+1}``, walking back over
    valid tokens only (a masked position passes ``V`` and ``A`` through).
    ``returns = A + V`` (before whitening); ``whiten`` then normalises ``A`` over
    the batch's valid tokens, as verl does.
    """
    next_value = torch.zeros_like(values[:, 0])
    next_advantage = torch.zeros_like(values[:, 0])
    advantages = torch.zeros_like(values)
    for t in reversed(range(token_level_rewards.shape[1])):
        valid = response_mask[:, t].to(values.dtype)
        delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        next_value = valid * values[:, t] + (1 - valid) * next_value
        next_advantage = valid * advantage + (1 - valid) * next_advantage
        advantages[:, t] = next_advantage
    returns = advantages + values
    if whiten:
        advantages = masked_whiten(advantages, response_mask)
    return advantages * response_mask, returns * response_mask


@torch.no_grad()
def grpo_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Any] | torch.Tensor,
    norm_by_std: bool = True,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO (https://arxiv.org/abs/2402.03300): ``A = (s - mean_group) / (std_group + ε)``.

    ``norm_by_std=False`` keeps ``s - mean_group`` (Dr. GRPO). The advantage is
    broadcast over the response's valid tokens; returns equal advantages.
    """
    scores = token_level_rewards.sum(-1)
    group = group_stats(scores, index)
    advantage = scores - group.mean
    if norm_by_std:
        advantage = advantage / (group.std + epsilon)
    advantages = advantage.unsqueeze(-1) * response_mask
    return advantages, advantages


@torch.no_grad()
def rloo_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Any] | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO (https://arxiv.org/abs/2402.14740): ``A_i = s_i - mean(s_j, j ≠ i)`` in its group.

    A group of one has no other sample: its advantage is its score.
    """
    scores = token_level_rewards.sum(-1)
    group = group_stats(scores, index)
    others = (group.total - scores) / (group.count - 1).clamp(min=1)
    baseline = torch.where(group.count > 1, others, torch.zeros_like(scores))
    advantages = (scores - baseline).unsqueeze(-1) * response_mask
    return advantages, advantages


@torch.no_grad()
def reinforce_pp_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (https://arxiv.org/abs/2501.03262): discounted returns, whitened over the batch.

    ``G_t = r_t + γ·G_{t+1}`` within each response (nothing flows back from
    padding); ``A = whiten(G)`` over all valid tokens of the batch.
    """
    returns = torch.zeros_like(token_level_rewards)
    running = torch.zeros_like(token_level_rewards[:, 0])
    for t in reversed(range(token_level_rewards.shape[1])):
        running = token_level_rewards[:, t] + gamma * running
        returns[:, t] = running
        running = running * response_mask[:, t]
    advantages = masked_whiten(returns, response_mask) * response_mask
    return advantages, returns * response_mask


@torch.no_grad()
def remax_advantages(
    token_level_rewards: torch.Tensor,
    reward_baselines: torch.Tensor,
    response_mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (https://arxiv.org/abs/2310.10505): return-to-go minus the greedy response's reward.

    ``G_t = Σ_{t' ≥ t} r_t'`` and ``A_t = G_t - b``, with ``b[B]`` the reward
    of the greedy response to the same prompt.
    """
    returns = (token_level_rewards * response_mask).flip(-1).cumsum(-1).flip(-1)
    advantages = (returns - reward_baselines.unsqueeze(-1)) * response_mask
    return advantages, returns
