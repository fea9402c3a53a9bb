"""What the vLLM engine is started with: its options, and the process settings vLLM reads at start.

vLLM reads part of its configuration from the environment and changes the
process it starts in (its CPU worker replaces ``torch.set_num_threads``, seeds
the global generators, and its loggers print to the terminal). :func:`engine_process`
sets what vLLM reads for exactly the engine's start and puts the rest back, so
a trainer sharing the process (the local backend) keeps its threads and seeds.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import random
import sys
from pathlib import Path
from typing import Any, Iterator, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from flowrl.errors import ConfigError

#: ``VLLMOptions.dtype`` and flowrl's role dtypes, as vLLM names them
DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16"}


class VLLMInstallError(ConfigError, ImportError):
    """vLLM is missing, or installed where it cannot run (an ``ImportError`` too, for callers that probe)."""


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
    max_model_len: int | None = Field(None, ge=8, description="none: the model's max_position_embeddings, or "
                                                               "the tokens kv_cache_mib holds where fewer")
    max_num_seqs: int | None = Field(
        None, ge=1, description="requests decoded together; none: as many as the KV cache holds at full length, "
        "at least 256, so a rollout's B·n samples run in one wave")
    enable_prefix_caching: bool = Field(True, description="the n samples of a prompt share its prefill")
    weight_bucket_mb: float = Field(64.0, gt=0, description="most MiB of weights handed over in one call of a push")
    push_in_place: bool = Field(
        True, description="CPU, unquantized: a push copies into the parameters and re-packs the linear layers "
        "(the engine keeps an unpacked copy of the linear weights for it); false: vLLM's layer-wise reload, "
        "which rebuilds every layer on each push")
    check_every: int = Field(
        1, ge=1, description="the probe check (the engine's log-probs of a fixed sequence against the trainer's) "
        "runs on the first push and once check_every pushes have gone unprobed; the names loaded: every push")
    in_process: bool | None = Field(
        None, description="run vLLM's engine core in this process (no busy-waiting engine processes); none: on "
        "CPU yes, on a GPU vLLM's own choice (its engine core in a process of its own)")
    threads: int | None = Field(
        None, ge=1, description="CPU: the engine's OpenMP/torch threads when it runs in processes of its own; "
        "none: this process's torch thread count (in process, the engine uses this process's threads)")
    cpu_threads_bind: str = Field("nobind", description="CPU: VLLM_CPU_OMP_THREADS_BIND ('auto' pins cores)")

    @model_validator(mode="after")
    def _runnable_install(self) -> "VLLMOptions":
        """``flowrl validate`` refuses what the engine's start would (:func:`check_install_path`)."""
        spec = importlib.util.find_spec("vllm")  # found, not imported: validation stays fast
        if spec is not None and spec.origin:
            try:
                check_install_path(Path(spec.origin).parent, on_cpu=not torch.cuda.is_available())
            except VLLMInstallError as err:
                raise ValueError(str(err)) from None
        return self


def import_vllm() -> Any:
    """``vllm``, after refusing an install it cannot run from (see :func:`check_install_path`)."""
    try:
        import vllm
    except ImportError as err:
        raise VLLMInstallError(
            "the vLLM rollout engine needs vLLM, which is not installed in this environment. On CPU build "
            "its environment with `bash scripts/vllm_env.sh` and run flowrl from build/vllm-venv/bin/python; "
            "on a CUDA machine `pip install -e \".[vllm]\"`. Or use `rollout: {engine: hf}`."
        ) from err
    check_install_path(Path(vllm.__file__).parent, on_cpu=not torch.cuda.is_available())
    return vllm


def check_install_path(package_dir: Path, *, on_cpu: bool) -> None:
    """Refuse a CPU vLLM installed under a path with a space in it, saying why.

    vLLM's CPU build puts its bundled ``libgomp`` on ``LD_PRELOAD``, a list that
    ``ld.so`` splits at spaces, and inductor builds its kernels with an unquoted
    ``-I`` path: either kills the engine (``EngineDeadError``) after minutes of
    start-up. Refused here instead, before anything starts.

    Example::

        >>> check_install_path(Path("/opt/my venv/lib/vllm"), on_cpu=True)
        Traceback (most recent call last):
        operators.rollout.vllm_engine.options.VLLMInstallError: vLLM's CPU build is installed under '/opt/my venv/lib/vllm', ...
    """
    if on_cpu and " " in str(package_dir):
        raise VLLMInstallError(
            f"vLLM's CPU build is installed under {str(package_dir)!r}, a path with a space in it: vLLM preloads "
            "its libgomp through LD_PRELOAD, which the dynamic loader splits at spaces, and its kernel compiler "
            "does not quote include paths, so the engine would die at start. Put the repository (and "
            "build/vllm-venv) under a path without spaces, or use `rollout: {engine: hf}`")


def max_num_seqs(options: VLLMOptions, config: dict[str, Any], dtype: str, kv_mib: int | None,
                 max_model_len: int) -> int:
    """``options.max_num_seqs``, else as many full-length sequences as a KV cache of ``kv_mib`` holds
    (at least 256, vLLM's default; at most 1024), so a rollout's B·n samples run in one wave.

    Example::

        >>> llama = {"num_attention_heads": 4, "hidden_size": 128, "num_hidden_layers": 2}
        >>> max_num_seqs(VLLMOptions(), llama, "float32", kv_mib=256, max_model_len=256)
        512
    """
    if options.max_num_seqs is not None:
        return options.max_num_seqs
    if kv_mib is None:
        return 256  # a GPU's cache is sized by vLLM after start: its own default
    return min(1024, max(256, kv_mib * 2**20 // kv_bytes_per_token(config, dtype) // max_model_len))


def max_model_len(options: VLLMOptions, config: dict[str, Any], dtype: str, kv_mib: int | None) -> int | None:
    """The ``max_model_len`` vLLM is given: the option; else none (vLLM takes the model's
    ``max_position_embeddings``), unless a KV cache of ``kv_mib`` cannot hold one sequence that long,
    which vLLM refuses: then the tokens 7/8 of it holds (vLLM keeps a few blocks for itself).

        >>> llama = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
        ...          "hidden_size": 576, "max_position_embeddings": 8192}       # SmolLM2-135M
        >>> [max_model_len(VLLMOptions(), llama, "float32", kv_mib) for kv_mib in (256, 1024)]
        [5088, None]
    """
    if options.max_model_len is not None or kv_mib is None:
        return options.max_model_len
    held = kv_mib * 2**20 * 7 // 8 // kv_bytes_per_token(config, dtype) // 16 * 16
    return held if held < int(config.get("max_position_embeddings") or 2048) else None


def kv_bytes_per_token(config: dict[str, Any], dtype: str) -> int:
    """What one token's keys and values take in the KV cache of a decoder described by ``config``."""
    heads = int(config.get("num_attention_heads") or 1)
    head_dim = int(config.get("head_dim") or int(config.get("hidden_size") or heads) // heads)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    layers = int(config.get("num_hidden_layers") or 1)
    return 2 * layers * kv_heads * head_dim * (4 if dtype == "float32" else 2)


@contextlib.contextmanager
def engine_process(options: VLLMOptions, *, in_process: bool) -> Iterator[None]:
    """The process as vLLM should find it while the engine starts, and as it was after.

    Set: vLLM's multiprocessing switch (in process or not), its CPU thread binding,
    the OpenMP thread count its engine processes inherit, and its loggers kept
    off the terminal (:func:`route_vllm_logs`). Put back: this process's
    environment, ``torch.set_num_threads`` (vLLM's CPU worker replaces it with a
    function that refuses) and thread count, and the global random generators
    (the worker seeds them).
    """
    threads = options.threads or torch.get_num_threads()
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0" if in_process else "1",
           "VLLM_CPU_OMP_THREADS_BIND": options.cpu_threads_bind, "OMP_NUM_THREADS": str(threads),
           "VLLM_CONFIGURE_LOGGING": "0"}
    saved_env = {key: os.environ.get(key) for key in env}
    saved_threads = torch.get_num_threads(), torch.set_num_threads
    saved_rng = torch.get_rng_state(), random.getstate()
    numpy = sys.modules.get("numpy")
    saved_np = numpy.random.get_state() if numpy is not None else None
    os.environ.update(env)
    route_vllm_logs()
    try:
        yield
    finally:
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        torch.set_num_threads = saved_threads[1]
        torch.set_num_threads(saved_threads[0])
        torch.set_rng_state(saved_rng[0])
        random.setstate(saved_rng[1])
        if saved_np is not None:
            numpy.random.set_state(saved_np)


#: vLLM's warnings that a push or a start raises every time and that say nothing to a flowrl user
_NOISE = ("Failed to load weights",  # layer-wise reload: a rotary embedding has no weights to reload
          "Passing raw prompts to InputProcessor is deprecated",
          "Using None for EOS token id because tokenizer is not initialized",
          "Successfully reset prefix cache")  # after every push


class _DropNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not any(text in record.getMessage() for text in _NOISE)


def route_vllm_logs() -> None:
    """vLLM's log records kept off the terminal: to the run's log (``$FLOWRL_RUN_LOG``, set by the
    trainer) where there is one, else to stderr when it is not a terminal (a worker process's stderr
    is the run's ``run.log``); a terminal gets ERROR and above only. :data:`_NOISE` is dropped.

    vLLM's own handler goes; its engine processes, started with
    ``VLLM_CONFIGURE_LOGGING=0`` (:func:`engine_process`), add none. This one is added once.
    """
    logger = logging.getLogger("vllm")
    if any(isinstance(h, _VLLMHandler) for h in logger.handlers):
        return
    logger.handlers.clear()  # vLLM's own, to stdout, where it was imported before VLLM_CONFIGURE_LOGGING=0
    handler = _VLLMHandler()
    handler.addFilter(_DropNoise())
    handler.setFormatter(logging.Formatter("vllm %(levelname)s %(name)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


#: where the local backend says the run's log is (``flowrl.store.runlog.RUN_LOG_ENV``), for the records of
#: libraries that run in its process
RUN_LOG_ENV = "FLOWRL_RUN_LOG"


class _VLLMHandler(logging.Handler):
    """Each record to the run's log, or to stderr (read at each record: a worker redirects it)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.format(record) + "\n"
            path = os.environ.get(RUN_LOG_ENV)
            if path:
                with open(path, "a", encoding="utf-8") as log:
                    log.write(text)
            elif record.levelno >= logging.ERROR or not _is_terminal(sys.stderr):
                sys.stderr.write(text)
        except Exception:  # noqa: BLE001 - logging must not fail the engine
            self.handleError(record)


def _is_terminal(stream: Any) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
