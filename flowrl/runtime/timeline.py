"""The run's timeline: every task's record, and the start-up of every process; Chrome traces.

* :class:`Timeline`: every task invocation, with start and end per worker, in
  arrival order; step bounds; :meth:`Timeline.to_chrome_trace` (open it in
  ui.perfetto.dev).
* The start-up: which process did what, when, from ``flowrl run`` to the first
  step. Every process records :class:`Span` s of its own start (the driver: Ray's
  start, placement; a worker: its interpreter and Ray, its imports, each role it
  built, joining its process group); the backend gathers them
  (``Backend.startup_spans``) and the trace and ``flowrl run -v``
  (:func:`describe`) show them, with each worker's first task from the timeline.

A worker imports this module first, so its import time marks the process's
start (:data:`IMPORTED_AT`): it imports nothing heavy.

Example::

    with span(spans, "driver", "ray init"):
        ray.init()
    print("\\n".join(describe(spans, timeline.records)))
    timeline.to_chrome_trace("run.trace.json", spans)
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

if TYPE_CHECKING:
    from flowrl.runtime.worker import Info

#: when this module was first imported in this process
IMPORTED_AT = time.time()


@dataclass(frozen=True)
class Span:
    """One thing a process did while starting: ``who`` (``driver``, ``train[0]``) did ``what``."""

    who: str
    what: str
    start: float
    end: float
    pid: int = 0


def process_start(pid: int | str = "self") -> float:
    """When process ``pid`` started (wall clock, to 10 ms), from /proc; this module's import
    time where /proc cannot tell."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            started_ticks = int(f.read().rpartition(")")[2].split()[19])  # field 22, starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return IMPORTED_AT


@contextmanager
def span(spans: list[Span], who: str, what: str) -> Iterator[None]:
    """Record the time the ``with`` block takes as ``who`` doing ``what``."""
    start = time.time()
    try:
        yield
    finally:
        spans.append(Span(who, what, start, time.time(), os.getpid()))


def first_tasks(records: Any) -> list[Span]:
    """Each worker's first task of the first training step, from a timeline's records."""
    first: dict[str, Any] = {}
    for r in records:
        if r.plan != "train":
            continue
        who = f"{r.pool}[{r.rank}]"
        if who not in first or r.start < first[who].start:
            first[who] = r
    return [Span(who, f"first task ({r.node}, step {r.step + 1})", r.start, r.end, r.pid)
            for who, r in first.items()]


def describe(spans: list[Span], records: Any = (), t0: float | None = None) -> list[str]:
    """The start-up timeline as lines: seconds since ``t0`` (default: this process's start),
    each span's duration, who and what; the first training task of each worker last."""
    t0 = process_start() if t0 is None else t0
    every = sorted([*spans, *first_tasks(records)], key=lambda s: (s.start, s.end))
    if not every:
        return []
    lines = ["start-up timeline (seconds since the command started):"]
    for s in every:
        lines.append(f"  {s.start - t0:7.2f} → {s.end - t0:7.2f}  ({s.end - s.start:5.2f} s)  "
                     f"{s.who:<12} {s.what}")
    return lines


def chrome_events(spans: list[Span], t0: float, pid: int) -> list[dict[str, Any]]:
    """The spans as Chrome trace events: one process (``pid``) named "start-up", a thread per process."""
    whos = sorted({s.who for s in spans}, key=lambda w: (w != "driver", w))
    tid = {w: i for i, w in enumerate(whos)}
    events: list[dict[str, Any]] = [{"ph": "M", "name": "process_name", "pid": pid, "args": {"name": "start-up"}}]
    events += [{"ph": "M", "name": "thread_name", "pid": pid, "tid": tid[w], "args": {"name": w}} for w in whos]
    events += [{"ph": "X", "name": s.what, "cat": "startup", "pid": pid, "tid": tid[s.who],
                "ts": (s.start - t0) * 1e6, "dur": max(0.0, s.end - s.start) * 1e6, "args": {"os_pid": s.pid}}
               for s in spans]
    return events


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
        ``startup`` spans (:class:`Span`) as a process of their own, before them."""
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


__all__ = ["IMPORTED_AT", "Span", "Timeline", "chrome_events", "describe", "first_tasks", "process_start", "span"]
