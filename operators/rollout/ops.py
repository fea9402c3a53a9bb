"""``rollout.generate``: n samples per prompt from the actor's rollout engine."""

from __future__ import annotations

import torch
from pydantic import Field

from flowrl.data.metrics import maximum
from flowrl.graph import Params, operator
from operators.models.vision import VISION_FIELDS, vision_inputs
from operators.rollout.base import SamplingParams


class Generate(Params):
    n: int = Field(1, ge=1, description="samples per prompt (a GRPO group)")
    # a million tokens is past any model's context; the engine allocates rows × max_new_tokens up front
    max_new_tokens: int = Field(16, ge=1, le=2**20, description="response length limit")
    temperature: float = Field(1.0, ge=0, description="0 or greedy=true: argmax")
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1, description="keep the k most likely tokens; 0 or -1: no top-k filtering")
    greedy: bool = Field(False, description="argmax decoding (validation, ReMax baselines)")


SEQUENCE_FIELDS = {
    "input_ids": "int64[B, T]",
    "attention_mask": "int64[B, T]",
    "position_ids": "int64[B, T]",
    "responses": "int64[B, R]",
    "response_mask": "int64[B, R]",
}


@operator(
    "rollout.generate", role="actor", scope="row", expands="n", cost=3.0, node_name="generate",
    inputs={"prompts": "int64[B, P]", "prompt_mask": "int64[B, P]", "uid": "object[B]", **VISION_FIELDS},
    outputs={**SEQUENCE_FIELDS, "rollout_log_probs": "float32[B, R]", "weight_version": "int64[B]"},
    params=Generate, aux_outputs=("rollout_log_probs", "weight_version"), optional_inputs=("uid", *VISION_FIELDS),
    val_params={"greedy": True}, dumped=("prompts", "responses", "weight_version"),
)
def generate(actor, batch, p: Generate):
    """Sample ``n`` responses per prompt; ``weight_version`` records the policy that made each one.

    A prompt's samples are keyed by its ``uid`` and the run's seed, so they do
    not depend on how the batch is split over the pool's workers.
    """
    sampling = SamplingParams(n=p.n, max_new_tokens=p.max_new_tokens, temperature=p.temperature,
                              top_p=p.top_p, top_k=p.top_k, greedy=p.greedy)
    images = {} if (vision := vision_inputs(batch)) is None else {"vision": vision}
    if images and not getattr(actor.engine, "takes_images", False):
        raise ValueError(f"the prompts have images, but the {type(actor.engine).__name__} rollout engine does not "
                         f"take them; use rollout engine 'hf'")
    out = actor.engine.generate(batch["prompts"], batch["prompt_mask"], sampling, seeds=actor.sampling_seeds(batch),
                                **images)
    lengths = out["response_mask"].sum(-1).float()
    version = torch.full((len(lengths),), actor.version, dtype=torch.int64)
    metrics = {"response_length/mean": lengths.mean(), "response_length/max": maximum(lengths.max()),
               **unshard_metrics(actor)}
    return (
        {**{k: out[k] for k in SEQUENCE_FIELDS}, "rollout_log_probs": out["rollout_log_probs"],
         "weight_version": version},
        metrics,
    )


def unshard_metrics(actor) -> dict[str, float]:
    """The memory a sharded actor's rollout took by gathering its weights, and freed after (MiB)."""
    memory = getattr(actor.engine, "memory", None)
    if memory is None:
        return {}
    return {"rollout/unshard_taken_mb": memory.taken_bytes / 2**20,
            "rollout/unshard_freed_mb": memory.freed_bytes / 2**20}
