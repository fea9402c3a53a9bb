"""Every task invocation, with start and end per worker; step bounds; Chrome traces.

Example::

    timeline.to_chrome_trace("run.trace.json")   # open in ui.perfetto.dev
"""

from __future__ import annotations

import json
from collections import deque
from pathlib import Path

from flowrl.runtime.startup import Span, chrome_events
from flowrl.runtime.worker import Info


class Timeline:
    """All task records of a run, in arrival order."""

    def __init__(self) -> None:
        self.records: list[Info] | deque[Info] = []

    def keep_last(self, n: int) -> None:
        """Keep only the newest ``n`` records (a long run without a trace: the driver's memory stays flat)."""
        self.records = deque(self.records, maxlen=n)

    def add(self, info: Info) -> None:
        self.records.append(info)

    def of_node(self, node: str, step: int | None = None, plan: str = "train") -> list[Info]:
        """The records of ``node`` (at ``step``) of ``plan``'s runs (``val``: validation's)."""
        return [r for r in self.records if r.node == node and r.plan == plan and (step is None or r.step == step)]

    def span(self, node: str, step: int) -> tuple[float, float]:
        """Earliest start and latest end of a node's tasks in a step."""
        recs = self.of_node(node, step)
        return min(r.start for r in recs), max(r.end for r in recs)

    def overlapping(self, a: str, step_a: int, b: str, step_b: int) -> list[tuple[Info, Info]]:
        """Pairs of recorded tasks of node ``a`` at ``step_a`` and node ``b`` at ``step_b`` that
        ran at the same time (each started before the other ended): overlap as it happened."""
        return [(x, y) for x in self.of_node(a, step_a) for y in self.of_node(b, step_b)
                if x.start < y.end and y.start < x.end]

    def to_chrome_trace(self, path: str | Path, startup: list[Span] = ()) -> Path:
        """Write a Chrome/Perfetto trace: one process per pool, one thread per rank; the
        ``startup`` spans (:mod:`flowrl.runtime.startup`) as a process of their own, before them."""
        starts = [r.start for r in self.records] + [s.start for s in startup]
        t0 = min(starts) if starts else 0.0
        pools = sorted({r.pool for r in self.records})
        pid = {p: i + 1 for i, p in enumerate(pools)}
        events: list[dict] = [
            {"ph": "M", "name": "process_name", "pid": pid[p], "args": {"name": f"pool {p}"}} for p in pools
        ]
        if startup:
            events += chrome_events(list(startup), t0, len(pools) + 1)
        for r in self.records:
            name = (r.node if r.mb is None else f"{r.node}[{r.mb}]") + ("" if r.plan == "train" else f" ({r.plan})")
            events.append({
                "ph": "X", "name": name, "cat": r.pool, "pid": pid[r.pool], "tid": r.rank,
                "ts": (r.start - t0) * 1e6, "dur": max(0.0, r.end - r.start) * 1e6,
                "args": {"step": r.step, "micro_batch": r.mb, "rows": r.rows, "version": r.version,
                         "worker_pid": r.pid, "plan": r.plan},
            })
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
        return path
