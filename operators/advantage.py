"""Advantage estimators: GAE (with a critic) and the critic-free GRPO, RLOO, REINFORCE++, ReMax."""

from __future__ import annotations

import torch
from pydantic import Field

from flowrl.graph import Params, operator
from operators.algos import (
    gae_advantages,
    grpo_advantages,
    reinforce_pp_advantages,
    remax_advantages,
    rloo_advantages,
)

OUT = {"advantages": "float32[B, R]", "returns": "float32[B, R]"}
REWARDS = {"token_level_rewards": "float32[B, R]", "response_mask": "int64[B, R]"}


def _metrics(adv: torch.Tensor, ret: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    valid = mask.bool()
    return {"critic/advantages/mean": adv[valid].mean(), "critic/returns/mean": ret[valid].mean()}


class GAE(Params):
    gamma: float = Field(1.0, ge=0, le=1, description="discount")
    lam: float = Field(0.95, ge=0, le=1, description="GAE λ")
    whiten: bool = Field(True, description="normalise advantages over the batch")


@operator("advantage.gae", scope="batch", node_name="advantage", params=GAE, outputs=OUT, aux_outputs=("returns",),
          inputs={**REWARDS, "values": "float32[B, R]"}, dumped=("advantages",))
def gae(batch, p: GAE):
    """δ_t = r_t + γV_{t+1} − V_t;  A_t = Σ_l (γλ)^l δ_{t+l};  returns = A + V."""
    adv, ret = gae_advantages(batch["token_level_rewards"], batch["values"], batch["response_mask"],
                              p.gamma, p.lam, p.whiten)
    return {"advantages": adv, "returns": ret}, _metrics(adv, ret, batch["response_mask"])


class GRPO(Params):
    norm_by_std: bool = Field(True, description="divide by the group's std (Dr. GRPO: false)")
    epsilon: float = Field(1e-6, gt=0)


@operator("advantage.grpo", scope="group", node_name="advantage", params=GRPO, outputs=OUT, aux_outputs=("returns",),
          inputs={**REWARDS, "uid": "object[B]"}, dumped=("uid", "advantages"))
def grpo(batch, p: GRPO):
    """A_i = (r_i − mean(r_group)) / (std(r_group) + ε), broadcast over the response's tokens."""
    adv, ret = grpo_advantages(batch["token_level_rewards"], batch["response_mask"], batch["uid"],
                               p.norm_by_std, p.epsilon)
    return {"advantages": adv, "returns": ret}, _metrics(adv, ret, batch["response_mask"])


@operator("advantage.rloo", scope="group", node_name="advantage", outputs=OUT, aux_outputs=("returns",),
          inputs={**REWARDS, "uid": "object[B]"}, dumped=("uid", "advantages"))
def rloo(batch, p):
    """A_i = r_i − mean(r_j for the other samples j of the same prompt)."""
    adv, ret = rloo_advantages(batch["token_level_rewards"], batch["response_mask"], batch["uid"])
    return {"advantages": adv, "returns": ret}, _metrics(adv, ret, batch["response_mask"])


class ReinforcePP(Params):
    gamma: float = Field(1.0, ge=0, le=1, description="discount")


@operator("advantage.reinforce_pp", scope="batch", node_name="advantage", params=ReinforcePP, outputs=OUT, aux_outputs=("returns",),
          inputs=REWARDS, dumped=("advantages",))
def reinforce_pp(batch, p: ReinforcePP):
    """G_t = r_t + γG_{t+1};  A = whiten(G) over the whole batch."""
    adv, ret = reinforce_pp_advantages(batch["token_level_rewards"], batch["response_mask"], p.gamma)
    return {"advantages": adv, "returns": ret}, _metrics(adv, ret, batch["response_mask"])


@operator("advantage.remax", scope="row", node_name="advantage", outputs=OUT, aux_outputs=("returns",),
          inputs={**REWARDS, "reward_baselines": "float32[B, R]"}, dumped=("advantages",))
def remax(batch, p):
    """A_t = Σ_{t'≥t} r_t' − b, with b the reward of the greedy response to the same prompt."""
    baseline = batch["reward_baselines"].sum(-1)  # the scalar score sits on one token
    adv, ret = remax_advantages(batch["token_level_rewards"], baseline, batch["response_mask"])
    return {"advantages": adv, "returns": ret}, _metrics(adv, ret, batch["response_mask"])
