"""flowrl's RL math against verl's own ``core_algos``, on the same seeded inputs.

Every advantage estimator, policy loss (value and gradient), aggregation mode
(with and without a global normaliser), value loss and KL estimator is
compared on three mask shapes: right-padded responses, masks with interior
zeros (multi-turn: tool output inside a response) and batches with fully
masked rows. verl is installed by ``.ci/run`` without its dependencies (see
:mod:`tests.verl_reference`); where it is missing the module is skipped with
that reason.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.verl_reference import INSTALL, add_verl_to_path

add_verl_to_path()
core_algos = pytest.importorskip("verl.trainer.ppo.core_algos", reason=f"verl is not installed: {INSTALL}")
from verl.trainer.config import AlgoConfig  # noqa: E402
from verl.workers.config import ActorConfig, PolicyLossConfig  # noqa: E402

from operators import algos  # noqa: E402
from operators.algos import POLICY_LOSSES, PolicyLossParams  # noqa: E402

B, R, GROUP = 12, 9, 4
MASKS = ("right_padded", "interior_zeros", "fully_masked_rows")


def make_mask(shape: str, gen: torch.Generator) -> torch.Tensor:
    lengths = torch.randint(2, R + 1, (B,), generator=gen)
    mask = (torch.arange(R).unsqueeze(0) < lengths.unsqueeze(1)).long()
    if shape == "interior_zeros":
        holes = (torch.rand(B, R, generator=gen) < 0.3).long()
        holes[:, 0] = 0
        mask = mask * (1 - holes)
    elif shape == "fully_masked_rows":
        mask[[1, 6, 11]] = 0  # one row in three of the four groups
    return mask


@pytest.fixture(params=MASKS)
def data(request):
    gen = torch.Generator().manual_seed(1234 + MASKS.index(request.param))
    mask = make_mask(request.param, gen)
    log_prob = -torch.rand(B, R, generator=gen) * 3 - 0.05
    return {
        "shape": request.param,
        "mask": mask,
        "rewards": torch.randn(B, R, generator=gen) * (torch.rand(B, R, generator=gen) < 0.4),
        "outcome": torch.randint(0, 2, (B,), generator=gen).float(),
        "values": torch.randn(B, R, generator=gen),
        "old_log_prob": log_prob,
        "log_prob": log_prob + torch.randn(B, R, generator=gen) * 0.3,
        "rollout_log_prob": log_prob + torch.randn(B, R, generator=gen) * 0.2,
        "advantages": torch.randn(B, R, generator=gen) * 3,
        "sum_pi_squared": torch.rand(B, R, generator=gen) * 0.5,
        "index": np.array([f"p{i // GROUP}" for i in range(B)], dtype=object),
    }


def same(ours: torch.Tensor, theirs: torch.Tensor, mask: torch.Tensor | None = None, atol: float = 1e-5) -> None:
    """Equal everywhere, or under ``mask`` only where verl leaves padding unmasked."""
    ours, theirs = torch.as_tensor(ours).float(), torch.as_tensor(theirs).float()
    if mask is not None:
        ours, theirs = ours * mask, theirs * mask
    torch.testing.assert_close(ours, theirs, atol=atol, rtol=1e-5)


def _place(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A score on each row's last valid token (rows without one get none), as a rule reward gives."""
    out = torch.zeros(mask.shape)
    for i in range(len(scores)):
        valid = torch.nonzero(mask[i]).squeeze(-1)
        if len(valid):
            out[i, valid[-1]] = scores[i]
    return out


# --- advantage estimators -------------------------------------------------------------------------

def test_gae(data):
    mask = data["mask"]
    for gamma, lam in ((1.0, 0.95), (0.9, 0.8)):
        ours = algos.gae_advantages(data["rewards"], data["values"], mask, gamma, lam)
        theirs = core_algos.compute_gae_advantage_return(data["rewards"], data["values"], mask, gamma, lam)
        same(ours[0], theirs[0], mask)  # verl leaves the whitened padding in place; nothing reads it
        same(ours[1], theirs[1], mask)


@pytest.mark.parametrize("norm", [True, False])
def test_grpo_and_dr_grpo(data, norm):
    ours = algos.grpo_advantages(data["rewards"], data["mask"], data["index"], norm_by_std=norm)
    for verl_fn in (core_algos.compute_grpo_outcome_advantage, core_algos.compute_grpo_vectorized_outcome_advantage):
        theirs = verl_fn(data["rewards"].clone(), data["mask"], data["index"], norm_adv_by_std_in_grpo=norm)
        same(ours[0], theirs[0])
        same(ours[1], theirs[1])


@pytest.mark.parametrize("norm", [True, False])
def test_grpo_passk(data, norm):
    rewards = _place(data["outcome"] + torch.arange(B) * 0.01, data["mask"])  # no ties for the best
    ours = algos.grpo_passk_advantages(rewards, data["mask"], data["index"], norm_by_std=norm)
    theirs = core_algos.compute_grpo_passk_outcome_advantage(
        rewards, data["mask"], data["index"], config=AlgoConfig(norm_adv_by_std_in_grpo=norm))
    same(ours[0], theirs[0])


def test_rloo(data):
    ours = algos.rloo_advantages(data["rewards"], data["mask"], data["index"])
    for verl_fn in (core_algos.compute_rloo_outcome_advantage, core_algos.compute_rloo_vectorized_outcome_advantage):
        same(ours[0], verl_fn(data["rewards"].clone(), data["mask"], data["index"])[0])


def test_opo(data):
    ours = algos.opo_advantages(data["rewards"], data["mask"], data["index"])
    same(ours[0], core_algos.compute_opo_outcome_advantage(data["rewards"].clone(), data["mask"], data["index"])[0])


def test_gpg(data):
    rewards = _place(data["outcome"], data["mask"])
    ours = algos.gpg_advantages(rewards, data["mask"], data["index"])
    same(ours[0], core_algos.compute_gpg_outcome_advantage(rewards.clone(), data["mask"], data["index"])[0])


def test_gdpo_single_component(data):
    ours = algos.gdpo_advantages([data["rewards"]], data["mask"], data["index"])
    same(ours[0], core_algos.compute_gdpo_outcome_advantage(data["rewards"].clone(), data["mask"], data["index"])[0])


@pytest.mark.parametrize("gamma", [1.0, 0.7])
def test_reinforce_plus_plus(data, gamma):
    ours = algos.reinforce_pp_advantages(data["rewards"], data["mask"], gamma)
    theirs = core_algos.compute_reinforce_plus_plus_outcome_advantage(
        data["rewards"], data["mask"], config=AlgoConfig(gamma=gamma))
    same(ours[0], theirs[0])
    same(ours[1], theirs[1])


def test_reinforce_plus_plus_baseline(data):
    ours = algos.reinforce_pp_baseline_advantages(data["rewards"], data["mask"], data["index"])
    theirs = core_algos.compute_reinforce_plus_plus_baseline_outcome_advantage(
        data["rewards"].clone(), data["mask"], data["index"])
    same(ours[0], theirs[0])


def test_remax(data):
    baselines = torch.randn(B, generator=torch.Generator().manual_seed(5))
    ours = algos.remax_advantages(data["rewards"], baselines, data["mask"])
    theirs = core_algos.compute_remax_outcome_advantage(data["rewards"], baselines, data["mask"])
    same(ours[0], theirs[0], data["mask"])  # verl leaves the return-to-go on padding; nothing reads it
    same(ours[1], theirs[1])


@pytest.mark.parametrize("with_is", [False, True])
@pytest.mark.parametrize("multi_turn", [False, True])
def test_optimal_token_baselines(data, with_is, multi_turn):
    weights = (data["log_prob"] - data["rollout_log_prob"]).exp().clamp(max=2.0) if with_is else None
    ours_fn = algos.tir_optimal_token_baseline_advantages if multi_turn else algos.optimal_token_baseline_advantages
    verl_fn = (core_algos.compute_multi_turn_optimal_token_baseline_advantage if multi_turn
               else core_algos.compute_optimal_token_baseline_advantage)
    args = (data["rewards"], data["mask"], data["index"], data["old_log_prob"], data["sum_pi_squared"], weights)
    ours, theirs = ours_fn(*args), verl_fn(*args)
    same(ours[0], theirs[0])
    same(ours[1], theirs[1])


# --- aggregation, policy losses, value loss -------------------------------------------------------

@pytest.mark.parametrize("mode", algos.AGG_MODES)
def test_agg_loss(data, mode):
    loss_mat, mask = data["advantages"], data["mask"]
    same(algos.agg_loss(loss_mat, mask, mode), core_algos.agg_loss(loss_mat, mask, mode))
    tokens, seqs = int(mask.sum()) + 17, int((mask.sum(-1) > 0).sum()) + 3  # a mini-batch larger than this part
    same(algos.agg_loss(loss_mat, mask, mode, norm_tokens=tokens, norm_seqs=seqs),
         core_algos.agg_loss(loss_mat, mask, mode, batch_num_tokens=tokens, global_batch_size=seqs))


def _verl_config(params: PolicyLossParams, mode: str, global_batch_info: dict) -> ActorConfig:
    config = ActorConfig(
        strategy="fsdp", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2, rollout_n=1,
        clip_ratio=params.clip_ratio, clip_ratio_low=params.low, clip_ratio_high=params.high,
        clip_ratio_c=params.clip_ratio_c, tau_pos=params.tau_pos, tau_neg=params.tau_neg,
        policy_loss=PolicyLossConfig(
            loss_mode=mode, clip_cov_ratio=params.clip_cov_ratio, clip_cov_lb=params.clip_cov_lb,
            clip_cov_ub=params.clip_cov_ub, kl_cov_ratio=params.kl_cov_ratio, ppo_kl_coef=params.ppo_kl_coef,
            dro_beta=params.dro_beta))
    config.global_batch_info.update(global_batch_info)
    return config


# knobs that make every branch of a loss fire on inputs of this size
LOSS_PARAMS = {
    "vanilla": PolicyLossParams(clip_ratio=0.2, clip_ratio_c=1.5),
    "dppo_tv": PolicyLossParams(clip_ratio=0.1, clip_ratio_c=1.3),
    "dppo_kl": PolicyLossParams(clip_ratio=0.05, clip_ratio_c=1.3),
    "gspo": PolicyLossParams(clip_ratio_low=3e-3, clip_ratio_high=4e-3),
    "sapo": PolicyLossParams(tau_pos=1.0, tau_neg=1.05),
    "clip_cov": PolicyLossParams(clip_cov_ratio=0.2, clip_cov_lb=0.1, clip_cov_ub=5.0),
    "kl_cov": PolicyLossParams(kl_cov_ratio=0.2, ppo_kl_coef=0.1),
    "geo_mean": PolicyLossParams(clip_ratio=0.2),
    "dro": PolicyLossParams(dro_beta=0.1),
    "cispo": PolicyLossParams(clip_ratio_low=0.2, clip_ratio_high=0.3),
}


def test_every_verl_policy_loss_has_a_flowrl_twin():
    assert set(POLICY_LOSSES) == set(core_algos.POLICY_LOSS_REGISTRY) - {"bypass_mode"}
    assert set(LOSS_PARAMS) == set(POLICY_LOSSES) - {"gpg"}


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
@pytest.mark.parametrize("agg_mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("normalised", [False, True])
def test_policy_loss(data, name, agg_mode, normalised):
    params = LOSS_PARAMS.get(name, PolicyLossParams())
    mask = data["mask"]
    weights = (data["old_log_prob"] - data["rollout_log_prob"]).exp().clamp(max=2.0) * mask
    agg = {"norm_tokens": int(mask.sum()) + 5, "norm_seqs": int((mask.sum(-1) > 0).sum()) + 2} if normalised else {}
    global_info = {"batch_num_tokens": agg["norm_tokens"], "global_batch_size": agg["norm_seqs"]} if normalised else {}
    results = []
    for side in ("flowrl", "verl"):
        log_prob = data["log_prob"].clone().requires_grad_(True)
        torch.manual_seed(7)  # clip_cov's random pick
        if side == "flowrl":
            out = POLICY_LOSSES[name](data["old_log_prob"], log_prob, data["advantages"], mask, agg_mode, params,
                                      weights, **agg)
            loss, metrics = out.pg_loss, {"actor/pg_clipfrac": out.pg_clipfrac, "actor/ppo_kl": out.ppo_kl,
                                          "actor/pg_clipfrac_lower": out.pg_clipfrac_lower}
        else:
            loss, metrics = core_algos.get_policy_loss_fn(name)(
                data["old_log_prob"], log_prob, data["advantages"], mask, agg_mode,
                _verl_config(params, name, global_info), weights)
        loss.backward()
        results.append((loss.detach(), log_prob.grad, metrics))
    (ours, our_grad, our_metrics), (theirs, their_grad, their_metrics) = results
    same(ours, theirs)
    same(our_grad, their_grad)
    for key, value in their_metrics.items():
        same(our_metrics[key], value)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum"])
def test_value_loss(data, mode):
    vpreds = data["values"] + torch.randn(B, R, generator=torch.Generator().manual_seed(3))
    returns = data["rewards"] + data["values"]
    ours = algos.value_loss(vpreds, returns, data["values"], data["mask"], 0.5, mode, norm_tokens=40, norm_seqs=11)
    theirs = core_algos.compute_value_loss(vpreds, returns, data["values"], data["mask"], 0.5, mode,
                                           batch_num_tokens=40, global_batch_size=11)
    same(ours[0], theirs[0])
    same(ours[1], theirs[1])


# --- KL estimators ----------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", algos.KL_ESTIMATORS)
def test_kl_estimators_value_and_gradient(data, kind):
    results = []
    for fn in (algos.kl_penalty, core_algos.kl_penalty):
        log_prob = data["log_prob"].clone().requires_grad_(True)
        kl = fn(log_prob, data["old_log_prob"], kind)
        (kl * data["mask"]).sum().backward()
        results.append((kl.detach(), log_prob.grad))
    same(results[0][0], results[1][0])
    same(results[0][1], results[1][1])


def test_kl_in_reward_matches_verl_compute_rewards(data):
    ours, _ = algos.apply_kl_penalty(data["rewards"], data["log_prob"], data["old_log_prob"], data["mask"],
                                     kl_coef=0.1, kind="k1")
    theirs = core_algos.compute_rewards(data["rewards"], data["log_prob"], data["old_log_prob"], 0.1)
    same(ours, theirs, data["mask"])  # flowrl puts no KL on padding


def test_masked_statistics(data):
    from verl.utils import torch_functional as verl_F

    values = torch.where(data["mask"].bool(), data["advantages"], torch.tensor(float("nan")))
    same(algos.masked_mean(values, data["mask"]), verl_F.masked_mean(values, data["mask"]))
    same(algos.masked_sum(values, data["mask"], dim=-1), verl_F.masked_sum(values, data["mask"], axis=-1))
    same(algos.masked_whiten(data["advantages"], data["mask"]), verl_F.masked_whiten(data["advantages"], data["mask"]))


# --- GDPO reward components, Σπ², rejection sampling and IcePop --------------------------------------

@pytest.mark.parametrize("weights", [None, [1.0, 0.5, 2.0]])
def test_gdpo_reward_components_from_compute_score_dicts(data, weights):
    from flowrl.data import DataProto
    from operators import advantage

    gen = torch.Generator().manual_seed(11)
    keys = ["format", "accuracy", "length"]
    values = {"format": torch.randint(0, 2, (B,), generator=gen).float(),
              "accuracy": torch.randint(0, 3, (B,), generator=gen).float() * 0.5,
              "length": torch.randn(B, generator=gen) * 4}
    extra_info = np.empty(B, dtype=object)
    for i in range(B):
        extra_info[i] = {key: float(values[key][i]) for key in keys}
    mask = data["mask"]
    batch = DataProto.from_dict(
        tensors={"token_level_rewards": data["rewards"], "response_mask": mask},
        non_tensors={"uid": data["index"], "reward_extra_info": extra_info})
    ours = advantage.gdpo(batch, gdpo_reward_keys=keys, gdpo_reward_weights=weights)
    prompts = torch.ones(B, 3, dtype=torch.long)
    theirs, _ = core_algos.compute_gdpo_outcome_advantage(
        data["rewards"], mask, data["index"],
        config=AlgoConfig(gdpo_reward_keys=keys, gdpo_reward_weights=weights),
        non_tensor_batch={key: values[key].numpy() for key in keys},
        batch={"prompts": prompts, "attention_mask": torch.cat([prompts, mask], -1)})
    same(ours["advantages"], theirs)
    assert not torch.allclose(ours["advantages"], advantage.gdpo(batch)["advantages"])  # the components count


def test_sum_pi_squared_matches_verl():
    from verl.utils import torch_functional as verl_F

    logits = torch.randn(3, 5, 40, generator=torch.Generator().manual_seed(2)) * 6
    same(algos.sum_pi_squared_from_logits(logits), verl_F.calculate_sum_pi_squared_from_logits(logits))


RS_CASES = [
    ("token_k1", "0.8_1.25"), ("token_k1", "1.25"), ("token_k2", 0.02), ("token_k3", 0.02),
    ("seq_sum_k1", "0.7_1.5"), ("seq_sum_k2", 0.15), ("seq_sum_k3", 0.15),
    ("seq_mean_k1", "0.9_1.1"), ("seq_mean_k2", 0.02), ("seq_mean_k3", 0.02),
    ("seq_max_k2", 0.05), ("seq_max_k3", 0.05),
    ("token_k1,seq_mean_k3,seq_max_k2", "0.8_1.25,0.02,0.05"), ("token_k2,seq_sum_k3", "0.03,0.3"),
    ("seq_sum_k3,seq_mean_k2", 0.1),
]


@pytest.mark.parametrize("options,threshold", RS_CASES)
def test_rollout_rejection_modes(data, options, threshold):
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_rejection_mask

    mask = data["mask"]
    ours = algos.rollout_correction(data["old_log_prob"], data["rollout_log_prob"], mask,
                                    rs_level=options, rs_threshold=threshold)
    theirs, their_metrics = compute_rollout_rejection_mask(data["old_log_prob"] - data["rollout_log_prob"], mask,
                                                           rollout_rs=options, rollout_rs_threshold=threshold)
    assert torch.equal(ours.response_mask, theirs)
    assert 0 < ours.metrics["rollout_corr/rs_masked_fraction"] < 1  # the thresholds bite on these inputs
    for option in options.split(","):
        for stat in ("mean", "max", "masked_fraction", "seq_masked_fraction"):
            same(ours.metrics[f"rollout_corr/rs_{option}_{stat}"], their_metrics[f"rollout_rs_{option}_{stat}"])
    for stat in ("masked_fraction", "seq_masked_fraction"):
        same(ours.metrics[f"rollout_corr/rs_{stat}"], their_metrics[f"rollout_rs_{stat}"])


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("threshold", [2.0, 1.1, "0.8_1.25", "0.5_3.0"])
def test_tis_and_icepop_weights(data, level, threshold):
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights

    mask = data["mask"]
    ours = algos.rollout_correction(data["old_log_prob"], data["rollout_log_prob"], mask,
                                    is_level=level, is_threshold=threshold)
    theirs, their_metrics = compute_rollout_correction_weights(
        data["old_log_prob"] - data["rollout_log_prob"], mask, rollout_is=level, rollout_is_threshold=threshold)
    same(ours.weights, theirs)
    if isinstance(threshold, str):
        same(ours.metrics["rollout_corr/is_oob_fraction"], their_metrics["rollout_is_oob_ratio"])
