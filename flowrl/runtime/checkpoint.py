"""Checkpoints on disk: atomic, pruned, verified on load.

A checkpoint after k completed steps is a directory ``step_<k>`` holding every worker's
role states (``workers.pt``), weights still owed to in-flight steps
(``weights.pt``), ``meta.json`` (the data position, the graph it belongs
to, each pool's worker count) and, for a role sharded over a pool's ranks, a
directory ``<role>/`` its ranks wrote together
(:func:`operators.models.sharded_checkpoint.save_sharded`: any number of ranks
reads it back). It is staged under a temporary name (:meth:`CheckpointStore.stage`,
where the ranks write their shards) and renamed into place, so a kill at any
moment leaves either the complete new checkpoint or none — never a half-written
one under a real name.

A checkpoint holds tensors and plain data only: the ``.pt`` files are read
with ``torch.load(weights_only=True)``, which refuses anything else (a pickled
callable, a class) *without running it*, and ``meta.json`` is JSON. The
directory's name, not the editable metadata, decides the step. Loading tries
the newest first and falls back to older ones, saying why, when a file is
corrupt, truncated, refused, or does not fit the graph.

Example::

    store = CheckpointStore("runs/grpo/checkpoints", keep=3)
    store.save(step=49, payload=result.checkpoint, meta={"graph": graph.config.dump()})
    payload, meta, path = store.load_latest(warn=print)
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import torch

from flowrl.runtime.errors import RuntimeFailure

#: trainer keys that may change between a run and its resumption
RESUMABLE_KEYS = ("steps", "out", "checkpoint_every", "keep_checkpoints", "log_every", "val_every",
                  "dump_rollouts", "wandb_project")


#: a complete checkpoint's directory name; the number is the count of completed steps
STEP_DIR = re.compile(r"step_(\d{1,12})")


class CheckpointError(RuntimeFailure):
    """No usable checkpoint, or one that belongs to another graph."""


class UnreadableCheckpoint(Exception):
    """One checkpoint cannot be used (the store then tries the previous one)."""


class CheckpointStore:
    """The checkpoints of one run directory."""

    def __init__(self, root: str | Path, keep: int = 3) -> None:
        self.root = Path(root)
        self.keep = keep

    def complete(self) -> list[Path]:
        """Complete checkpoints, newest first."""
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.glob("step_*")
                 if STEP_DIR.fullmatch(p.name) and p.is_dir() and (p / "meta.json").is_file()]
        return sorted(found, key=steps_done, reverse=True)

    def stage(self, step: int) -> Path:
        """The directory step ``step``'s checkpoint is assembled in before :meth:`save` renames it
        into place (sharded roles write their shards here first). Absolute: workers in other
        processes write to it."""
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in self.root.glob(".tmp_*"):  # left by a run killed mid-save
            if not stale.name.endswith(f"_{os.getpid()}"):
                shutil.rmtree(stale, ignore_errors=True)
        return (self.root / f".tmp_step_{step + 1:08d}_{os.getpid()}").resolve()

    def save(self, step: int, payload: dict[str, Any], meta: dict[str, Any]) -> Path:
        """Write ``payload`` (a runtime snapshot) as the checkpoint of step ``step`` (0-based)."""
        tmp = self.stage(step)
        for stale in self.root.glob(f".tmp_step_*_{os.getpid()}"):  # staged for a step that never saved
            if stale.name < tmp.name:
                shutil.rmtree(stale, ignore_errors=True)
        # named by completed steps, as the run shows them ("step 100/300" → step_00000100);
        # meta's "step" is the 0-based index of the last step in it
        final = self.root / f"step_{step + 1:08d}"
        tmp.mkdir(exist_ok=True)
        shards = payload.get("shards")
        for role in _sharded_roles(payload["workers"]) if shards else ():
            source = Path(shards) / role  # written by the pool's ranks: here already, unless staged elsewhere
            if source.resolve() != tmp / role:
                shutil.copytree(source, tmp / role, dirs_exist_ok=True)
        _write(tmp / "workers.pt", lambda f: torch.save(payload["workers"], f))
        _write(tmp / "weights.pt", lambda f: torch.save(payload["weights"], f))
        body = {**meta, "step": step, "source": payload.get("source"),
                "operator_state": payload.get("operator_state") or {}}
        _write(tmp / "meta.json", lambda f: f.write(json.dumps(body, indent=1, default=str).encode()))
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)  # atomic: the checkpoint appears whole or not at all
        _fsync_dir(self.root)
        for old in self.complete()[self.keep:]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def load(self, path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(payload, meta)`` of one checkpoint, or :class:`UnreadableCheckpoint` saying why."""
        try:
            meta = json.loads((path / "meta.json").read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise UnreadableCheckpoint(f"meta.json is not readable JSON ({e})") from None
        if not isinstance(meta, dict) or not isinstance(meta.get("graph"), dict):
            raise UnreadableCheckpoint("meta.json has no 'graph' mapping (the config the checkpoint belongs to)")
        payload = {"step": steps_done(path) - 1, "source": meta.get("source"),
                   "operator_state": meta.get("operator_state") or {}, "shards": str(path.resolve())}
        for key in ("workers", "weights"):
            payload[key] = _load_tensors(path / f"{key}.pt")
        return payload, meta

    def load_latest(
        self,
        warn: Callable[[str], None] = print,
        accept: Callable[[dict[str, Any], dict[str, Any], Path], None] | None = None,
    ) -> tuple[dict[str, Any], dict[str, Any], Path]:
        """``(payload, meta, path)`` of the newest checkpoint that loads (and that ``accept`` takes).

        ``accept(payload, meta, path)`` may raise :class:`UnreadableCheckpoint`
        (this one does not fit: try the previous one) or :class:`CheckpointError`
        (stop: no older checkpoint will do either).
        """
        candidates = self.complete()
        if not candidates:
            raise CheckpointError(f"no complete checkpoint in {self.root}; nothing to resume "
                                  f"(checkpoints are written every trainer.checkpoint_every steps and at the "
                                  f"end of a run; start without --resume)")
        for path in candidates:
            try:
                payload, meta = self.load(path)
                if accept is not None:
                    accept(payload, meta, path)
                return payload, meta, path
            except UnreadableCheckpoint as e:
                warn(f"checkpoint {path} is unreadable ({e}); falling back to an older one")
        raise CheckpointError(f"every checkpoint in {self.root} is unreadable; see the messages above. "
                              f"Start again with --overwrite, or in a new run directory (--out)")


def steps_done(path: Path) -> int:
    """The number of completed steps a checkpoint directory holds, from its name (``step_00000100`` → 100)."""
    m = STEP_DIR.fullmatch(path.name)
    if m is None:
        raise UnreadableCheckpoint(f"{path.name!r} is not a checkpoint directory name (step_<completed steps>)")
    return int(m.group(1))


def _load_tensors(path: Path) -> Any:
    """Tensors and plain containers from ``path``; anything else is refused before it runs."""
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else "unpickling failed"
        if "weights_only" in str(e) or "Unsupported global" in str(e) or "GLOBAL" in str(e):
            raise UnreadableCheckpoint(
                f"{path.name} holds something other than tensors and plain data, refused without loading it "
                f"({_unsupported_global(str(e)) or 'not a weights-only file'}); flowrl never runs code from a checkpoint"
            ) from None
        raise UnreadableCheckpoint(f"{path.name}: {first}") from None
    except Exception as e:  # noqa: BLE001 - truncated, empty, not a torch file at all: all mean "unusable"
        text = str(e).strip().splitlines()
        raise UnreadableCheckpoint(f"{path.name}: {type(e).__name__}: {text[0] if text else ''}") from None


def _unsupported_global(text: str) -> str | None:
    m = re.search(r"GLOBAL ([\w.]+)", text)
    return f"it names {m.group(1)}" if m else None


def _sharded_roles(workers: dict[Any, Any]) -> set[str]:
    """The roles whose state the ranks of a pool wrote as shards (a directory each, not in ``workers.pt``)."""
    return {state["sharded"] for worker in workers.values() for state in (worker.get("roles") or {}).values()
            if isinstance(state, dict) and "sharded" in state}


def fingerprint(config_dump: dict[str, Any]) -> dict[str, Any]:
    """The part of a graph config a checkpoint is bound to: run-length settings and pools'
    worker counts excluded (a sharded role's checkpoint reshards onto any number of ranks;
    meta.json records the counts that wrote it, see :func:`worker_counts`)."""
    out = json.loads(json.dumps(config_dump, default=str))
    for key in RESUMABLE_KEYS:
        out.get("trainer", {}).pop(key, None)
    for pool in (out.get("pools") or {}).values():
        if isinstance(pool, dict):
            pool.pop("workers", None)
    return out


def worker_counts(config_dump: dict[str, Any]) -> dict[str, int]:
    """``{pool: workers}`` of a graph config dump."""
    return {name: int(pool.get("workers", 1)) for name, pool in (config_dump.get("pools") or {}).items()
            if isinstance(pool, dict)}


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Dotted keys where two config dumps differ: ``["nodes.generate.n: 8 → 4"]``."""
    if isinstance(a, dict) and isinstance(b, dict):
        out: list[str] = []
        for key in sorted(set(a) | set(b)):
            sub = f"{path}.{key}" if path else str(key)
            if key not in a:
                out.append(f"{sub}: (absent) → {b[key]!r}")
            elif key not in b:
                out.append(f"{sub}: {a[key]!r} → (absent)")
            else:
                out.extend(differences(a[key], b[key], sub))
        return out
    return [] if a == b else [f"{path}: {a!r} → {b!r}"]


def _write(path: Path, fill: Callable[[Any], None]) -> None:
    with open(path, "wb") as f:
        fill(f)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
