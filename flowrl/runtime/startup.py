"""The start-up timeline: which process did what, when, from ``flowrl run`` to the first step.

Every process records :class:`Span` s of its own start (the driver: Ray's start,
placement; a worker: its interpreter and Ray, its imports, each role it built,
joining its process group); the backend gathers them (``Backend.startup_spans``)
and the trace (:meth:`~flowrl.runtime.timeline.Timeline.to_chrome_trace`) and
``flowrl run -v`` (:func:`describe`) show them, with each worker's first task
from the run's timeline.

Example::

    with span(spans, "driver", "ray init"):
        ray.init()
    print("\\n".join(describe(spans, timeline)))
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

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


__all__ = ["IMPORTED_AT", "Span", "chrome_events", "describe", "first_tasks", "process_start", "span"]
