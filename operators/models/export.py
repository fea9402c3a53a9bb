"""``flowrl export``: a Hugging Face model directory from a role's checkpointed state.

The runtime's checkpointer reads the role's state (whole tensors, whatever
number of ranks wrote them) and the graph it belongs to; this module builds the
role's model from the graph (``builtin:tiny`` or a local directory, its dtype),
maps the checkpoint's names onto it through a :class:`StateDictAdapter` (a tied
parameter, stored once, is tied again) and writes ``config.json``,
``model.safetensors`` and the tokenizer files (and a vision-language model's
processor, which ``AutoProcessor`` loads).

The tokenizer is written to encode a plain prompt as the model saw prompts in
training: when the chat template the prompts were formatted with starts with
the BOS token and a plain encode does not add it, the exported tokenizer adds
it, so ``transformers`` generation from ``tokenizer("copy 3 7 =")`` matches
flowrl's.

A role trained with LoRA (``lora:``) checkpoints its adapters only: the base is
rebuilt from the graph's model, the adapters put on it, and two directories come
out: ``out_dir`` with the adapters merged into the weights (a plain model, as
above) and ``out_dir/adapter`` in peft's ``save_pretrained`` format, which
``PeftModel.from_pretrained(base, out_dir / "adapter")`` loads onto the base.

Example::

    state, meta, path = CheckpointStore.of_run("runs/grpo").read_role("actor", step=100)
    export_hf(state["model"], meta["graph"], "exported/grpo-step100", role="actor")
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch

from flowrl.errors import ConfigError
from operators.data.multimodal import load_processor
from operators.models.fsdp import tied_parameters
from operators.models.loading import load_model, save_model
from operators.models.lora import LoraConfig, add_adapters, is_lora

#: where, inside an export of a LoRA role, its adapters go (peft's format)
ADAPTER_DIR = "adapter"


class ExportError(ConfigError, ValueError):
    """The run directory, step or role cannot be exported; says which and how to fix it."""


class StateDictAdapter:
    """Checkpoint names → the names of the model exported (torchtitan's ``StateDictAdapter``).

    flowrl trains Hugging Face modules, so a name maps to itself; what the
    adapter does is tie again what the checkpoint stored once.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.tied = tied_parameters(model)

    def to_hf(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = dict(state)
        for names in self.tied:
            present = next((n for n in names if n in out), None)
            if present is not None:
                out.update({n: out[present] for n in names if n not in out})
        return out


def with_training_bos(tokenizer: Any) -> Any:
    """``tokenizer``, adding the BOS token on a plain encode when training prompts began with it
    (flowrl encodes a prompt's chat-template text without special tokens, so a template that
    renders ``bos_token`` first gives every prompt a BOS) and a plain encode does not."""
    bos = tokenizer.bos_token_id
    if bos is None or getattr(tokenizer, "chat_template", None) is None:
        return tokenizer
    text = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=True,
                                         tokenize=False)
    trained = tokenizer.encode(text, add_special_tokens=False)[:1] == [bos]
    if trained and tokenizer("x")["input_ids"][:1] != [bos]:
        tokenizer.add_bos_token = True
    return tokenizer


def export_hf(weights: dict[str, torch.Tensor], graph: dict[str, Any], out_dir: str | Path,
              role: str = "actor", where: str | Path = "the checkpoint") -> Path:
    """Write ``role``'s model with ``weights`` (its checkpointed model state) as a HF directory
    ``out_dir``; ``graph``: the config the checkpoint belongs to; ``where``: named in errors."""
    roles = graph.get("roles") or {}
    model, tokenizer, spec = role_model(roles, role, weights, where)
    if is_lora(model):
        model.save_pretrained(Path(out_dir) / ADAPTER_DIR)
        model = model.merge_and_unload()
    out = save_model(model, with_training_bos(tokenizer), out_dir)
    processor = load_processor(spec)
    if processor is not None:  # image prompts go through it: its tokenizer as the prompts were encoded
        processor.save_pretrained(out)
    return out


def role_model(roles: dict[str, Any], role: str, weights: Mapping[str, torch.Tensor] | None,
               where: str | Path = "the checkpoint", error: type[Exception] = ExportError) -> tuple[Any, Any, str]:
    """``(model, tokenizer, model spec)`` of ``role`` of a graph's ``roles`` (its config, dumped) with
    ``weights`` (its checkpointed model state; None: the weights it starts from). A role trained with
    LoRA is its base with the adapters put on (a peft model): its checkpoint holds the adapters only.
    Weights that do not fit raise ``error`` naming ``where``, the role and what does not fit."""
    if role not in roles:
        raise error(f"{where}: the graph has no role {role!r}; roles: {', '.join(sorted(roles)) or 'none'} "
                    f"(pass --role)")
    cfg = roles[role]
    source = cfg.get("from")
    spec_cfg = roles.get(source, cfg) if source else cfg
    spec, dtype = spec_cfg.get("model", "builtin:tiny"), spec_cfg.get("dtype", "float32")
    model, tokenizer = load_model(spec, head=role_head(roles, role), dtype=dtype)
    lora = spec_cfg.get("lora") if not cfg.get("frozen") else None
    if lora is not None:  # the checkpoint holds the adapters; the base is the model the graph names
        model = add_adapters(model, LoraConfig(**lora), seed=0)
    if weights is None:
        return model, tokenizer, spec
    try:
        fit = model.load_state_dict(StateDictAdapter(model).to_hf(dict(weights)), strict=False)
    except RuntimeError as err:  # a tensor of another shape: torch lists each one below its header line
        details = [line.strip() for line in str(err).splitlines()[1:] if line.strip()]
        raise error(f"{where}: the weights of role {role!r} do not fit model {spec!r}: "
                    f"{_some(details, 'mismatch')}") from None
    missing = [k for k in fit.missing_keys if lora is None or ".lora_" in k]
    if missing or fit.unexpected_keys:
        parts = []
        if missing:
            parts.append(f"the model has {_some(missing, 'tensor')} the checkpoint lacks")
        if fit.unexpected_keys:
            parts.append(f"the checkpoint has {_some(fit.unexpected_keys, 'tensor')} the model lacks")
        raise error(f"{where}: the weights of role {role!r} do not fit model {spec!r}: {'; '.join(parts)}")
    return model, tokenizer, spec


#: the model head each role kind trains (``load_model``'s ``head``); any other kind is a causal LM
HEADS = {"critic": "value", "reward_model": "reward"}


def role_head(roles: dict[str, Any], role: str) -> str:
    """The head of ``role``'s model: its ``kind``, else the kind of the role it derives from, else its name."""
    seen: set[str] = set()
    name = role
    while name in roles and name not in seen:
        seen.add(name)
        cfg = roles[name]
        if cfg.get("kind"):
            return HEADS.get(cfg["kind"], "causal_lm")
        if not cfg.get("from"):
            break
        name = cfg["from"]
    return HEADS.get(name, "causal_lm")


def _some(items: list[str], what: str, shown: int = 3) -> str:
    """``"2 tensors (a, b)"``, naming at most ``shown`` of them."""
    more = f", and {len(items) - shown} more" if len(items) > shown else ""
    return f"{len(items)} {what}{'s' if len(items) != 1 else ''} ({', '.join(items[:shown])}{more})"
