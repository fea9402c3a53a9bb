"""Starting (or joining) Ray, in the background: its seconds overlap the driver's own start.

``ray.init`` of a local Ray takes seconds (its servers start, register, connect),
most of them waiting on other processes; the driver meanwhile loads the graph and
imports torch. :func:`begin` starts it on a thread as early as the backend is
known (``flowrl run`` calls it first thing); :meth:`RayStart.ready` waits for it
where the workers are created.

A local Ray's processes inherit the driver's environment, with one torch
thread and no tokenizer threads set in it (a ``runtime_env`` would make every
worker's start wait on Ray's runtime-env agent); a joined cluster's workers get
them through the ``runtime_env``.

On a busy machine a local Ray's own start can time out (its raylet has 30 s, fixed
inside Ray, to register): the start is tried again after a pause that grows
(:data:`TRIES`, or ``FLOWRL_RAY_START_TRIES``), and when every try failed one
:class:`RayStartError` says so, with the machine's load, that no run state was
touched, and what to try instead.

A local Ray listens on loopback only: an unauthenticated Ray runs code for
whoever reaches it, so it is closed to the network unless
``FLOWRL_RAY_LISTEN_ALL=1`` (``flowrl run --ray-listen-all``) opens it.

Example::

    start = begin(address=None)   # returns at once
    ...                           # load the graph, build the plan
    ray = start.ready()           # Ray is up (or the error of its start is raised here)
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from flowrl.errors import PlacementError, RunError
from flowrl.timeouts import RAY_REACH_S
from flowrl.runtime.timeline import Span
from flowrl.plan.traits import RAY


#: tries of a local Ray's start, and the pause before each try after the first
TRIES = 3
BACKOFF_S = (5.0, 20.0)


class RayStartError(RunError):
    """A local Ray did not start (every try timed out or failed); nothing of the run was read or written."""


class RayStart:
    """One start of Ray (or join of a cluster) on a daemon thread."""

    def __init__(self, address: str | None) -> None:
        self.address = address
        self.started_ray = False  # this process started the Ray it runs on (and shuts it down)
        self.span: Span | None = None
        self._error: BaseException | None = None
        self._done, self._release = threading.Event(), threading.Event()
        threading.Thread(target=self._run, name="flowrl-ray-init", daemon=True).start()

    def _run(self) -> None:
        start = time.time()
        try:
            self.started_ray = _init_ray(self.address)
        except BaseException as e:  # noqa: BLE001 - raised again by ready(), in the caller's thread
            self._error = e
        self.span = Span("driver", "ray.init", start, time.time(), os.getpid())
        self._done.set()
        # Ray's servers die with the *thread* that started them (their parent-death signal is
        # per thread): this one stays until Ray is shut down
        if self.started_ray:
            self._release.wait()

    def ready(self) -> Any:
        """The ``ray`` module, once initialised; raises what the start raised."""
        self._done.wait()
        if self._error is not None:
            raise self._error
        import ray

        return ray

    def release(self) -> None:
        """Let the starting thread end (call after ``ray.shutdown()``)."""
        self._release.set()


_PENDING: RayStart | None = None


def begin(address: str | None = None) -> RayStart:
    """Start Ray on a thread (once per process until :func:`take` hands the start to a backend)."""
    global _PENDING
    if _PENDING is None or _PENDING.address != address:
        _PENDING = RayStart(address)
    return _PENDING


def prestart(backend: str, address: str | None = None) -> None:
    """Begin Ray's start when ``backend`` is ``ray`` (``flowrl run`` calls it before it loads the graph)."""
    if backend == RAY.name:
        begin(address)


def exit_now(code: int) -> None:
    """End this process with ``code`` without waiting for a Ray start in flight (``flowrl run`` refusing
    before its run began: Ray's own exit would first wait for its start, a minute on a busy machine).
    Ray's servers die with the thread that started them; nothing of the run was written."""
    if _PENDING is not None and (not _PENDING._done.is_set() or _PENDING.started_ray):
        import sys

        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def take(address: str | None) -> RayStart:
    """The start :func:`begin` made for ``address`` (or a new one), now owned by the caller."""
    global _PENDING
    start = _PENDING if _PENDING is not None and _PENDING.address == address else RayStart(address)
    _PENDING = None
    return start


def _init_ray(explicit: str | None) -> bool:
    """Join ``explicit`` (or ``RAY_ADDRESS``), else start a local Ray listening on 127.0.0.1 only;
    True when this process started a Ray of its own. Nothing to do when Ray is up already."""
    address = explicit or os.environ.get("RAY_ADDRESS") or None
    loopback = not address and os.environ.get("FLOWRL_RAY_LISTEN_ALL", "") not in ("1", "true", "yes")
    if loopback:
        # Ray binds every server to its node address and takes 127.0.0.1 as that address
        # only with its single-machine switch; set before Ray reads it (here and in the
        # processes ray.init starts) — _node_ip_address="127.0.0.1" is rewritten to the LAN IP
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    # a failed task's error reaches the user once, from the runtime; Ray would print it again
    # (with its own traceback) for every dependent result nobody fetched
    os.environ.setdefault("RAY_IGNORE_UNHANDLED_ERRORS", "1")
    # idle worker processes Ray would start ahead for this driver: no actor here runs in one (each
    # asks for its own resources), and on a small machine their start slows the workers' own
    os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
    import ray

    if ray.is_initialized():
        return False
    if loopback:
        from ray._private import ray_constants

        ray_constants.ENABLE_RAY_CLUSTER = False
    env = {"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}}
    # Ray's own start-up chatter would interleave with the run's view; errors still show
    quiet = {"logging_level": logging.ERROR, "log_to_driver": True}
    origin = "--address" if explicit else "RAY_ADDRESS in the environment"
    if address:
        _reachable(address, origin)
        try:
            ray.init(address=address, runtime_env=env, **quiet)
        except ConnectionError as e:
            raise PlacementError(f"cannot join the Ray cluster at {address} ({origin}): {e}. Start it, "
                                 f"or unset RAY_ADDRESS to run on a local Ray") from None
    else:  # a Ray of its own: ray.init() alone would join whatever local cluster another process started
        # its processes inherit this one's environment: a runtime_env instead would make each worker's start
        # wait on Ray's runtime-env agent (1-2 s of a first step on 2 busy cores)
        os.environ.update(env["env_vars"])
        _start_local(lambda: ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, **quiet),
                     ray.shutdown)
    return True


def _start_local(init: Any, shutdown: Any, sleep: Any = time.sleep) -> None:
    """``init()`` until it succeeds, :data:`TRIES` times at most (``FLOWRL_RAY_START_TRIES``), pausing longer
    before each new try and cleaning up what a failed try left; then one :class:`RayStartError`."""
    tries = max(1, int(os.environ.get("FLOWRL_RAY_START_TRIES", TRIES)))
    start, causes = time.time(), []
    for attempt in range(tries):
        if attempt:
            sleep(BACKOFF_S[min(attempt, len(BACKOFF_S)) - 1])
        try:
            init()
            return
        except Exception as e:  # noqa: BLE001 - Ray raises a bare Exception when its node times out
            causes.append(str(e).split(". ")[0].strip() or type(e).__name__)
            try:
                shutdown()  # the processes a failed start left behind
            except Exception:  # noqa: BLE001 - nothing more to clean
                pass
    load = f", load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores" if hasattr(os, "getloadavg") else ""
    raise RayStartError(
        f"a local Ray did not start ({tries} tries in {time.time() - start:.0f} s{load}: {causes[-1]}); nothing "
        f"of the run was read or written, its checkpoints are untouched. Try again when the machine is less busy, "
        f"run with --backend local, or allow more tries with FLOWRL_RAY_START_TRIES={tries * 2}")


def _reachable(address: str, origin: str, timeout_s: float = RAY_REACH_S) -> None:
    """Fail fast, naming ``origin``, when a ``host:port`` cluster address does not answer (Ray would retry
    for minutes)."""
    import socket

    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "://" in address:
        return  # "auto", ray://...: Ray resolves those itself
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise PlacementError(f"cannot reach the Ray cluster at {address} ({origin}): {e.strerror or e}. Start "
                             f"it, fix the address, or unset RAY_ADDRESS to run on a local Ray") from None


__all__ = ["RayStart", "RayStartError", "begin", "exit_now", "prestart", "take"]
