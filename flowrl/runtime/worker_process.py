"""A worker in a process of its own (a Ray actor): the :class:`~flowrl.runtime.worker.Worker`, plus
what its process does before its first task.

It starts in two calls, so that its imports overlap the driver's own start: the
constructor needs only where the worker sits (pool, rank) and the modules its
roles come from, and imports them the moment the process exists; :meth:`ProcessWorker.setup`,
sent once the plan is made, builds the roles (the :class:`Worker`'s own start).
Before anything is imported the process's output goes to the run's log and known
library warnings are filtered (:mod:`flowrl.store.runlog`); it records its
start-up (:mod:`flowrl.runtime.timeline`): the interpreter and Ray, its imports,
each role it built, joining its process group.
"""

from __future__ import annotations

import importlib
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

from flowrl.runtime.timeline import IMPORTED_AT, Span, process_start, span  # first: its import time is a mark
from flowrl.errors import NodeError
from flowrl.store.runlog import capture_worker_output, quiet_known_warnings
from flowrl.plan.pools import RoleBuild
from flowrl.runtime.worker import NodeEntry, Worker


class ProcessWorker(Worker):
    """:class:`Worker` as a process of its own: output to ``log``, ``imports`` imported at once, start-up
    recorded; the roles are built by :meth:`setup` (in the constructor when ``setup`` holds its arguments)."""

    def __init__(self, pool: str, rank: int, world_size: int, log: str | None, imports: Sequence[str] = (),
                 setup: tuple[Any, ...] | None = None) -> None:
        entered = time.time()
        self.pool, self.rank, self.world_size = pool, rank, world_size
        self.who, pid = f"{pool}[{rank}]", os.getpid()
        if log:
            capture_worker_output(Path(log), f"{self.who} (pid {pid})")
        else:
            quiet_known_warnings()
        self.spans = [Span(self.who, "interpreter and Ray started", process_start(), IMPORTED_AT, pid),
                      Span(self.who, "flowrl runtime imported", IMPORTED_AT, entered, pid)]
        self._failed: NodeError | None = None
        with span(self.spans, self.who, "imported its roles' modules"):
            for module in imports:
                try:
                    importlib.import_module(module)
                except Exception:  # noqa: BLE001 - building the role imports it again and says what is wrong
                    pass
        if setup is not None:
            self.setup(*setup)

    def setup(self, roles: list[RoleBuild], nodes: dict[str, dict[str, NodeEntry]], seed: int = 0,
              threads: int = 1, gpus: float = 0.0, distributed: bool = False, first_process: bool = True) -> int:
        """Build the roles (a pool of N > 1: in :meth:`join_group`) for the plan's ``nodes``; the process's pid."""
        try:
            super().__init__(self.pool, self.rank, self.world_size, [self._timed(rb) for rb in roles], nodes, seed,
                             threads, gpus, distributed, first_process)
        except NodeError as e:  # raised by ping: the driver reports it as raised, once
            self._failed = e
        return os.getpid()

    def _timed(self, rb: RoleBuild) -> RoleBuild:
        """``rb`` with a factory that records how long the build took."""
        if rb.shares is not None:
            return rb
        factory = rb.factory

        def build(config: Any, ctx: Any) -> Any:
            start = time.time()
            try:
                return factory(config, ctx)
            finally:
                self.spans.append(Span(self.who, f"role {rb.name} built ({rb.kind})", start, time.time(),
                                       os.getpid()))

        return replace(rb, factory=build)

    def join_group(self, *args: Any, **kwargs: Any) -> int:
        if self._failed is not None:  # its roles were never built: say why, not what is missing for the group
            raise self._failed
        start = time.time()
        try:
            return super().join_group(*args, **kwargs)
        finally:
            self.spans.append(Span(self.who, "joined its process group, roles built", start, time.time(),
                                   os.getpid()))

    def ping(self) -> int:
        if self._failed is not None:
            raise self._failed
        return super().ping()

    def startup_spans(self) -> list[Span]:
        return list(self.spans)


__all__ = ["ProcessWorker"]
