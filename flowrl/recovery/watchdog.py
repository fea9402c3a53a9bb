"""The watchdog: a task that has *run* past its timeout fails the step, named.

A task is timed from when its inputs were done and its worker was free for it
(not from when it was queued), so a slow upstream node or a long queue is never
blamed on the task behind it: that node's own watchdog fires first.

The error carries the stuck worker's Python stacks, every thread
(:mod:`flowrl.runtime.hangs`), so it says which line the operator is stuck on;
for a task on several ranks of a pool's group, every rank's, headed by which
ranks are inside the collective that does not complete and which are not. It
names the node (:class:`TaskTimeout`), so the live view can mark it stuck.
Every node has a timeout: its own ``timeout_s``, else ``schedule.timeout_s``
(one hour unless set; ``null`` turns it off).

A hang is reported long before that: once the run can predict its tasks' seconds (from
``costs.json``, or from the steps it measured: the plan check's prediction), a task that has run
``trainer.stuck_factor`` times its prediction (10×) and at least ``trainer.stuck_min_s`` (60 s)
is reported stuck with its worker's stacks, once (:class:`StuckReport`); the timeout still
fails it.

Example::

    check_timeouts(step, plan, graph, pending, ended, submitted_at, worker_free, label, stacks)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from flowrl.graph import Graph
from flowrl.errors import NodeTimeoutError
from flowrl.runtime.hangs import collective_summary
from flowrl.plan.planner import DRIVER, Plan

TaskKey = tuple[str, int | None]


class TaskTimeout(NodeTimeoutError):
    """A task past its timeout; ``node``: its node (None: a weight sync)."""

    def __init__(self, message: str, node: str | None = None) -> None:
        super().__init__(message)
        self.node = node


@dataclass
class StuckReport:
    """Where a task far past its predicted seconds is reported (``say``), each task once; ``expected()``: every
    task's predicted seconds now (None before the run can predict)."""

    say: Callable[[str], None]
    expected: Callable[[], dict[TaskKey, float] | None]
    reported: set[tuple[int, TaskKey]] = field(default_factory=set)

    def past(self, graph: Graph, step: int, key: TaskKey, ran: float) -> float | None:
        """The predicted seconds of ``key`` when it is newly past its stuck threshold after ``ran`` seconds."""
        factor, least = graph.config.trainer.stuck_factor, graph.config.trainer.stuck_min_s
        predicted = (self.expected() or {}).get(key) if factor is not None else None
        if not predicted or ran <= max(least, factor * predicted) or (step, key) in self.reported:
            return None
        self.reported.add((step, key))
        return predicted


def check_timeouts(
    step: int,
    plan: Plan,
    graph: Graph,
    pending: dict[object, tuple[TaskKey | None, str, int]],
    ended: dict[TaskKey, float],
    submitted_at: float,
    worker_free: dict[tuple[str, int], float],
    label: Callable[[str, int], str],
    stacks: Callable[[str, int], str] | None = None,
    stuck: StuckReport | None = None,
) -> None:
    """Raise :class:`TaskTimeout` for the first pending task past its ``timeout_s``; report each task newly
    far past its predicted seconds to ``stuck``.

    ``pending`` maps a handle to ``(task key or None for a sync/snapshot, pool, rank)``;
    ``stacks(pool, rank)``: that worker's Python stacks, shown in the error.
    """
    now = time.time()
    default = graph.config.schedule.timeout_s
    busy = {(pool, rank) for k, pool, rank in pending.values() if k is None}  # syncs, snapshots
    first: dict[tuple[str, int], object] = {}  # each worker's earliest pending handle (reports are in submit order)
    for h, (_, pool, rank) in pending.items():
        first.setdefault((pool, rank), h)
    for h, (key, pool, rank) in pending.items():
        if key is None:  # a weight sync: timed from when its worker was free for it
            ready = max(submitted_at, worker_free.get((pool, rank), 0.0))
            if default is not None and first[(pool, rank)] is h and now - ready > default:
                raise TaskTimeout(
                    f"loading weights on {label(pool, rank)} (for step {step + 1}) has taken {now - ready:.1f}s, "
                    f"past schedule.timeout_s={default:g}" + _where(pool, [rank], label, stacks))
            continue
        limit = graph.nodes[key[0]].timeout_s or default
        if limit is None and stuck is None:
            continue
        deps = plan.tasks[key].deps
        if any(d not in ended for d in deps):
            continue  # still waiting on its inputs; that node's own watchdog fires first
        ready = max([ended[d] for d in deps] + [submitted_at])
        if pool != DRIVER:
            queue = plan.pool_order[pool]
            before = queue[: queue.index(key)]
            if (pool, rank) in busy or any(k not in ended for k in before):
                continue  # queued behind other work on its worker
            ready = max([ready, worker_free.get((pool, rank), 0.0)] + [ended[k] for k in before])
        ranks = plan.tasks[key].ranks if len(plan.tasks[key].ranks) > 1 else [rank]
        where = (f"node {key[0]!r} (step {step + 1}" + (f", micro-batch {key[1]}" if key[1] is not None else "")
                 + f") has run {now - ready:.1f}s on {label(pool, rank)}")
        predicted = stuck.past(graph, step, key, now - ready) if stuck is not None else None
        if predicted is not None and (limit is None or now - ready <= limit):
            stuck.say(f"{where}, {(now - ready) / predicted:.0f}× its predicted {predicted:.3g}s "
                      f"(trainer.stuck_factor={graph.config.trainer.stuck_factor:g}, trainer.stuck_min_s="
                      f"{graph.config.trainer.stuck_min_s:g}): it looks stuck"
                      + (f"; schedule.timeout_s={limit:g} fails it" if limit is not None else "")
                      + _where(pool, ranks, label, stacks))
        if limit is not None and now - ready > limit:
            waited = [f"{d[0]}" + (f"[{d[1]}]" if d[1] is not None else "") for d in deps]
            raise TaskTimeout(
                f"{where}, past its "
                f"timeout_s={limit:g}; its inputs ({', '.join(waited) or 'the data'}) were ready and its "
                f"worker free, so it is the operator itself that is slow or stuck" + _where(pool, ranks, label, stacks),
                key[0])


def _where(pool: str, ranks: list[int], label: Callable[[str, int], str],
           stacks: Callable[[str, int], str] | None) -> str:
    """The stuck workers' stacks (and, for several ranks, which are inside a collective) as the tail of a
    timeout's message."""
    where = {r: stacks(pool, r) for r in ranks} if stacks is not None else {}
    summary = collective_summary(pool, where) if len(ranks) > 1 else ""
    return (f"\n{summary}" if summary else "") + "".join(
        f"\n--- where {label(pool, r)} is (every thread, innermost call last) ---\n{text.rstrip()}"
        for r, text in where.items() if text)


__all__ = ["StuckReport", "TaskTimeout", "check_timeouts"]
