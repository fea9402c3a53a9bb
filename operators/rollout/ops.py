"""``rollout.generate``: n samples per prompt from the actor's rollout engine."""

from __future__ import annotations

import math
import os

import torch
from pydantic import Field

from flowrl.data.metrics import maximum
from flowrl.graph import Params, TokenMetrics, operator
from flowrl.graph.checks import ParameterError, graph_check
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


#: a generation's response lengths in tokens (a mean over its rows, and the longest)
RESPONSE_LENGTHS = TokenMetrics(mean="response_length/mean", max="response_length/max")


def length_metrics(response_mask: torch.Tensor) -> dict[str, float]:
    """The response lengths of a generation's rows, as :data:`RESPONSE_LENGTHS` names them."""
    lengths = response_mask.sum(-1).float()
    return {RESPONSE_LENGTHS.mean: lengths.mean(), RESPONSE_LENGTHS.max: maximum(lengths.max())}


@operator(
    "rollout.generate", role="actor", scope="row", expands="n", cost=3.0, node_name="generate",
    inputs={"prompts": "int64[B, P]", "prompt_mask": "int64[B, P]", "uid": "object[B]", **VISION_FIELDS},
    outputs={**SEQUENCE_FIELDS, "rollout_log_probs": "float32[B, R]", "weight_version": "int64[B]"},
    params=Generate, optional_inputs=("uid", *VISION_FIELDS),
    # a second generation (ReMax's greedy baseline) is read only for its responses: the full
    # sequences and log-probs it also writes are by-products, not a wiring mistake
    aux_outputs=("input_ids", "attention_mask", "position_ids", "rollout_log_probs", "weight_version"),
    val_params={"greedy": True}, dumped=("prompts", "responses", "weight_version"),
    token_mask="response_mask",
    headline=(RESPONSE_LENGTHS.mean,), tokens=RESPONSE_LENGTHS,
)
def generate(actor, batch, p: Generate):
    """Sample ``n`` responses per prompt; ``weight_version`` records the policy that made each one.

    A prompt's samples are keyed by its ``uid`` and the run's seed, so they do
    not depend on how the batch is split over the pool's workers.
    """
    sampling = SamplingParams(n=p.n, max_new_tokens=p.max_new_tokens, temperature=p.temperature,
                              top_p=p.top_p, top_k=p.top_k, greedy=p.greedy)
    images = {} if (vision := vision_inputs(batch)) is None else {"vision": vision}
    if images and not actor.engine.takes_images:
        raise ValueError(f"the prompts have images, but the {type(actor.engine).__name__} rollout engine does not "
                         f"take them; use rollout engine 'hf'")
    out = actor.engine.generate(batch["prompts"], batch["prompt_mask"], sampling, seeds=actor.sampling_seeds(batch),
                                **images)
    version = torch.full((len(out["response_mask"]),), actor.version, dtype=torch.int64)
    metrics = {**length_metrics(out["response_mask"]), **unshard_metrics(actor)}
    return (
        {**{k: out[k] for k in SEQUENCE_FIELDS}, "rollout_log_probs": out["rollout_log_probs"],
         "weight_version": version},
        metrics,
    )


#: bytes per response token an engine allocates for the whole batch before the first token:
#: token ids and the mask (int64) and the log-prob (float32)
RESPONSE_BYTES = 8 + 8 + 4


def machine_memory() -> int | None:
    """This machine's physical memory in bytes (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


@graph_check
def _rollout_fits_in_memory(graph):
    """Samples per prompt (``n``) × prompts × ``max_new_tokens`` past what a worker can allocate: the run's
    engine asks for its response buffers up front and fails on the allocation (or is killed for memory)."""
    memory = machine_memory()
    if memory is None:
        return
    for name, node in graph.nodes.items():
        if node.op is None or node.params is None or not node.op.expands:
            continue
        n = getattr(node.params, node.op.expands, None)
        max_new = getattr(node.params, "max_new_tokens", None)
        if not isinstance(n, int) or not isinstance(max_new, int):
            continue
        pool = graph.pool_of(name)
        workers = graph.config.pools[pool].workers if pool in graph.config.pools else 1
        rows = math.ceil(graph.config.data.batch_size * n / workers)
        need = rows * max_new * RESPONSE_BYTES
        if need > memory:
            yield ParameterError(
                f"{node.op.expands}={n:,} samples of each of {graph.config.data.batch_size} prompts is "
                f"{rows:,} responses per worker of up to {max_new:,} tokens: their buffers alone take "
                f"{need / 2**30:,.0f} GiB, more than this machine's {memory / 2**30:,.0f} GiB",
                node=name, field=node.op.expands, location=graph.locate("nodes", name, node.op.expands),
                fix=f"lower {node.op.expands}, max_new_tokens or data.batch_size, or add workers to pool {pool!r}")


def unshard_metrics(actor) -> dict[str, float]:
    """The memory a sharded actor's rollout took by gathering its weights, and freed after (MiB)."""
    memory = actor.engine.memory
    if memory is None:
        return {}
    return {"rollout/unshard_taken_mb": memory.taken_bytes / 2**20,
            "rollout/unshard_freed_mb": memory.freed_bytes / 2**20}
