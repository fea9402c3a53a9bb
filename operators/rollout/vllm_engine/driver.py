"""The one thread that drives vLLM's synchronous engine (``LLMEngine``): requests in, steps, results out.

vLLM's ``LLMEngine`` is not thread-safe and steps only when told. The driver
owns it: callers hand it requests (a batch's, or the agent loop's one at a
time: all are stepped together, so conversations interleave in vLLM's
scheduler) and jobs (a weight push, a probe). A job runs between steps once
the requests in flight have finished, and no request is admitted while one
waits, so a push never sees a half-generated request and costs nothing when
the engine is idle (vLLM's ``pause_generation`` is not needed).
"""

from __future__ import annotations

import threading
import uuid
from concurrent.futures import Future
from typing import Any, Callable, TypeVar

from flowrl.errors import RunError

T = TypeVar("T")


class EngineStopped(RunError):
    """The vLLM engine was shut down, or died, with requests still waiting on it."""


class Driver:
    """Steps ``engine`` (a vLLM ``LLMEngine``) in a daemon thread of its own."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._cond = threading.Condition()
        self._pending: list[tuple[str, dict, Any, Future]] = []
        self._jobs: list[tuple[Callable[[], Any], Future]] = []
        self._running: dict[str, Future] = {}  # the driver thread's own
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="flowrl-vllm", daemon=True)
        self._thread.start()

    def submit(self, prompt_ids: list[int], sampling: Any) -> Future:
        """A request; its future's result is vLLM's final ``RequestOutput``."""
        future: Future = Future()
        with self._cond:
            if self._stopped:
                raise EngineStopped("the vLLM engine is shut down")
            self._pending.append((uuid.uuid4().hex, {"prompt_token_ids": prompt_ids}, sampling, future))
            self._cond.notify()
        return future

    def call(self, job: Callable[[], T]) -> T:
        """Run ``job()`` on the driver thread when nothing is in flight, and wait for its result."""
        future: Future = Future()
        with self._cond:
            if self._stopped:
                raise EngineStopped("the vLLM engine is shut down")
            self._jobs.append((job, future))
            self._cond.notify()
        return future.result()

    def stop(self, timeout: float = 30.0) -> None:
        """Finish what is in flight, fail what waits, and end the thread."""
        with self._cond:
            self._stopped = True
            waiting, self._pending = self._pending, []
            jobs, self._jobs = self._jobs, []
            self._cond.notify()
        for future in [f for *_, f in waiting] + [f for _, f in jobs]:
            future.set_exception(EngineStopped("the vLLM engine was shut down before this request ran"))
        self._thread.join(timeout)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._pending or self._jobs or self._running or self._stopped):
                    self._cond.wait()
                if self._stopped and not self._running:
                    return
                job = self._jobs.pop(0) if self._jobs and not self._running else None
                admit, self._pending = ([], self._pending) if self._jobs else (self._pending, [])
            if job is not None:
                work, future = job
                try:
                    future.set_result(work())
                except BaseException as err:  # noqa: BLE001 - the caller re-raises it
                    future.set_exception(err)
                continue
            for request_id, prompt, sampling, future in admit:
                try:
                    self.engine.add_request(request_id, prompt, sampling)
                    self._running[request_id] = future
                except Exception as err:  # noqa: BLE001 - a bad request fails its caller, not the engine
                    future.set_exception(err)
            if self._running:
                self._step()

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as err:  # noqa: BLE001 - every waiting caller learns of it
            running, self._running = self._running, {}
            for future in running.values():
                future.set_exception(err)
            return
        for output in outputs:
            if output.finished:
                self._running.pop(output.request_id).set_result(output)
