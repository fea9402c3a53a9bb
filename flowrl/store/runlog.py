"""The run's log file (``<out>/run.log``): what worker processes print, and the full traceback of a failure.

The terminal shows what a person needs; the log keeps the rest:

* **Known third-party warnings** (:data:`KNOWN_WARNINGS`, e.g. transformers'
  ``past_key_values`` FutureWarning, raised on every generation step) are
  filtered at the source — in each process, before the library is imported.
* **Everything else a worker process prints** (its stdout and stderr, Python's
  and C's) goes to the log (:func:`capture_worker_output`), each warning with a
  tagged line; at the end the terminal gets one line per distinct warning with
  its count (:func:`warning_notes`).
* **A failed step's traceback** is written there (:func:`record_failure`); the
  error printed names the log instead of showing it.

Example::

    capture_worker_output(Path("runs/grpo/run.log"), "train[0] (pid 123)")  # in a worker process
    for line in warning_notes(Path("runs/grpo/run.log")):                     # in the driver, at the end
        print(line)
"""

from __future__ import annotations

import os
import sys
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

from flowrl.errors import NodeError, RuntimeFailure

#: the log's name in a run directory
RUN_LOG = "run.log"
#: the environment variable naming the run's log while the local backend runs operators in this process:
#: libraries' log handlers there write to it rather than to the terminal (the vLLM engine's does)
RUN_LOG_ENV = "FLOWRL_RUN_LOG"
#: (category, message regex) of warnings libraries raise that say nothing to a flowrl user
KNOWN_WARNINGS: tuple[tuple[type[Warning], str], ...] = (
    # transformers >= 4.56 on a model called with a cache object: raised on every forward pass
    (FutureWarning, r"`past_key_values` is deprecated"),
    (FutureWarning, r".*`torch_dtype` is deprecated"),
    (UserWarning, r"TypedStorage is deprecated"),
)
#: starts the log line of each warning a worker raised (what :func:`warning_notes` counts)
WARNING_TAG = "[flowrl warning]"


def quiet_known_warnings() -> None:
    """Filter :data:`KNOWN_WARNINGS` in this process (call before the library is imported:
    a module-level warning fires at import)."""
    for category, message in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)


def capture_worker_output(log: Path, label: str) -> None:
    """In a worker process: known warnings filtered, every other one tagged in ``log``, and the
    process's stdout and stderr (file descriptors 1 and 2: C libraries' output too) appended to
    ``log`` instead of reaching the driver's terminal."""
    quiet_known_warnings()
    log.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)

    def show(message: Any, category: type[Warning], filename: str, lineno: int, file: Any = None,
             line: str | None = None) -> None:
        first = str(message).strip().splitlines()
        text = f"{category.__name__}: {first[0] if first else ''}"
        detail = warnings.formatwarning(message, category, filename, lineno, line)
        _append(sys.stderr, f"{WARNING_TAG} {label}: {text}\n{detail}")

    warnings.showwarning = show


def _append(stream: Any, text: str) -> None:
    try:
        stream.write(text)
        stream.flush()
    except (OSError, ValueError):  # a closed stream at interpreter exit: the warning is lost, not the run
        pass


def log_note(log: Path, message: str) -> None:
    """Append one timestamped line to the run's log: what the run says to whoever reads the log rather than
    the terminal (a plan check's warning on a loaded machine)."""
    try:
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "a", encoding="utf-8") as f:
            f.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} {message}\n")
    except OSError:
        pass  # a note, not the run: a full disk loses the note only


def log_offset(log: Path | None) -> int:
    """Where this run's part of ``log`` starts (the log is appended to across resumed runs)."""
    try:
        return log.stat().st_size if log is not None else 0
    except OSError:
        return 0


def warning_notes(log: Path | None, offset: int = 0) -> list[str]:
    """One line per distinct warning the workers logged since ``offset``, with its count and workers."""
    if log is None or not log.is_file():
        return []
    counts: Counter[str] = Counter()
    where: dict[str, set[str]] = {}
    with open(log, "rb") as f:
        f.seek(offset)
        for raw in f:
            line = raw.decode("utf-8", "replace")
            if not line.startswith(WARNING_TAG):
                continue
            worker, _, text = line[len(WARNING_TAG):].strip().partition(": ")
            counts[text] += 1
            where.setdefault(text, set()).add(worker.split(" (pid", 1)[0])
    return [f"warning ×{n} from {', '.join(sorted(where[text]))}: {text} (each in {log})"
            for text, n in counts.most_common()]


def record_failure(log: Path | None, exc: BaseException) -> BaseException:
    """Append ``exc`` with its full traceback (a worker's, for a failed node) to ``log``; a
    :class:`NodeError` then names the log instead of carrying the traceback in its message."""
    if log is None or not isinstance(exc, RuntimeFailure):
        return exc
    if isinstance(exc, NodeError):
        head = f"node {exc.node!r} failed (step {exc.step + 1}) on {exc.worker}: {exc.cause}"
        body = exc.traceback or "(no traceback: the check that refused the output is the cause)\n"
    else:
        head = f"{type(exc).__name__}: {exc}"
        body = "".join(traceback.format_exception(exc))
    try:
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "a", encoding="utf-8") as f:
            f.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} run failed: {head}\n{body.rstrip()}\n")
    except OSError:
        return exc  # the message keeps the traceback: it has nowhere else to go
    if isinstance(exc, NodeError):
        exc.log = str(log)
    return exc


__all__ = ["KNOWN_WARNINGS", "RUN_LOG", "WARNING_TAG", "capture_worker_output", "log_note", "log_offset",
           "quiet_known_warnings", "record_failure", "warning_notes"]
