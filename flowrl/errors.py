"""Every flowrl error has one root, :class:`FlowrlError`, in two branches a user can catch:
:class:`ConfigError` (what ``flowrl validate`` and a command refuse before anything runs: a
graph, a parameter, a file) and :class:`RunError` (what a run raises once it has started). Each
class also keeps the builtin it always was (``ValueError``, ``KeyError``, ...), so code that
caught those still does.

What can go wrong while a step runs names the node, step and worker.

A :class:`NodeError` reads the same on every backend: one line naming the node,
the step and the worker with the cause, then the user's own frame when the error
was raised in user code (never a flowrl or library frame), then where the full
traceback is: the run's log file once :func:`flowrl.store.runlog.record_failure`
wrote it there, else (a :class:`~flowrl.runtime.scheduler.Runtime` used from
Python, with no run directory) the traceback itself.
"""

from __future__ import annotations

import re
import sys
import sysconfig
from pathlib import Path

#: the packages of this project: their frames are flowrl's, never the user's
_OWN = tuple(str(Path(__file__).resolve().parents[1] / pkg) + "/" for pkg in ("flowrl", "operators", "visualizer"))
#: where the interpreter and installed libraries live
_LIBS = tuple({str(Path(p).resolve()) + "/" for key in ("stdlib", "platstdlib", "purelib", "platlib")
               if (p := sysconfig.get_paths().get(key))} | {str(Path(sys.prefix).resolve()) + "/lib/"})
_FRAME = re.compile(r'^  File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<fn>.+)$', re.MULTILINE)


def user_frame(traceback: str) -> str | None:
    """The innermost frame of ``traceback`` (formatted text) in the user's own code, as
    ``file:line, in function``; None when every frame is flowrl's, a library's or Python's."""
    found = None
    for m in _FRAME.finditer(traceback):
        path = m["file"]
        if path.startswith("<") or "site-packages/" in path or "dist-packages/" in path:
            continue
        resolved = str(Path(path).resolve()) if Path(path).is_absolute() else path
        if resolved.startswith(_OWN) or resolved.startswith(_LIBS):
            continue
        found = f"{path}:{m['line']}, in {m['fn']}"
    return found


class FlowrlError(Exception):
    """The root of every error flowrl raises."""


class ConfigError(FlowrlError):
    """Something given before the run is wrong: a graph, a parameter, a file, a command's options."""


class RunError(FlowrlError, RuntimeError):
    """A run could not go on: a step failed, a worker died, a checkpoint could not be read."""


#: the name the runtime has always used for the run branch
RuntimeFailure = RunError


class NodeError(RuntimeFailure):
    """An operator raised inside a worker; carries the remote traceback (see the module docstring).

    Picklable, so it crosses process boundaries intact.
    """

    def __init__(self, node: str, step: int, mb: int | None, worker: str, cause: str, traceback: str = "",
                 log: str | None = None):
        self.node, self.step, self.mb, self.worker, self.cause, self.traceback = node, step, mb, worker, cause, traceback
        #: the run's log file holding the full traceback, once written there
        self.log = log
        super().__init__(str(self))

    def __str__(self) -> str:
        mb_s = f", micro-batch {self.mb}" if self.mb is not None else ""
        # ``step`` is 0-based inside; a person reads steps as the metrics count them, from 1
        when = f"at step {self.step + 1}" if self.step >= 0 else "while starting"
        lines = [f"node {self.node!r} failed {when}{mb_s} on {self.worker}: {self.cause}"]
        frame = user_frame(self.traceback) if self.traceback else None
        if frame:
            lines.append(f"  in your code: {frame}")
        if self.log:
            lines.append(f"  details: {self.log}")
        elif self.traceback:
            lines.append("--- remote traceback ---\n" + self.traceback.rstrip())
        return "\n".join(lines)

    def __reduce__(self):
        return (NodeError, (self.node, self.step, self.mb, self.worker, self.cause, self.traceback, self.log))


class WorkerDiedError(RuntimeFailure):
    """A worker process died (killed, out of memory, crashed) while the step ran."""


class NodeTimeoutError(RuntimeFailure):
    """A node ran past its ``timeout_s``."""


class PlacementError(RuntimeFailure):
    """The pools cannot be placed on the cluster (asked for more than exists)."""


class StalenessError(RuntimeFailure):
    """A node was about to run on weights older than the staleness bound allows."""

    def __reduce__(self):
        return (StalenessError, self.args)


class RefillNeeded(RunError):
    """A node with ``on_error: refill`` failed on some groups: the driver replaces their prompts
    (:mod:`flowrl.recovery.refill`). ``groups``: their places among the task's groups; ``uids``:
    their values of the node's declared group key (verl's ``uid``) when it declares one.

    Raised by the worker's failure-policy hook and handed to the driver as it is (not as a
    :class:`NodeError`): it is a request, not a failure of the node."""

    def __init__(self, node: str, step: int, mb: int | None, groups: list[int], uids: list | None, cause: str):
        self.node, self.step, self.mb, self.groups, self.uids, self.cause = node, step, mb, groups, uids, cause
        super().__init__(f"node {node!r} at step {step + 1} failed on {len(groups)} group(s): {cause}")

    def __reduce__(self):
        return (RefillNeeded, (self.node, self.step, self.mb, self.groups, self.uids, self.cause))
