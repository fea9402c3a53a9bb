"""The staleness bound, in one place: the window of steps in flight, the gates,
the minimum weight version, the weight syncs and when their handles may go.

A *state edge* (``update_actor`` at step t feeds ``generate`` at step t+1) with
staleness bound ``s`` lets its consumer at step t use weights no older than
version ``t - s`` (version = updates applied). So:

* **gate** — the consumer at step t waits for the update of step ``t - 1 - s``
  (a step offset of ``s + 1``; nothing to wait for when that is negative);
* **minimum version** — a worker refuses to run it on weights older than
  ``t - s`` (:class:`~flowrl.errors.StalenessError`);
* **planned version** — the version it runs on, exactly: ``t - s`` when the
  weights come from another pool (its sync loads those), ``t`` on the
  updater's own pool (every earlier step's update ran before it in the pool's
  queue), ``t + 1`` there for a task that follows the update within its step;
  the driver fails the step on any other (:class:`VersionNotPlanned`);
* **sync** — when the consumer's role lives on another pool, the weights of
  step ``t - 1 - s`` are fetched right behind that update (in the trainer's
  queue) and loaded on every rank of the consumer's pool before the gated task;
* **window** — the driver keeps ``s + 2`` steps submitted: ``s + 1`` may run,
  one more is loaded and submitted ahead (its gates hold it back);
* **cleanup** — once step t is finished, the handles of updates before step
  ``t - s - 1`` can no longer gate anything and are dropped.

Example::

    gate = Gate("actor", "update_actor", "generate", staleness=1, sync_role="rollout")
    gate.update_step(5), gate.min_version(5), gate.version(5)       # (3, 4, 4)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

from flowrl.errors import RunError


class VersionNotPlanned(RunError):
    """A task ran on another weight version than the plan has its step use: samples of mixed
    versions, or a version count that a restart or a resume reset, repeated or skipped."""


@dataclass(frozen=True)
class Gate:
    """A state edge as seen by the task it gates: wait for ``src``'s update of ``role``
    ``offset`` steps back; ``sync_role`` is the role on the task's pool that must load
    the weights first (None when it shares the updater's process)."""

    role: str
    src: str
    dst: str
    staleness: int
    sync_role: str | None = None
    after_update: bool = False  # the task follows the update within its step (on the updater's pool)

    @property
    def offset(self) -> int:
        """How many steps back the update this task waits for happened."""
        return self.staleness + 1

    def update_step(self, t: int) -> int:
        """The step whose update the task of step ``t`` waits for (negative: none)."""
        return t - self.offset

    def min_version(self, t: int) -> int:
        """The oldest weight version the task of step ``t`` may run with."""
        return max(0, t - self.staleness)

    def version(self, t: int) -> int:
        """The weight version the task of step ``t`` runs on (see the module docstring)."""
        if self.sync_role is not None:
            return self.min_version(t)
        return t + int(self.after_update)


def planned_version(gates: Iterable[Gate], t: int) -> int | None:
    """The weight version a task of step ``t`` with ``gates`` runs on (None: no state edge gates it)."""
    return max((g.version(t) for g in gates), default=None)


def window(bound: int) -> int:
    """How many steps the driver keeps submitted under staleness bound ``bound``."""
    return bound + 2


def keep_from(step: int, bound: int) -> int:
    """After step ``step`` finished: updates of steps before this one gate nothing any more."""
    return step - bound - 1


class Versions:
    """The handles the gates wait on: each update's task reports, the weights fetched
    behind it, and the syncs that loaded them on other pools.

    ``call(pool, rank, method, *args)`` queues a worker method (the backend's);
    ``ready()`` is a handle that is already done.
    """

    def __init__(self, bound: int, call: Callable[..., Any], ready: Callable[[], Any]) -> None:
        self.bound = bound
        self._call, self._ready = call, ready
        self.updates: dict[tuple[str, int], Any] = {}  # (role, step) → a report handle of its update
        self.weights: dict[tuple[str, int], Any] = {}  # (role, step) → its weights, fetched behind it
        self.syncs: dict[tuple[str, int, str, int], Any] = {}  # (role, step, pool, rank) → set_weights
        self.restored_step = -1  # updates up to here happened before the checkpoint resumed from

    def updated(self, role: str, t: int, pool: str, report: Any, publish: bool, gather: int = 1) -> None:
        """The update of ``role`` at step ``t`` was submitted on ``pool`` (rank 0 reports
        ``report``); ``publish``: another pool needs its weights, fetch them right behind it.
        ``gather``: how many of the pool's ranks take part (a sharded role's weights are
        gathered by all of them and land on rank 0)."""
        self.updates[(role, t)] = report
        if publish:
            handles = [self._call(pool, rank, "get_weights", role) for rank in range(gather)]
            self.weights[(role, t)] = handles[0]

    def gate(self, g: Gate, t: int, pool: str, rank: int) -> tuple[Any, Any | None] | None:
        """``(handle, new sync or None)``: what the task of step ``t`` on (pool, rank) waits
        for under gate ``g``; None when nothing (the first steps)."""
        j = g.update_step(t)
        if j < 0:
            return None
        if g.sync_role is None:
            if (g.role, j) not in self.updates and j <= self.restored_step:
                return self._ready(), None  # done before the checkpoint this run resumed from
            return self.updates[(g.role, j)], None
        key = (g.sync_role, j, pool, rank)
        if key in self.syncs:
            return self.syncs[key], None
        handle = self._call(pool, rank, "set_weights", g.sync_role, self.weights[(g.role, j)], t)
        self.syncs[key] = handle
        return handle, handle

    def in_flight_weights(self, t: int) -> dict[tuple[str, int], Any]:
        """Weights already fetched that steps after ``t`` will still load (for a checkpoint)."""
        return {k: h for k, h in self.weights.items() if k[1] >= t - self.bound}

    def restore(self, step: int, weights: dict[tuple[str, int], Any]) -> None:
        self.weights = dict(weights)
        self.restored_step = step

    def finished(self, step: int) -> None:
        """Drop what no later step can wait on."""
        keep = keep_from(step, self.bound)
        for d in (self.weights, self.updates, self.syncs):
            for k in [k for k in d if k[1] < keep]:
                del d[k]


__all__ = ["Gate", "VersionNotPlanned", "Versions", "keep_from", "planned_version", "window"]
