"""The actor update: a policy loss chosen by name (verl's ``policy_loss.loss_mode``), entropy
bonus, KL loss, and rollout correction (train/inference mismatch metrics, TIS, MIS)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from flowrl.data.metrics import mean, total
from flowrl.graph import Params, operator
from flowrl.graph.checks import MissingProducerError, graph_check
from operators.algos import (
    KL_ESTIMATORS,
    POLICY_LOSSES,
    RS_OPTIONS,
    PolicyLossParams,
    entropy_loss,
    get_policy_loss,
    kl_loss,
    mismatch_metrics,
    parse_is_threshold,
    parse_rs_thresholds,
    rollout_correction,
)
from operators.algos.losses import AGG_MODES
from operators.logprob import SEQUENCE_IMAGES_IN
from operators.models import response_log_probs
from operators.models.vision import VISION_FIELDS, vision_inputs

AGG = f"^({'|'.join(AGG_MODES)})$"


def _choice(names) -> str:
    return "^(" + "|".join(n.replace("+", r"\+") for n in names) + ")$"


class ActorUpdate(Params):
    policy_loss: str = Field("vanilla", pattern=_choice(POLICY_LOSSES),
                             description=f"the policy loss: {', '.join(POLICY_LOSSES)}")
    clip_ratio: float = Field(0.2, gt=0, description="ε of the clipped surrogate (dppo_*: the divergence bound)")
    clip_ratio_low: float | None = Field(None, gt=0, description="ε below 1 (default: clip_ratio)")
    clip_ratio_high: float | None = Field(None, gt=0, description="ε above 1 (default: clip_ratio)")
    clip_ratio_c: float = Field(3.0, gt=1, description="dual-clip bound c > 1 (verl's default 3.0); dppo_*: "
                                                       "the IS truncation")
    dual_clip: bool = Field(True, description="cap a negative-advantage token's loss at -A·clip_ratio_c "
                                              "(vanilla; verl always does)")
    tau_pos: float = Field(1.0, gt=0, description="sapo: gate temperature for positive advantages")
    tau_neg: float = Field(1.05, gt=0, description="sapo: gate temperature for negative advantages")
    clip_cov_ratio: float = Field(0.0002, gt=0, description="clip_cov: share of tokens whose gradient is cut")
    clip_cov_lb: float = Field(1.0, description="clip_cov: covariance lower bound")
    clip_cov_ub: float = Field(5.0, description="clip_cov: covariance upper bound")
    kl_cov_ratio: float = Field(0.0002, gt=0, description="kl_cov: share of tokens given the KL penalty")
    ppo_kl_coef: float = Field(0.1, ge=0, description="kl_cov: the penalty's weight")
    dro_beta: float | None = Field(None, gt=0, description="dro: weight of the quadratic log-ratio penalty")
    entropy_coeff: float = Field(0.0, ge=0, description="entropy bonus weight")
    use_kl_loss: bool = Field(False, description="add β·KL(π‖π_ref) to the loss (GRPO-style)")
    kl_loss_coef: float = Field(0.001, ge=0)
    kl_loss_type: str = Field("k3", pattern=_choice(KL_ESTIMATORS),
                              description="k1, abs, k2, k3 (kl, mse, low_var_kl), '+' for a k2 gradient")
    loss_agg_mode: str = Field("token-mean", pattern=AGG)
    rollout_is: Literal["token", "sequence"] | None = Field(
        None, description="TIS: weight the loss by min(π_old/π_rollout, rollout_is_threshold), per token or "
                          "per sequence (needs old_log_probs from logprob.old)")
    rollout_is_threshold: float | str = Field(
        2.0, description="TIS cap C (also the mismatch metrics' threshold), or 'lower_upper' (e.g. '0.5_2.0') "
                         "for IcePop: weight ρ inside the band, 0 outside")
    rollout_rs: str | None = Field(
        None, description="rejection: 'token' / 'sequence' drop tokens / sequences whose π_old/π_rollout is "
                          f"outside the bounds (MIS); or verl's divergence options, comma separated: "
                          f"{', '.join(RS_OPTIONS)}")
    rollout_rs_threshold: float | str = Field(
        2.0, description="MIS upper bound; for the divergence options one threshold for all or one per option, "
                         "comma separated ('lower_upper' for k1)")
    rollout_rs_threshold_lower: float | None = Field(None, gt=0, description="MIS lower bound (default 1/upper)")
    mini_batch_size: int | None = Field(None, ge=1, description="rows per optimizer step (default: all)")
    epochs: int = Field(1, ge=1, description="passes over the batch")
    micro_batch_size: int | None = Field(None, ge=1, description="rows per forward pass (grad accumulation)")
    temperature: float = Field(1.0, gt=0, description="the rollout's temperature")

    @model_validator(mode="after")
    def _rollout_correction_specs(self):
        # refuse a bad spec when the graph loads, not at the first update
        parse_is_threshold(self.rollout_is_threshold)
        if self.rollout_rs in ("token", "sequence"):
            if not isinstance(self.rollout_rs_threshold, (int, float)) or self.rollout_rs_threshold <= 0:
                raise ValueError(f"rollout_rs_threshold for rollout_rs={self.rollout_rs!r} is one number > 0, "
                                 f"got {self.rollout_rs_threshold!r}")
        elif self.rollout_rs is not None:
            parse_rs_thresholds(self.rollout_rs, self.rollout_rs_threshold)
        return self

    def loss_params(self) -> PolicyLossParams:
        return PolicyLossParams(
            clip_ratio=self.clip_ratio, clip_ratio_low=self.clip_ratio_low, clip_ratio_high=self.clip_ratio_high,
            clip_ratio_c=self.clip_ratio_c if self.dual_clip or self.policy_loss != "vanilla" else None,
            tau_pos=self.tau_pos, tau_neg=self.tau_neg,
            clip_cov_ratio=self.clip_cov_ratio, clip_cov_lb=self.clip_cov_lb, clip_cov_ub=self.clip_cov_ub,
            kl_cov_ratio=self.kl_cov_ratio, ppo_kl_coef=self.ppo_kl_coef, dro_beta=self.dro_beta)


def agg_kwargs(norm) -> dict[str, float]:
    """The global normaliser ``fit`` hands a loss function, as :func:`agg_loss` keywords."""
    return {} if norm is None else {"norm_tokens": norm.tokens, "norm_seqs": norm.seqs}


@graph_check
def _kl_loss_has_reference(graph):
    """use_kl_loss reads ref_log_prob, an optional input: without a producer the update would fail at step 1."""
    producers = graph.producers()
    for name, node in graph.nodes.items():
        if node.op_name == "actor.update" and node.params is not None and node.params.use_kl_loss:
            field = dict(node.config.inputs).get("ref_log_prob", "ref_log_prob")
            if field not in producers:
                yield MissingProducerError(
                    f"use_kl_loss: true needs {field!r} (the reference policy's log-probs), and no node "
                    f"produces it", node=name, field=field, location=graph.locate("nodes", name, "use_kl_loss"),
                    fix="add a node {op: logprob.ref, role: ref} with a frozen reference role, or set "
                        "use_kl_loss: false")


@operator(
    "actor.update", role="actor", scope="batch", dispatch="all", updates_role=True, node_name="update_actor",
    cost=4.0, params=ActorUpdate, optional_inputs=("ref_log_prob", "rollout_log_probs", *VISION_FIELDS),
    balance_by="attention_mask", headline=("actor/pg_loss", "actor/approx_kl", "actor/entropy"),
    inputs={**SEQUENCE_IMAGES_IN, "response_mask": "int64[B, R]", "old_log_probs": "float32[B, R]",
            "advantages": "float32[B, R]", "ref_log_prob": "float32[B, R]", "rollout_log_probs": "float32[B, R]"},
    outputs={},
    token_mask="response_mask",
)
def update(actor, batch, p: ActorUpdate):
    """L = policy_loss(ratio, A) − c_H · H(π) + β · KL(π ‖ π_ref), with ratio = exp(log π − log π_old).

    The train/inference mismatch — this update's log-probs against the
    sampler's (``rollout_log_probs``, or ``old_log_probs`` when the graph feeds
    the sampler's log-probs in as π_old) — is reported every step
    (``actor/rollout_corr/*``: means over tokens or sequences and maxima, reduced as such over
    micro-batches and ranks). With a separate π_old (``logprob.old``), TIS / MIS correct it for
    the sampler.
    """
    if p.use_kl_loss and "ref_log_prob" not in batch:
        raise ValueError("use_kl_loss needs ref_log_prob: add a logprob.ref node to the graph")
    # The sampler's log-probs: their own column when the graph computes π_old separately
    # (logprob.old), else old_log_probs itself is the sampler's (bypass: old_log_probs ← rollout_log_probs).
    behaviour = "rollout_log_probs" if "rollout_log_probs" in batch else "old_log_probs"
    if (p.rollout_is or p.rollout_rs) and behaviour == "old_log_probs":
        raise ValueError(
            "rollout_is / rollout_rs correct π_old for the sampler, but update_actor sees no separate "
            "rollout_log_probs: with old_log_probs ← rollout_log_probs the PPO ratio π/π_rollout already carries "
            "(and clips) the mismatch. Add a logprob.old node and drop update_actor's old_log_probs input mapping")
    loss_of = get_policy_loss(p.policy_loss)
    params = p.loss_params()

    def loss_fn(mb, norm=None):
        log_prob, entropy = response_log_probs(actor.model, mb["input_ids"], mb["attention_mask"],
                                               mb["position_ids"], mb["responses"].shape[1], p.temperature,
                                               with_entropy=True, entropy_grad=p.entropy_coeff > 0,
                                               vision=vision_inputs(mb))
        mask = mb["response_mask"]
        agg = agg_kwargs(norm)
        weights = None
        # the gap between the policy being trained and the one that sampled, whatever corrects it
        metrics = mismatch_metrics(log_prob, mb[behaviour], mask, parse_is_threshold(p.rollout_is_threshold)[0])
        if p.rollout_is or p.rollout_rs:
            corr = rollout_correction(mb["old_log_probs"], mb["rollout_log_probs"], mask,
                                      is_level=p.rollout_is, is_threshold=p.rollout_is_threshold,
                                      rs_level=p.rollout_rs, rs_threshold=p.rollout_rs_threshold,
                                      rs_threshold_lower=p.rollout_rs_threshold_lower)
            weights, mask = corr.weights, corr.response_mask
            metrics.update({k: v for k, v in corr.metrics.items() if "/is_" in k or "/rs_" in k})
        pg = loss_of(mb["old_log_probs"], log_prob, mb["advantages"], mask, p.loss_agg_mode, params,
                     weights, **agg)
        ent = entropy_loss(entropy, mask, p.loss_agg_mode, **agg)
        loss = pg.pg_loss - p.entropy_coeff * ent
        # the policy loss's statistics are means over the tokens it trains on (MIS leaves some out)
        metrics.update({"clipfrac": mean(pg.pg_clipfrac, mask.sum()), "approx_kl": mean(pg.ppo_kl, mask.sum())})
        if p.dual_clip or p.policy_loss != "vanilla":
            metrics["clipfrac_lower"] = mean(pg.pg_clipfrac_lower, mask.sum())
        # normalised by the whole mini-batch: each micro-batch's loss is its share, and the shares add up
        metrics.update({"pg_loss": total(pg.pg_loss.detach()), "entropy": total(ent.detach())})
        if p.use_kl_loss:
            kl = kl_loss(log_prob, mb["ref_log_prob"], mask, p.kl_loss_type, p.loss_agg_mode, **agg)
            loss = loss + p.kl_loss_coef * kl
            metrics["kl_loss"] = total(kl.detach())
        return loss, metrics

    m = actor.fit(batch, loss_fn, mini_batch_size=p.mini_batch_size, epochs=p.epochs,
                  micro_batch_size=p.micro_batch_size)
    return {}, {f"actor/{k}": v for k, v in m.items()}
