"""``flowrl export``: a Hugging Face model directory from a run's checkpoint.

A checkpoint ``<run>/checkpoints/step_<K>/`` names its graph in ``meta.json``
(the role's model spec: ``builtin:tiny`` or a local directory, and its dtype)
and holds the role's weights in one of two forms, read by one function,
:func:`checkpoint_weights`:

- whole: ``workers.pt``, every worker's role states (read with
  ``torch.load(weights_only=True)``: tensors and plain containers only);
- sharded: ``<role>/``, written by
  :func:`operators.models.sharded_checkpoint.save_sharded` from any number of ranks.

The output is ``config.json``, ``model.safetensors`` and the tokenizer files:
``AutoModelForCausalLM.from_pretrained(out)`` gives the trained logits.

Example::

    export_hf("runs/grpo", "exported/grpo-step100", step=100)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from operators.models.fsdp import tied_parameters
from operators.models.loading import load_model, save_model
from operators.models.sharded_checkpoint import META_FILE, load_full_weights


class ExportError(ValueError):
    """The run directory, step or role cannot be exported; says which and how to fix it."""


def find_checkpoint(run_dir: str | Path, step: int | None = None) -> Path:
    """``<run_dir>/checkpoints/step_<K>`` for ``step`` K (completed steps), or the newest one."""
    root = Path(run_dir) / "checkpoints"
    found = sorted((p for p in root.glob("step_*") if (p / "meta.json").is_file()),
                   key=lambda p: int(p.name.split("_")[1])) if root.is_dir() else []
    if not found:
        raise ExportError(f"{root}: no complete checkpoint (a step_<K> directory with meta.json); "
                          f"pass a run directory (trainer.out) of a run with trainer.checkpoint_every set")
    if step is None:
        return found[-1]
    for path in found:
        if int(path.name.split("_")[1]) == step:
            return path
    steps = ", ".join(str(int(p.name.split("_")[1])) for p in found)
    raise ExportError(f"{root}: no checkpoint for step {step}; available steps: {steps}")


def checkpoint_weights(step_dir: str | Path, role: str = "actor") -> dict[str, torch.Tensor]:
    """The full weights of ``role`` in a checkpoint directory, sharded or whole."""
    step_dir = Path(step_dir)
    if (step_dir / role / META_FILE).is_file():
        return load_full_weights(step_dir / role)
    whole = step_dir / "workers.pt"
    if not whole.is_file():
        raise ExportError(f"{step_dir}: holds neither {role}/{META_FILE} (sharded) nor workers.pt (whole)")
    workers: dict[Any, Any] = torch.load(whole, map_location="cpu", weights_only=True)
    # every rank of the pool holds the same full weights in a whole checkpoint: take the lowest
    for key in sorted(workers, key=lambda k: tuple(str(x) for x in k) if isinstance(k, tuple) else (str(k),)):
        roles = workers[key].get("roles", {})
        if role in roles:
            return dict(roles[role]["model"])
    held = sorted({r for w in workers.values() for r in w.get("roles", {})})
    raise ExportError(f"{whole}: no role {role!r}; it holds {', '.join(held) or 'no roles'} (pass --role)")


def export_hf(run_dir: str | Path, out_dir: str | Path, step: int | None = None,
              role: str = "actor") -> Path:
    """Write ``role``'s weights at ``step`` (default: the newest) as a HF directory ``out_dir``."""
    step_dir = find_checkpoint(run_dir, step)
    meta = json.loads((step_dir / "meta.json").read_text())
    roles = (meta.get("graph") or {}).get("roles") or {}
    if role not in roles:
        raise ExportError(f"{step_dir}/meta.json: the graph has no role {role!r}; "
                          f"roles: {', '.join(sorted(roles)) or 'none'} (pass --role)")
    cfg = roles[role]
    source = cfg.get("from")
    spec_cfg = roles.get(source, cfg) if source else cfg
    spec, dtype = spec_cfg.get("model", "builtin:tiny"), spec_cfg.get("dtype", "float32")
    weights = checkpoint_weights(step_dir, role)
    model, tokenizer = load_model(spec, dtype=dtype)
    for names in tied_parameters(model):
        present = next((n for n in names if n in weights), None)
        for name in names:
            if present is not None and name not in weights:
                weights[name] = weights[present]
    try:
        model.load_state_dict(weights, strict=True)
    except RuntimeError as err:
        raise ExportError(f"{step_dir}: the weights of role {role!r} do not fit model {spec!r}: "
                          f"{str(err).splitlines()[0]}") from err
    return save_model(model, tokenizer, out_dir)
