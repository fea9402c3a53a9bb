"""The sglang rollout engine (GPU): ``sglang.Engine`` behind the :class:`RolloutEngine` interface.

Written against sglang's offline ``Engine`` API: ``sglang.Engine(model_path=...)``,
``generate`` / ``async_generate`` with ``input_ids`` and ``return_logprob=True``
(token ids and log-probs read from ``meta_info["output_token_logprobs"]``,
``(logprob, token_id, text)`` triples), ``update_weights_from_tensor``,
``release_memory_occupation`` / ``resume_memory_occupation`` (the engine is
started with ``enable_memory_saver=True``) and ``shutdown``.

It needs a CUDA GPU and ``pip install flowrl[sglang]`` (in its own environment:
sglang pins its own torch). It has NOT been run in flowrl's CPU-only test
environment; nothing here is faked — without sglang, constructing the engine
raises an ImportError that says so. The log-probs are sglang's (of the
temperature-scaled distribution); check them against the actor's recomputation
(``rollout_log_probs`` vs ``old_log_probs``) on first use.

Example (on a GPU machine)::

    >>> engine = SGLangRolloutEngine("/models/Qwen2.5-0.5B-Instruct", pad_token_id=151643,
    ...                              stop_token_ids=[151645], seed=0)          # doctest: +SKIP
    >>> out = engine.generate(batch["input_ids"], batch["attention_mask"], n=8,
    ...                       max_new_tokens=512)                              # doctest: +SKIP
    >>> engine.release_memory(); train(); engine.resume_memory()             # doctest: +SKIP
    >>> engine.update_weights(policy.state_dict(), version=1)                # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch
from pydantic import BaseModel, ConfigDict

from flowrl.data.expand import expand_rows
from operators.rollout.base import RolloutEngine, SamplingParams, pad_responses, rollout_output, sample_seeds
from operators.rollout.engines import EngineSource, register_rollout_engine


def _import_sglang() -> Any:
    try:
        import sglang
    except ImportError as err:
        raise ImportError(
            "SGLangRolloutEngine needs sglang, which is not installed here. It runs on a CUDA GPU: "
            "install it with `pip install flowrl[sglang]` in a GPU environment, or use the "
            "transformers engine (operators.rollout.HFRolloutEngine) on CPU."
        ) from err
    return sglang


class SGLangRolloutEngine(RolloutEngine):
    """Rollouts from an ``sglang.Engine`` on the GPU(s) of this process.

    ``engine_kwargs`` go to ``sglang.Engine`` (``tp_size``, ``mem_fraction_static``,
    ``dtype``...). Token ids go in and come out: sglang's tokenizer is skipped.
    The agent loop calls it per request (``generate_one`` → ``async_generate``):
    sglang's scheduler batches the concurrent requests itself.
    """

    #: the agent loop sends it single requests rather than batching them in front of it
    serves_requests = True

    def __init__(
        self,
        model_path: str,
        *,
        pad_token_id: int,
        stop_token_ids: Iterable[int],
        seed: int = 0,
        **engine_kwargs: Any,
    ):
        sglang = _import_sglang()
        self.pad_token_id = int(pad_token_id)
        self.stop_token_ids = sorted({int(i) for i in stop_token_ids})
        if not self.stop_token_ids:
            raise ValueError("SGLangRolloutEngine needs at least one stop token id")
        self.engine = sglang.Engine(
            model_path=model_path,
            random_seed=seed,
            skip_tokenizer_init=True,
            enable_memory_saver=True,
            **engine_kwargs,
        )

    def _sampling_params(self, params: SamplingParams) -> dict[str, Any]:
        sampling = {
            "max_new_tokens": params.max_new_tokens,
            "temperature": 0.0 if params.is_greedy else params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k if params.top_k > 0 else -1,
            "stop_token_ids": self.stop_token_ids,
            "no_stop_trim": True,  # keep the stop token: it is part of the response and its mask
            "skip_special_tokens": False,
        }
        if params.seed is not None:
            sampling["sampling_seed"] = params.seed
        return sampling

    @staticmethod
    def _tokens_and_log_probs(output: Mapping[str, Any]) -> tuple[list[int], list[float]]:
        triples = output["meta_info"]["output_token_logprobs"]
        return [int(t[1]) for t in triples], [float(t[0]) for t in triples]

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 params: SamplingParams | None = None, *, seeds: torch.Tensor | None = None,
                 **overrides: Any) -> dict[str, torch.Tensor]:
        params = self.resolve(params, overrides)
        attention_mask = attention_mask.long()
        prompts = expand_rows(input_ids, params.n).cpu()
        prompt_mask = expand_rows(attention_mask, params.n).cpu()
        requests = [row[mask.bool()].tolist() for row, mask in zip(prompts, prompt_mask)]
        sampling: dict[str, Any] | list[dict[str, Any]] = self._sampling_params(params)
        if seeds is not None:  # one seed per request; sglang honours it with enable_deterministic_inference
            sampling = [{**sampling, "sampling_seed": int(s)} for s in sample_seeds(torch.as_tensor(seeds), params.n)]
        outputs = self.engine.generate(input_ids=requests, sampling_params=sampling, return_logprob=True)
        tokens, log_probs = zip(*(self._tokens_and_log_probs(o) for o in outputs))
        responses, response_mask, rollout_log_probs = pad_responses(
            tokens, log_probs, params.max_new_tokens, self.pad_token_id)
        return rollout_output(prompts, prompt_mask, responses, response_mask, rollout_log_probs)

    async def generate_one(self, prompt_ids: list[int], params: SamplingParams | None = None,
                           **overrides: Any) -> dict[str, Any]:
        params = self.resolve(params, {**overrides, "n": 1})
        output = await self.engine.async_generate(input_ids=list(prompt_ids),
                                                  sampling_params=self._sampling_params(params),
                                                  return_logprob=True)
        tokens, log_probs = self._tokens_and_log_probs(output)
        finish = output["meta_info"].get("finish_reason") or {}
        return {
            "response_ids": tokens,
            "log_probs": log_probs,
            "finish_reason": "stop" if finish.get("type") == "stop" else "length",
        }

    def update_weights(self, state_dict: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], *,
                       version: int) -> dict[str, float]:
        """Load the trainer's weights, version ``version``, into the running engine (sglang flushes its cache)."""
        named = list(state_dict.items() if isinstance(state_dict, Mapping) else state_dict)
        self.engine.update_weights_from_tensor(named_tensors=named, flush_cache=True)
        return {}

    def release_memory(self) -> None:
        self.engine.release_memory_occupation()

    def resume_memory(self) -> None:
        self.engine.resume_memory_occupation()

    def shutdown(self) -> None:
        """Stop sglang's scheduler and detokenizer processes."""
        self.engine.shutdown()


class SGLangOptions(BaseModel):
    """Options of the ``sglang`` engine: keyword arguments of ``sglang.Engine``, which checks them."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


@register_rollout_engine("sglang", SGLangOptions)
def _build_sglang(source: EngineSource, options: SGLangOptions) -> SGLangRolloutEngine:
    return SGLangRolloutEngine(source.model_path, pad_token_id=source.tokenizer.pad_token_id,
                               stop_token_ids=[source.tokenizer.eos_token_id], seed=source.seed,
                               **options.model_dump())
