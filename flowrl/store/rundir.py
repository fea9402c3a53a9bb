"""A run directory has one owner: a lock held for the run's life, and rules for old state.

The lock is ``<out>/.flowrl.lock``: an ``flock`` on it (released by the kernel
when the process dies, however it dies) plus who holds it (pid, host, start
time) as JSON, so a second run is refused with the holder named. A lock file
left by a dead process is taken over, saying so.

A fresh run refuses a directory holding another run's state (metrics or
checkpoints) unless it resumes that run or is told to overwrite it.
:meth:`RunDirectory.check` says every such refusal without taking the lock, so
``flowrl run`` refuses before it waits on Ray or builds a worker.

Example::

    with RunDirectory(Path("runs/grpo"), say=print) as rundir:
        rundir.claim(resume=False, overwrite=False)
        ...  # the run
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any, Callable

from flowrl.errors import RuntimeFailure
from flowrl.store.checkpoint import CHECKPOINTS, CheckpointStore

LOCK_NAME = ".flowrl.lock"
#: what a run writes into its directory (``--overwrite`` removes exactly these)
RUN_STATE = ("metrics.jsonl", CHECKPOINTS, "config.yaml", "rollouts", "tensorboard", "fingerprints.jsonl")


def run_dir_of(config: Any, out: str | Path | None = None) -> Path:
    """A run's directory: ``out`` when given (``--out``), else the graph's ``trainer.out``, else ``runs/<name>``."""
    return Path(out or config.trainer.out or f"runs/{config.name}")


class RunDirectoryError(RuntimeFailure):
    """The run directory is in use by another run, or holds state this run would clobber."""


class RunDirectory:
    """The lock and the state rules of one run directory (see the module docstring)."""

    def __init__(self, path: Path, say: Callable[[str], None] = print) -> None:
        self.path = Path(path)
        self.say = say
        self._fd: int | None = None

    # ------------------------------------------------------------------ lock
    def lock(self) -> None:
        """Hold the directory for this process, or raise naming the run that holds it."""
        self.path.mkdir(parents=True, exist_ok=True)
        lock_path = self.path / LOCK_NAME
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe(_read_holder(fd))
            os.close(fd)
            raise self._in_use(holder) from None
        previous = _read_holder(fd)
        if previous:
            self.say(f"taking over the lock of {self.path} left by a run that is gone ({_describe(previous)})")
        me = {"pid": os.getpid(), "host": socket.gethostname(),
              "started": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime())}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        os.fsync(fd)
        self._fd = fd

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, 0)  # an empty lock file reads as "nobody", not as a dead holder
        finally:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "RunDirectory":
        self.lock()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    # ------------------------------------------------------------------ state
    def existing_state(self) -> list[str]:
        """What of another run's state the directory holds: metrics rows or checkpoints (a run that
        stopped before its first step left neither, and is simply replaced)."""
        found = []
        metrics = self.path / "metrics.jsonl"
        if metrics.is_file() and metrics.stat().st_size > 0:
            found.append("metrics.jsonl")
        if CheckpointStore.of_run(self.path).any_saved():
            found.append(CHECKPOINTS)
        return found

    def claim(self, *, resume: bool, overwrite: bool) -> None:
        """Apply the fresh-run rule: another run's state is refused unless resuming or overwriting."""
        found = self.existing_state()
        if resume or not found:
            return
        if overwrite:
            removed = [name for name in RUN_STATE if (self.path / name).exists()]
            self._remove(removed)
            self.say(f"--overwrite: removed the previous run's {', '.join(removed)} from {self.path}")
            return
        raise self._holds_a_run(found)

    def check(self, *, resume: bool, overwrite: bool) -> None:
        """Raise now what :meth:`lock` and :meth:`claim` would refuse (another run holds the directory; another
        run's state without ``--resume``/``--overwrite``; ``--resume`` with no checkpoint), touching nothing."""
        lock_path = self.path / LOCK_NAME
        if lock_path.is_file():
            fd = os.open(lock_path, os.O_RDONLY)
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                raise self._in_use(_describe(_read_holder(fd))) from None
            finally:
                os.close(fd)  # closing drops a shared lock taken here
        if resume:
            store = CheckpointStore.of_run(self.path)
            if not store.complete():
                raise store.nothing_to_resume()
        elif not overwrite and (found := self.existing_state()):
            raise self._holds_a_run(found)

    def _in_use(self, holder: str) -> RunDirectoryError:
        return RunDirectoryError(f"run directory {self.path} is in use by another run ({holder}). Wait for it to "
                                 f"finish, stop it, or give this run another directory with --out")

    def _holds_a_run(self, found: list[str]) -> RunDirectoryError:
        return RunDirectoryError(f"run directory {self.path} already holds a run ({', '.join(found)}). Continue it "
                                 f"with --resume, replace it with --overwrite, or choose another directory with --out")

    def _remove(self, names: list[str]) -> None:
        for name in names:
            target = self.path / name
            shutil.rmtree(target) if target.is_dir() else target.unlink()


def _read_holder(fd: int) -> dict[str, Any] | None:
    raw = os.pread(fd, 4096, 0)
    if not raw.strip():
        return None
    try:
        data = json.loads(raw)
    except ValueError:
        return {"pid": "?", "host": "?", "started": "?"}
    return data if isinstance(data, dict) else None


def _describe(holder: dict[str, Any] | None) -> str:
    if not holder:
        return "holder unknown"
    return f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}, started {holder.get('started', '?')}"


__all__ = ["LOCK_NAME", "RUN_STATE", "RunDirectory", "RunDirectoryError"]
