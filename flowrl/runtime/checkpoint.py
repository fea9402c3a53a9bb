"""Checkpoints on disk: atomic, pruned, verified on load.

A checkpoint after k completed steps is a directory ``step_<k>`` holding every worker's
role states (``workers.pt``), weights still owed to in-flight steps
(``weights.pt``), and ``meta.json`` (the step, the data position, the graph it
belongs to). It is written under a temporary name and renamed into place, so a
kill at any moment leaves either the complete new checkpoint or none — never a
half-written one under a real name. Loading tries the newest first and falls
back to older ones, saying why, when a file is corrupt or truncated.

Example::

    store = CheckpointStore("runs/grpo/checkpoints", keep=3)
    store.save(step=49, payload=result.checkpoint, meta={"graph": graph.config.dump()})
    payload, meta = store.load_latest(warn=print)
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import torch

from flowrl.runtime.errors import RuntimeFailure

#: trainer keys that may change between a run and its resumption
RESUMABLE_KEYS = ("steps", "out", "checkpoint_every", "keep_checkpoints", "log_every", "val_every",
                  "dump_rollouts", "wandb_project")


class CheckpointError(RuntimeFailure):
    """No usable checkpoint, or one that belongs to another graph."""


class CheckpointStore:
    """The checkpoints of one run directory."""

    def __init__(self, root: str | Path, keep: int = 3) -> None:
        self.root = Path(root)
        self.keep = keep

    def complete(self) -> list[Path]:
        """Complete checkpoints, newest first."""
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.glob("step_*") if p.is_dir() and (p / "meta.json").is_file()]
        return sorted(found, key=lambda p: int(p.name.split("_")[1]), reverse=True)

    def save(self, step: int, payload: dict[str, Any], meta: dict[str, Any]) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in self.root.glob(".tmp_*"):  # left by a run killed mid-save
            shutil.rmtree(stale, ignore_errors=True)
        # named by completed steps, as the run shows them ("step 100/300" → step_00000100);
        # meta's "step" is the 0-based index of the last step in it
        final = self.root / f"step_{step + 1:08d}"
        tmp = self.root / f".tmp_step_{step + 1:08d}_{os.getpid()}"
        tmp.mkdir()
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

    def load_latest(self, warn: Callable[[str], None] = print) -> tuple[dict[str, Any], dict[str, Any], Path]:
        """``(payload, meta, path)`` of the newest loadable checkpoint."""
        candidates = self.complete()
        if not candidates:
            raise CheckpointError(f"no complete checkpoint in {self.root}; nothing to resume "
                                  f"(set trainer.checkpoint_every to write them)")
        for path in candidates:
            try:
                meta = json.loads((path / "meta.json").read_text())
                payload = {
                    "step": meta["step"],
                    "workers": torch.load(path / "workers.pt", weights_only=False),
                    "weights": torch.load(path / "weights.pt", weights_only=False),
                    "source": meta.get("source"),
                    "operator_state": meta.get("operator_state", {}),
                }
                return payload, meta, path
            except Exception as e:  # noqa: BLE001 - any unreadable file means: try the previous one
                warn(f"checkpoint {path} is unreadable ({type(e).__name__}: {e}); falling back to an older one")
        raise CheckpointError(f"every checkpoint in {self.root} is unreadable; see the messages above")


def fingerprint(config_dump: dict[str, Any]) -> dict[str, Any]:
    """The part of a graph config a checkpoint is bound to (run-length settings excluded)."""
    out = json.loads(json.dumps(config_dump, default=str))
    for key in RESUMABLE_KEYS:
        out.get("trainer", {}).pop(key, None)
    return out


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
