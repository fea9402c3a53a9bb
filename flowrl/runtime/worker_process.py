"""A worker in a process of its own (a Ray actor): the :class:`~flowrl.runtime.worker.Worker`, plus
what its process does before its first task.

Before any role is built (and so before transformers is imported) the process's
output goes to the run's log and known library warnings are filtered
(:mod:`flowrl.runtime.runlog`); it records its start-up (:mod:`flowrl.runtime.startup`):
the interpreter and Ray, its imports, each role it built, joining its process group.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from flowrl.runtime.startup import IMPORTED_AT, Span, process_start  # first: its import time is a mark
from flowrl.runtime.errors import NodeError
from flowrl.runtime.runlog import capture_worker_output, quiet_known_warnings
from flowrl.runtime.pools import RoleBuild
from flowrl.runtime.worker import Worker


class ProcessWorker(Worker):
    """:class:`Worker` as a process of its own: output to ``log``, start-up recorded."""

    def __init__(self, log: str | None, pool: str, rank: int, world_size: int, roles: list[RoleBuild],
                 *args: Any, **kwargs: Any) -> None:
        entered = time.time()
        who = f"{pool}[{rank}]"
        if log:
            capture_worker_output(Path(log), f"{who} (pid {os.getpid()})")
        else:
            quiet_known_warnings()
        pid = os.getpid()
        self.spans = [Span(who, "interpreter and Ray started", process_start(), IMPORTED_AT, pid),
                      Span(who, "flowrl runtime imported", IMPORTED_AT, entered, pid)]
        self._failed: NodeError | None = None
        try:
            super().__init__(pool, rank, world_size, [self._timed(rb, who) for rb in roles], *args, **kwargs)
        except NodeError as e:  # raised by ping: as a task's error it reaches the driver as raised, where
            self._failed = e    # Ray would report a failed constructor as a dead actor with its own traceback

    def _timed(self, rb: RoleBuild, who: str) -> RoleBuild:
        """``rb`` with a factory that records how long the build took."""
        if rb.shares is not None:
            return rb
        factory = rb.factory

        def build(config: Any, ctx: Any) -> Any:
            start = time.time()
            try:
                return factory(config, ctx)
            finally:
                self.spans.append(Span(who, f"role {rb.name} built ({rb.kind})", start, time.time(), os.getpid()))

        return replace(rb, factory=build)

    def join_group(self, *args: Any, **kwargs: Any) -> int:
        start = time.time()
        try:
            return super().join_group(*args, **kwargs)
        finally:
            self.spans.append(Span(f"{self.pool}[{self.rank}]", "joined its process group, roles built",
                                   start, time.time(), os.getpid()))

    def ping(self) -> int:
        if self._failed is not None:
            raise self._failed
        return super().ping()

    def startup_spans(self) -> list[Span]:
        return list(self.spans)


__all__ = ["ProcessWorker"]
