"""The critical path of a step: the longest chain of dependent tasks, and every task's place on it.

One walk over the task graph serves every reader: the planner's upward ranks (a task's longest
path to the end of the step, the priority :mod:`~flowrl.plan.ordering` schedules by), a
makespan's lower bounds (:func:`~flowrl.plan.simulate.bounds_of`: what every step reports and the
plan check predicts) and the search's critical path column.

Example::

    cp = critical_path(plan.tasks, seconds, plan.order)
    cp.length, cp.path                   # 1.9, [("generate", 0), ("reward", 0), ...]
    cp.through(key)                      # the longest chain through one task
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Mapping

import networkx as nx

if TYPE_CHECKING:
    from flowrl.plan.planner import Task, TaskKey


@dataclass
class CriticalPath:
    """Longest paths through one step's tasks, each task taking ``seconds[key]``."""

    seconds: dict[TaskKey, float]
    head: dict[TaskKey, float]  # the longest chain that ends where the task can start
    tail: dict[TaskKey, float]  # the longest chain left after the task ends
    path: list[TaskKey]  # the longest chain, first task first
    length: float  # its seconds: when the step would end with every task started as soon as its inputs are

    def through(self, key: TaskKey) -> float:
        """The longest chain through the task."""
        return self.head[key] + self.seconds[key] + self.tail[key]

    def upward_rank(self, key: TaskKey) -> float:
        """The task's own seconds and the longest chain after it: its critical path to the end of the step."""
        return self.seconds[key] + self.tail[key]


def critical_path(tasks: Mapping[TaskKey, Task], seconds: Mapping[TaskKey, float] | None = None,
                  order: Iterable[TaskKey] | None = None) -> CriticalPath:
    """The longest paths through ``tasks`` (each waits on its ``deps``), a task taking ``seconds[key]``
    (missing: 0) or, without ``seconds``, its declared cost. ``order``: a topological order of the
    tasks (default: one networkx finds); among equally long chains, the one ending first in it wins,
    and a task's longest way in comes from the input with the latest end (then the largest key)."""
    if seconds is None:
        dur = {k: t.cost for k, t in tasks.items()}
    else:
        dur = {k: seconds.get(k, 0.0) for k in tasks}
    if order is None:
        g = nx.DiGraph()
        g.add_nodes_from(tasks)
        g.add_edges_from((d, k) for k, t in tasks.items() for d in t.deps)
        order = nx.topological_sort(g)
    order = list(order)
    head: dict[TaskKey, float] = {}
    before: dict[TaskKey, TaskKey | None] = {}
    for key in order:
        end, prev = max(((head[d] + dur[d], d) for d in tasks[key].deps), default=(0.0, None))
        head[key], before[key] = end, prev
    succ: dict[TaskKey, list[TaskKey]] = {k: [] for k in tasks}
    for key, t in tasks.items():
        for d in t.deps:
            succ[d].append(key)
    tail: dict[TaskKey, float] = {}
    for key in reversed(order):
        tail[key] = max((dur[s] + tail[s] for s in succ[key]), default=0.0)
    if not order:
        return CriticalPath(dur, head, tail, [], 0.0)
    last: TaskKey | None = max(order, key=lambda k: head[k] + dur[k])
    length = head[last] + dur[last]
    path = []
    while last is not None:
        path.append(last)
        last = before[last]
    return CriticalPath(dur, head, tail, path[::-1], length)


__all__ = ["CriticalPath", "critical_path"]
