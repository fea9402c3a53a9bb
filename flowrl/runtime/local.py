"""The ``local`` backend: every pool's ranks as threads of this process (tests, debugging).

The ranks share one process and form no process group: each keeps a full copy
of its roles and an update gets the whole batch (the plan runs it as declared).
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import queue
import threading
import time
from typing import Any

from flowrl.runtime.backend import Backend, Supervisor, backend
from flowrl.timeouts import THREAD_EXIT_S
from flowrl.runtime.hangs import STACKS_TIMEOUT_S, thread_stacks
from flowrl.plan.pools import DRIVER, PoolSpec
from flowrl.plan.traits import LOCAL
from flowrl.runtime.worker import Call, NodeEntry, Worker
from flowrl.store.runlog import RUN_LOG_ENV


@backend(LOCAL)
class LocalBackend(Backend):
    """Everything in this process; threads stand in for worker processes."""

    def __init__(self, address: str | None = None) -> None:
        self.workers: dict[tuple[str, int], Worker] = {}
        self.queues: dict[tuple[str, int], _DaemonExecutor] = {}
        self.driver_pool = _DaemonExecutor(serial=False, name="flowrl-driver")

    def start(self, pools: list[PoolSpec], nodes: dict[str, dict[str, NodeEntry]], seed: int,
              driver: bool = True) -> None:
        if self.log_path is not None:  # operators run here: what libraries log goes to the run's log
            os.environ[RUN_LOG_ENV] = str(self.log_path)
        for p in pools:
            for rank in range(p.workers):
                self.workers[(p.name, rank)] = Worker(p.name, rank, p.workers, p.roles, nodes, seed,
                                                      threads=max(1, int(p.cpus)), gpus=p.gpus)
                self.queues[(p.name, rank)] = _DaemonExecutor(serial=True, name=f"flowrl-{p.name}{rank}")
        if driver:
            self.workers[(DRIVER, 0)] = Worker(DRIVER, 0, 1, [], nodes, seed)

    def _executor(self, pool: str, rank: int) -> "_DaemonExecutor":
        return self.driver_pool if pool == DRIVER else self.queues[(pool, rank)]

    def submit(self, pool: str, rank: int, call: Call, inputs: list[Any]) -> tuple[Any, Any]:
        worker = self.workers[(pool, rank)]

        def run() -> Any:
            return worker.execute(call, *[f.result() for f in inputs])

        both = self._executor(pool, rank).submit(run)
        return _Projection(both, 0), _Projection(both, 1)

    def call(self, pool: str, rank: int, method: str, *args: Any) -> Any:
        worker = self.workers[(pool, rank)]

        def run() -> Any:
            vals = [a.result() if isinstance(a, (cf.Future, _Projection)) else a for a in args]
            return getattr(worker, method)(*vals)

        return self._executor(pool, rank).submit(run)

    def put(self, value: Any) -> Any:
        f: cf.Future = cf.Future()
        f.set_result(value)
        return f

    def get(self, handle: Any, timeout: float | None = None) -> Any:
        return handle.result(timeout=timeout)

    def wait(self, handles: list[Any], timeout: float) -> tuple[list[Any], list[Any]]:
        deadline = time.monotonic() + timeout
        while True:
            done = [h for h in handles if h.done()]
            if done or time.monotonic() >= deadline:
                return done, [h for h in handles if not h.done()]
            time.sleep(min(0.005, max(0.0, deadline - time.monotonic())))

    def make_supervisor(self) -> "LocalSupervisor":
        return LocalSupervisor(self)

    def shutdown(self) -> None:
        for q in self.queues.values():
            q.shutdown()
        self.driver_pool.shutdown()
        for w in self.workers.values():  # a rollout engine's processes (vLLM) end with the run, not the process
            for role in {id(r): r for r in w.roles.values()}.values():
                role.close()
        if self.log_path is not None and os.environ.get(RUN_LOG_ENV) == str(self.log_path):
            del os.environ[RUN_LOG_ENV]


class LocalSupervisor(Supervisor):
    """The local backend's threads never die on their own; a stuck one's stack is read in this process."""

    backend: LocalBackend

    def stacks(self, pool: str, rank: int, timeout: float = STACKS_TIMEOUT_S) -> str:
        return thread_stacks(names=(self.backend._executor(pool, rank).name,))


class _DaemonExecutor:
    """Runs callables on daemon threads: one thread in submission order (a
    pool's queue), or a thread per call (the driver). Daemon threads, unlike a
    ThreadPoolExecutor's, never keep the process alive — a hung operator that
    the watchdog already reported must not block exit."""

    def __init__(self, serial: bool, name: str) -> None:
        self.serial, self.name = serial, name
        self.queue: queue.Queue = queue.Queue()
        self.closed = False
        self.thread: threading.Thread | None = None
        if serial:
            self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
            self.thread.start()

    def submit(self, fn: Any) -> cf.Future:
        fut: cf.Future = cf.Future()
        if self.closed:
            fut.set_exception(RuntimeError(f"{self.name} is shut down"))
        elif self.serial:
            self.queue.put((fn, fut))
        else:
            threading.Thread(target=self._run, args=(fn, fut), name=self.name, daemon=True).start()
        return fut

    @staticmethod
    def _run(fn: Any, fut: cf.Future) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
            fut.set_exception(e)

    def _loop(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            self._run(*item)

    def shutdown(self) -> None:
        self.closed = True
        if self.serial:
            while not self.queue.empty():
                try:
                    _, fut = self.queue.get_nowait()
                    fut.cancel()
                except (queue.Empty, TypeError):
                    break
            self.queue.put(None)
            # let an idle thread leave before the interpreter tears torch down under it
            # (a thread still inside torch at exit aborts the process); a hung one stays
            if self.thread is not None and self.thread is not threading.current_thread():
                self.thread.join(timeout=THREAD_EXIT_S)


class _Projection:
    """One element of a future's tuple result, itself future-like."""

    def __init__(self, fut: cf.Future, index: int) -> None:
        self.fut, self.index = fut, index

    def result(self, timeout: float | None = None) -> Any:
        return self.fut.result(timeout=timeout)[self.index]

    def done(self) -> bool:
        return self.fut.done()

    def exception(self) -> BaseException | None:
        return self.fut.exception() if self.fut.done() else None


__all__ = ["LocalBackend", "LocalSupervisor"]
