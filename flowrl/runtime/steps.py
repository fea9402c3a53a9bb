"""A step in flight, and what the driver's step loop offers around it.

The loop of :class:`~flowrl.runtime.scheduler.Runtime` submits a step's tasks and
waits for their reports; the cross-cutting work attaches to it from outside:

* **driver-step hooks** (:class:`StepHook`, Hamilton's lifecycle adapters):
  each sees every finished training step (:class:`FinishedStep`: its result, its
  metrics row, and its nodes' outputs, still readable) and is cut back when a run
  resumes. The run wing registers them (:mod:`flowrl.run.hooks`: fingerprints,
  records, dumps, timing, the metrics sinks);
* **recovery** (:class:`Guard`; :class:`~flowrl.recovery.recovery.Recovery` is
  the one that recovers): told of every failed report and asked while tasks are
  pending, it answers with an outcome — :class:`Resubmitted` (the lost tasks run
  again), :class:`RollBack` (the run goes on from a checkpoint's step) or
  :class:`Fail` — and acts through the port the runtime implements
  (:class:`RecoveryPort`: the steps in flight, submit the lost tasks again).
  A failed report reaches it as a :class:`Failure`: the error, and the dead
  workers the backend's supervisor found behind it (label and cause), asked
  once, where the report was waited for.

Which tasks a fault loses (:func:`lost_tasks`) is knowledge of the runtime's
steps, so it lives here: a dead worker's tasks and a refilled step's are found
and submitted again by one path.

Example::

    class Say(StepHook):
        def step_done(self, done: FinishedStep) -> None:
            print(done.row["step"], done.result.metrics["reward/mean"])

    Runtime(graph, backend="local", hooks=[Say()])
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Protocol

from flowrl.data import DataProto, DataProtoFuture
from flowrl.graph import Graph
from flowrl.plan.planner import Plan, TaskKey
from flowrl.errors import RuntimeFailure
from flowrl.runtime.backend import Backend, Death, Supervisor, named_failure
from flowrl.runtime.hangs import get_within
from flowrl.runtime.reports import StepResult
from flowrl.runtime.worker import Info

Worker = tuple[str, int]
#: where a report comes from: its task (None: a weight sync), pool and rank
Where = tuple[TaskKey | None, str, int]


@dataclass
class StepRun:
    """A submitted run of a plan on one batch (a training step, or validation after it):
    its tasks' output futures and report handles."""

    step: int
    submitted_at: float
    plan: Plan
    src: Any = None  # the handle of the step's source batch
    snapshot: dict[str, Any] | None = None  # checkpoint handles queued right after this step
    validation: "StepRun | None" = None  # a validation run queued right behind this step
    outputs: dict[TaskKey, DataProtoFuture] = field(default_factory=dict)
    reports: dict[Any, Where] = field(default_factory=dict)  # handle → (task, pool, rank)
    first_report: dict[TaskKey, Any] = field(default_factory=dict)  # a task's report on its first rank
    batch: DataProto | None = None  # the source batch (a refill replaces prompts in it)
    state_in: dict[str, Any] = field(default_factory=dict)  # operator states the step started from
    faults: Counter[str] = field(default_factory=Counter)  # restarts, refills: faults/<name>


@dataclass(frozen=True)
class Failure:
    """A report that failed: the ``error`` it raised, and every dead worker the supervisor found behind it
    (:meth:`~flowrl.runtime.backend.Supervisor.deaths`; asked only when a pool may restart)."""

    error: BaseException
    deaths: dict[Worker, Death] = field(default_factory=dict)


# ---------------------------------------------------------------------- outcomes
@dataclass(frozen=True)
class Resubmitted:
    """The lost tasks were submitted again (on a new worker, or with fresh prompts): the step goes on."""

    tasks: int


@dataclass(frozen=True)
class RollBack:
    """The run was loaded back to a checkpoint: it goes on from 0-based step ``step``."""

    step: int


@dataclass(frozen=True)
class Fail:
    """The step fails with ``error`` (named: node, step, worker, cause)."""

    error: BaseException


Outcome = Resubmitted | RollBack | Fail


# ---------------------------------------------------------------------- recovery's port
class RecoveryPort(Protocol):
    """What recovery may ask of the runtime (implemented by :class:`~flowrl.runtime.scheduler.Runtime`)."""

    graph: Graph
    worker_free: dict[Worker, float]  # when each worker last finished a task (the watchdog's clock)

    def steps(self) -> list[StepRun]:
        """The step being finished, then the steps submitted behind it."""

    def reported(self, handle: Any) -> bool | None:
        """True: the report came back; False: not yet; None: it failed."""

    def resubmit_lost(self, dead: set[Worker], whole_first: bool = False) -> int:
        """Submit again every task lost to ``dead`` workers (and, ``whole_first``, every task of the step
        being finished), with every task that read or waited on one; how many."""

    def rebatch(self, st: StepRun, batch: DataProto) -> None:
        """Give step ``st`` another source batch (before its tasks are submitted again)."""

    def count(self, step: int, fault: str, n: int = 1) -> None:
        """Add ``n`` to ``faults/<fault>`` of 0-based step ``step`` (now, or when it runs again)."""


class Guard:
    """Recovery's contract with the runtime. This one recovers nothing and watches nothing: a failed
    task fails its step, named. :class:`~flowrl.recovery.recovery.Recovery` overrides all three."""

    port: RecoveryPort
    supervisor: Supervisor

    def attach(self, port: RecoveryPort, supervisor: Supervisor) -> None:
        """Called once by the runtime that owns this guard."""
        self.port, self.supervisor = port, supervisor

    #: whether :class:`Failure` should carry the dead workers (a pool may restart one)
    wants_deaths: bool = False

    def failed(self, st: StepRun, failure: Failure, where: Where) -> Outcome:
        """A report of ``st`` failed: what now."""
        key, pool, rank = where
        return Fail(named_failure(failure.error, st.step, key and key[0], self.supervisor.worker_label(pool, rank)))

    def watch(self, st: StepRun, pending: dict[Any, Where], ended: dict[TaskKey, float]) -> Fail | None:
        """Asked at every poll while ``pending`` reports of ``st`` are out (``ended``: when each finished
        task ended): a :class:`Fail` ends the step."""
        return None


# ---------------------------------------------------------------------- driver-step hooks
@dataclass
class FinishedStep:
    """A finished training step, as driver-step hooks see it."""

    result: StepResult
    #: the step's metrics row as the sinks write it: ``step`` (1-based), its metrics, validation's;
    #: a hook may add its own (timing)
    row: dict[str, Any]
    #: the named fields of the step, each at its producer's row space, read as a consumer reads them
    read: Callable[[Iterable[str]], DataProto]


class StepHook:
    """Work attached to every finished training step of the driver; each method does nothing unless
    overridden. Hooks run in the order they are registered."""

    def step_done(self, done: FinishedStep) -> None:
        """A training step finished (its checkpoint, if any, is saved after every hook ran)."""

    def rewind(self, step: int) -> None:
        """The run (re)starts at 0-based ``step`` (a fresh run: 0; a resume or a rollback: the step after
        the checkpoint): open, and drop whatever was written for steps from ``step`` on."""

    def sync(self) -> None:
        """Make what was written durable (before a checkpoint is saved)."""

    def close(self) -> None:
        """The run ended."""


# ---------------------------------------------------------------------- lost tasks
def lost_tasks(steps: list[StepRun], dead: set[Worker], status: Callable[[Any], bool | None],
               first: frozenset[TaskKey] = frozenset()) -> tuple[list[list[TaskKey]], set[tuple[str, int]]]:
    """Per step in flight (in order), its lost tasks in plan order, and the ``(role, step)`` of the
    lost updates. Lost: a task that failed, a dead worker's task that had not reported, a task of
    ``first`` in the first step (its source batch changed), and every task that reads, waits on (an
    order edge, a state edge's update, the previous operator state) a lost one — those never ran,
    they failed on their inputs. ``status(handle)``: as :meth:`RecoveryPort.reported`."""
    lost_updates: set[tuple[str, int]] = set()
    lost_state: set[str] = set()  # stateful nodes whose latest task is lost
    out = []
    for st in steps:
        plan = st.plan
        reported: dict[TaskKey, set[bool | None]] = {}
        for h, (key, _, _) in st.reports.items():
            if key is not None:
                reported.setdefault(key, set()).add(status(h))
        lost: set[TaskKey] = set()
        for key in plan.order:
            task = plan.tasks[key]
            seen = reported.get(key, {True})
            on_dead = any((task.pool, r) in dead for r in task.ranks)
            hit = (None in seen or (on_dead and seen != {True}) or (st is steps[0] and key in first)
                   or any(d in lost for d in task.deps)
                   or any((g.role, g.update_step(st.step)) in lost_updates for g in task.gates)
                   or (task.stateful and task.node in lost_state))
            if hit:
                lost.add(key)
                if task.updates is not None:
                    lost_updates.add((task.updates, st.step))
            if task.stateful:
                (lost_state.add if hit else lost_state.discard)(task.node)
        out.append([k for k in plan.order if k in lost])
    return out, lost_updates


def forget(st: StepRun, keys: list[TaskKey], dead: set[Worker], syncs: dict[tuple[str, int, str, int], Any],
           lost_updates: set[tuple[str, int]]) -> list[Any]:
    """Drop the reports of ``keys`` and the dead workers' syncs from a step, and the weight syncs
    that loaded a dead worker or a lost update's weights, before the tasks are submitted again;
    the handles dropped (to be discarded once they fail, not left as unhandled errors)."""
    steps = {j for _, j in lost_updates}
    dropped = [syncs.pop(k) for k in [k for k in syncs if (k[2], k[3]) in dead or k[1] in steps]]
    gone = set(keys)
    for h in [h for h, (k, pool, rank) in st.reports.items()
              if k in gone or (k is None and (pool, rank) in dead)]:
        del st.reports[h]
        dropped.append(h)
    for k in gone:
        st.first_report.pop(k, None)
        if k in st.outputs:
            dropped += st.outputs[k].handles()
    return dropped


def hand_back_state(op_state: dict[str, Any], st: StepRun, key: TaskKey) -> None:
    """Before stateful task ``key`` of step ``st`` runs again: its node's state back to what the task was
    first handed (its previous micro-batch's, or the state the step started from)."""
    earlier = [k for k in st.plan.order if k[0] == key[0] and (k[1] or 0) < (key[1] or 0)]
    state = st.first_report[earlier[-1]] if earlier else st.state_in.get(key[0])
    if state is None:
        op_state.pop(key[0], None)
    else:
        op_state[key[0]] = state


def report_status(backend: Any, handle: Any) -> bool | None:
    """True: the report came back; False: not yet; None: it failed."""
    done, _ = backend.wait([handle], 0)
    if not done:
        return False
    try:
        backend.get(handle)
    except Exception:  # noqa: BLE001 - a failed report is a status here, not an error
        return None
    return True


class StateNotTaken(RuntimeFailure):
    """A worker's state for a checkpoint did not come (``cause``: why; ``worker``: its pool and rank)."""

    def __init__(self, worker: Worker, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.worker, self.cause = worker, cause


def resolve_snapshot(backend: Backend, snap: dict[str, Any], timeout_s: float | None) -> dict[str, Any]:
    """A queued checkpoint's values: each worker's state within ``timeout_s`` (else :class:`StateNotTaken`,
    naming the worker, for recovery to decide on), the in-flight weights, the operators' states."""
    def state_of(h: Any) -> Any:
        value = backend.get(h)
        return value.state if isinstance(value, Info) else value

    def worker_state(key: Worker, h: Any) -> Any:
        what = f"the state of {backend.worker_label(*key)} for the checkpoint of step {snap['step'] + 1}"
        try:
            return get_within(backend.get, h, timeout_s, what)
        except Exception as e:  # noqa: BLE001 - a dead worker, a timeout: recovery decides
            raise StateNotTaken(key, e) from e

    return {**snap, "workers": {k: worker_state(k, h) for k, h in snap["workers"].items()},
            "weights": {k: backend.get(h) for k, h in snap["weights"].items()},
            "operator_state": {n: state_of(h) for n, h in snap["operator_state"].items()}}


__all__ = ["Fail", "Failure", "FinishedStep", "Guard", "Outcome", "RecoveryPort", "Resubmitted", "RollBack", "StepHook",
           "StateNotTaken", "StepRun", "Where", "forget", "hand_back_state", "lost_tasks", "report_status", "resolve_snapshot"]
