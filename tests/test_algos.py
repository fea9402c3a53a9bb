"""Advantages, KL, losses: each checked against a value worked out by hand in the test."""

from __future__ import annotations

import math

import pytest
import torch

from operators.algos import (
    AdaptiveKLController,
    FixedKLController,
    agg_loss,
    apply_kl_penalty,
    build_kl_controller,
    chunked_token_stats,
    entropy_from_logits,
    entropy_loss,
    gae_advantages,
    group_ids,
    grpo_advantages,
    kl_loss,
    kl_penalty,
    logprobs_from_logits,
    masked_mean,
    masked_var,
    masked_whiten,
    policy_loss,
    reinforce_pp_advantages,
    remax_advantages,
    rloo_advantages,
    sum_pi_squared_from_logits,
    value_loss,
)

T = torch.tensor


def close(actual: torch.Tensor, expected, atol: float = 1e-5) -> None:
    torch.testing.assert_close(actual.float(), torch.as_tensor(expected, dtype=torch.float32),
                               atol=atol, rtol=0)


# --- building blocks --------------------------------------------------------------------------

def test_logprobs_and_entropy_from_logits():
    logits = T([[[1.0, 2.0, 3.0], [math.log(3.0), 0.0, -math.inf]]])
    # log p(2) = 3 - log(e^1 + e^2 + e^3); log p(0) of the second row = log(3/4)
    lse = math.log(math.e + math.e ** 2 + math.e ** 3)
    close(logprobs_from_logits(logits, T([[2, 0]])), [[3 - lse, math.log(0.75)]])
    # H(0.75, 0.25) = -(0.75 ln 0.75 + 0.25 ln 0.25)
    p = torch.softmax(T([1.0, 2.0, 3.0]), -1)
    close(entropy_from_logits(logits[:, :1]), [[float(-(p * p.log()).sum())]])
    close(entropy_from_logits(T([[math.log(3.0), 0.0]])), [-(0.75 * math.log(0.75) + 0.25 * math.log(0.25))])


def test_chunked_token_stats_equal_the_whole_logits_and_keep_no_whole_logits_for_backward():
    """A chunk of tokens at a time: the log-probs, entropy, Σπ² and gradients of the whole [N, V] logits,
    and nothing saved for backward as large as the whole logits."""
    gen = torch.Generator().manual_seed(0)
    n, hidden_size, vocab = 37, 8, 1000
    hidden = torch.randn(n, hidden_size, generator=gen, requires_grad=True)
    head = torch.randn(vocab, hidden_size, generator=gen, requires_grad=True)
    labels = torch.randint(0, vocab, (n,), generator=gen)
    logits = (hidden @ head.T) / 0.7
    whole = (logprobs_from_logits(logits, labels), entropy_from_logits(logits), sum_pi_squared_from_logits(logits))

    saved: list[int] = []

    def keep(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        chunked = chunked_token_stats(hidden, labels, lambda h, rows: (h @ head.T) / 0.7, vocab,
                                      with_entropy=True, with_sum_pi_squared=True, chunk_elements=8 * vocab)
    # 8 tokens' logits at a time (5 chunks), and none kept for backward: it recomputes a chunk's from its
    # hidden states, so all that is saved is far below even one copy of the whole logits
    assert sum(saved) < n * vocab // 4
    for ours, theirs in zip(chunked, whole):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    weights = torch.randn(3, n, generator=gen)
    ours = torch.autograd.grad(sum((w * t).sum() for w, t in zip(weights, chunked)), (hidden, head))
    theirs = torch.autograd.grad(sum((w * t).sum() for w, t in zip(weights, whole)), (hidden, head))
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    # entropy_grad=False: the entropy is a metric, without a graph; no grad: no chunk is checkpointed
    _, entropy, _ = chunked_token_stats(hidden, labels, lambda h, rows: h @ head.T, vocab, with_entropy=True,
                                        entropy_grad=False, chunk_elements=8 * vocab)
    assert not entropy.requires_grad
    with torch.no_grad():
        log_probs, _, _ = chunked_token_stats(hidden, labels, lambda h, rows: (h @ head.T) / 0.7, vocab,
                                              chunk_elements=vocab)
    torch.testing.assert_close(log_probs, whole[0].detach(), atol=1e-5, rtol=0)


def test_masked_statistics():
    values, mask = T([1.0, 2.0, 3.0, 100.0]), T([1, 1, 1, 0])
    close(masked_mean(values, mask), 2.0)
    close(masked_var(values, mask), 1.0)                      # ((1-2)² + 0 + (3-2)²) / (3 - 1)
    close(masked_var(values, mask, unbiased=False), 2 / 3)
    close(masked_whiten(values, mask)[:3], [-1.0, 0.0, 1.0])
    close(masked_whiten(values, mask, shift_mean=False)[:3], [1.0, 2.0, 3.0])
    close(masked_mean(T([[1.0, 3.0], [5.0, 7.0]]), T([[1, 1], [1, 0]]), dim=-1), [2.0, 5.0])


def test_group_ids_number_groups_in_order_of_appearance():
    assert group_ids(["x", "y", "x", "z"]).tolist() == [0, 1, 0, 2]
    assert group_ids(T([7, 7, 3])).tolist() == [0, 0, 1]


# --- advantages ---------------------------------------------------------------------------------

def test_gae_by_hand():
    gamma, lam = 0.9, 0.5
    rewards = T([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    values = T([[0.5, 0.6, 0.7], [0.2, 0.4, 9.0]])           # 9.0 sits on a masked token
    mask = T([[1, 1, 1], [1, 1, 0]])
    # row 0: δ2 = 1 - 0.7 = 0.3, A2 = 0.3
    #        δ1 = 0.9·0.7 - 0.6 = 0.03, A1 = 0.03 + 0.45·0.3 = 0.165
    #        δ0 = 0.9·0.6 - 0.5 = 0.04, A0 = 0.04 + 0.45·0.165 = 0.11425
    # row 1: t2 masked; δ1 = 1 - 0.4 = 0.6, A1 = 0.6; δ0 = 0.9·0.4 - 0.2 = 0.16, A0 = 0.16 + 0.45·0.6 = 0.43
    expected_adv = [[0.11425, 0.165, 0.3], [0.43, 0.6, 0.0]]
    expected_ret = [[0.11425 + 0.5, 0.165 + 0.6, 0.3 + 0.7], [0.43 + 0.2, 0.6 + 0.4, 0.0]]
    adv, ret = gae_advantages(rewards, values, mask, gamma=gamma, lam=lam, whiten=False)
    close(adv, expected_adv)
    close(ret, expected_ret)
    # whitened over the 5 valid tokens
    valid = T([0.11425, 0.165, 0.3, 0.43, 0.6])
    mean, std = valid.mean(), valid.std()                     # std: unbiased, like masked_var
    adv_w, ret_w = gae_advantages(rewards, values, mask, gamma=gamma, lam=lam)
    close(adv_w[mask.bool()], (valid - mean) / std, atol=1e-4)
    close(ret_w, expected_ret)


def test_gae_skips_masked_tokens_inside_a_response():
    # a masked observation token in the middle passes V and A through: γ = λ = 1
    rewards, values, mask = T([[0.0, 0.0, 1.0]]), T([[0.5, 9.0, 0.7]]), T([[1, 0, 1]])
    adv, _ = gae_advantages(rewards, values, mask, gamma=1.0, lam=1.0, whiten=False)
    # A2 = 1 - 0.7 = 0.3; t1 skipped; A0 = (0 + 0.7 - 0.5) + 0.3 = 0.5
    close(adv, [[0.5, 0.0, 0.3]])


def test_grpo_by_hand():
    # groups: a = {1.0, 0.0}, b = {0.5, 0.5}, c = {1, 0, 0}, d = {0.3} alone
    scores = [1.0, 0.0, 0.5, 0.5, 1.0, 0.0, 0.0, 0.3]
    uid = ["a", "a", "b", "b", "c", "c", "c", "d"]
    mask = torch.ones(8, 3)
    mask[1, 2] = 0
    rewards = torch.zeros(8, 3)
    rewards[:, 1] = T(scores)                                 # where in the row does not matter: its sum does
    adv, ret = grpo_advantages(rewards, mask, index=uid)
    # a: mean 0.5, unbiased std sqrt(0.5² + 0.5²) = 0.70711 → ±0.5 / 0.70711
    # b: std 0 → 0 / (0 + ε) = 0
    # c: mean 1/3, std sqrt((4/9 + 1/9 + 1/9) / 2) = 0.57735 → (2/3)/0.57735, (-1/3)/0.57735
    # d: alone → mean 0, std 1 → 0.3 / (1 + ε)
    eps = 1e-6
    per_seq = [0.5 / (math.sqrt(0.5) + eps), -0.5 / (math.sqrt(0.5) + eps), 0.0, 0.0,
               (2 / 3) / (math.sqrt(1 / 3) + eps), (-1 / 3) / (math.sqrt(1 / 3) + eps),
               (-1 / 3) / (math.sqrt(1 / 3) + eps), 0.3 / (1 + eps)]
    close(adv, T(per_seq).unsqueeze(-1) * mask)
    close(ret, adv)
    # Dr. GRPO: no std scaling
    adv_nostd, _ = grpo_advantages(rewards, mask, index=uid, norm_by_std=False)
    close(adv_nostd[:, 0], [0.5, -0.5, 0.0, 0.0, 2 / 3, -1 / 3, -1 / 3, 0.3])


def test_rloo_by_hand():
    rewards = T([[0.0, 1.0], [0.0, 0.0], [0.5, 0.0], [0.0, 0.7]])   # scores 1, 0, 0.5 | 0.7 alone
    mask = T([[1, 1], [1, 1], [1, 0], [1, 1]])
    adv, _ = rloo_advantages(rewards, mask, index=[0, 0, 0, 1])
    # 1 - (0 + 0.5)/2 = 0.75;  0 - (1 + 0.5)/2 = -0.75;  0.5 - (1 + 0)/2 = 0;  alone: 0.7
    close(adv, [[0.75, 0.75], [-0.75, -0.75], [0.0, 0.0], [0.7, 0.7]])


def test_reinforce_pp_by_hand():
    rewards = T([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    mask = T([[1, 1, 1], [1, 1, 0]])
    adv, ret = reinforce_pp_advantages(rewards, mask, gamma=0.5)
    # row 0: G = [0.25, 0.5, 1]; row 1: G2 = 0 (masked, cut), G1 = 2, G0 = 0.5·2 = 1
    close(ret, [[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]])
    # whitened over the valid returns 0.25, 0.5, 1, 1, 2: mean 0.95, unbiased var 1.8 / 4 = 0.45
    expected = (T([[0.25, 0.5, 1.0], [1.0, 2.0, 0.95]]) - 0.95) / math.sqrt(0.45)
    close(adv, expected * mask, atol=1e-4)


def test_remax_by_hand():
    rewards = T([[0.0, 0.0, 1.0], [0.0, 0.5, 0.0]])
    mask = T([[1, 1, 1], [1, 1, 0]])
    adv, ret = remax_advantages(rewards, T([0.4, 0.2]), mask)
    close(ret, [[1.0, 1.0, 1.0], [0.5, 0.5, 0.0]])          # return-to-go
    close(adv, [[0.6, 0.6, 0.6], [0.3, 0.3, 0.0]])          # minus the greedy baseline


# --- KL -------------------------------------------------------------------------------------------

def test_kl_estimators_by_hand():
    logp, ref = T([-1.0, -2.0]), T([-2.0, -1.0])
    close(kl_penalty(logp, ref, "k1"), [1.0, -1.0])
    close(kl_penalty(logp, ref, "kl"), [1.0, -1.0])
    close(kl_penalty(logp, ref, "abs"), [1.0, 1.0])
    close(kl_penalty(logp, ref, "k2"), [0.5, 0.5])
    close(kl_penalty(logp, ref, "mse"), [0.5, 0.5])
    # k3 = r - log r - 1 with log r = ref - logp = [-1, 1]
    k3 = [math.exp(-1) + 1 - 1, math.exp(1) - 1 - 1]
    close(kl_penalty(logp, ref, "k3"), k3)
    close(kl_penalty(logp, ref, "low_var_kl"), k3)
    # log r = -30 is clamped to -20, and e^-20 + 20 - 1 = 19 is clamped to 10
    close(kl_penalty(T([0.0]), T([-30.0]), "k3"), [10.0])
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'"):
        kl_penalty(logp, ref, "k4")


def test_kl_controllers():
    fixed = FixedKLController(0.05)
    fixed.update(current_kl=10.0, n_steps=100)
    assert fixed.value == 0.05
    adaptive = AdaptiveKLController(init_kl_coef=0.1, target_kl=1.0, horizon=100)
    adaptive.update(current_kl=2.0, n_steps=10)               # error clipped to +0.2: ×(1 + 0.2·10/100)
    assert adaptive.value == pytest.approx(0.102)
    adaptive.update(current_kl=0.9, n_steps=50)               # error -0.1: ×(1 - 0.1·50/100)
    assert adaptive.value == pytest.approx(0.102 * 0.95)
    assert isinstance(build_kl_controller("adaptive", 0.1, target_kl=1.0, horizon=10), AdaptiveKLController)
    with pytest.raises(ValueError, match="target_kl and horizon"):
        build_kl_controller("adaptive", 0.1)


def test_kl_in_reward_by_hand():
    scores = T([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    old = torch.full((2, 3), -1.0)
    ref = T([[-2.0, -1.0, -1.5], [-1.0, -3.0, -1.0]])
    mask = T([[1, 1, 1], [1, 1, 0]])
    rewards, current_kl = apply_kl_penalty(scores, old, ref, mask, kl_coef=0.1, kind="k1")
    # k1 = old - ref = [[1, 0, 0.5], [0, 2, (masked)]]; rewards = scores - 0.1·k1
    close(rewards, [[-0.1, 0.0, 0.95], [0.0, 0.8, 0.0]])
    # per-sequence mean KL: (1 + 0 + 0.5)/3 = 0.5 and (0 + 2)/2 = 1 → batch mean 0.75
    assert current_kl == pytest.approx(0.75)


# --- losses ---------------------------------------------------------------------------------------

def test_agg_loss_modes_by_hand():
    loss = T([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = T([[1, 1, 0], [1, 0, 0]])
    close(agg_loss(loss, mask, "token-mean"), (1 + 2 + 4) / 3)
    close(agg_loss(loss, mask, "seq-mean-token-sum"), ((1 + 2) + 4) / 2)
    close(agg_loss(loss, mask, "seq-mean-token-mean"), ((1 + 2) / 2 + 4 / 1) / 2)
    close(agg_loss(loss, mask, "token-sum"), 1 + 2 + 4)
    close(agg_loss(loss, mask, "seq-mean-token-sum-norm"), ((1 + 2) + 4) / 2 / 3)
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        agg_loss(loss, mask, "token-max")


def test_agg_loss_skips_fully_masked_rows_and_takes_a_global_normaliser():
    loss = T([[1.0, 2.0], [4.0, 5.0], [7.0, 7.0]])
    mask = T([[1, 1], [1, 0], [0, 0]])
    close(agg_loss(loss, mask, "seq-mean-token-sum"), (3 + 4) / 2)          # the empty row is no sequence
    close(agg_loss(loss, mask, "seq-mean-token-mean"), (1.5 + 4) / 2)
    close(agg_loss(loss, mask, "token-mean", norm_tokens=10), 7 / 10)
    close(agg_loss(loss, mask, "seq-mean-token-sum", norm_seqs=7), 7 / 7)
    nan_under_mask = torch.where(mask.bool(), loss, torch.tensor(float("nan")))
    close(agg_loss(nan_under_mask, mask, "token-mean"), 7 / 3)


def test_ppo_policy_loss_by_hand():
    old = torch.zeros(1, 4)
    new = torch.log(T([[1.5, 0.5, 1.1, 1.5]]))
    adv = T([[1.0, -1.0, -2.0, 5.0]])
    mask = T([[1, 1, 1, 0]])
    out = policy_loss(old, new, adv, mask, clip_ratio=0.2)
    # t0: ratio 1.5, A = 1:  max(-1.5, -1.2) = -1.2   (clipped)
    # t1: ratio 0.5, A = -1: max(0.5, 0.8) = 0.8      (clipped)
    # t2: ratio 1.1, A = -2: max(2.2, 2.2) = 2.2      (inside the range)
    close(out.pg_loss, (-1.2 + 0.8 + 2.2) / 3)
    close(out.pg_clipfrac, 2 / 3)
    close(out.ppo_kl, -(math.log(1.5) + math.log(0.5) + math.log(1.1)) / 3)
    close(out.pg_clipfrac_lower, 0.0)
    # seq-mean-token-sum of the same token losses
    close(policy_loss(old, new, adv, mask, loss_agg_mode="seq-mean-token-sum").pg_loss, -1.2 + 0.8 + 2.2)
    # asymmetric clip: ε_high = 0.6 lets ratio 1.5 through: t0 loss becomes -1.5
    close(policy_loss(old, new, adv, mask, clip_ratio_high=0.6).pg_loss, (-1.5 + 0.8 + 2.2) / 3)
    # gradient flows through log_prob
    new = new.clone().requires_grad_(True)
    policy_loss(old, new, adv, mask).pg_loss.backward()
    # only t2 is unclipped: d/dlogp (-A·ratio)/3 = 2·1.1/3
    close(new.grad, [[0.0, 0.0, 2 * 1.1 / 3, 0.0]])


def test_ppo_dual_clip_by_hand():
    old = torch.zeros(1, 2)
    new = torch.log(T([[4.0, 1.5]]))
    adv = T([[-1.0, -1.0]])
    mask = torch.ones(1, 2)
    # t0: max(-A·4, -A·1.2) = 4, capped by dual clip at -A·c = 3; t1: max(1.5, 1.2) = 1.5 < 3
    plain = policy_loss(old, new, adv, mask, clip_ratio=0.2)
    dual = policy_loss(old, new, adv, mask, clip_ratio=0.2, clip_ratio_c=3.0)
    close(plain.pg_loss, (4.0 + 1.5) / 2)
    close(dual.pg_loss, (3.0 + 1.5) / 2)
    close(dual.pg_clipfrac_lower, 0.5)
    close(dual.pg_clipfrac, 0.0)
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        policy_loss(old, new, adv, mask, clip_ratio_c=1.0)


def test_value_loss_by_hand():
    vpreds = T([[1.0, 1.0, 0.0, 5.0]])
    values = T([[0.5, 0.5, 0.0, 0.0]])
    returns = T([[0.0, 2.0, 1.0, 0.0]])
    mask = T([[1, 1, 1, 0]])
    loss, clipfrac = value_loss(vpreds, returns, values, mask, cliprange_value=0.2)
    # t0: clip(1.0 → 0.7): max((1-0)², (0.7-0)²) = 1.0
    # t1: clip(1.0 → 0.7): max((1-2)², (0.7-2)²) = 1.69   (clipped one larger)
    # t2: no change:      max(1, 1) = 1.0
    close(loss, 0.5 * (1.0 + 1.69 + 1.0) / 3)
    close(clipfrac, 1 / 3)
    loss_sum, _ = value_loss(vpreds, returns, values, mask, cliprange_value=0.2, loss_agg_mode="seq-mean-token-sum")
    close(loss_sum, 0.5 * 3.69)


def test_entropy_and_kl_loss_by_hand():
    entropy = T([[0.5, 1.0, 9.0], [2.0, 9.0, 9.0]])
    mask = T([[1, 1, 0], [1, 0, 0]])
    close(entropy_loss(entropy, mask), (0.5 + 1.0 + 2.0) / 3)
    close(entropy_loss(entropy, mask, "seq-mean-token-mean"), (0.75 + 2.0) / 2)
    logp, ref = T([[-1.0, -2.0]]), T([[-2.0, -1.0]])
    k3 = [math.exp(-1), math.exp(1) - 2]
    close(kl_loss(logp, ref, torch.ones(1, 2)), sum(k3) / 2)
    close(kl_loss(logp, ref, torch.ones(1, 2), kind="k1"), 0.0)
