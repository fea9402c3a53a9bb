"""Advantage estimators, with verl's names and defaults (``core_algos``).

Every estimator takes ``token_level_rewards[B, R]`` and ``response_mask[B, R]``
and returns ``(advantages[B, R], returns[B, R])``; advantages are zero on
masked positions. The outcome estimators use the sequence score
``Σ_t token_level_rewards``; the group estimators compare it within a group —
the samples of one prompt, named by ``index`` (a uid per row).

========================================  =========================================================
``gae``                                   GAE with a critic; masked tokens pass V and A through
``grpo``                                  ``(s - mean_g) / (std_g + ε)``; Dr.GRPO without the std
``grpo_passk``                            only the group's best sample: ``s_max - s_2nd`` (/ std)
``rloo``                                  ``s - mean of the other samples of the group``
``opo``                                   ``s - length-weighted group mean``
``gpg``                                   ``α·(s - mean_g) / f_norm``, ``α = B / #nonzero scores``
``gdpo``                                  GRPO per reward component, weighted sum, whitened
``reinforce_plus_plus``                   discounted returns, whitened over the batch
``reinforce_plus_plus_baseline``          ``s - mean_g`` on every token, whitened over the batch
``remax``                                 return-to-go minus the greedy response's reward
``optimal_token_baseline``                per-token baseline weighted by path variance
``tir_optimal_token_baseline``            the same over the valid tokens only (multi-turn)
========================================  =========================================================

A masked position inside a response (a tool's output in a multi-turn
response) is skipped, not a boundary: returns and GAE carry across it.

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
def grpo_passk_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Any] | torch.Tensor,
    norm_by_std: bool = True,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO Pass@k (https://arxiv.org/abs/2503.19595): only each group's best sample learns,
    with ``A = s_max - s_second`` (divided by ``std_group + ε`` if ``norm_by_std``).

    Every group needs at least 2 samples; ties go to the first best sample.
    """
    scores = token_level_rewards.sum(-1)
    groups = group_ids(index).to(scores.device)
    advantage = torch.zeros_like(scores)
    for g in range(int(groups.max()) + 1 if len(groups) else 0):
        rows = torch.nonzero(groups == g).squeeze(-1)
        if len(rows) < 2:
            raise ValueError(f"grpo_passk needs at least 2 samples per prompt; group {g} has {len(rows)} "
                             "(set rollout n >= 2)")
        group_scores = scores[rows]
        top = torch.topk(group_scores, 2)
        value = top.values[0] - top.values[1]
        if norm_by_std:
            value = value / (group_scores.std() + epsilon)
        advantage[rows[top.indices[0]]] = value
    advantages = advantage.unsqueeze(-1) * response_mask
    return advantages, advantages


@torch.no_grad()
def opo_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Any] | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO (https://arxiv.org/abs/2505.23585): ``A = s - Σ_g |y|·s / Σ_g |y|``, the
    length-weighted group mean as baseline (0 for a group of one)."""
    scores = token_level_rewards.sum(-1)
    lengths = response_mask.sum(-1).to(scores.dtype)
    groups = group_ids(index).to(scores.device)
    weighted = torch.zeros(int(groups.max()) + 1 if len(groups) else 0, dtype=scores.dtype)
    weighted = weighted.index_add(0, groups, lengths * scores)
    total_length = torch.zeros_like(weighted).index_add(0, groups, lengths)
    count = torch.bincount(groups)
    baseline = torch.where(count[groups] > 1, weighted[groups] / total_length[groups], torch.zeros_like(scores))
    advantages = (scores - baseline).unsqueeze(-1) * response_mask
    return advantages, advantages


@torch.no_grad()
def gpg_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Any] | torch.Tensor,
    f_norm: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG (https://arxiv.org/abs/2504.02546): ``A = α·(s - mean_group) / f_norm`` with
    ``α = B / #{rows with a non-zero score}``, which undoes the dilution by all-zero groups."""
    scores = token_level_rewards.sum(-1)
    alpha = len(scores) / torch.count_nonzero(scores).clamp(min=1)
    advantages = (alpha * (scores - group_stats(scores, index).mean) / f_norm).unsqueeze(-1) * response_mask
    return advantages, advantages


@torch.no_grad()
def gdpo_advantages(
    component_rewards: Sequence[torch.Tensor],
    response_mask: torch.Tensor,
    index: Sequence[Any] | torch.Tensor,
    weights: Sequence[float] | None = None,
    norm_by_std: bool = True,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GDPO (https://arxiv.org/abs/2601.05242): GRPO on each reward component
    (``component_rewards``: token-level ``[B, R]`` each) separately, the weighted sum,
    then whitened over the batch — a dominant component cannot drown the others."""
    weights = [1.0] * len(component_rewards) if weights is None else list(weights)
    if len(weights) != len(component_rewards):
        raise ValueError(f"gdpo: {len(weights)} weights for {len(component_rewards)} reward components")
    total = sum(w * grpo_advantages(r, response_mask, index, norm_by_std, epsilon)[0]
                for w, r in zip(weights, component_rewards))
    advantages = masked_whiten(total, response_mask) * response_mask
    return advantages, advantages


def _return_to_go(token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    return (token_level_rewards * response_mask).flip(-1).cumsum(-1).flip(-1)


def _path_variance(old_log_probs: torch.Tensor, sum_pi_squared: torch.Tensor, response_mask: torch.Tensor,
                   rollout_is_weights: torch.Tensor | None) -> torch.Tensor:
    """``W_t = Σ_{j ≤ t} (1 - 2π_j + Σπ²)·ρ_j²``: the cumulative path-variance proxy."""
    w = 1 - 2 * old_log_probs.exp() + sum_pi_squared
    if rollout_is_weights is not None:
        w = w * rollout_is_weights ** 2
    return (w * response_mask).cumsum(-1)


def _zero_tail(baselines: torch.Tensor, rows: list[int], lengths: torch.Tensor) -> None:
    """Zero the baseline of the group's unique longest response beyond the second-longest."""
    ordered = torch.sort(lengths).values
    longest, second = int(ordered[-1]), int(ordered[-2])
    at_longest = torch.nonzero(lengths == longest).squeeze(-1)
    if at_longest.numel() == 1 and longest > second:
        baselines[rows[int(at_longest[0])], second:] = 0.0


def _groups(index: Sequence[Any] | torch.Tensor, keep: torch.Tensor | None = None) -> list[list[int]]:
    members: dict[int, list[int]] = {}
    for row, g in enumerate(group_ids(index).tolist()):
        if keep is None or bool(keep[row]):
            members.setdefault(g, []).append(row)
    return list(members.values())


@torch.no_grad()
def optimal_token_baseline_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Any] | torch.Tensor,
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    rollout_is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Optimal token baseline: ``A_t = G_t - B_t`` with, per group and position,
    ``B_t = Σ G_t·W_t / Σ W_t`` and ``W_t`` the cumulative path variance
    ``Σ_{j≤t} 1 - 2π_j + Σ_v π_v²`` (``sum_pi_squared`` is ``Σ_v π_v²`` per token).
    A group of one has no baseline."""
    returns = _return_to_go(token_level_rewards, response_mask)
    w = _path_variance(old_log_probs, sum_pi_squared, response_mask, rollout_is_weights)
    baselines = torch.zeros_like(returns)
    for rows in _groups(index):
        if len(rows) == 1:
            continue
        idx = torch.tensor(rows, device=returns.device)
        mask = response_mask[idx]
        weight = w[idx] * mask
        baselines[idx] = ((returns[idx] * weight).sum(0) / (weight.sum(0) + epsilon)).expand(len(rows), -1)
        if handle_zero_tail:
            _zero_tail(baselines, rows, mask.sum(-1))
    return (returns - baselines) * response_mask, returns


@torch.no_grad()
def tir_optimal_token_baseline_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Any] | torch.Tensor,
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    rollout_is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The optimal token baseline for multi-turn responses: the valid tokens of each response
    are packed left first, so the k-th *model* token of every sample shares a baseline,
    whatever tool output sits between. Rows without a valid token are left out."""
    returns = _return_to_go(token_level_rewards, response_mask)
    w = _path_variance(old_log_probs, sum_pi_squared, response_mask, rollout_is_weights)
    valid = response_mask.bool()
    lengths = valid.sum(-1)
    width = int(lengths.max()) if lengths.numel() else 0
    packed_w = w.new_zeros(len(lengths), width)
    packed_g = torch.zeros_like(packed_w)
    for i in range(len(lengths)):
        packed_w[i, : lengths[i]] = w[i, valid[i]]
        packed_g[i, : lengths[i]] = returns[i, valid[i]]
    baselines = torch.zeros_like(packed_g)
    for rows in _groups(index, keep=lengths > 0):
        if len(rows) == 1:
            continue
        idx = torch.tensor(rows, device=returns.device)
        b = (packed_g[idx] * packed_w[idx]).sum(0) / (packed_w[idx].sum(0) + epsilon)
        baselines[idx] = b.to(baselines.dtype)
        if handle_zero_tail:
            _zero_tail(baselines, rows, lengths[idx])
    packed_adv = packed_g - baselines
    advantages = torch.zeros_like(returns)
    for i in range(len(lengths)):
        advantages[i, valid[i]] = packed_adv[i, : lengths[i]]
    return advantages * response_mask, returns


@torch.no_grad()
def reinforce_pp_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (https://arxiv.org/abs/2501.03262): discounted returns, whitened over the batch.

    ``G_t = r_t + γ·G_{t+1}`` over the valid tokens of each response: a masked
    token (padding, or a tool's output inside a multi-turn response) neither
    receives a return nor breaks the chain — the running return is carried
    across it. ``A = whiten(G)`` over all valid tokens of the batch.
    """
    returns = torch.zeros_like(token_level_rewards)
    running = torch.zeros_like(token_level_rewards[:, 0])
    for t in reversed(range(token_level_rewards.shape[1])):
        valid = response_mask[:, t].to(running.dtype)
        candidate = token_level_rewards[:, t] + gamma * running
        returns[:, t] = candidate * valid
        running = valid * candidate + (1 - valid) * running
    advantages = masked_whiten(returns, response_mask) * response_mask
    return advantages, returns


@torch.no_grad()
def reinforce_pp_baseline_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Any] | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline: ``s - mean_group`` on every valid token, whitened over the batch."""
    scores = token_level_rewards.sum(-1)
    centred = (scores - group_stats(scores, index).mean).unsqueeze(-1) * response_mask
    advantages = masked_whiten(centred, response_mask) * response_mask
    return advantages, advantages


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
