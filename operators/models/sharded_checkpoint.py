"""Sharded checkpoints of a model and its optimizer: every rank writes its shards, any world size reads.

Written with ``torch.distributed.checkpoint`` to safetensors files (the
``HuggingFaceStorageWriter``: each rank writes its own shards, the offsets of
every shard in the file's JSON header) plus ``sharded.json``: the optimizer's
hyper-parameters, the world size that wrote it and the caller's metadata.
Loading reads tensors and JSON only — nothing is unpickled — and reshards:
a checkpoint written by N ranks loads into M.

The directory appears atomically: ranks write into ``.tmp_<name>`` beside it,
and rank 0 renames it into place after every rank has finished.

Example (on every rank)::

    save_sharded(run / "checkpoints" / "step_00000010" / "actor", model, optimizer, group,
                 meta={"updates": 10})
    meta = load_sharded(path, model, optimizer, group)
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from operators.models.fsdp import Group, tied_parameters


@contextmanager
def _no_group_is_intended():
    # a pool of one saves and loads without a process group on purpose; torch warns that it assumes so
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield

META_FILE = "sharded.json"
FORMAT = "flowrl-sharded-v1"
_MODEL, _OPTIM = "model.", "optim."


class ShardedCheckpointError(ValueError):
    """A sharded checkpoint directory is missing, incomplete or of another format."""


def save_sharded(path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                 group: Group, meta: dict[str, Any] | None = None) -> Path:
    """Write ``model`` (and ``optimizer``) to the directory ``path``. A collective: call on every rank."""
    path = Path(path)
    tmp = path.parent / f".tmp_{path.name}"
    if group.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    group.barrier("checkpoint: create directory")
    tensors, param_groups = _flat_state(model, optimizer)
    with group.guard("checkpoint: write shards"), _no_group_is_intended():
        dcp.save(tensors, storage_writer=dcp.HuggingFaceStorageWriter(str(tmp), save_distributed=True),
                 no_dist=group.world_size == 1)
    if group.rank == 0:
        body = {"format": FORMAT, "world_size": group.world_size, "param_groups": param_groups,
                "meta": meta or {}}
        (tmp / META_FILE).write_text(json.dumps(body, indent=1))
    group.barrier("checkpoint: shards written")
    if group.rank == 0:
        if path.exists():
            shutil.rmtree(path)
        os.rename(tmp, path)  # atomic: whole or absent
    group.barrier("checkpoint: renamed")
    return path


def load_sharded(path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                 group: Group) -> dict[str, Any]:
    """Load the checkpoint at ``path`` into ``model`` (and ``optimizer``), whatever world size wrote it.

    A collective: call on every rank, after sharding the model and building the
    optimizer as for training. Returns the ``meta`` given to :func:`save_sharded`.
    """
    body = read_meta(path)
    tensors, _ = _flat_state(model, optimizer)
    with group.guard("checkpoint: read shards"), _no_group_is_intended():
        dcp.load(tensors, storage_reader=dcp.HuggingFaceStorageReader(str(path)),
                 no_dist=group.world_size == 1)
    model_sd = {k[len(_MODEL):]: v for k, v in tensors.items() if k.startswith(_MODEL)}
    for first, *aliases in tied_parameters(model):
        model_sd.update({alias: model_sd[first] for alias in aliases})
    optim_sd = None
    if optimizer is not None:
        state: dict[str, dict[str, torch.Tensor]] = {}
        for key, value in tensors.items():
            if key.startswith(_OPTIM):
                fqn, _, name = key[len(_OPTIM):].rpartition(".")
                state.setdefault(fqn, {})[name] = value
        optim_sd = {"state": state, "param_groups": body["param_groups"]}
    with group.guard("checkpoint: set state"):
        set_state_dict(model, optimizer if optimizer is not None else [],
                       model_state_dict=model_sd, optim_state_dict=optim_sd or {})
    return body["meta"]


def read_meta(path: str | Path) -> dict[str, Any]:
    """The ``sharded.json`` of a checkpoint directory; an error naming the path when there is none."""
    file = Path(path) / META_FILE
    if not file.is_file():
        raise ShardedCheckpointError(f"{path}: not a sharded checkpoint (no {META_FILE}); "
                                     f"write one with save_sharded")
    body = json.loads(file.read_text())
    if body.get("format") != FORMAT:
        raise ShardedCheckpointError(f"{file}: format {body.get('format')!r}, expected {FORMAT!r}")
    return body


def load_full_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The model's full weights from a sharded checkpoint, in one process with no group (for export).

    A tied parameter appears once, under its first name (see :func:`~operators.models.fsdp.tied_parameters`).
    """
    read_meta(path)
    reader = dcp.HuggingFaceStorageReader(str(path))
    metadata = reader.read_metadata()
    tensors = {k: torch.empty(m.size, dtype=m.properties.dtype)
               for k, m in metadata.state_dict_metadata.items() if k.startswith(_MODEL)}
    with _no_group_is_intended():
        dcp.load(tensors, storage_reader=reader, no_dist=True)
    return {k[len(_MODEL):]: v for k, v in tensors.items()}


def _flat_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
                ) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    """One flat ``{name: tensor}`` for the storage writer, and the optimizer's JSON-able param groups."""
    if optimizer is None:
        model_sd, optim_sd = get_model_state_dict(model, options=StateDictOptions()), {}
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer)
    # a tied parameter is stored once, under its first name (safetensors refuses shared storage)
    aliases = {alias for _, *rest in tied_parameters(model) for alias in rest}
    flat = {_MODEL + k: v for k, v in model_sd.items() if k not in aliases}
    for fqn, state in optim_sd.get("state", {}).items():
        for name, value in state.items():
            flat[f"{_OPTIM}{fqn}.{name}"] = value if torch.is_tensor(value) else torch.tensor(value)
    param_groups = json.loads(json.dumps(optim_sd.get("param_groups", []), default=_jsonable))
    return flat, param_groups


def _jsonable(value: Any) -> Any:
    if torch.is_tensor(value):
        return value.tolist()
    if isinstance(value, tuple):
        return list(value)
    raise TypeError(f"optimizer hyper-parameter {value!r} ({type(value).__name__}) is not JSON")
