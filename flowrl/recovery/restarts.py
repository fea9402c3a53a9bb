"""Dead workers replaced during the run (``pools.<name>.max_restarts``).

A pool of one worker whose roles no node updates (one that generates or
scores; the checks refuse ``max_restarts`` elsewhere) may lose its worker
(kill -9, out of memory) without stopping the run. The driver then:

1. reads which workers are dead from the failed report (the backend's
   supervisor named them, with how each ended), and replaces each (a new process
   in the same placement, building the same roles; a ``kill`` fault of the
   fault switch does not fire again in it);
2. finds the *lost* tasks of every step in flight
   (:func:`~flowrl.runtime.steps.lost_tasks`): the
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
dead worker there (when its pool has a restart left) rolls the whole run back
to its last checkpoint instead (:mod:`flowrl.recovery.rollback`). Both are
decided by :class:`~flowrl.recovery.recovery.Recovery`.

Example::

    restarts = Restarts({"gen": 1})
    if restarts.allows(dead):  ...
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Iterable

from flowrl.graph import Graph
from flowrl.runtime.backend import Death, Supervisor
from flowrl.runtime.steps import RecoveryPort, Resubmitted, StepRun

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
            to = (f"the checkpoint of step {self.rolled_back_to + 1}" if self.rolled_back_to >= 0
                  else "its start (no checkpoint yet; every pool started anew)")
            return (f"worker {self.worker} died at step {self.step + 1} ({self.cause}); its pool was started "
                    f"anew and the run rolled back to {to}")
        return (f"worker {self.worker} died at step {self.step + 1} ({self.cause}); replaced by a new process, "
                f"{self.rerun} task(s) run again")


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


def replace_dead(port: RecoveryPort, supervisor: Supervisor, restarts: Restarts, st: StepRun,
                 dead: dict[Worker, Death]) -> Resubmitted:
    """Replace the dead workers and submit the tasks they lost again (see the module docstring);
    ``st``: the step being finished, where the restarts count."""
    for w in sorted(dead):
        supervisor.replace(*w)
    rerun = port.resubmit_lost(set(dead))
    for w in sorted(dead):
        restarts.record(Restart(dead[w].label, dead[w].cause, st.step, rerun), w[0])
    st.faults["restarts"] += len(dead)
    return Resubmitted(rerun)


__all__ = ["Restart", "Restarts", "replace_dead"]
