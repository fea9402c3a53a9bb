"""The order a pool runs its tasks in: list scheduling by declared cost, critical path first.

Repeatedly, the task that can start earliest (its inputs done, its pool free)
goes next; among equals, the one with the longest path to the end of the step
(its *upward rank*). So a pool fills the time it would spend waiting for one
upstream micro-batch with work that is already ready. ``schedule.order:
declared`` instead keeps the order the nodes are written in (a hand-written
loop's order), for comparison.

Example::

    upward_ranks(tasks)
    order = priority_order(tasks)        # a topological order of the step's tasks
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import networkx as nx

from flowrl.plan.critical import critical_path
from flowrl.plan.pools import DRIVER

if TYPE_CHECKING:
    from flowrl.plan.planner import Task


def upward_ranks(tasks: dict[tuple[str, int | None], Task]) -> None:
    """Set each task's ``rank``: its critical path to the end of the step, by declared cost."""
    cp = critical_path(tasks)
    for key, t in tasks.items():
        t.rank = cp.upward_rank(key)


def declared_order(tasks: dict[tuple[str, int | None], Task], nodes: list[str]) -> list[tuple[str, int | None]]:
    """Nodes in the order they are written, micro-batches in order (a hand-written loop's order)."""
    g = nx.DiGraph()
    for key, t in tasks.items():
        g.add_node(key)
        g.add_edges_from((d, key) for d in t.deps)
    rank = {n: i for i, n in enumerate(nodes)}
    return list(nx.lexicographical_topological_sort(g, key=lambda k: (rank[k[0]], k[1] or 0)))


def priority_order(tasks: dict[tuple[str, int | None], Task]) -> list[tuple[str, int | None]]:
    """List-schedule the tasks by declared cost; the order they start in (a topological order)."""
    seq = {key: i for i, key in enumerate(tasks)}
    end: dict[tuple[str, int | None], float] = {}
    pool_free: dict[str, float] = {}
    order: list[tuple[str, int | None]] = []
    left = set(tasks)
    while left:
        best, best_key = None, None
        for key in left:
            t = tasks[key]
            if not all(d in end for d in t.deps):
                continue
            start = max((end[d] for d in t.deps), default=0.0)
            if t.pool != DRIVER:
                start = max(start, pool_free.get(t.pool, 0.0))
            rank_key = (round(start, 9), -t.rank, seq[key])
            if best is None or rank_key < best:
                best, best_key = rank_key, key
        assert best_key is not None, "the task graph has a cycle"
        t = tasks[best_key]
        end[best_key] = best[0] + t.cost
        if t.pool != DRIVER:
            pool_free[t.pool] = end[best_key]
        order.append(best_key)
        left.remove(best_key)
    return order


__all__ = ["declared_order", "priority_order", "upward_ranks"]
