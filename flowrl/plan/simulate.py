"""Predicting steps: one simulator of a plan's steps back to back, and a makespan's lower bounds.

Steps run as the runtime submits them (:func:`simulate_steps`): each pool runs its
queue one task at a time, step after step in the plan's order; a task waits for its
inputs and its gates, a step for the staleness window, and the processes share the
cores. ``flowrl plan``'s timeline (:func:`simulate`) is one step of it alone, the
search and every run's plan check (:func:`seconds_per_step`) read the interval
between step ends once the pipeline is full. The bounds of a makespan — the critical
path through the task graph and the busiest pool's work — say how far a schedule is
from the best any schedule could do; the runtime reports a measured step against them.

Example::

    sim = simulate(plan)                 # or plan.simulate(): one step's timeline
    print(sim.makespan, sim.lower_bound)
    step_s, alone = seconds_per_step(plan, seconds, cpus=2)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from flowrl.plan.critical import critical_path
from flowrl.plan.pools import DRIVER
from flowrl.plan.staleness import window

if TYPE_CHECKING:
    from flowrl.plan.planner import Plan, TaskKey


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
    """One step of :func:`simulate_steps` alone, as a timeline: each pool runs its order one task at a
    time, every task as soon as its inputs are, a device each.

    ``costs`` maps node → measured seconds for the whole batch, spread over its tasks
    (:func:`spread`); nodes without one take their declared cost.
    """
    seconds = spread(plan, costs) if costs is not None else {}
    # the driver's threads too run as if alone: timing/<node> measured them sharing its core already
    sim = _Steps(plan, seconds, steps=1, cpus=None, overhead=0.0, threads_share=False)
    sim.run()
    start = {k: sim.start[(0, k)] for k in plan.order}
    end = {k: sim.end[(0, k)] for k in plan.order}
    makespan = max(end.values(), default=0.0)
    return Simulation(start, end, makespan, *bounds_of(plan, {k: end[k] - start[k] for k in end}),
                      measured=costs is not None)


def spread(plan: Plan, node_seconds: dict[str, float], missing: float | None = None) -> dict[TaskKey, float]:
    """Each task's seconds from its node's measured seconds per step (``timing/<node>``), shared evenly by
    the node's tasks (its micro-batches); a node without a measure: ``missing`` seconds, or (None)
    left out, for its declared cost."""
    out: dict[TaskKey, float] = {}
    for key, t in plan.tasks.items():
        if t.node in node_seconds:
            out[key] = node_seconds[t.node] / len(plan.node_tasks(t.node))
        elif missing is not None:
            out[key] = missing
    return out


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
    """The event-driven simulation behind :func:`simulate_steps` and :func:`simulate` (processor sharing
    between events); it keeps when each task started and ended."""

    EPS = 1e-12

    def __init__(self, plan: Plan, seconds: dict[Any, float], steps: int, cpus: float | None, overhead: float,
                 threads_share: bool = True):
        """``seconds``: each task's duration alone (missing: its declared cost); ``threads_share``: the
        driver's tasks, threads of one process, share its core (else each runs as if alone)."""
        self.plan, self.steps, self.cpus, self.overhead = plan, steps, cpus, overhead
        self.threads_share = threads_share
        self.work = {(s, k): max(0.0, seconds.get(k, plan.tasks[k].cost)) for s in range(steps) for k in plan.order}
        self.updates = {t.updates: key for key, t in plan.tasks.items() if t.updates is not None}
        self.window = window(plan.staleness_bound)
        self.queues: dict[str, list[Any]] = {}
        for s in range(steps):
            for key in plan.order:
                pool = plan.tasks[key].pool
                if pool != DRIVER:
                    self.queues.setdefault(pool, []).append((s, key))
        self.head = {p: 0 for p in self.queues}
        self.driver = {s: [k for k in plan.order if plan.tasks[k].pool == DRIVER] for s in range(steps)}
        self.start: dict[Any, float] = {}
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
        thread = share / threads if self.threads_share and threads else share
        return {k: thread if k[0] != "overhead" and self.plan.tasks[k[1]].pool == DRIVER else share for k in running}

    def run(self) -> list[float]:
        now, running = 0.0, {}  # running: task (or ("overhead", step)) → work left
        total = len(self.work)
        while len(self.end) < total:
            for pool, queue in self.queues.items():
                i = self.head[pool]
                busy = any(k[0] != "overhead" and self.plan.tasks[k[1]].pool == pool for k in running)
                if i < len(queue) and not busy and self.ready(*queue[i], now):
                    running[queue[i]], self.start[queue[i]] = self.work[queue[i]], now
                    self.head[pool] = i + 1
            for s, keys in self.driver.items():
                if s >= self.window and self.released.get(s - self.window, float("inf")) > now + self.EPS:
                    break  # this step and the ones after it are not submitted yet
                for key in [k for k in keys if self.ready(s, k, now)]:
                    keys.remove(key)
                    running[(s, key)], self.start[(s, key)] = self.work[(s, key)], now
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
    ends = simulate_steps(plan, seconds, steps + window(plan.staleness_bound), cpus, step_overhead)
    return (ends[steps - 1] - ends[1]) / (steps - 2), ends[0]


def bounds_of(plan: Plan, durations: dict[tuple[str, int | None], float]) -> tuple[float, tuple[str, float]]:
    """Two lower bounds of a step's makespan given task durations: the critical path
    through the task graph, and the tightest pool bound — a pool runs its tasks one at a
    time, cannot start before the earliest of them can, and after its last one ends at
    least the shortest remaining path is left: ``min head + Σ work + min tail``."""
    cp = critical_path(plan.tasks, durations, plan.order)
    head, dur, tail = cp.head, cp.seconds, cp.tail
    per_pool: dict[str, list[Any]] = {}
    for key, t in plan.tasks.items():
        if t.pool != DRIVER:
            per_pool.setdefault(t.pool, []).append(key)
    pools = {
        pool: min(head[k] for k in keys) + sum(dur[k] for k in keys) + min(tail[k] for k in keys)
        for pool, keys in per_pool.items()
    }
    tightest = max(pools.items(), key=lambda kv: kv[1], default=("", 0.0))
    # the longest chain through any task: cp.length, summed from each task's two sides
    return max((cp.through(k) for k in plan.tasks), default=0.0), tightest


def pool_work(plan: Plan, durations: dict[tuple[str, int | None], float]) -> dict[str, float]:
    """Seconds of work each pool did (driver tasks excluded)."""
    work: dict[str, float] = {}
    for key, d in durations.items():
        pool = plan.tasks[key].pool
        if pool != DRIVER:
            work[pool] = work.get(pool, 0.0) + d
    return work


__all__ = ["Simulation", "bounds_of", "pool_work", "seconds_per_step", "simulate", "simulate_steps", "spread"]
