"""Models, tokenizers and optimizers: ``builtin:tiny`` or a local HF directory through one loader.

Example::

    >>> from operators.models import load_model, build_optimizer
    >>> policy, tok = load_model("builtin:tiny", seed=0)
    >>> opt, sched = build_optimizer(policy.parameters(), {"lr": 5e-4})
"""

from operators.models.loading import (
    BUILTIN_MODELS,
    ModelLoadError,
    load_model,
    load_tokenizer,
    resolve_dtype,
    save_model,
)
from operators.models.forward import (
    response_log_probs,
    response_log_probs_and_sum_pi_squared,
    response_values,
)
from operators.models.optim import OptimConfig, build_optimizer, clip_grad_norm, lr_multiplier
from operators.models.tiny import VOCAB, build_tiny_model, build_tiny_tokenizer, tiny_config
from operators.models.value import ValueModel

__all__ = [
    "BUILTIN_MODELS", "ModelLoadError", "load_model", "load_tokenizer", "resolve_dtype", "save_model",
    "response_log_probs", "response_log_probs_and_sum_pi_squared", "response_values",
    "OptimConfig", "build_optimizer", "clip_grad_norm", "lr_multiplier",
    "VOCAB", "build_tiny_model", "build_tiny_tokenizer", "tiny_config",
    "ValueModel",
]
