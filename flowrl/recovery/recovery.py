"""One recovery path: what the driver does when a task fails or hangs.

A node's ``on_error`` retries and drops groups in the worker
(:mod:`flowrl.recovery.faults`); everything the driver must decide goes through
one :class:`Recovery`, which the runtime asks about every failed report and,
while tasks are pending, about the time they take. It answers with an outcome
(:mod:`flowrl.runtime.steps`), never by raising:

* a worker reported ``on_error: refill`` → the failed groups' prompts replaced,
  the step's tasks submitted again (:mod:`flowrl.recovery.refill`):
  ``Resubmitted``;
* a worker died and its pool has ``max_restarts`` left → it is replaced and the
  tasks it lost submitted again, by the same path (:mod:`flowrl.recovery.restarts`):
  ``Resubmitted``; or, on a pool whose state lives on every rank, the run is
  resumed from its last checkpoint (:mod:`flowrl.recovery.rollback`): ``RollBack``;
* a task past its ``timeout_s`` → ``Fail`` with the stuck worker's stacks
  (:mod:`flowrl.recovery.watchdog`); one far past its predicted seconds is reported stuck, with
  them, long before;
* anything else → ``Fail`` with the error named (node, step, worker, cause).

A failed report comes with the dead workers behind it (the backend's supervisor
asked once, where the report was waited for: :class:`~flowrl.runtime.steps.Failure`).
Recovery acts through the runtime's port (the steps in flight, submit lost tasks
again) and the supervisor (replace, restart, stacks); a rollback resumes through
the run's own resume path, which drops the steps in flight as it loads the checkpoint.

Example::

    runtime = Runtime(graph, backend="ray", recovery=Recovery(run=trainer))
    runtime.recovery.restarts.events      # every worker replaced
"""

from __future__ import annotations

from typing import Any

from flowrl.recovery.refill import refill, refill_of
from flowrl.recovery.restarts import Restarts, replace_dead
from flowrl.recovery.rollback import Resumable, roll_back
from flowrl.recovery.watchdog import StuckReport, TaskTimeout, check_timeouts
from flowrl.runtime.backend import Supervisor
from flowrl.runtime.steps import Fail, Failure, Guard, Outcome, RecoveryPort, StepRun, Where
from flowrl.plan.planner import TaskKey


class Recovery(Guard):
    """The restart budget, worker replacement, group refill, rollback and the watchdog (see the module
    docstring). ``run``: what a rollback resumes through (``flowrl run``'s trainer); without one, a
    dead worker of a pool that must roll back fails the step."""

    restarts: Restarts

    def __init__(self, run: Resumable | None = None, stuck: StuckReport | None = None) -> None:
        """``stuck``: where tasks far past their predicted seconds are reported (none: only the timeout)."""
        self.run, self.stuck = run, stuck

    def attach(self, port: RecoveryPort, supervisor: Supervisor) -> None:
        super().attach(port, supervisor)
        self.restarts = Restarts.for_graph(port.graph)
        self.wants_deaths = any(self.restarts.allowed.values())

    def failed(self, st: StepRun, failure: Failure, where: Where) -> Outcome:
        need = refill_of(failure.error)
        if need is not None:
            return refill(need, st, self.port)
        dead = failure.deaths
        if not self.restarts.allows(dead):
            return super().failed(st, failure, where)
        rolled = sorted({pool for pool, _ in dead} & self.restarts.rolls_back)
        if rolled:
            return roll_back(self.port, self.supervisor, self.restarts, self.run, dead, rolled, st.step)
        return replace_dead(self.port, self.supervisor, self.restarts, st, dead)

    def watch(self, st: StepRun, pending: dict[Any, Where], ended: dict[TaskKey, float]) -> Fail | None:
        try:
            check_timeouts(st.step, st.plan, st.plan.graph, pending, ended, st.submitted_at, self.port.worker_free,
                           self.supervisor.worker_label, self.supervisor.stacks, self.stuck)
        except TaskTimeout as e:
            return Fail(e)
        return None


__all__ = ["Recovery"]
