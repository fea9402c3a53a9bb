"""KL to the reference as a reward penalty: fixed β, or β adapted toward a target KL.

The adaptive β is operator state: declared (``state=``), kept by the runtime
across steps, checkpointed with the run and handed to every rank alike.
"""

from __future__ import annotations

from pydantic import Field

from flowrl.graph import Params, StateSpec, operator
from operators.algos import AdaptiveKLController, apply_kl_penalty

INPUTS = {"token_level_scores": "float32[B, R]", "old_log_probs": "float32[B, R]",
          "ref_log_prob": "float32[B, R]", "response_mask": "int64[B, R]"}
ESTIMATOR = "^(k1|abs|k2|k3|kl|mse|low_var_kl)$"


class FixedKL(Params):
    kl_coef: float = Field(0.001, ge=0, description="β")
    kl_estimator: str = Field("k1", pattern=ESTIMATOR, description="k1, abs, k2 or k3 (low-variance)")


@operator("kl.reward", scope="row", node_name="kl_reward", params=FixedKL, inputs=INPUTS,
          outputs={"token_level_rewards": "float32[B, R]"}, token_mask="response_mask",
          headline=("actor/reward_kl_penalty",))
def reward(batch, p: FixedKL):
    """r_t = score_t − β · KL_t(π_old ‖ π_ref)."""
    rewards, kl = apply_kl_penalty(batch["token_level_scores"], batch["old_log_probs"], batch["ref_log_prob"],
                                   batch["response_mask"], p.kl_coef, p.kl_estimator)
    return {"token_level_rewards": rewards}, {"actor/reward_kl_penalty": kl, "actor/kl_coef": p.kl_coef}


class AdaptiveKL(Params):
    init_kl_coef: float = Field(0.001, ge=0)
    target_kl: float = Field(0.1, gt=0)
    horizon: int = Field(10000, ge=1)
    kl_estimator: str = Field("k1", pattern=ESTIMATOR)


def _initial_beta(p: AdaptiveKL) -> dict[str, float]:
    return {"kl_coef": p.init_kl_coef}


ADAPTIVE_STATE = StateSpec(init=_initial_beta)


@operator("kl.adaptive_reward", scope="batch", node_name="kl_reward", params=AdaptiveKL,
          inputs=INPUTS, outputs={"token_level_rewards": "float32[B, R]"}, state=ADAPTIVE_STATE,
          token_mask="response_mask", headline=("actor/reward_kl_penalty",))
def adaptive_reward(batch, p: AdaptiveKL):
    """r_t = score_t − β · KL_t, then β ← β · (1 + clip(KL/target − 1, ±0.2) · B/horizon)."""
    state = batch.meta_info[ADAPTIVE_STATE.key]  # {"kl_coef": β}, this node's state from the last step
    ctrl = AdaptiveKLController(state["kl_coef"], p.target_kl, p.horizon)
    beta = ctrl.value
    rewards, kl = apply_kl_penalty(batch["token_level_scores"], batch["old_log_probs"], batch["ref_log_prob"],
                                   batch["response_mask"], beta, p.kl_estimator)
    ctrl.update(kl, n_steps=len(batch))
    state["kl_coef"] = ctrl.value
    return {"token_level_rewards": rewards}, {"actor/reward_kl_penalty": kl, "actor/kl_coef": beta}
