"""Log-probabilities of the sampled responses: under the actor (old) and the reference.

``logprob.old_sum_pi_squared`` is ``logprob.old`` that also writes
``sum_pi_squared`` (``Σ_v π(v)²`` per response token, verl's
``actor.calculate_sum_pi_squared=True``), which the optimal-token-baseline
estimators read. It is a separate operator because an operator's outputs are
fixed by its declaration, and most graphs do not want the extra column.
"""

from __future__ import annotations

import torch
from pydantic import Field

from flowrl.graph import Params, operator
from operators.models import response_log_probs, response_log_probs_and_sum_pi_squared
from operators.models.vision import VISION_FIELDS, vision_inputs

SEQUENCE_IN = {"input_ids": "int64[B, T]", "attention_mask": "int64[B, T]", "position_ids": "int64[B, T]",
               "responses": "int64[B, R]"}
# a vision-language model's forward also reads the rows' images, when the graph's source has them
SEQUENCE_IMAGES_IN = {**SEQUENCE_IN, **VISION_FIELDS}


class LogProb(Params):
    temperature: float = Field(1.0, gt=0, description="the rollout's temperature, so log-probs match it")


def _log_probs(role, batch, p: LogProb) -> torch.Tensor:
    def forward(mb):
        return response_log_probs(role.model, mb["input_ids"], mb["attention_mask"], mb["position_ids"],
                                  mb["responses"].shape[1], p.temperature, vision=vision_inputs(mb))[0]
    return role.forward(batch, forward)


@operator("logprob.old", role="actor", scope="row", node_name="old_logprob", cost=2.0, params=LogProb,
          inputs=SEQUENCE_IMAGES_IN, outputs={"old_log_probs": "float32[B, R]"}, balance_by="attention_mask",
          optional_inputs=tuple(VISION_FIELDS))
def old(actor, batch, p: LogProb):
    """log π_old(response | prompt), per token: the PPO ratio's denominator."""
    return {"old_log_probs": _log_probs(actor, batch, p)}


@operator("logprob.old_sum_pi_squared", role="actor", scope="row", node_name="old_logprob", cost=2.0, params=LogProb,
          inputs=SEQUENCE_IMAGES_IN, outputs={"old_log_probs": "float32[B, R]", "sum_pi_squared": "float32[B, R]"},
          balance_by="attention_mask", optional_inputs=tuple(VISION_FIELDS))
def old_sum_pi_squared(actor, batch, p: LogProb):
    """log π_old(response | prompt) and Σ_v π_old(v)², per token (for advantage.optimal_token_baseline)."""
    with torch.no_grad():
        log_probs, sum_pi_squared = response_log_probs_and_sum_pi_squared(
            actor.model, batch["input_ids"], batch["attention_mask"], batch["position_ids"],
            batch["responses"].shape[1], p.temperature, vision=vision_inputs(batch))
    return {"old_log_probs": log_probs, "sum_pi_squared": sum_pi_squared}


@operator("logprob.ref", role="ref", role_kinds=("actor",), scope="row", node_name="ref_logprob", cost=2.0,
          params=LogProb, inputs=SEQUENCE_IMAGES_IN, outputs={"ref_log_prob": "float32[B, R]"},
          balance_by="attention_mask",
          optional_inputs=tuple(VISION_FIELDS))
def ref(reference, batch, p: LogProb):
    """log π_ref(response | prompt), per token: the KL anchor."""
    return {"ref_log_prob": _log_probs(reference, batch, p)}
