"""Step reports: what the driver learns from a finished step's task reports.

Metrics are reduced, each as it declares (:mod:`flowrl.data.metrics`: a plain
number is a mean weighted by rows), over the tasks of a node and the ranks
whose outputs the task's dispatch mode collects (every rank of a ``split``
task; rank 0 of an ``all`` task, whose ranks repeat one computation); durations give the step's
makespan, its lower bounds (critical path, busiest pool) and per-node timings.

Each report carries the weight version its task ran on (the worker's count,
the version its samples are stamped with): :func:`check_versions` fails the
step on one the plan did not have that step use.

Example::

    check_versions(plan, infos)
    metrics, makespan, bound = step_metrics(plan, infos, submitted_at=t0)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from flowrl.data import DataProto
from flowrl.data.metrics import Reduction
from flowrl.plan.planner import Plan, TaskKey
from flowrl.plan.simulate import bounds_of, pool_work
from flowrl.plan.staleness import VersionNotPlanned, planned_version
from flowrl.runtime.worker import Info


@dataclass
class StepResult:
    """One finished step: metrics, its task reports, and any fetched fields."""

    step: int
    metrics: dict[str, float]
    infos: list[Info]
    makespan: float
    lower_bound: float
    data: DataProto | None = None
    checkpoint: dict[str, Any] | None = None  # states taken right after this step (see Runtime.run)
    val_metrics: dict[str, float] | None = None  # validation right after this step
    syncs: list[Info] = field(default_factory=list)  # weight loads on other pools this step waited on

    def row(self) -> dict[str, Any]:
        """The step's metrics row as the sinks write it: ``step`` (1-based), its metrics, validation's."""
        return {"step": self.step + 1, **self.metrics, **(self.val_metrics or {})}

    @property
    def efficiency(self) -> float:
        return self.lower_bound / self.makespan if self.makespan > 0 else 1.0


def task_durations(infos: list[Info]) -> dict[TaskKey, float]:
    """Each task's seconds: its slowest rank's."""
    durations: dict[TaskKey, float] = {}
    for info in infos:
        key = (info.node, info.mb)
        durations[key] = max(durations.get(key, 0.0), info.end - info.start)
    return durations


def step_metrics(plan: Plan, infos: list[Info], submitted_at: float) -> tuple[dict[str, float], float, float]:
    """``(metrics, makespan, lower bound)`` of one run of ``plan`` (a step, or validation) from its task reports."""
    reduction = Reduction()
    durations = task_durations(infos)
    timing: dict[str, float] = {}
    for info in infos:
        if info.rank not in plan.tasks[(info.node, info.mb)].collected:
            continue  # a rank repeating rank 0's computation (dispatch "all")
        reduction.add(info.metrics, weight=float(max(info.rows, 1)))
    for key, d in durations.items():
        timing[key[0]] = timing.get(key[0], 0.0) + d
    metrics = {name: float(v) for name, v in reduction.values().items()}
    for node, d in timing.items():
        metrics[f"timing/{node}"] = d
    start = min((i.start for i in infos), default=submitted_at)
    makespan = max((i.end for i in infos), default=start) - start
    critical, (_, work) = bounds_of(plan, durations)
    bound = max(critical, work)
    metrics["timing/step"] = makespan
    metrics["scheduler/lower_bound"] = bound
    metrics["scheduler/critical_path"] = critical
    metrics["scheduler/efficiency"] = bound / makespan if makespan > 0 else 1.0
    g = plan.graph
    versions = [i.version for i in infos if i.version is not None and g.nodes[i.node].op.role]
    if g.state_edges and versions:
        metrics["scheduler/min_weight_version"] = float(min(versions))
    return metrics, makespan, bound


def check_versions(plan: Plan, infos: list[Info]) -> None:
    """Raise :class:`~flowrl.plan.staleness.VersionNotPlanned` for the first task that ran on another
    weight version than the plan has its step use (:meth:`~flowrl.plan.staleness.Gate.version`)."""
    for info in infos:
        gates = plan.tasks[(info.node, info.mb)].gates
        planned = planned_version(gates, info.step)
        if planned is not None and info.version != planned:
            role = plan.graph.nodes[info.node].role
            how = ("loaded from the update on another pool" if any(g.sync_role for g in gates)
                   else "on the updater's own pool")
            raise VersionNotPlanned(
                f"node {info.node!r} at step {info.step + 1} ran on weight version {info.version} of role "
                f"{role!r} on {info.pool}[{info.rank}] (pid {info.pid}), but the plan has it use version "
                f"{planned} (staleness {max(g.staleness for g in gates)}, {how}): its samples would be "
                f"stamped with a version their weights do not have, or mix versions; the weight version "
                f"is the worker's count, restored from a checkpoint on --resume")


def pipeline_metrics(plan: Plan, infos: list[Info], last_end: float | None) -> tuple[dict[str, float], float | None]:
    """Steps overlap when staleness >= 1: a step's own makespan then includes waiting
    behind the previous one; what counts is the interval between finished steps against
    the busiest pool's work per step. Returns the metrics and this step's end."""
    if not infos:
        return {}, last_end
    end = max(i.end for i in infos)
    out: dict[str, float] = {}
    if last_end is not None and end > last_end:
        interval = end - last_end
        work = max(pool_work(plan, task_durations(infos)).values(), default=0.0)
        out["timing/interval"] = interval
        out["scheduler/pipeline_efficiency"] = min(1.0, work / interval)
    return out, end


def node_states(plan: Plan, ended: dict[TaskKey, float]) -> dict[str, str]:
    """Each node's state in a step: done, running (inputs ready) or waiting."""
    states: dict[str, str] = {}
    for key, task in plan.tasks.items():
        if key in ended:
            state = "done"
        elif all(d in ended for d in task.deps):
            state = "running"
        else:
            state = "waiting"
        prev = states.get(task.node)
        # a node is done when all its micro-batches are; running when any is
        if prev is None or state == "running" or (prev == "done" and state != "done"):
            states[task.node] = state
    return states


__all__ = ["StepResult", "node_states", "pipeline_metrics", "step_metrics"]
