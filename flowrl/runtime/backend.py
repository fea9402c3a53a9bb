"""The backend contract: what the runtime asks of the machinery that runs tasks.

The runtime talks to a backend through handles (Ray ObjectRefs, or
``concurrent.futures.Future`` locally). Every backend keeps the same semantics:

* each (pool, rank) runs its tasks one at a time, in submission order — a task
  whose inputs are not ready holds its pool, exactly like a Ray actor's queue;
* different pools run concurrently;
* driver tasks (stateless operators) run as soon as their inputs are ready,
  concurrently with everything else (Ray: a threaded 0-CPU actor);
* submitting never waits for a value.

A backend registers itself by name with its traits (:func:`backend`); the two
built in are ``local`` (:mod:`flowrl.runtime.local`) and ``ray``
(:mod:`flowrl.runtime.ray_backend`), both registered by importing
:mod:`flowrl.runtime.backends`.

What runs tasks and what looks after the processes that run them are two
contracts: a :class:`Backend` starts workers, submits, fetches, waits and shuts
down; its :class:`Supervisor` (``backend.supervisor``) finds dead workers and
how they ended, replaces them, starts a pool anew and reads a stuck worker's
stacks — what recovery (:mod:`flowrl.recovery`) asks, never the step loop.
"""

from __future__ import annotations

import abc
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from flowrl.errors import NodeError, RuntimeFailure, WorkerDiedError
from flowrl.runtime.hangs import STACKS_TIMEOUT_S
from flowrl.plan.pools import PoolSpec
from flowrl.plan.traits import LOCAL, BackendTraits, register_traits

if TYPE_CHECKING:  # the worker's module imports torch and tensordict: the Ray backend asks for
    # workers before the driver has imported them
    from flowrl.runtime.worker import Call, NodeEntry


class Backend(abc.ABC):
    """Interface (see module docstring)."""

    name = "base"
    #: what the plan depends on (:mod:`flowrl.plan.traits`); set by :func:`backend`
    traits: BackendTraits = LOCAL
    #: the run's log (:mod:`flowrl.store.runlog`): where worker processes' output goes; None: keep none
    log_path: Path | None = None

    @abc.abstractmethod
    def start(self, pools: list[PoolSpec], nodes: dict[str, dict[str, NodeEntry]], seed: int,
              driver: bool = True) -> None:
        """Create every pool's workers (and their roles); a driver worker only when ``driver``."""

    @abc.abstractmethod
    def submit(self, pool: str, rank: int, call: Call, inputs: list[Any]) -> tuple[Any, Any]:
        """Run ``call`` on (pool, rank) once ``inputs`` are ready → (data handle, info handle)."""

    @abc.abstractmethod
    def call(self, pool: str, rank: int, method: str, *args: Any) -> Any:
        """Run a worker method (``get_weights``...) in the pool's queue; args may be handles."""

    @abc.abstractmethod
    def put(self, value: Any) -> Any:
        """A handle to ``value``."""

    @abc.abstractmethod
    def get(self, handle: Any, timeout: float | None = None) -> Any:
        """The value behind a handle (raises what produced it raised)."""

    @abc.abstractmethod
    def wait(self, handles: list[Any], timeout: float) -> tuple[list[Any], list[Any]]:
        """``(done, pending)``: every handle done by the time all are, or ``timeout`` passes,
        or (a backend that can tell cheaply) at least one is."""

    def wait_reports(self, handles: list[Any], timeout: float) -> list[tuple[Any, Any]]:
        """``(handle, value or the exception it raised)`` for every finished handle, once at
        least one is finished or ``timeout`` passes; the values are fetched together."""
        done, _ = self.wait(handles, timeout)
        if not done:
            return []
        try:
            return list(zip(done, self.get_many(done)))
        except Exception:  # noqa: BLE001 - find which one failed, and keep the others' values
            out: list[tuple[Any, Any]] = []
            for h in done:
                try:
                    out.append((h, self.get(h)))
                except BaseException as exc:  # noqa: BLE001 - handed to the caller, named there
                    out.append((h, exc))
            return out

    def get_many(self, handles: list[Any]) -> list[Any]:
        """The values behind ``handles`` (one round trip where the backend allows)."""
        return [self.get(h) for h in handles]

    def discard(self, handles: list[Any]) -> None:
        """Handles the runtime no longer needs, some of which will fail (a task run again): let them
        go without reporting their errors as unhandled."""

    def worker_label(self, pool: str, rank: int) -> str:
        return f"{pool}[{rank}]"

    @property
    def supervisor(self) -> "Supervisor":
        """What looks after this backend's workers (one per backend, made when first asked)."""
        if "_supervisor" not in self.__dict__:
            self._supervisor = self.make_supervisor()
        return self._supervisor

    def make_supervisor(self) -> "Supervisor":
        """This backend's :class:`Supervisor`; the base one knows no dead worker and reads no stack."""
        return Supervisor(self)

    def startup_spans(self) -> list[Any]:
        """What each process did while the workers started (:class:`~flowrl.runtime.timeline.Span`)."""
        return []

    def notes(self) -> list[str]:
        """Lines for the terminal at the end of a run (one per distinct warning the workers logged)."""
        return []

    def shutdown(self) -> None:
        pass


@dataclass(frozen=True)
class Death:
    """A dead worker as the supervisor found it: its label (pool, rank, pid) and how it ended."""

    label: str
    cause: str


class Supervisor:
    """What looks after a backend's workers (see the module docstring): the base one, for a backend whose
    workers are not processes of their own (``local``), knows no dead worker and reads no stack."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    def worker_label(self, pool: str, rank: int) -> str:
        return self.backend.worker_label(pool, rank)

    def stacks(self, pool: str, rank: int, timeout: float = STACKS_TIMEOUT_S) -> str:
        """The Python stack of every thread of the worker (pool, rank) runs in, taken while
        its task may be stuck (:mod:`flowrl.runtime.hangs`); '' when the backend cannot tell."""
        return ""

    def deaths(self, failure: BaseException | None = None) -> dict[tuple[str, int], Death]:
        """Every worker whose process has died, with its label and how it ended; asked about ``failure``
        (a report that failed), a broken collective with no death seen yet is asked again for a few
        seconds: a peer's broken collective can come before the backend has seen the death."""
        dead = self.dead_now()
        if dead or failure is None or "collective" not in str(failure):
            return dead
        until = time.monotonic() + STACKS_TIMEOUT_S
        while not dead and time.monotonic() < until:
            time.sleep(0.25)
            dead = self.dead_now()
        return dead

    def dead_now(self) -> dict[tuple[str, int], Death]:
        """The dead workers as the backend sees them at this moment (:meth:`deaths`)."""
        return {}

    def replace(self, pool: str, rank: int) -> None:
        """Start a new worker for a dead one, in its place, building the same roles. A backend whose
        workers are not processes of their own reports no dead worker, so is never asked."""
        raise WorkerDiedError(f"worker {self.worker_label(pool, rank)} died, and the {self.backend.name} backend "
                              f"cannot start another in its place: resume the run with --resume")

    def restart_pool(self, pool: str) -> None:
        """Start every worker of ``pool`` anew (the live ones ended: a rank whose peer died may be stuck in
        a collective) and form its process group again, for a rollback (:mod:`flowrl.recovery.rollback`)."""
        self.replace(pool, 0)


#: every backend, by the name ``flowrl run --backend`` takes: name → factory(address=None)
BACKENDS: dict[str, Callable[..., Backend]] = {}


def backend(traits: BackendTraits) -> Callable[[type[Backend]], type[Backend]]:
    """Register a backend class under ``traits.name`` with its traits (like role kinds and data sources)."""

    def wrap(cls: type[Backend]) -> type[Backend]:
        register_traits(traits)
        BACKENDS[traits.name] = cls
        cls.name, cls.traits = traits.name, traits
        return cls

    return wrap


def describe_death(exc: BaseException) -> str | None:
    """A readable cause when ``exc`` says a worker process died, else None."""
    name = type(exc).__name__
    if name in ("ActorDiedError", "RayActorError", "ActorUnavailableError", "WorkerCrashedError",
                "OutOfMemoryError", "NodeDiedError"):
        text = str(exc).strip().splitlines()
        # Ray's "Worker exit type: ... Worker exit detail: ...": how the process ended, when it says
        exit = re.search(r"Worker exit type: (\S+) Worker exit detail: (.*?)\.?\s*(?:Some common causes|$)",
                         str(exc), re.M)
        how = f" (exit type {exit[1]}: {exit[2]})" if exit else ""
        return f"{name}: {text[0] if text else ''}{how}"
    return None


def named_failure(exc: BaseException, step: int, node: str | None, where: str) -> RuntimeFailure:
    """What a task's failure fails the step with: the :class:`NodeError` it carries (the operator's,
    already named), a :class:`WorkerDiedError` when its worker died, else the error named by node,
    step (0-based) and ``where`` (the worker's label). ``node``: None for a weight sync."""
    cause = getattr(exc, "cause", None)
    if isinstance(exc, NodeError):
        return exc
    if isinstance(cause, NodeError):
        return cause
    death = describe_death(exc) or (describe_death(cause) if cause is not None else None)
    node = node or "(weight sync)"
    if death:
        return WorkerDiedError(f"worker {where} died while running node {node!r} at step {step + 1}: {death}")
    return RuntimeFailure(f"node {node!r} at step {step + 1} on {where} failed: {type(exc).__name__}: {exc}")


__all__ = ["BACKENDS", "Backend", "Supervisor", "backend", "describe_death", "named_failure"]
