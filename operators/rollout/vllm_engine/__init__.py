"""The vLLM rollout engine (CPU or GPU): ``engine`` (:class:`VLLMRolloutEngine`, registered as ``vllm``),
``driver`` (the thread that steps vLLM's synchronous engine), ``weights`` (the push and the probe),
``options`` (what it starts with, and the process settings vLLM reads). vLLM is imported only when an
engine is built."""

from operators.rollout.vllm_engine.engine import VLLMRolloutEngine, WeightSyncError
from operators.rollout.vllm_engine.options import VLLMInstallError, VLLMOptions, check_install_path
from operators.rollout.vllm_engine.weights import (WeightSyncExtension, model_cache_dir, model_fingerprint,
                                                   probe_forward, probe_tokens, save_for_vllm, weight_buckets)

__all__ = ["VLLMRolloutEngine", "WeightSyncError", "VLLMInstallError", "VLLMOptions", "check_install_path",
           "WeightSyncExtension", "model_cache_dir", "model_fingerprint", "probe_forward", "probe_tokens",
           "save_for_vllm", "weight_buckets"]
