"""One way in for every model: ``builtin:tiny``, a local Hugging Face directory, or a GGUF file.

``load_model(spec, head=...)`` returns ``(model, tokenizer)`` for the policy
(``head="causal_lm"``), the critic (``"value"``: :class:`ValueModel`) or a reward
model (``"reward"``: a sequence classifier with one label). Nothing is
downloaded: a spec that is neither a builtin, an existing directory nor a GGUF
file is an error that names the path. A GGUF file (``builtin:smollm2-135m``,
``pkg:<package>/<file>``, a ``.gguf`` path: :mod:`operators.models.gguf`) is
converted once into a cached Hugging Face directory, which every loader reads.

Example::

    >>> model, tok = load_model("builtin:tiny", seed=0)
    >>> sum(p.numel() for p in model.parameters())
    528640

A missing or invalid directory raises :class:`ModelLoadError` naming the path:
``load_model("/no/such/dir")`` → ``model '/no/such/dir': no such directory (...)``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Union

import torch
from tokenizers import Tokenizer

from operators.models.errors import ModelLoadError
from operators.models.gguf import GGUF_BUILTINS, check_gguf_spec, converted_dir, gguf_model_dir, is_gguf_spec
from operators.models.hf import hf
from operators.models.tiny import build_tiny_model, build_tiny_tokenizer, tiny_config, tiny_core_tokenizer
from operators.models.tiny_tools import (build_tiny_tools_model, build_tiny_tools_tokenizer, tiny_tools_config,
                                         tiny_tools_core_tokenizer)
from operators.models.tiny_vl import build_tiny_vl_model, build_tiny_vl_tokenizer, tiny_vl_core_tokenizer
from operators.models.value import ValueModel

# transformers is fetched (:func:`hf`) where a model or tokenizer is built: checking a spec
# (``flowrl validate``) reads a config.json and needs none of it
if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Head = Literal["causal_lm", "value", "reward"]
DType = Union[str, torch.dtype]

#: the builtin models built locally from code
LOCAL_BUILTINS = ("builtin:tiny", "builtin:tiny-tools", "builtin:tiny-vl")
#: every builtin model: those built locally and the pretrained ones that come as a package's GGUF file
BUILTIN_MODELS = (*LOCAL_BUILTINS, *GGUF_BUILTINS)

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}


def resolve_dtype(dtype: DType) -> torch.dtype:
    """``"bf16"``/``"bfloat16"``/``torch.bfloat16`` → ``torch.bfloat16`` (and fp32, fp16).

    Example::

        >>> resolve_dtype("bf16")
        torch.bfloat16
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)}") from None


def _check_dir(spec: str) -> Path:
    """The Hugging Face directory of ``spec``: a GGUF file's converted one (converted now if it never was)."""
    if is_gguf_spec(spec):
        return gguf_model_dir(spec)
    if spec.startswith("builtin:"):
        raise ModelLoadError(
            f"model {spec!r}: unknown builtin model; available: {', '.join(BUILTIN_MODELS)}"
        )
    path = Path(spec).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"model {spec!r}: no such directory ({path.resolve()}). Pass 'builtin:tiny', the "
            "path of a local Hugging Face model directory or of a .gguf file (nothing is downloaded)."
        )
    if not path.is_dir() or not (path / "config.json").is_file():
        raise ModelLoadError(
            f"model {spec!r}: {path.resolve()} is not a Hugging Face model directory "
            "(no config.json); save one with model.save_pretrained(path) and "
            "tokenizer.save_pretrained(path)."
        )
    return path


#: files any of which makes a directory's tokenizer loadable by transformers
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
                   "sentencepiece.bpe.model")
#: weight files (a sharded checkpoint names its shards in an index)
WEIGHT_GLOBS = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", "pytorch_model.bin.index.json")


def check_model_spec(spec: str) -> None:
    """Raise :class:`ModelLoadError` unless ``spec`` is a builtin model or a local Hugging Face
    directory with weights, a tokenizer and a ``config.json`` that transformers loads — cheap enough for
    ``flowrl validate`` (no weights read; transformers is imported only for a directory). A GGUF file is
    checked to exist with what reads it installed, not converted."""
    if spec.startswith("builtin:") or is_gguf_spec(spec):
        check_tokenizer_spec(spec)
        return
    path = _check_dir(spec)
    config = path / "config.json"
    try:
        loaded = json.loads(config.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ModelLoadError(f"model {spec!r}: {config} does not load ({err}); save the model again with "
                             f"model.save_pretrained(path)") from None
    if not isinstance(loaded, dict) or "model_type" not in loaded:
        raise ModelLoadError(f"model {spec!r}: {config} has no 'model_type'; it is not a transformers model config")
    try:  # transformers types every field: only its own loader tells a config it will refuse
        hf("AutoConfig").from_pretrained(str(path))
    except Exception as err:  # noqa: BLE001 - transformers and huggingface_hub raise many kinds here
        reason = " ".join(str(err).split())
        raise ModelLoadError(f"model {spec!r}: transformers cannot load {config}: {reason}; fix the file or save "
                             f"the model again with model.save_pretrained(path)") from None
    if not any(next(path.glob(pattern), None) for pattern in WEIGHT_GLOBS):
        raise ModelLoadError(f"model {spec!r}: {path.resolve()} has no weights (model.safetensors or "
                             f"pytorch_model.bin); save them with model.save_pretrained(path)")
    check_tokenizer_spec(spec)


def check_tokenizer_spec(spec: str) -> None:
    """Raise :class:`ModelLoadError` unless :func:`load_tokenizer` would find a tokenizer for ``spec``."""
    if is_gguf_spec(spec):
        check_gguf_spec(spec)  # a GGUF file carries its tokenizer
        return
    if spec.startswith("builtin:"):
        if spec not in BUILTIN_MODELS:
            raise ModelLoadError(f"model {spec!r}: unknown builtin model; available: {', '.join(BUILTIN_MODELS)}")
        return
    path = _check_dir(spec)
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ModelLoadError(f"model {spec!r}: {path.resolve()} has no tokenizer (none of "
                             f"{', '.join(TOKENIZER_FILES)}); save one there with tokenizer.save_pretrained(path)")


def has_chat_template(spec: str) -> bool:
    """Whether the tokenizer of ``spec`` (builtin or a checked directory) carries a chat template, read
    from its files: ``chat_template.jinja``/``.json`` or ``tokenizer_config.json``'s ``chat_template``.
    A GGUF file not converted yet is taken at its word (reading its metadata takes seconds): the run's
    prompt formatting names a missing template."""
    if spec in LOCAL_BUILTINS:
        return True
    if is_gguf_spec(spec):
        converted = converted_dir(spec)
        if converted is None:
            return True
        spec = str(converted)
    path = Path(spec).expanduser()
    if (path / "chat_template.jinja").is_file() or (path / "chat_template.json").is_file():
        return True
    if (path / "additional_chat_templates").is_dir() and any((path / "additional_chat_templates").iterdir()):
        return True
    try:
        config = json.loads((path / "tokenizer_config.json").read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(config, dict) and bool(config.get("chat_template"))


def vocabulary(spec: str) -> Tokenizer | None:
    """The ``tokenizers`` core of ``spec``'s tokenizer (no transformers): what tells which words it knows;
    None where there is none to read (a sentencepiece-only directory)."""
    if spec == "builtin:tiny":
        return tiny_core_tokenizer()
    if spec == "builtin:tiny-tools":
        return tiny_tools_core_tokenizer()
    if spec == "builtin:tiny-vl":
        return tiny_vl_core_tokenizer()
    if is_gguf_spec(spec):
        converted = converted_dir(spec)
        if converted is None:
            return None  # a pretrained tokenizer's byte-level vocabulary reads every word anyway
        spec = str(converted)
    path = Path(spec).expanduser() / "tokenizer.json"
    try:
        return Tokenizer.from_file(str(path)) if path.is_file() else None
    except Exception:  # noqa: BLE001 - a tokenizer.json tokenizers cannot read is left to the run's loader
        return None


def load_tokenizer(spec: str) -> PreTrainedTokenizerBase:
    """The tokenizer for ``spec``, with left padding and a pad token (falls back to eos).

    Example::

        >>> load_tokenizer("builtin:tiny").padding_side
        'left'
    """
    if spec == "builtin:tiny":
        return build_tiny_tokenizer()
    if spec == "builtin:tiny-tools":
        return build_tiny_tools_tokenizer()
    if spec == "builtin:tiny-vl":
        return build_tiny_vl_tokenizer()
    path = _check_dir(spec)
    AutoTokenizer = hf("AutoTokenizer")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"model {spec!r}: cannot load its tokenizer from {path}: {err}") from err
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(
    spec: str,
    *,
    head: Head = "causal_lm",
    dtype: DType = "float32",
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> tuple[torch.nn.Module, PreTrainedTokenizerBase]:
    """Load ``(model, tokenizer)`` from ``builtin:tiny``, a local HF directory or a GGUF file.

    ``head``: ``"causal_lm"`` (the policy), ``"value"`` (a :class:`ValueModel`:
    the backbone plus a value head; the head is loaded from
    ``value_head.safetensors`` when the directory has one, else initialised from
    ``seed``) or ``"reward"`` (a one-label sequence classifier). A GGUF file's weights
    come dequantized to fp32 (then cast to ``dtype``). ``seed`` fixes
    the initial weights of ``builtin:tiny`` and of any new head; the global RNG
    is not touched.

    Example::

        >>> policy, tok = load_model("builtin:tiny", dtype="bf16")
        >>> policy.dtype
        torch.bfloat16
    """
    torch_dtype = resolve_dtype(dtype)
    tokenizer = load_tokenizer(spec)
    if spec in LOCAL_BUILTINS:
        model = _build_tiny(spec, head, seed)
    else:
        model = _load_dir(_check_dir(spec), spec, head, seed, torch_dtype)
    return model.to(device=device, dtype=torch_dtype), tokenizer


def _build_tiny(spec: str, head: Head, seed: int) -> torch.nn.Module:
    if spec == "builtin:tiny-vl":
        if head != "causal_lm":
            raise ModelLoadError(f"model {spec!r}: only the policy head is built (head={head!r} is not)")
        return build_tiny_vl_model(seed)
    tools = spec == "builtin:tiny-tools"
    if head == "causal_lm":
        return build_tiny_tools_model(seed) if tools else build_tiny_model(seed)
    config_fn = tiny_tools_config if tools else tiny_config
    LlamaForSequenceClassification, LlamaModel = hf("LlamaForSequenceClassification"), hf("LlamaModel")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if head == "value":
            return ValueModel(LlamaModel(config_fn()), head_seed=seed)
        if head == "reward":
            config = config_fn()
            config.num_labels = 1
            return LlamaForSequenceClassification(config)
    raise ValueError(f"unknown head {head!r}; use 'causal_lm', 'value' or 'reward'")


def _load_dir(path: Path, spec: str, head: Head, seed: int, dtype: torch.dtype) -> torch.nn.Module:
    AutoConfig, AutoModel, AutoModelForCausalLM = hf("AutoConfig"), hf("AutoModel"), hf("AutoModelForCausalLM")
    AutoModelForSequenceClassification = hf("AutoModelForSequenceClassification")
    try:
        if head == "causal_lm":
            # a vision-language model (its config has a vision tower) loads with its image-text class
            if hasattr(AutoConfig.from_pretrained(str(path)), "vision_config"):
                return hf("AutoModelForImageTextToText").from_pretrained(str(path), dtype=dtype)
            return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
        if head == "value":
            critic = ValueModel(AutoModel.from_pretrained(str(path), dtype=dtype), head_seed=seed)
            critic.load_value_head(path)
            return critic
        if head == "reward":
            config = AutoConfig.from_pretrained(str(path))
            config.num_labels = 1
            if config.pad_token_id is None:
                config.pad_token_id = getattr(config, "eos_token_id", None)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                return AutoModelForSequenceClassification.from_pretrained(
                    str(path), config=config, dtype=dtype
                )
    except (OSError, ValueError, KeyError) as err:
        raise ModelLoadError(f"model {spec!r}: cannot load it from {path} as head={head!r}: {err}") from err
    raise ValueError(f"unknown head {head!r}; use 'causal_lm', 'value' or 'reward'")


def save_model(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, path: str | Path) -> Path:
    """Write ``model`` and ``tokenizer`` as one HF directory that :func:`load_model` reads back.

    Example::

        >>> model, tok = load_model("builtin:tiny")
        >>> out = save_model(model, tok, tmp_dir / "tiny")          # doctest: +SKIP
        >>> load_model(str(out))[0].config.hidden_size              # doctest: +SKIP
        128
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
