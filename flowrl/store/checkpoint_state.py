"""What a checkpoint holds, file by file: ``Stateful`` objects as tensors and JSON.

A role hands the checkpointer a ``Stateful`` (``state_dict()`` /
``load_state_dict(state)``, as torch.distributed.checkpoint's protocol). Its
state dict is a tree of dicts and lists whose leaves are tensors or JSON
values; :func:`split` cuts it into a JSON tree (each tensor replaced by
``{"$tensor": "<path>"}``) and a flat ``{path: tensor}``. The tensors go
through torch.distributed.checkpoint to safetensors files (each rank writes its
shards; a checkpoint written by N ranks loads into M, and one process is a
group of one: one format for both), the JSON tree back to the driver, which
writes it into ``meta.json``. Nothing is pickled.

A tensor leaf is the group's: every rank of a pool's process group holds its
shard (a DTensor) or the same value. A JSON leaf is the rank's own; what sits
under :data:`RANK_LOCAL` (a sampling stream) belongs to the rank that wrote it
and is left out when another rank takes the state (a pool that grew).

Example (in a worker, on every rank of the pool)::

    trees = save_states(staging, {"actor": actor}, group, rank=0)
    load_states(path, {"actor": actor}, trees, group, rank=0)
"""

from __future__ import annotations

import errno
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from safetensors.torch import load_file, save_file

from flowrl.errors import RunError, RuntimeFailure

#: the key a JSON tree puts where a tensor was
TENSOR = "$tensor"
#: the part of a state that belongs to the rank that wrote it
RANK_LOCAL = "rank_local"
#: the directory the roles' tensors go in, inside a checkpoint
ROLES = "roles"


class CheckpointError(RuntimeFailure):
    """No usable checkpoint, one that belongs to another graph, or one that could not be written."""


class UnreadableCheckpoint(RunError):
    """One checkpoint cannot be used (the store then tries the previous one)."""


def split(tree: Any, path: str = "") -> tuple[Any, dict[str, torch.Tensor]]:
    """``(json_tree, {path: tensor})`` of a state dict (see the module docstring)."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(node: Any, at: str) -> Any:
        if torch.is_tensor(node):
            tensors[at] = node
            return {TENSOR: at}
        if isinstance(node, Mapping):
            out = {}
            for key, value in node.items():
                if not isinstance(key, str) or "/" in key:
                    raise TypeError(f"state key {key!r} at {at or '/'}: keys must be strings without '/'")
                out[key] = walk(value, f"{at}/{key}" if at else key)
            return out
        if isinstance(node, (list, tuple)):
            return [walk(v, f"{at}/{i}" if at else str(i)) for i, v in enumerate(node)]
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        raise TypeError(f"state at {at or '/'} is a {type(node).__name__}: a checkpoint holds tensors "
                        f"and JSON values only")

    return walk(tree, path), tensors


def join(tree: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """The state dict :func:`split` cut: each placeholder replaced by its tensor."""
    if isinstance(tree, dict):
        if set(tree) == {TENSOR}:
            return tensors[tree[TENSOR]]
        return {k: join(v, tensors) for k, v in tree.items()}
    if isinstance(tree, list):
        return [join(v, tensors) for v in tree]
    return tree


def tensor_keys(tree: Any) -> list[str]:
    """The tensor paths a JSON tree names."""
    if isinstance(tree, dict):
        if set(tree) == {TENSOR}:
            return [tree[TENSOR]]
        return [k for v in tree.values() for k in tensor_keys(v)]
    if isinstance(tree, list):
        return [k for v in tree for k in tensor_keys(v)]
    return []


def role_dir(directory: str | Path, role: str, rank: int, world_size: int) -> Path:
    """Where ``role``'s tensors go: one directory for the ranks of a process group (or a pool of
    one), one per rank for the workers of a pool that share no group (each holds its own copy)."""
    name = role if world_size > 1 or rank == 0 else f"{role}@{rank}"
    return Path(directory) / ROLES / name


def save_states(directory: str | Path, states: Mapping[str, Any], group: Any, rank: int) -> dict[str, Any]:
    """Write every ``Stateful``'s tensors under ``directory`` and return their JSON trees.

    A collective over ``group`` (the pool's process group): call on every rank."""
    trees = {}
    for name, obj in states.items():
        tree, tensors = split(obj.state_dict())
        if tensors:
            _write_tensors(role_dir(directory, name, rank, group.world_size), tensors, group, name)
        trees[name] = tree
    return trees


def load_states(directory: str | Path, states: Mapping[str, Any], trees: Mapping[str, Any], group: Any,
                rank: int, own: bool = True) -> None:
    """Load what :func:`save_states` wrote into the ``Stateful`` objects, whatever number of ranks
    wrote it. ``own``: ``trees`` were written by this rank (else its :data:`RANK_LOCAL` parts are
    left out). A collective over ``group``: call on every rank."""
    for name, tree in trees.items():
        obj = states[name]
        if not own and isinstance(tree, dict):
            tree = {k: v for k, v in tree.items() if k != RANK_LOCAL}
        keys = tensor_keys(tree)
        loaded: dict[str, torch.Tensor] = {}
        if keys:
            # torchtitan's way: the object's own state is the template DCP loads into (its shards,
            # laid out for this run's ranks), then the object takes it back
            _, template = split(obj.state_dict())
            missing = [k for k in keys if k not in template]
            if missing:
                raise UnreadableCheckpoint(f"role {name!r} holds no {', '.join(missing[:3])} (the checkpoint "
                                           f"has a different model or optimizer)")
            loaded = {k: template[k] for k in keys}
            path = role_dir(directory, name, rank, group.world_size)
            if not path.is_dir():  # a rank of threads new to the pool takes rank 0's copy
                path = role_dir(directory, name, 0, group.world_size)
            try:
                with group.guard(f"checkpoint: read {name}"), _no_group_is_intended():
                    dcp.load(loaded, storage_reader=dcp.HuggingFaceStorageReader(str(path)),
                             no_dist=group.world_size == 1)
            except CheckpointException as e:  # a BaseException: say what a rank met, as an unusable checkpoint
                raise UnreadableCheckpoint(f"{ROLES}/{path.name}: {_first_failure(e)}") from None
        obj.load_state_dict(join(tree, loaded))


def read_full(directory: str | Path, role: str, tree: Any) -> Any:
    """``role``'s state with every tensor whole, in one process with no group (for export)."""
    path = Path(directory) / ROLES / role
    keys = set(tensor_keys(tree))
    tensors: dict[str, torch.Tensor] = {}
    if keys:
        reader = dcp.HuggingFaceStorageReader(str(path))
        metadata = reader.read_metadata().state_dict_metadata
        tensors = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in metadata.items() if k in keys}
        absent = keys - set(tensors)
        if absent:
            raise UnreadableCheckpoint(f"{path} holds no {', '.join(sorted(absent)[:3])}")
        with _no_group_is_intended():
            dcp.load(tensors, storage_reader=reader, no_dist=True)
    return join(tree, tensors)


def write_weights(directory: Path, weights: Mapping[tuple[str, int], Any]) -> list[dict[str, Any]]:
    """Weights fetched for steps still to come, one safetensors file each; their JSON entries.

    A tensor that is another one (tied weights) is written once and named as its alias."""
    entries = []
    for (role, step), (tensors, version) in sorted(weights.items()):
        name = f"weights/{role}.{step}.safetensors"
        (directory / "weights").mkdir(exist_ok=True)
        unique, aliases, seen = {}, {}, {}
        for key, t in (tensors or {}).items():
            ident = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())
            if ident in seen:
                aliases[key] = seen[ident]
                continue
            seen[ident] = key
            unique[key] = t.detach().to("cpu").contiguous()
        shared = {t.untyped_storage().data_ptr() for t in unique.values()}
        if len(shared) < len(unique):  # views of one storage that are not the same tensor
            unique = {k: t.clone() for k, t in unique.items()}
        save_file(unique, str(directory / name))
        entries.append({"role": role, "step": step, "version": version, "file": name, "aliases": aliases,
                        "none": tensors is None})
    return entries


def read_weights(directory: Path, entries: list[dict[str, Any]]) -> dict[tuple[str, int], Any]:
    """What :func:`write_weights` wrote: ``{(role, step): (weights, version)}``."""
    out = {}
    for e in entries:
        tensors = load_file(str(directory / e["file"]))
        for alias, key in e["aliases"].items():
            tensors[alias] = tensors[key]
        out[(e["role"], int(e["step"]))] = (None if e.get("none") else tensors, e["version"])
    return out


def _first_failure(err: CheckpointException) -> str:
    failures = [f[0] if isinstance(f, tuple) else f for f in err.failures.values()]
    first = failures[0] if failures else err
    text = str(first).strip().splitlines()
    return f"{type(first).__name__}: {text[-1] if text else ''}"


def disk_error(err: BaseException) -> OSError | None:
    """The ``OSError`` behind a failed write (DCP collects them per rank), or None."""
    seen = set()
    stack = [err]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError):
            return e
        # DCP collects each rank's failure as (exception, traceback)
        failures = [f[0] if isinstance(f, tuple) else f for f in getattr(e, "failures", {}).values()]
        stack += [e.__cause__, e.__context__, *[f for f in failures if isinstance(f, BaseException)]]
    return None


def no_space_message(err: OSError, what: str, where: Path | str) -> str:
    """The message a user sees when ``what`` could not be written: no traceback, what to do."""
    cause = "the disk is full" if err.errno in (errno.ENOSPC, errno.EDQUOT) else (err.strerror or str(err))
    return (f"could not write {what} in {where}: {cause}; the partial checkpoint was removed and the previous "
            f"checkpoint is intact (free disk space, or point --out at another disk)")


def _write_tensors(path: Path, tensors: dict[str, torch.Tensor], group: Any, name: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    try:
        with group.guard(f"checkpoint: write {name}"), _no_group_is_intended():
            dcp.save(tensors, storage_writer=dcp.HuggingFaceStorageWriter(str(path), save_distributed=True),
                     no_dist=group.world_size == 1)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - a full disk: a sentence, not a traceback
        disk = disk_error(e)
        if disk is None:
            raise
        raise CheckpointError(no_space_message(disk, f"the state of role {name!r}", path.parent.parent)) from None


@contextmanager
def _no_group_is_intended() -> Iterator[None]:
    # a pool of one saves and loads without a process group on purpose; torch warns that it assumes so
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
