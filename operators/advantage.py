"""Advantage estimators as operators, one per verl ``adv_estimator`` name.

=====================================  ===================================  ==========
operator                               verl ``algorithm.adv_estimator``     scope
=====================================  ===================================  ==========
``advantage.gae``                      ``gae``                              batch
``advantage.grpo``                     ``grpo`` (Dr.GRPO: no std)           group
``advantage.grpo_passk``               ``grpo_passk``                       group
``advantage.rloo``                     ``rloo``                             group
``advantage.opo``                      ``opo``                              group
``advantage.gpg``                      ``gpg``                              batch
``advantage.gdpo``                     ``gdpo``                             batch
``advantage.reinforce_pp``             ``reinforce_plus_plus``              batch
``advantage.reinforce_pp_baseline``    ``reinforce_plus_plus_baseline``     batch
``advantage.remax``                    ``remax``                            row
``advantage.optimal_token_baseline``   ``optimal_token_baseline``           group
``advantage.tir_optimal_token_baseline``  ``tir_optimal_token_baseline``    group
=====================================  ===================================  ==========
"""

from __future__ import annotations

import numpy as np
import torch
from pydantic import AliasChoices, Field, model_validator

from flowrl.data.metrics import Metric, maximum, mean, minimum
from flowrl.graph import Params, operator
from operators.algos import (
    gae_advantages,
    gdpo_advantages,
    gpg_advantages,
    grpo_advantages,
    grpo_passk_advantages,
    opo_advantages,
    optimal_token_baseline_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    remax_advantages,
    rloo_advantages,
    tir_optimal_token_baseline_advantages,
)

OUT = {"advantages": "float32[B, R]", "returns": "float32[B, R]"}
REWARDS = {"token_level_rewards": "float32[B, R]", "response_mask": "int64[B, R]"}
GROUPED = {**REWARDS, "uid": "object[B]"}


def _metrics(adv: torch.Tensor, ret: torch.Tensor, mask: torch.Tensor) -> dict[str, Metric]:
    """Means over the response tokens: weighted by their count where a step's tasks are reduced."""
    valid = mask.bool()
    return {"critic/advantages/mean": mean(adv[valid].mean(), valid.sum()),
            "critic/returns/mean": mean(ret[valid].mean(), valid.sum())}


def _out(adv: torch.Tensor, ret: torch.Tensor, mask: torch.Tensor):
    return {"advantages": adv, "returns": ret}, _metrics(adv, ret, mask)


class GAE(Params):
    gamma: float = Field(1.0, ge=0, le=1, description="discount")
    lam: float = Field(0.95, ge=0, le=1, description="GAE λ")
    whiten: bool = Field(True, description="normalise advantages over the batch")


@operator("advantage.gae", scope="batch", node_name="advantage", params=GAE, outputs=OUT, aux_outputs=("returns",),
          inputs={**REWARDS, "values": "float32[B, R]"}, dumped=("advantages",), token_mask="response_mask")
def gae(batch, p: GAE):
    """δ_t = r_t + γV_{t+1} − V_t;  A_t = Σ_l (γλ)^l δ_{t+l};  returns = A + V."""
    adv, ret = gae_advantages(batch["token_level_rewards"], batch["values"], batch["response_mask"],
                              p.gamma, p.lam, p.whiten)
    return _out(adv, ret, batch["response_mask"])


class GRPO(Params):
    norm_by_std: bool = Field(True, validation_alias=AliasChoices("norm_by_std", "norm_adv_by_std_in_grpo"),
                              description="divide by the group's std (Dr. GRPO: false); "
                                          "verl's name norm_adv_by_std_in_grpo is accepted")
    epsilon: float = Field(1e-6, gt=0)


@operator("advantage.grpo", scope="group", group_key="uid", node_name="advantage", params=GRPO, outputs=OUT,
          aux_outputs=("returns",), inputs=GROUPED, dumped=("uid", "advantages"), token_mask="response_mask")
def grpo(batch, p: GRPO):
    """A_i = (r_i − mean(r_group)) / (std(r_group) + ε), broadcast over the response's tokens."""
    adv, ret = grpo_advantages(batch["token_level_rewards"], batch["response_mask"], batch["uid"],
                               p.norm_by_std, p.epsilon)
    return _out(adv, ret, batch["response_mask"])


@operator("advantage.grpo_passk", scope="group", group_key="uid", node_name="advantage", params=GRPO, outputs=OUT,
          aux_outputs=("returns",), inputs=GROUPED, dumped=("uid", "advantages"), token_mask="response_mask")
def grpo_passk(batch, p: GRPO):
    """Only the best sample of each group learns: A = (r_max − r_second) / (std(r_group) + ε)."""
    adv, ret = grpo_passk_advantages(batch["token_level_rewards"], batch["response_mask"], batch["uid"],
                                     p.norm_by_std, p.epsilon)
    return _out(adv, ret, batch["response_mask"])


@operator("advantage.rloo", scope="group", group_key="uid", node_name="advantage", outputs=OUT,
          aux_outputs=("returns",), inputs=GROUPED, dumped=("uid", "advantages"), token_mask="response_mask")
def rloo(batch, p):
    """A_i = r_i − mean(r_j for the other samples j of the same prompt)."""
    adv, ret = rloo_advantages(batch["token_level_rewards"], batch["response_mask"], batch["uid"])
    return _out(adv, ret, batch["response_mask"])


@operator("advantage.opo", scope="group", group_key="uid", node_name="advantage", outputs=OUT, aux_outputs=("returns",),
          inputs=GROUPED, dumped=("uid", "advantages"), token_mask="response_mask")
def opo(batch, p):
    """A_i = r_i − Σ_j |y_j| r_j / Σ_j |y_j| over the group (length-weighted baseline)."""
    adv, ret = opo_advantages(batch["token_level_rewards"], batch["response_mask"], batch["uid"])
    return _out(adv, ret, batch["response_mask"])


class GPG(Params):
    f_norm: float = Field(1.0, gt=0, description="divide the centred score by this")


@operator("advantage.gpg", scope="batch", node_name="advantage", params=GPG, outputs=OUT, aux_outputs=("returns",),
          inputs=GROUPED, dumped=("uid", "advantages"), token_mask="response_mask")
def gpg(batch, p: GPG):
    """A_i = α (r_i − mean(r_group)) / f_norm, α = B / #(rows with a non-zero score)."""
    adv, ret = gpg_advantages(batch["token_level_rewards"], batch["response_mask"], batch["uid"], p.f_norm)
    return _out(adv, ret, batch["response_mask"])


class GDPO(GRPO):
    reward_keys: list[str] = Field(
        default_factory=list, validation_alias=AliasChoices("reward_keys", "gdpo_reward_keys"),
        description="the reward components: keys of compute_score's dict (reward.rule_extras' reward_extra_info), "
                    "each normalised in its group on its own; empty: the one reward. verl: gdpo_reward_keys")
    reward_weights: list[float] | None = Field(
        None, validation_alias=AliasChoices("reward_weights", "gdpo_reward_weights"),
        description="one weight per reward key (default: equal). verl: gdpo_reward_weights")

    @model_validator(mode="after")
    def _one_weight_per_key(self):
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward_keys):
            raise ValueError(f"reward_weights has {len(self.reward_weights)} weights for "
                             f"{len(self.reward_keys)} reward_keys; give one per key")
        return self


@operator("advantage.gdpo", scope="batch", node_name="advantage", params=GDPO, outputs=OUT,
          aux_outputs=("returns",), inputs={**GROUPED, "reward_extra_info": "object[B]"},
          optional_inputs=("reward_extra_info",), dumped=("uid", "advantages"), token_mask="response_mask")
def gdpo(batch, p: GDPO):
    """GRPO per reward component, weighted sum, whitened over the batch (no reward_keys: the one reward)."""
    if not p.reward_keys:
        components, metrics = [batch["token_level_rewards"]], {}
    else:
        if "reward_extra_info" not in batch:
            raise ValueError("advantage.gdpo: reward_keys are set but the batch has no reward_extra_info; score with "
                             "reward.rule_extras and a compute_score that returns a dict holding "
                             f"{', '.join(p.reward_keys)}")
        scores = reward_components(batch["reward_extra_info"], p.reward_keys)
        # each component as a [B, 1] reward: GRPO reads only each response's total, wherever it sits
        components = [scores[:, k:k + 1] for k in range(len(p.reward_keys))]
        metrics = {f"gdpo/{key}/{stat}": how(getattr(scores[:, k], stat)())
                   for k, key in enumerate(p.reward_keys)
                   for stat, how in (("mean", float), ("max", maximum), ("min", minimum))}
    adv, ret = gdpo_advantages(components, batch["response_mask"], batch["uid"], weights=p.reward_weights,
                               norm_by_std=p.norm_by_std, epsilon=p.epsilon)
    advantages, base = _out(adv, ret, batch["response_mask"])
    return advantages, {**base, **metrics}


def reward_components(extra_info, keys: list[str]) -> torch.Tensor:
    """``float32[B, K]``: each response's value of each key, from its ``reward_extra_info`` dict."""
    out = torch.empty(len(extra_info), len(keys), dtype=torch.float32)
    for i, row in enumerate(extra_info):
        for k, key in enumerate(keys):
            value = (row or {}).get(key)
            if isinstance(value, str) or not isinstance(value, (int, float, bool, np.number)):
                have = ", ".join(sorted(row or {})) or "none"
                raise ValueError(f"advantage.gdpo: response {i} has no numeric reward component {key!r} "
                                 f"(its extras: {have}); make compute_score return {key!r} for every response, "
                                 "or fix reward_keys")
            out[i, k] = float(value)
    return out


class ReinforcePP(Params):
    gamma: float = Field(1.0, ge=0, le=1, description="discount")


@operator("advantage.reinforce_pp", scope="batch", node_name="advantage", params=ReinforcePP, outputs=OUT,
          aux_outputs=("returns",), inputs=REWARDS, dumped=("advantages",), token_mask="response_mask")
def reinforce_pp(batch, p: ReinforcePP):
    """G_t = r_t + γG_{t+1} over valid tokens;  A = whiten(G) over the whole batch."""
    adv, ret = reinforce_pp_advantages(batch["token_level_rewards"], batch["response_mask"], p.gamma)
    return _out(adv, ret, batch["response_mask"])


@operator("advantage.reinforce_pp_baseline", scope="batch", node_name="advantage", outputs=OUT,
          aux_outputs=("returns",), inputs=GROUPED, dumped=("uid", "advantages"), token_mask="response_mask")
def reinforce_pp_baseline(batch, p):
    """A = whiten(r_i − mean(r_group)) over the whole batch."""
    adv, ret = reinforce_pp_baseline_advantages(batch["token_level_rewards"], batch["response_mask"], batch["uid"])
    return _out(adv, ret, batch["response_mask"])


@operator("advantage.remax", scope="row", node_name="advantage", outputs=OUT, aux_outputs=("returns",),
          inputs={**REWARDS, "reward_baselines": "float32[B, R]"}, dumped=("advantages",), token_mask="response_mask")
def remax(batch, p):
    """A_t = Σ_{t'≥t} r_t' − b, with b the reward of the greedy response to the same prompt."""
    baseline = batch["reward_baselines"].sum(-1)  # the scalar score sits on one token
    adv, ret = remax_advantages(batch["token_level_rewards"], baseline, batch["response_mask"])
    return _out(adv, ret, batch["response_mask"])


class OptimalTokenBaseline(Params):
    handle_zero_tail: bool = Field(True, description="no baseline where only the longest sample has tokens")
    epsilon: float = Field(1e-8, gt=0)


OTB_INPUTS = {**GROUPED, "old_log_probs": "float32[B, R]", "sum_pi_squared": "float32[B, R]",
              "rollout_is_weights": "float32[B, R]"}


@operator("advantage.optimal_token_baseline", scope="group", group_key="uid", node_name="advantage",
          params=OptimalTokenBaseline, outputs=OUT, aux_outputs=("returns",), inputs=OTB_INPUTS,
          optional_inputs=("rollout_is_weights",), dumped=("uid", "advantages"), token_mask="response_mask")
def optimal_token_baseline(batch, p: OptimalTokenBaseline):
    """A_t = G_t − Σ_g G_t W_t / Σ_g W_t,  W_t = Σ_{j≤t} 1 − 2π_j + Σ_v π_v²  (per group and position)."""
    return _optimal_token_baseline(optimal_token_baseline_advantages, batch, p)


@operator("advantage.tir_optimal_token_baseline", scope="group", group_key="uid", node_name="advantage",
          params=OptimalTokenBaseline, outputs=OUT, aux_outputs=("returns",), inputs=OTB_INPUTS,
          optional_inputs=("rollout_is_weights",), dumped=("uid", "advantages"), token_mask="response_mask")
def tir_optimal_token_baseline(batch, p: OptimalTokenBaseline):
    """The optimal token baseline over each response's valid (model) tokens, packed (multi-turn)."""
    return _optimal_token_baseline(tir_optimal_token_baseline_advantages, batch, p)


def _optimal_token_baseline(estimator, batch, p: OptimalTokenBaseline):
    adv, ret = estimator(
        batch["token_level_rewards"], batch["response_mask"], batch["uid"], batch["old_log_probs"],
        batch["sum_pi_squared"], batch["rollout_is_weights"] if "rollout_is_weights" in batch else None,
        p.handle_zero_tail, p.epsilon)
    return _out(adv, ret, batch["response_mask"])
