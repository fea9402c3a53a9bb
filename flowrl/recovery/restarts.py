"""Dead workers replaced during the run (``pools.<name>.max_restarts``).

A pool of one worker whose roles no node updates (one that generates or
scores; the checks refuse ``max_restarts`` elsewhere) may lose its worker
(kill -9, out of memory) without stopping the run. The driver then:

1. asks the backend which workers are dead, and replaces each (a new process
   in the same placement, building the same roles; a ``kill`` fault of the
   fault switch does not fire again in it);
2. finds the *lost* tasks of every step in flight (:func:`lost_tasks`): the
   dead worker's tasks that had not reported, and every task that reads,
   waits on (an order edge, a state edge's update, the previous operator
   state) a lost one — those never ran, they failed on their inputs; tasks
   that finished, or run on without them, are left alone;
3. submits the lost tasks again, step by step in plan order: the gates load
   on the new worker the very weight version each task was planned with, and
   sampling seeds are keyed by prompt, so they produce what the dead worker
   would have.

Each replacement counts in the step's ``faults/restarts`` and is logged with
the worker, the cause and the step.

A pool whose ranks form one process group, or whose role a node trains, cannot
take a new worker in the middle of a step: its state lives on every rank. A
dead worker there raises :class:`RollbackNeeded` (when its pool has a restart
left), and ``flowrl run`` rolls the whole run back to its last checkpoint
(:mod:`flowrl.recovery.rollback`).

Example::

    restarts = Restarts({"gen": 1})
    if restarts.allows(dead):  ...
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from flowrl.graph import Graph
from flowrl.runtime.backend import describe_death
from flowrl.errors import RuntimeFailure
from flowrl.runtime.hangs import STACKS_TIMEOUT_S
from flowrl.plan.planner import Plan, TaskKey

log = logging.getLogger("flowrl.restarts")

Worker = tuple[str, int]


@dataclass
class Restart:
    """One replaced worker, for the log and the metrics."""

    worker: str
    cause: str
    step: int  # 0-based
    rerun: int  # tasks submitted again
    rolled_back_to: int | None = None  # a rollback: the step (0-based) of the checkpoint the run went on from

    def __str__(self) -> str:
        if self.rolled_back_to is not None:
            return (f"worker {self.worker} died at step {self.step + 1} ({self.cause}); its pool was started "
                    f"anew and the run rolled back to the checkpoint of step {self.rolled_back_to + 1}")
        return (f"worker {self.worker} died at step {self.step + 1} ({self.cause}); replaced by a new process, "
                f"{self.rerun} task(s) run again")


class RollbackNeeded(RuntimeFailure):
    """A worker of a pool that must roll back (see the module docstring) died, and the pool has a
    restart left. ``dead``: ``(pool, rank, label, cause)`` of every dead worker; ``pools``: the
    pools to start anew; ``step``: the step (0-based) being finished."""

    def __init__(self, dead: list[tuple[str, int, str, str]], pools: list[str], step: int) -> None:
        self.dead, self.pools, self.step = dead, pools, step
        _, _, label, cause = dead[0]
        super().__init__(
            f"worker {label} died at step {step + 1} ({cause}); pool {pools[0]!r} holds a sharded or trained "
            f"role, so the run must roll back to its last checkpoint: flowrl run does that itself "
            f"(pools.{pools[0]}.max_restarts); a Runtime driven by hand cannot — resume it from a checkpoint")


class Restarts:
    """How many replacements each pool may still have, and the ones made."""

    def __init__(self, allowed: dict[str, int], rolls_back: Iterable[str] = ()) -> None:
        """``rolls_back``: the pools whose dead worker rolls the run back rather than being replaced."""
        self.allowed = dict(allowed)
        self.rolls_back = set(rolls_back)
        self.used: Counter[str] = Counter()
        self.events: list[Restart] = []

    @classmethod
    def for_graph(cls, graph: Graph) -> "Restarts":
        """Each pool's ``max_restarts``; the pools of several workers or with a trained role roll back."""
        trained = {node.role for node in graph.nodes.values() if node.updates_role}
        pools = graph.config.pools
        return cls({p: cfg.max_restarts for p, cfg in pools.items()},
                   [p for p, cfg in pools.items() if cfg.workers > 1 or trained & set(cfg.roles)])

    def allows(self, dead: Iterable[Worker]) -> bool:
        dead = list(dead)
        need = Counter(pool for pool, _ in dead)
        return bool(dead) and all(self.used[p] + n <= self.allowed.get(p, 0) for p, n in need.items())

    def record(self, event: Restart, pool: str) -> None:
        self.used[pool] += 1
        self.events.append(event)
        log.warning("%s (restart %d of %d for pool %r)", event, self.used[pool], self.allowed.get(pool, 0), pool)


def lost_tasks(steps: list[Any], dead: set[Worker], status: Callable[[Any], bool | None],
               first: frozenset[TaskKey] = frozenset()) -> tuple[list[list[TaskKey]], set[tuple[str, int]]]:
    """Per step in flight (in order), its lost tasks in plan order (see the module docstring),
    and the ``(role, step)`` of the lost updates.

    ``steps``: objects with ``step``, ``plan`` (:class:`Plan`) and ``reports`` (handle →
    (task key, pool, rank)); ``status(handle)``: True (reported), False (not yet), None (failed);
    ``first``: tasks of the first step lost whatever they reported (its source batch changed).
    """
    lost_updates: set[tuple[str, int]] = set()
    lost_state: set[str] = set()  # stateful nodes whose latest task is lost
    out = []
    for st in steps:
        plan: Plan = st.plan
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


def forget(st: Any, keys: list[TaskKey], dead: set[Worker], syncs: dict[tuple[str, int, str, int], Any],
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


def replace_dead(backend: Any, restarts: Restarts, syncs: dict[tuple[str, int, str, int], Any], steps: list[Any],
                 submit: Callable[[Any, Any], None], op_state: dict[str, Any], exc: BaseException,
                 after: Callable[[Any], None] | None = None) -> bool:
    """Replace the dead workers and submit the lost tasks of ``steps`` (the step being finished
    first) again; False (nothing done) when no restart is allowed, no worker is dead or a pool
    has no restart left. ``exc``: the failure that made the driver look (its cause is logged)."""
    if not any(restarts.allowed.values()):
        return False
    cause = describe_death(exc) or describe_death(getattr(exc, "cause", None) or exc) or type(exc).__name__
    dead = set(backend.dead_workers())
    if not dead and any(restarts.allowed.get(p) for p in restarts.rolls_back) and "collective" in str(exc):
        dead = _wait_for_death(backend)  # a peer's broken collective can come before Ray has seen the death
    if not restarts.allows(dead):
        return False
    rolled = sorted({pool for pool, _ in dead} & restarts.rolls_back)
    if rolled:
        backend.discard([h for st in steps for h in [*st.reports, *(h for o in st.outputs.values()
                                                                      for h in o.handles())]])
        raise RollbackNeeded([(p, r, backend.worker_label(p, r), backend.death_cause(p, r) or cause)
                              for p, r in sorted(dead)], rolled, steps[0].step)
    lost, lost_updates = lost_tasks(steps, dead, lambda h: report_status(backend, h))
    labels = {w: backend.worker_label(*w) for w in dead}
    for w in sorted(dead):
        backend.replace(*w)
    rerun = resubmit(steps, lost, lost_updates, dead, syncs, submit, op_state, after, backend.discard)
    for w in sorted(dead):
        restarts.record(Restart(labels[w], backend.death_cause(*w) or cause, steps[0].step, rerun), w[0])
    steps[0].faults["restarts"] += len(dead)
    return True


def _wait_for_death(backend: Any) -> set[Worker]:
    """The dead workers, asked again for a few seconds while none is found."""
    until = time.monotonic() + STACKS_TIMEOUT_S
    while time.monotonic() < until:
        time.sleep(0.25)
        dead = set(backend.dead_workers())
        if dead:
            return dead
    return set()


def resubmit(steps: list[Any], lost: list[list[TaskKey]], lost_updates: set[tuple[str, int]], dead: set[Worker],
             syncs: dict[tuple[str, int, str, int], Any], submit: Callable[[Any, Any], None],
             op_state: dict[str, Any], after: Callable[[Any], None] | None = None,
             discard: Callable[[list[Any]], None] | None = None) -> int:
    """Forget the lost tasks' reports and syncs, then submit them again step by step in plan order,
    each stateful one from the state it was first handed; ``after(step)`` right behind each step
    that had lost tasks (its checkpoint, queued again); how many were submitted."""
    dropped = [h for st, keys in zip(steps, lost) for h in forget(st, keys, dead, syncs, lost_updates)]
    if discard is not None:
        discard(dropped)
    for st, keys in zip(steps, lost):
        for key in keys:
            task = st.plan.tasks[key]
            if task.stateful:  # the state its node had before it: the previous micro-batch's, or the step's
                earlier = [k for k in st.plan.order if k[0] == key[0] and (k[1] or 0) < (key[1] or 0)]
                op_state[key[0]] = st.first_report[earlier[-1]] if earlier else st.state_in.get(key[0])
                if op_state[key[0]] is None:
                    del op_state[key[0]]
            submit(st, task)
        if after is not None and keys:
            after(st)
    return sum(map(len, lost))


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


__all__ = ["Restart", "Restarts", "RollbackNeeded", "forget", "lost_tasks", "replace_dead", "report_status", "resubmit"]
