"""The checkpointer: the one owner of a run's checkpoints and their layout on disk.

In the shape of torchtitan's ``CheckpointManager``: every stateful role is a
``Stateful`` whose tensors go through torch.distributed.checkpoint (one format
for one process and N ranks, see :mod:`flowrl.store.checkpoint_state`), and
the rest of a run's state rides along: the data position, the operators' state,
the weights fetched for steps still in flight, each rank's sampling stream. It
lists, stages, saves, loads, verifies and purges (keeps the newest ``keep``).
Nothing else knows the layout: a run keeps its checkpoints in ``<out>/checkpoints``
(:meth:`CheckpointStore.of_run`), a step's directory is named by :meth:`CheckpointStore.path`,
and ``flowrl export`` asks :meth:`CheckpointStore.read_role`.

A checkpoint after k completed steps is a directory ``step_<k>``::

    meta.json       format, the flowrl that wrote it, the graph, the data position, operator
                    state, every worker's JSON state, the in-flight weights' entries
    roles/<role>/   the role's tensors (model, optimizer): safetensors shards its ranks wrote
    weights/        in-flight weights, one safetensors file per (role, step)
    manifest.json   every file above with its size and sha256, written last

It is staged under a temporary name (:meth:`CheckpointStore.stage`, where the
ranks write their shards) and renamed into place, so a kill at any moment
leaves either the complete new checkpoint or none. Loading verifies the
manifest: a missing or corrupt file makes the checkpoint unreadable and the
previous one is used, named in a warning. Tensors and JSON only: nothing is
unpickled. The directory's name, not the editable metadata, decides the step.

Example::

    store = CheckpointStore.of_run("runs/grpo", keep=3)      # runs/grpo/checkpoints
    store.save(step=49, payload=result.checkpoint, meta={"graph": graph.config.dump()})
    payload, meta, path = store.load_latest(warn=print)
"""

from __future__ import annotations

import json
import os
import re
import shutil
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

from flowrl.store.checkpoint_state import (ROLES, CheckpointError, UnreadableCheckpoint, no_space_message,
                                             read_full, read_weights, write_weights)
from flowrl.store.verify import FORMAT, MANIFEST, checksums, read_meta, verify


#: trainer keys that may change between a run and its resumption
RESUMABLE_KEYS = ("steps", "out", "checkpoint_every", "keep_checkpoints", "log_every", "val_every",
                  "dump_rollouts", "wandb_project", "record", "fault", "stuck_factor", "stuck_min_s")


#: the folder of a run directory (``trainer.out``) that holds its checkpoints
CHECKPOINTS = "checkpoints"

#: a complete checkpoint's directory name; the number is the count of completed steps
STEP_DIR = re.compile(r"step_(\d{1,12})")


def step_name(done: int) -> str:
    """The directory name of the checkpoint after ``done`` completed steps (``100`` → ``step_00000100``)."""
    return f"step_{done:08d}"


def written_by() -> str:
    """This flowrl, as a checkpoint names the version that wrote it."""
    try:
        return f"flowrl {metadata.version('flowrl')}"
    except metadata.PackageNotFoundError:
        return "flowrl (not installed)"


class CheckpointStore:
    """The checkpoints of one run directory."""

    def __init__(self, root: str | Path, keep: int = 3) -> None:
        self.root = Path(root)
        self.keep = keep

    @classmethod
    def of_run(cls, run_dir: str | Path, keep: int = 3) -> "CheckpointStore":
        """The checkpoints of the run directory ``run_dir`` (``trainer.out``)."""
        return cls(Path(run_dir) / CHECKPOINTS, keep=keep)

    def path(self, step: int) -> Path:
        """Where the checkpoint of step ``step`` (0-based) lives once saved: named by completed steps, as
        the run shows them ("step 100/300" → ``step_00000100``)."""
        return self.root / step_name(step + 1)

    def any_saved(self) -> bool:
        """Whether a checkpoint was ever renamed into place here (complete or not)."""
        return any(STEP_DIR.fullmatch(p.name) for p in self.root.glob("step_*"))

    def complete(self) -> list[Path]:
        """Checkpoints that were renamed into place, newest first."""
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.glob("step_*")
                 if STEP_DIR.fullmatch(p.name) and p.is_dir() and (p / "meta.json").is_file()]
        return sorted(found, key=steps_done, reverse=True)

    def find(self, step: int | None = None) -> Path:
        """The checkpoint after ``step`` completed steps, or the newest; an error listing what there is."""
        found = self.complete()
        if not found:
            raise CheckpointError(f"{self.root}: no complete checkpoint (a step_<K> directory with meta.json); "
                                  f"pass a run directory (trainer.out) of a run that saved one")
        if step is None:
            return found[0]
        for path in found:
            if steps_done(path) == step:
                return path
        steps = ", ".join(str(steps_done(p)) for p in reversed(found))
        raise CheckpointError(f"{self.root}: no checkpoint for step {step}; available steps: {steps}")

    def stage(self, step: int) -> Path:
        """The directory step ``step``'s checkpoint is assembled in before :meth:`save` renames it
        into place (sharded roles write their shards here first). Absolute: workers in other
        processes write to it."""
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in self.root.glob(".tmp_*"):  # left by a run killed mid-save
            if not stale.name.endswith(f"_{os.getpid()}"):
                shutil.rmtree(stale, ignore_errors=True)
        return (self.root / f".tmp_{step_name(step + 1)}_{os.getpid()}").resolve()

    def discard_staged(self) -> None:
        """Remove what this process staged and never saved (a save that failed half-way)."""
        for staged in self.root.glob(f".tmp_step_*_{os.getpid()}"):
            shutil.rmtree(staged, ignore_errors=True)

    def save(self, step: int, payload: dict[str, Any], meta: dict[str, Any]) -> Path:
        """Write ``payload`` (a runtime snapshot) as the checkpoint of step ``step`` (0-based)."""
        tmp = self.stage(step)
        for stale in self.root.glob(f".tmp_step_*_{os.getpid()}"):  # staged for a step that never saved
            if stale.name < tmp.name:
                shutil.rmtree(stale, ignore_errors=True)
        final = self.path(step)  # meta's "step" is the 0-based index of the last step in it
        try:
            tmp.mkdir(exist_ok=True)
            shards = payload.get("shards")
            if shards and Path(shards).resolve() != tmp and (Path(shards) / ROLES).is_dir():
                shutil.copytree(Path(shards) / ROLES, tmp / ROLES, dirs_exist_ok=True)  # staged elsewhere
            body = {**meta, "format": FORMAT, "written_by": written_by(), "step": step,
                    "source": payload.get("source"), "operator_state": payload.get("operator_state") or {},
                    "states": {f"{pool}/{rank}": state for (pool, rank), state in payload["workers"].items()},
                    "weights": write_weights(tmp, payload.get("weights") or {})}
            _write(tmp / "meta.json", json.dumps(body, indent=1).encode())
            _write(tmp / MANIFEST, json.dumps({"format": FORMAT, "files": checksums(tmp)}, indent=1).encode())
            if final.exists():
                shutil.rmtree(final)
            os.rename(tmp, final)  # atomic: the checkpoint appears whole or not at all
            _fsync_dir(self.root)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(no_space_message(e, f"the checkpoint of step {step + 1}", self.root)) from None
        self.purge()
        return final

    def purge(self) -> None:
        """Keep the newest ``keep`` checkpoints, remove the rest."""
        for old in self.complete()[self.keep:]:
            shutil.rmtree(old, ignore_errors=True)

    def load(self, path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(payload, meta)`` of one checkpoint, or :class:`UnreadableCheckpoint` saying why.

        The checkpoint proves itself before anything in it is used: its manifest has the shape this
        flowrl writes, lists every file in the directory and every file the format requires (meta.json,
        each role's shards for the ranks that wrote them, each in-flight weights file) with matching
        sizes and checksums, and meta.json's step is the one its directory's name says."""
        meta = read_meta(path)
        _check_format(path, meta)
        verify(path, meta, steps_done(path))
        try:
            workers = {(key.rpartition("/")[0], int(key.rpartition("/")[2])): state
                       for key, state in meta["states"].items()}
            weights = read_weights(path, meta["weights"])
        except Exception as e:  # noqa: BLE001 - a hand-edited meta.json: unusable, say which part
            raise UnreadableCheckpoint(f"meta.json's states or weights do not read: {type(e).__name__}: {e}") from None
        payload = {"step": steps_done(path) - 1, "source": meta.get("source"), "workers": workers,
                   "operator_state": meta.get("operator_state") or {}, "shards": str(path.resolve()),
                   "weights": weights}
        return payload, meta

    def nothing_to_resume(self) -> CheckpointError:
        """The error of a ``--resume`` that finds no complete checkpoint here."""
        return CheckpointError(f"no complete checkpoint in {self.root}; nothing to resume (checkpoints are written "
                               f"every trainer.checkpoint_every steps and at the end of a run; start without --resume)")

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
            raise self.nothing_to_resume()
        reasons = []
        for path in candidates:
            try:
                payload, meta = self.load(path)
                if accept is not None:
                    accept(payload, meta, path)
                return payload, meta, path
            except UnreadableCheckpoint as e:
                reasons.append(f"{path.name}: {e}")
                warn(f"checkpoint {path} is unreadable ({e}); falling back to an older one")
        raise CheckpointError(f"every checkpoint in {self.root} is unreadable ({'; '.join(reasons[:3])}). "
                              f"Start again with --overwrite, or in a new run directory (--out)")

    def read_role(self, role: str, step: int | None = None) -> tuple[Any, dict[str, Any], Path]:
        """``(state, meta, path)``: ``role``'s state with whole tensors (as one process holds it),
        from the checkpoint after ``step`` steps (default: the newest), in this process."""
        path = self.find(step)
        try:
            payload, meta = self.load(path)
        except UnreadableCheckpoint as e:
            raise CheckpointError(f"checkpoint {path} is unreadable: {e}") from None
        holders = sorted(k for k, state in payload["workers"].items() if role in (state.get("roles") or {}))
        if not holders:
            held = sorted({r for state in payload["workers"].values() for r in state.get("roles") or {}})
            raise CheckpointError(f"checkpoint {path} has no role {role!r}; it holds "
                                  f"{', '.join(held) or 'no roles'} (pass --role)")
        tree = payload["workers"][holders[0]]["roles"][role]
        try:
            return read_full(path, role, tree), meta, path
        except UnreadableCheckpoint as e:
            raise CheckpointError(f"checkpoint {path}: {e}") from None


def steps_done(path: Path) -> int:
    """The number of completed steps a checkpoint directory holds, from its name (``step_00000100`` → 100)."""
    m = STEP_DIR.fullmatch(path.name)
    if m is None:
        raise UnreadableCheckpoint(f"{path.name!r} is not a checkpoint directory name (step_<completed steps>)")
    return int(m.group(1))


class DataChanged(CheckpointError):
    """A resume whose data source no longer holds what the checkpoint's run was trained on."""


def data_changes(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """How a data source's identity (a source's ``identity()``, recorded in ``meta.json``) changed: its
    contents or its generator's settings; the path aside (the same bytes moved are the same data)."""
    def shown(identity: dict[str, Any]) -> dict[str, Any]:
        return {k: (v[:12] + "…" if k == "sha256" and isinstance(v, str) else v)
                for k, v in identity.items() if k != "path"}

    return differences(shown(saved), shown(now))


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


def _check_format(path: Path, meta: dict[str, Any]) -> None:
    """Refuse a checkpoint of another layout, naming the flowrl that wrote it."""
    fmt = meta.get("format")
    if fmt == FORMAT:
        return
    if fmt is None:
        raise UnreadableCheckpoint(
            f"it was written by flowrl before the checkpointer (checkpoint format 1: workers.pt and "
            f"weights.pt, flowrl 0.1.0 up to commit ef287f2); {written_by()} reads format {FORMAT} only "
            f"and does not load it: resume with the flowrl that wrote it, or start a new run (--out)")
    raise UnreadableCheckpoint(f"it was written by {meta.get('written_by', 'another flowrl')} in checkpoint "
                               f"format {fmt!r}; {written_by()} reads format {FORMAT}: use that flowrl")


def _write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
