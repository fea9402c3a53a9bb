"""Predicting a step: a plan's timeline from declared (or measured) costs, and its lower bounds.

Each pool runs its order one task at a time; driver tasks run as soon as their
inputs are. The bounds of a makespan — the critical path through the task
graph and the busiest pool's work — say how far a schedule is from the best
any schedule could do; the runtime reports a measured step against them.

Example::

    sim = simulate(plan)                 # or plan.simulate()
    print(sim.makespan, sim.lower_bound)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from flowrl.runtime.pools import DRIVER
from flowrl.runtime.staleness import window

if TYPE_CHECKING:
    from flowrl.runtime.plan import Plan, Task


@dataclass
class Simulation:
    """A predicted (or replayed) timeline: start/end per task, makespan and bounds."""

    start: dict[tuple[str, int | None], float]
    end: dict[tuple[str, int | None], float]
    makespan: float
    critical_path: float
    pool_bound: tuple[str, float]
    measured: bool = False  # costs were measured seconds rather than declared relative costs

    @property
    def lower_bound(self) -> float:
        return max(self.critical_path, self.pool_bound[1])

    @property
    def efficiency(self) -> float:
        return self.lower_bound / self.makespan if self.makespan > 0 else 1.0


def simulate(plan: Plan, costs: dict[str, float] | None = None) -> Simulation:
    """List-schedule the plan: each pool runs its order sequentially; the driver in parallel.

    ``costs`` maps node → seconds for the whole batch (default: declared costs).
    """
    def cost(t: Task) -> float:
        if costs is None or t.node not in costs:
            return t.cost
        n = plan.micro_batches if t.mb is not None else 1
        return costs[t.node] / n

    start: dict[Any, float] = {}
    end: dict[Any, float] = {}
    pool_free: dict[str, float] = {}
    for key in plan.order:  # a topological order consistent with every pool's order
        t = plan.tasks[key]
        ready = max((end[d] for d in t.deps), default=0.0)
        s = ready if t.pool == DRIVER else max(ready, pool_free.get(t.pool, 0.0))
        start[key], end[key] = s, s + cost(t)
        if t.pool != DRIVER:
            pool_free[t.pool] = end[key]
    makespan = max(end.values(), default=0.0)
    return Simulation(start, end, makespan, *bounds_of(plan, {k: end[k] - start[k] for k in end}),
                      measured=costs is not None)


def simulate_steps(plan: Plan, seconds: dict[tuple[str, int | None], float], steps: int = 6) -> list[float]:
    """Each step's predicted end when ``steps`` steps run back to back, as the runtime submits them:
    step after step into each pool's queue in the plan's order, a task behind its inputs and its gates
    (the update ``staleness + 1`` steps back, :class:`~flowrl.runtime.staleness.Gate`), and no step
    submitted before the step ``window`` steps back finished. ``seconds``: every task's duration."""
    updates = {t.updates: key for key, t in plan.tasks.items() if t.updates is not None}
    bound = max((g.staleness for t in plan.tasks.values() for g in t.gates), default=0)
    end: dict[tuple[int, tuple[str, int | None]], float] = {}
    pool_free: dict[str, float] = {}
    step_end: list[float] = []
    for s in range(steps):
        submitted = step_end[s - window(bound)] if s >= window(bound) else 0.0
        for key in plan.order:
            t = plan.tasks[key]
            ready = max([submitted, *(end[(s, d)] for d in t.deps)])
            for g in t.gates:
                j = g.update_step(s)
                if j >= 0 and g.role in updates:
                    ready = max(ready, end[(j, updates[g.role])])
            begin = ready if t.pool == DRIVER else max(ready, pool_free.get(t.pool, 0.0))
            end[(s, key)] = begin + seconds.get(key, t.cost)
            if t.pool != DRIVER:
                pool_free[t.pool] = end[(s, key)]
        step_end.append(max((end[(s, k)] for k in plan.order), default=0.0))
    return step_end


def seconds_per_step(plan: Plan, seconds: dict[tuple[str, int | None], float], steps: int = 8) -> tuple[float, float]:
    """``(seconds per step, one step alone)`` with steps back to back (:func:`simulate_steps`): the
    interval between step ends once the first step has filled the pipeline."""
    ends = simulate_steps(plan, seconds, max(3, steps))
    return (ends[-1] - ends[1]) / (len(ends) - 2), ends[0]


def bounds_of(plan: Plan, durations: dict[tuple[str, int | None], float]) -> tuple[float, tuple[str, float]]:
    """Two lower bounds of a step's makespan given task durations: the critical path
    through the task graph, and the tightest pool bound — a pool runs its tasks one at a
    time, cannot start before the earliest of them can, and after its last one ends at
    least the shortest remaining path is left: ``min head + Σ work + min tail``."""
    dur = {k: durations.get(k, 0.0) for k in plan.tasks}
    head: dict[Any, float] = {}
    for key in plan.order:
        head[key] = max((head[d] + dur[d] for d in plan.tasks[key].deps), default=0.0)
    succ: dict[Any, list[Any]] = {k: [] for k in plan.tasks}
    for key, t in plan.tasks.items():
        for d in t.deps:
            succ[d].append(key)
    tail: dict[Any, float] = {}
    for key in reversed(plan.order):
        tail[key] = max((dur[s] + tail[s] for s in succ[key]), default=0.0)
    critical = max((head[k] + dur[k] + tail[k] for k in plan.tasks), default=0.0)
    per_pool: dict[str, list[Any]] = {}
    for key, t in plan.tasks.items():
        if t.pool != DRIVER:
            per_pool.setdefault(t.pool, []).append(key)
    pools = {
        pool: min(head[k] for k in keys) + sum(dur[k] for k in keys) + min(tail[k] for k in keys)
        for pool, keys in per_pool.items()
    }
    tightest = max(pools.items(), key=lambda kv: kv[1], default=("", 0.0))
    return critical, tightest


def pool_work(plan: Plan, durations: dict[tuple[str, int | None], float]) -> dict[str, float]:
    """Seconds of work each pool did (driver tasks excluded)."""
    work: dict[str, float] = {}
    for key, d in durations.items():
        pool = plan.tasks[key].pool
        if pool != DRIVER:
            work[pool] = work.get(pool, 0.0) + d
    return work


__all__ = ["Simulation", "bounds_of", "pool_work", "seconds_per_step", "simulate", "simulate_steps"]
