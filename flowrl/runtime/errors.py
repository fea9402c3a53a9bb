"""What can go wrong while a step runs, each naming the node, step and worker."""

from __future__ import annotations


class RuntimeFailure(RuntimeError):
    """Base class: a step could not complete."""


class NodeError(RuntimeFailure):
    """An operator raised inside a worker; carries the remote traceback.

    Picklable, so it crosses process boundaries intact.
    """

    def __init__(self, node: str, step: int, mb: int | None, worker: str, cause: str, traceback: str = ""):
        self.node, self.step, self.mb, self.worker, self.cause, self.traceback = node, step, mb, worker, cause, traceback
        mb_s = f", micro-batch {mb}" if mb is not None else ""
        # ``step`` is 0-based inside; a person reads steps as the metrics count them, from 1
        when = f"at step {step + 1}" if step >= 0 else "while starting"
        msg = f"node {node!r} failed {when}{mb_s} on {worker}: {cause}"
        if traceback:
            msg += "\n--- remote traceback ---\n" + traceback.rstrip()
        super().__init__(msg)

    def __reduce__(self):
        return (NodeError, (self.node, self.step, self.mb, self.worker, self.cause, self.traceback))


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
