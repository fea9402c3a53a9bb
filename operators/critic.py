"""The critic: values of each response token's state, and the clipped value update."""

from __future__ import annotations

from pydantic import Field

from flowrl.graph import Params, operator
from flowrl.data.metrics import mean, total
from operators.actor import AGG, agg_kwargs
from operators.algos import value_loss
from operators.logprob import SEQUENCE_IN
from operators.models import response_values


@operator("critic.values", role="critic", scope="row", node_name="values", cost=2.0,
          inputs=SEQUENCE_IN, outputs={"values": "float32[B, R]"}, balance_by="attention_mask")
def values(critic, batch, p):
    """V(s_t) for every response position t."""
    v = critic.forward(batch, lambda mb: response_values(critic.model, mb["input_ids"], mb["attention_mask"],
                                                         mb["position_ids"], mb["responses"].shape[1]))
    return {"values": v.float()}


class CriticUpdate(Params):
    cliprange_value: float = Field(0.5, gt=0, description="clip new values to old ± this")
    loss_agg_mode: str = Field("token-mean", pattern=AGG)
    mini_batch_size: int | None = Field(None, ge=1, description="rows per optimizer step (default: all)")
    epochs: int = Field(1, ge=1)
    micro_batch_size: int | None = Field(None, ge=1, description="rows per forward pass (grad accumulation)")


@operator("critic.update", role="critic", scope="batch", dispatch="all", updates_role=True,
          node_name="update_critic", cost=4.0, params=CriticUpdate, balance_by="attention_mask",
          inputs={**SEQUENCE_IN, "response_mask": "int64[B, R]", "values": "float32[B, R]",
                  "returns": "float32[B, R]"}, outputs={}, token_mask="response_mask",
                  headline=("critic/vf_loss",))
def update(critic, batch, p: CriticUpdate):
    """L_V = ½ · max((V − R)², (clip(V, V_old ± ε) − R)²), aggregated over tokens."""

    def loss_fn(mb, norm=None):
        vpreds = response_values(critic.model, mb["input_ids"], mb["attention_mask"], mb["position_ids"],
                                 mb["responses"].shape[1])
        loss, clipfrac = value_loss(vpreds, mb["returns"], mb["values"], mb["response_mask"],
                                    p.cliprange_value, p.loss_agg_mode, **agg_kwargs(norm))
        # the loss is a share of the mini-batch's (a sum); the clip fraction a mean over its tokens
        return loss, {"vf_loss": total(loss.detach()), "vf_clipfrac": mean(clipfrac, mb["response_mask"].sum())}

    m = critic.fit(batch, loss_fn, mini_batch_size=p.mini_batch_size, epochs=p.epochs,
                   micro_batch_size=p.micro_batch_size)
    return {}, {f"critic/{k}": v for k, v in m.items()}
