"""The rollout-engine interface every backend implements, and its sampling parameters.

An engine turns left-padded prompts into responses. ``generate`` returns a dict
of tensors (``n`` samples per prompt, each prompt's samples adjacent):

=====================  ==================  ==========================================
``prompts``            ``int64[N, P]``      the prompt of each sample (left-padded)
``responses``          ``int64[N, R]``      sampled tokens, ``pad`` after the stop token
``response_mask``      ``int64[N, R]``      1 up to and including the stop token
``input_ids``          ``int64[N, P + R]``  ``prompts ‖ responses``
``attention_mask``     ``int64[N, P + R]``  prompt mask ‖ response mask
``position_ids``       ``int64[N, P + R]``  ``clip(cumsum(attention_mask) - 1, 0)``
``rollout_log_probs``  ``float32[N, R]``    log-prob of each sampled token, 0 where masked
=====================  ==================  ==========================================

with ``N = B·n`` and ``R`` at most ``max_new_tokens``: an engine may return
responses only as wide as the longest one it made (the HF engine does), so
two calls can return different widths; :func:`flowrl.data.padding.concat_padded`
joins them. ``rollout_log_probs`` is
``log softmax(logits / T)`` at the sampled token (``T = 1`` when greedy), taken
before top-k/top-p truncation: the quantity the actor recomputes as its old
log-prob, so the two agree up to numerics.
"""

from __future__ import annotations

import abc
import hashlib
from typing import Any, Iterable, Mapping, Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field

from operators.data.dataset import position_ids_from_mask


class SamplingParams(BaseModel):
    """How to sample. ``greedy`` (or ``temperature == 0``) picks the argmax; validation uses it.

    Example::

        >>> SamplingParams(n=8, max_new_tokens=8).temperature
        1.0
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    n: int = Field(1, ge=1)
    max_new_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0)
    #: nucleus sampling: keep the smallest set of tokens with probability ≥ top_p
    top_p: float = Field(1.0, gt=0, le=1)
    #: keep the top_k most likely tokens; 0 or -1 disables
    top_k: int = Field(-1, ge=-1)
    greedy: bool = False
    #: a fresh generator seeded with this for this call; ``None`` uses the engine's own
    seed: int | None = None

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0


class RolloutEngine(abc.ABC):
    """The contract of a rollout engine, as an actor calls it: generation (batched and per
    request), new weights in place with the version they carry, a check that it computes what
    the trainer's model computes, its memory given back and taken again, its sampling stream
    for a checkpoint, and its own processes stopped.

    **The weight version is given, never counted.** The worker owns the count
    (:class:`flowrl.graph.Role`); :meth:`update_weights` is told the version of the
    weights it loads, and an engine keeps nothing of its own that a resume or a restarted
    worker would have to re-derive. What an engine does not have it need not write:
    an engine that generates with the actor's own module checks nothing, one without
    processes stops nothing, one without a generator of its own has no stream to save.
    """

    #: the agent loop sends it single requests (it batches them itself) rather than batches
    serves_requests: bool = False
    #: a vision-language model's engine reads the prompts' images (``generate(..., vision=)``)
    takes_images: bool = False
    #: what a sharded actor's gather for the last rollout took and freed (``fsdp.MemoryChange``), if any
    memory: Any = None

    @abc.abstractmethod
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 params: SamplingParams | None = None, *, seeds: torch.Tensor | None = None,
                 **overrides: Any) -> dict[str, torch.Tensor]:
        """A batch of left-padded prompts → the dict in the module docstring.

        ``seeds`` (``int64[B]``, :func:`prompt_seeds`) key each prompt's samples
        (:func:`sample_seeds`): the same prompt, seed and weights give the same
        samples whatever else is in the batch. ``overrides`` are
        :class:`SamplingParams` fields applied over ``params``.
        """

    @abc.abstractmethod
    async def generate_one(self, prompt_ids: list[int], params: SamplingParams | None = None,
                           **overrides: Any) -> dict[str, Any]:
        """One request (``n`` is ignored): ``{"response_ids", "log_probs", "finish_reason"}``.

        ``finish_reason`` is ``"stop"`` (a stop token ended it, and is its last
        id) or ``"length"`` (``max_new_tokens`` reached).
        """

    @abc.abstractmethod
    def update_weights(self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], *,
                       version: int) -> dict[str, float]:
        """Load the policy's weights (a state dict, or ``(name, tensor)`` pairs taken one at a time;
        parameter names as in the HF model's ``state_dict``), which are weight version ``version``
        (the worker's count). Returns the push's metrics."""

    def check_weights(self, model: torch.nn.Module) -> dict[str, float]:
        """Raise unless the engine computes what ``model`` (the trainer's) computes; the check's
        metrics. An engine that generates with the trainer's own module has nothing to check."""
        return {}

    @abc.abstractmethod
    def release_memory(self) -> None:
        """Free the engine's accelerator memory (weights, KV cache) until :meth:`resume_memory`."""

    @abc.abstractmethod
    def resume_memory(self) -> None:
        """Take the memory back; the weights are those of the last :meth:`update_weights`."""

    def memory_metrics(self) -> dict[str, float]:
        """What the engine's memory is after a push (its processes' resident memory, ...); none here."""
        return {}

    def rng_state(self) -> torch.Tensor | None:
        """The state of the generator that hands out prompt seeds, for a checkpoint (None: it has none)."""
        return None

    def set_rng_state(self, state: torch.Tensor) -> None:
        """Take back :meth:`rng_state`'s output."""

    def shutdown(self) -> None:
        """Stop the engine's own processes, if it started any."""

    @staticmethod
    def resolve(params: SamplingParams | None, overrides: Mapping[str, Any]) -> SamplingParams:
        params = params or SamplingParams()
        return SamplingParams(**{**params.model_dump(), **overrides}) if overrides else params


def rollout_output(prompts: torch.Tensor, prompt_mask: torch.Tensor, responses: torch.Tensor,
                   response_mask: torch.Tensor, rollout_log_probs: torch.Tensor) -> dict[str, torch.Tensor]:
    """Assemble the dict in the module docstring from its parts (prompts already repeated ``n`` times)."""
    attention_mask = torch.cat([prompt_mask.long(), response_mask.long()], dim=-1)
    return {
        "prompts": prompts,
        "responses": responses,
        "response_mask": response_mask.long(),
        "input_ids": torch.cat([prompts, responses], dim=-1),
        "attention_mask": attention_mask,
        "position_ids": position_ids_from_mask(attention_mask),
        "rollout_log_probs": rollout_log_probs.float(),
    }


def pad_responses(token_lists: Sequence[Sequence[int]], log_prob_lists: Sequence[Sequence[float]],
                  length: int, pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad per-request token and log-prob lists to ``length``: ``(responses, response_mask, log_probs)``.

    Example::

        >>> pad_responses([[5, 2]], [[-0.5, -0.1]], length=3, pad_token_id=0)[0]
        tensor([[5, 2, 0]])
    """
    responses = torch.full((len(token_lists), length), pad_token_id, dtype=torch.long)
    response_mask = torch.zeros((len(token_lists), length), dtype=torch.long)
    log_probs = torch.zeros((len(token_lists), length), dtype=torch.float32)
    for i, (tokens, lps) in enumerate(zip(token_lists, log_prob_lists)):
        tokens, lps = list(tokens)[:length], list(lps)[:length]
        responses[i, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        response_mask[i, :len(tokens)] = 1
        log_probs[i, :len(lps)] = torch.tensor(lps, dtype=torch.float32)
    return responses, response_mask, log_probs


# --- sampling streams ----------------------------------------------------------------------------
# Each sample draws its randomness from a stream keyed by its prompt's seed and its index among the
# prompt's n samples, never from a generator shared by the batch. A prompt then gets the same samples
# whichever rank, batch or neighbours it lands with: a pool of 2 workers samples what 1 worker does.
# The mixing is murmur3's 32-bit finaliser on int64 tensors, multiplying in 16-bit halves so no
# product leaves int64 (signed overflow is not something to lean on across devices).

_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x · c mod 2**32`` for ``x`` in ``[0, 2**32)``: every partial product stays below ``2**49``."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """murmur3's finaliser: a bijection on ``[0, 2**32)`` whose every output bit depends on every input bit."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def prompt_seeds(uids: Sequence[Any], seed: int) -> torch.Tensor:
    """``int64[B]``: a sampling seed per prompt from its uid and the run's seed (BLAKE2b, 63 bits).

    Example::

        >>> a, b = prompt_seeds(["0-0", "0-1"], seed=0), prompt_seeds(["0-1"], seed=0)
        >>> bool(a[1] == b[0]), bool(a[0] != a[1])
        (True, True)
    """
    return torch.tensor([derive_seed(seed, uid) for uid in uids], dtype=torch.int64)


def call_seeds(count: int, params: SamplingParams, seeds: torch.Tensor | None,
               generator: torch.Generator) -> torch.Tensor:
    """``int64[count]``: an engine call's prompt seeds: ``seeds`` as given, else drawn from
    ``params.seed`` (a fresh generator) or the engine's own ``generator``."""
    if seeds is not None:
        seeds = torch.as_tensor(seeds, dtype=torch.int64).cpu().reshape(-1)
        if len(seeds) != count:
            raise ValueError(f"seeds has {len(seeds)} entries for {count} prompts: give one per prompt")
        return seeds
    generator = generator if params.seed is None else torch.Generator().manual_seed(params.seed)
    return torch.randint(0, 2**62, (count,), generator=generator)


def derive_seed(*parts: Any) -> int:
    """A 63-bit seed from the text of ``parts`` (BLAKE2b): the same parts, the same seed, in any process."""
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def sample_seeds(seeds: torch.Tensor, n: int) -> torch.Tensor:
    """``int64[B·n]``: the seed of each of the ``n`` samples of each prompt (a prompt's samples adjacent)."""
    seeds = seeds.long()
    lo, hi = (seeds & _M32).unsqueeze(-1), ((seeds >> 32) & _M32).unsqueeze(-1)
    j = torch.arange(1, n + 1, dtype=torch.int64, device=seeds.device)
    lo = mix32(lo ^ _mul32(j, 0x9E3779B9))
    hi = mix32(hi ^ lo)
    return (((hi & 0x7FFFFFFF) << 32) | lo).reshape(-1)


def stream_uniforms(seeds: torch.Tensor, t: int) -> torch.Tensor:
    """``float64[N]`` in ``(0, 1)``: draw ``t`` (the token position) of the streams ``seeds`` (53 bits each)."""
    lo, hi = seeds & _M32, (seeds >> 32) & _M32
    a = mix32(mix32(lo ^ _mul32(torch.full_like(lo, t + 1), 0x27D4EB2F)) ^ hi)
    b = mix32(a ^ 0x165667B1)
    bits = ((a >> 5) << 26) | (b >> 6)
    return (bits.double() + 0.5) / 2.0**53
