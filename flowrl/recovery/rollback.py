"""Rolling a run back to its last checkpoint when a worker of a sharded or trained pool dies.

A pool whose ranks form one process group (FSDP2), or whose role a node
trains, keeps its state on every rank: a new process cannot take a dead one's
place in the middle of a step (:mod:`flowrl.recovery.restarts` raises
:class:`~flowrl.recovery.restarts.RollbackNeeded` instead). With
``pools.<name>.max_restarts`` left, ``flowrl run`` then, in the same driver:

1. ends every worker of that pool (a live rank may be stuck in a collective
   with the dead one), starts new ones and forms the pool's group again; a dead
   worker of another pool is replaced; every step in flight is forgotten;
2. loads the last checkpoint the way ``--resume`` does (the same code:
   :meth:`~flowrl.run.trainer.Trainer._resume`): every worker's state, the
   data position, the step; ``metrics.jsonl`` and ``fingerprints.jsonl`` cut
   back to it;
3. goes on from the step after it. The steps run again are the steps the
   uninterrupted run takes, so the run ends with the same metrics; the step the
   worker died in reports ``faults/restarts`` (workers that died) and
   ``faults/rollbacks``, and the log names the worker, the cause and the step.

A run with no checkpoint yet cannot roll back: it fails, named.

Example::

    for result in rolling(lambda s: runtime.run(source, steps=n - s, start_step=s), 0, roll_back):
        print(result.step, result.metrics["reward/mean"])
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Iterator

from flowrl.errors import WorkerDiedError
from flowrl.recovery.restarts import Restart, RollbackNeeded

if TYPE_CHECKING:
    from flowrl.runtime.reports import StepResult

log = logging.getLogger("flowrl.restarts")


def rolling(run_from: Callable[[int], Iterator["StepResult"]], start: int,
            roll_back: Callable[[RollbackNeeded], int]) -> Iterator["StepResult"]:
    """The results of ``run_from(start)``; on a :class:`RollbackNeeded`, ``roll_back`` it (the step to go
    on from) and the results of ``run_from`` that step, the faults counted on the step the worker died in."""
    counts: dict[int, dict[str, float]] = {}
    while True:
        try:
            for result in run_from(start):
                for k, v in counts.pop(result.step, {}).items():
                    result.metrics[k] = result.metrics.get(k, 0.0) + v
                yield result
            return
        except RollbackNeeded as e:
            start = roll_back(e)
            counts.setdefault(e.step, {"faults/restarts": 0.0, "faults/rollbacks": 0.0})
            counts[e.step]["faults/restarts"] += len(e.dead)
            counts[e.step]["faults/rollbacks"] += 1


def roll_back(trainer: Any, exc: RollbackNeeded, sinks: Any) -> int:
    """Start ``exc``'s pools anew and load the last checkpoint into the run (see the module docstring);
    the step to go on from. ``trainer``: the :class:`~flowrl.run.trainer.Trainer`; ``sinks``: its open
    metrics sinks (``metrics.jsonl`` is cut back under them)."""
    runtime = trainer.runtime
    if not trainer.store.complete():
        _, _, label, cause = exc.dead[0]
        every = trainer.graph.config.trainer.checkpoint_every
        raise WorkerDiedError(f"worker {label} died at step {exc.step + 1} ({cause}); pool {exc.pools[0]!r} "
                              f"rolls back to its last checkpoint, but none has been saved yet (the first comes "
                              f"after step {every}): start the run again, or lower trainer.checkpoint_every") from None
    for pool in exc.pools:
        runtime.backend.restart_pool(pool)
    for pool, rank, _, _ in exc.dead:
        if pool not in exc.pools:
            runtime.backend.replace(pool, rank)
    runtime.forget_steps()
    sinks.sync()
    start = trainer._resume()  # the path --resume takes: workers' state, data position, metrics cut back
    sinks.jsonl.close()  # metrics.jsonl was replaced by its cut-back copy: write to that one
    sinks.jsonl = (trainer.out / "metrics.jsonl").open("a")
    trainer.history[:] = [row for row in trainer.history if row["step"] <= start]
    for pool, rank, label, cause in exc.dead:
        event = Restart(label, cause, exc.step, 0, rolled_back_to=start - 1)
        runtime.restarts.record(event, pool)
        trainer.say(f"{event} (restart {runtime.restarts.used[pool]} of {runtime.restarts.allowed[pool]})")
    return start


__all__ = ["roll_back", "rolling"]
