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

from flowrl.plan.pools import DRIVER
from flowrl.plan.staleness import window

if TYPE_CHECKING:
    from flowrl.plan.planner import Plan, Task


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


def simulate_steps(plan: Plan, seconds: dict[tuple[str, int | None], float], steps: int = 6,
                   cpus: float | None = None, step_overhead: float = 0.0) -> list[float]:
    """Each step's predicted end when ``steps`` steps run back to back, as the runtime submits them:
    step after step into each pool's queue in the plan's order, a task behind its inputs and its gates
    (the update ``staleness + 1`` steps back, :class:`~flowrl.plan.staleness.Gate`), and no step
    submitted before the step ``window`` steps back finished and the driver's ``step_overhead`` seconds
    after it (collecting its results, metrics, fingerprints) are done. ``seconds``: every task's duration
    on an otherwise idle machine.

    Cores are shared (``cpus``; None: as many as the tasks need): a pool's task keeps one process per rank
    busy, the driver's tasks are threads of one process (they share its core), the driver's per-step work
    is one more process; while more processes run than there are cores, each runs ``cpus / running``
    as fast, as an operating system's fair scheduler shares them."""
    return _Steps(plan, seconds, steps, cpus, step_overhead).run()


class _Steps:
    """The event-driven simulation behind :func:`simulate_steps` (processor sharing between events)."""

    EPS = 1e-12

    def __init__(self, plan: Plan, seconds: dict[Any, float], steps: int, cpus: float | None, overhead: float):
        self.plan, self.steps, self.cpus, self.overhead = plan, steps, cpus, overhead
        self.work = {(s, k): max(0.0, seconds.get(k, plan.tasks[k].cost)) for s in range(steps) for k in plan.order}
        self.updates = {t.updates: key for key, t in plan.tasks.items() if t.updates is not None}
        bound = max((g.staleness for t in plan.tasks.values() for g in t.gates), default=0)
        self.window = window(bound)
        self.queues: dict[str, list[Any]] = {}
        for s in range(steps):
            for key in plan.order:
                pool = plan.tasks[key].pool
                if pool != DRIVER:
                    self.queues.setdefault(pool, []).append((s, key))
        self.head = {p: 0 for p in self.queues}
        self.driver = {s: [k for k in plan.order if plan.tasks[k].pool == DRIVER] for s in range(steps)}
        self.end: dict[Any, float] = {}
        self.left = {s: len(plan.order) for s in range(steps)}
        self.step_end: dict[int, float] = {}
        self.released: dict[int, float] = {}  # step → when the driver's per-step work after it is done

    def ready(self, s: int, key: Any, now: float) -> bool:
        if s >= self.window and self.released.get(s - self.window, float("inf")) > now + self.EPS:
            return False
        t = self.plan.tasks[key]
        if any((s, d) not in self.end for d in t.deps):
            return False
        for g in t.gates:
            j = g.update_step(s)
            if j >= 0 and g.role in self.updates and (j, self.updates[g.role]) not in self.end:
                return False
        return True

    def rates(self, running: dict[Any, float]) -> dict[Any, float]:
        """Seconds of work each running task does per second now."""
        threads = sum(1 for k in running if k[0] != "overhead" and self.plan.tasks[k[1]].pool == DRIVER)
        demand = (1 if threads else 0) + sum(
            1 if k[0] == "overhead" else len(self.plan.tasks[k[1]].ranks)
            for k in running if k[0] == "overhead" or self.plan.tasks[k[1]].pool != DRIVER)
        share = min(1.0, self.cpus / demand) if self.cpus and demand else 1.0
        return {k: share / threads if k[0] != "overhead" and self.plan.tasks[k[1]].pool == DRIVER else share
                for k in running}

    def run(self) -> list[float]:
        now, running = 0.0, {}  # running: task (or ("overhead", step)) → work left
        total = len(self.work)
        while len(self.end) < total:
            for pool, queue in self.queues.items():
                i = self.head[pool]
                busy = any(k[0] != "overhead" and self.plan.tasks[k[1]].pool == pool for k in running)
                if i < len(queue) and not busy and self.ready(*queue[i], now):
                    running[queue[i]] = self.work[queue[i]]
                    self.head[pool] = i + 1
            for s, keys in self.driver.items():
                if s >= self.window and self.released.get(s - self.window, float("inf")) > now + self.EPS:
                    break  # this step and the ones after it are not submitted yet
                for key in [k for k in keys if self.ready(s, k, now)]:
                    keys.remove(key)
                    running[(s, key)] = self.work[(s, key)]
            if not running:
                raise RuntimeError("simulate_steps: no task can start (a dependency cycle in the plan)")
            rates = self.rates(running)
            dt = min(left / rates[k] if rates[k] > 0 else float("inf") for k, left in running.items())
            now += dt
            for k in list(running):
                running[k] -= rates[k] * dt
                if running[k] <= self.EPS * max(1.0, now):
                    del running[k]
                    self.finish(k, now, running)
        return [self.step_end[s] for s in range(self.steps)]

    def finish(self, item: Any, now: float, running: dict[Any, float]) -> None:
        if item[0] == "overhead":
            self.released[item[1]] = now
            return
        s = item[0]
        self.end[item] = now
        self.left[s] -= 1
        if self.left[s] == 0:
            self.step_end[s] = now
            if self.overhead > 0:
                running[("overhead", s)] = self.overhead
            else:
                self.released[s] = now


def seconds_per_step(plan: Plan, seconds: dict[tuple[str, int | None], float], steps: int = 8,
                     cpus: float | None = None, step_overhead: float = 0.0) -> tuple[float, float]:
    """``(seconds per step, one step alone)`` with steps back to back (:func:`simulate_steps`): the
    interval between step ends once the first step has filled the pipeline, over ``steps`` steps that
    have steps after them (the last steps of a run end sooner: nothing of the next step shares their time)."""
    steps = max(3, steps)
    bound = max((g.staleness for t in plan.tasks.values() for g in t.gates), default=0)
    ends = simulate_steps(plan, seconds, steps + window(bound), cpus, step_overhead)
    return (ends[steps - 1] - ends[1]) / (steps - 2), ends[0]


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
