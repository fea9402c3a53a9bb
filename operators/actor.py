"""The actor update: PPO's clipped surrogate, with optional dual clip, entropy bonus and KL loss."""

from __future__ import annotations

from pydantic import Field

from flowrl.graph import Params, operator
from flowrl.graph.checks import MissingProducerError, graph_check
from operators.algos import entropy_loss, kl_loss, policy_loss
from operators.logprob import SEQUENCE_IN
from operators.models import response_log_probs

AGG = "^(token-mean|seq-mean-token-sum|seq-mean-token-mean)$"


class ActorUpdate(Params):
    clip_ratio: float = Field(0.2, gt=0, description="ε of the clipped surrogate")
    clip_ratio_low: float | None = Field(None, gt=0, description="ε below 1 (default: clip_ratio)")
    clip_ratio_high: float | None = Field(None, gt=0, description="ε above 1 (default: clip_ratio)")
    clip_ratio_c: float | None = Field(None, gt=1, description="dual-clip bound c > 1 (off by default)")
    entropy_coeff: float = Field(0.0, ge=0, description="entropy bonus weight")
    use_kl_loss: bool = Field(False, description="add β·KL(π‖π_ref) to the loss (GRPO-style)")
    kl_loss_coef: float = Field(0.001, ge=0)
    kl_loss_type: str = Field("k3", pattern="^(k1|abs|k2|k3|kl|mse|low_var_kl)$")
    loss_agg_mode: str = Field("token-mean", pattern=AGG)
    mini_batch_size: int | None = Field(None, ge=1, description="rows per optimizer step (default: all)")
    epochs: int = Field(1, ge=1, description="passes over the batch")
    micro_batch_size: int | None = Field(None, ge=1, description="rows per forward pass (grad accumulation)")
    temperature: float = Field(1.0, gt=0, description="the rollout's temperature")


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
    cost=4.0, params=ActorUpdate, optional_inputs=("ref_log_prob",),
    inputs={**SEQUENCE_IN, "response_mask": "int64[B, R]", "old_log_probs": "float32[B, R]",
            "advantages": "float32[B, R]", "ref_log_prob": "float32[B, R]"},
    outputs={},
)
def update(actor, batch, p: ActorUpdate):
    """L = PPO-clip(ratio, A) − c_H · H(π) + β · KL(π ‖ π_ref), with ratio = exp(log π − log π_old)."""
    if p.use_kl_loss and "ref_log_prob" not in batch:
        raise ValueError("use_kl_loss needs ref_log_prob: add a logprob.ref node to the graph")

    def loss_fn(mb):
        log_prob, entropy = response_log_probs(actor.model, mb["input_ids"], mb["attention_mask"],
                                               mb["position_ids"], mb["responses"].shape[1], p.temperature,
                                               with_entropy=True)
        mask = mb["response_mask"]
        pg = policy_loss(mb["old_log_probs"], log_prob, mb["advantages"], mask, p.clip_ratio,
                         p.clip_ratio_low, p.clip_ratio_high, p.clip_ratio_c, p.loss_agg_mode)
        ent = entropy_loss(entropy, mask, p.loss_agg_mode)
        loss = pg.pg_loss - p.entropy_coeff * ent
        metrics = {"pg_loss": pg.pg_loss.detach(), "clipfrac": pg.pg_clipfrac, "approx_kl": pg.ppo_kl,
                   "entropy": ent.detach()}
        if p.clip_ratio_c is not None:
            metrics["clipfrac_lower"] = pg.pg_clipfrac_lower
        if p.use_kl_loss:
            kl = kl_loss(log_prob, mb["ref_log_prob"], mask, p.kl_loss_type, p.loss_agg_mode)
            loss = loss + p.kl_loss_coef * kl
            metrics["kl_loss"] = kl.detach()
        return loss, metrics

    m = actor.fit(batch, loss_fn, mini_batch_size=p.mini_batch_size, epochs=p.epochs,
                  micro_batch_size=p.micro_batch_size)
    return {}, {f"actor/{k}": v for k, v in m.items()}
