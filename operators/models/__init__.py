"""Models, tokenizers and optimizers: ``builtin:tiny``, a local HF directory or a GGUF file through one loader.

Example::

    >>> from operators.models import load_model, build_optimizer
    >>> policy, tok = load_model("builtin:tiny", seed=0)
    >>> opt, sched = build_optimizer(policy.parameters(), {"lr": 5e-4})
"""

from flowrl.data.lazy import lazy_exports

#: where each public name lives: imported on first use (the CLI loads operators without torch's weight)
_HOME = {
    "BUILTIN_MODELS": "operators.models.loading",
    "ModelLoadError": "operators.models.errors",
    "GGUF_BUILTINS": "operators.models.gguf",
    "gguf_model_dir": "operators.models.gguf",
    "is_gguf_spec": "operators.models.gguf",
    "check_model_spec": "operators.models.loading",
    "load_model": "operators.models.loading",
    "load_tokenizer": "operators.models.loading",
    "resolve_dtype": "operators.models.loading",
    "save_model": "operators.models.loading",
    "response_log_probs": "operators.models.forward",
    "response_values": "operators.models.forward",
    "OptimConfig": "operators.models.optim",
    "build_optimizer": "operators.models.optim",
    "clip_grad_norm": "operators.models.optim",
    "lr_multiplier": "operators.models.optim",
    "VOCAB": "operators.models.tiny",
    "build_tiny_model": "operators.models.tiny",
    "build_tiny_tokenizer": "operators.models.tiny",
    "tiny_config": "operators.models.tiny",
    "ValueModel": "operators.models.value",
    "response_log_probs_and_sum_pi_squared": "operators.models.forward",
}
__getattr__, __dir__ = lazy_exports(__name__, _HOME)

__all__ = list(_HOME)  # every lazily exported name is public
