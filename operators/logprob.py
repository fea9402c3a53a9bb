"""Log-probabilities of the sampled responses: under the actor (old) and the reference."""

from __future__ import annotations

import torch
from pydantic import Field

from flowrl.graph import Params, operator
from operators.models import response_log_probs

SEQUENCE_IN = {"input_ids": "int64[B, T]", "attention_mask": "int64[B, T]", "position_ids": "int64[B, T]",
               "responses": "int64[B, R]"}


class LogProb(Params):
    temperature: float = Field(1.0, gt=0, description="the rollout's temperature, so log-probs match it")


def _log_probs(role, batch, p: LogProb) -> torch.Tensor:
    def forward(mb):
        return response_log_probs(role.model, mb["input_ids"], mb["attention_mask"], mb["position_ids"],
                                  mb["responses"].shape[1], p.temperature)[0]
    return role.forward(batch, forward)


@operator("logprob.old", role="actor", scope="row", node_name="old_logprob", cost=2.0, params=LogProb,
          inputs=SEQUENCE_IN, outputs={"old_log_probs": "float32[B, R]"})
def old(actor, batch, p: LogProb):
    """log π_old(response | prompt), per token: the PPO ratio's denominator."""
    return {"old_log_probs": _log_probs(actor, batch, p)}


@operator("logprob.ref", role="ref", role_kinds=("actor",), scope="row", node_name="ref_logprob", cost=2.0,
          params=LogProb, inputs=SEQUENCE_IN, outputs={"ref_log_prob": "float32[B, R]"})
def ref(reference, batch, p: LogProb):
    """log π_ref(response | prompt), per token: the KL anchor."""
    return {"ref_log_prob": _log_probs(reference, batch, p)}
