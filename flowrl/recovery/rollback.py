"""Rolling a run back to its last checkpoint when a worker of a sharded or trained pool dies.

A pool whose ranks form one process group (FSDP2), or whose role a node trains,
keeps its state on every rank: a new process cannot take a dead one's place in
the middle of a step (:mod:`flowrl.recovery.restarts`). With
``pools.<name>.max_restarts`` left, recovery then, in the same driver:

1. ends every worker of that pool (a live rank may be stuck in a collective
   with the dead one), starts new ones and forms the pool's group again; a dead
   worker of another pool is replaced;
2. resumes the run the way ``--resume`` does, through the same public path
   (:class:`Resumable`, :meth:`flowrl.run.trainer.Trainer.resume`): the steps
   in flight dropped, every worker's state, the data position, the step; every
   sink (``metrics.jsonl``, ``fingerprints.jsonl``, records) cut back to it;
3. answers :class:`~flowrl.runtime.steps.RollBack`: the runtime goes on from
   the step after the checkpoint. The steps run again are the steps the
   uninterrupted run takes, so the run ends with the same metrics; the step the
   worker died in reports ``faults/restarts`` (workers that died) and
   ``faults/rollbacks``, and the log names the worker, the cause and the step.

A run with no checkpoint yet (a death in its first steps) goes back to its start
instead: every pool started anew (its roles built from the seed, as the run began),
the data at its first batch, every sink emptied (:meth:`Resumable.start_over`). A
runtime driven by hand (no :class:`Resumable`) cannot roll back: the step fails, named.

Example::

    outcome = roll_back(port, supervisor, restarts, trainer, failure.deaths, ["train"], step=4)
"""

from __future__ import annotations

from typing import Callable, Protocol

from flowrl.errors import WorkerDiedError
from flowrl.recovery.restarts import Restart, Restarts
from flowrl.runtime.backend import Death, Supervisor
from flowrl.runtime.steps import Fail, RecoveryPort, RollBack


class Resumable(Protocol):
    """What a rollback resumes through: the run's own resume path (``flowrl run --resume``'s)."""

    say: Callable[[str], None]

    def has_checkpoint(self) -> bool:
        """Whether a complete checkpoint has been saved."""

    def resume(self) -> int:
        """Drop the steps in flight, load the newest checkpoint into the run and cut its sinks back; the
        0-based step to go on from."""

    def start_over(self) -> int:
        """Take the run back to before its first step (no step in flight, the data at its start, every sink
        emptied); 0."""


def roll_back(port: RecoveryPort, supervisor: Supervisor, restarts: Restarts, run: Resumable | None,
              dead: dict[tuple[str, int], Death], pools: list[str], step: int) -> RollBack | Fail:
    """Start ``pools`` anew and resume ``run`` from its last checkpoint (see the module docstring);
    ``dead``: every dead worker; ``step``: the 0-based step being finished."""
    first = min(dead)
    died = f"worker {dead[first].label} died at step {step + 1} ({dead[first].cause}); pool {pools[0]!r}"
    if run is None:
        return Fail(WorkerDiedError(
            f"{died} holds a sharded or trained role, so the run must roll back to its last checkpoint: flowrl "
            f"run does that itself (pools.{pools[0]}.max_restarts); a Runtime driven by hand cannot — resume it "
            f"from a checkpoint"))
    saved = run.has_checkpoint()
    # before the first checkpoint the run goes back to its start: every pool's roles built anew from the seed,
    # as the run began (no checkpoint would give the pools that did not die their state back)
    restarted = pools if saved else list(port.graph.config.pools)
    for pool in restarted:
        supervisor.restart_pool(pool)
    for pool, rank in sorted(dead):
        if pool not in restarted:
            supervisor.replace(pool, rank)
    start = run.resume() if saved else run.start_over()
    for (pool, _), death in sorted(dead.items()):
        event = Restart(death.label, death.cause, step, 0, rolled_back_to=start - 1)
        restarts.record(event, pool)
        run.say(f"{event} (restart {restarts.used[pool]} of {restarts.allowed[pool]})")
    port.count(step, "restarts", len(dead))
    port.count(step, "rollbacks")
    return RollBack(start)


__all__ = ["Resumable", "roll_back"]
