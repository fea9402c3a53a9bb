"""Two backends, one contract: ``ray`` (the default) and ``local`` (one process).

The scheduler talks to a backend through handles (Ray ObjectRefs, or
``concurrent.futures.Future`` locally). Both keep the same semantics:

* each (pool, rank) runs its tasks one at a time, in submission order — a task
  whose inputs are not ready holds its pool, exactly like a Ray actor's queue;
* different pools run concurrently;
* driver tasks (stateless operators) run as soon as their inputs are ready,
  concurrently with everything else (Ray: a threaded 0-CPU actor);
* submitting never waits for a value.
"""

from __future__ import annotations

import abc
import concurrent.futures as cf
import logging
import os
import queue
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from flowrl.runtime.errors import PlacementError
from flowrl.runtime.worker import Call, NodeEntry, RoleBuild, Worker

DRIVER = "driver"


@dataclass
class PoolSpec:
    name: str
    workers: int
    cpus: float
    gpus: float
    roles: list[RoleBuild]
    backend: str = "cpu:gloo,cuda:nccl"  # torch.distributed, per device type (a pool of N > 1)
    timeout_s: float = 300.0  # one collective's limit


class Backend(abc.ABC):
    """Interface (see module docstring)."""

    name = "base"
    #: whether a pool's workers are processes that form one torch.distributed group (data
    #: parallel, sharded roles); otherwise every rank of a pool holds its own full roles
    process_groups = False

    @abc.abstractmethod
    def start(self, pools: list[PoolSpec], nodes: dict[str, NodeEntry], seed: int, driver: bool = True) -> None:
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

    def worker_label(self, pool: str, rank: int) -> str:
        return f"{pool}[{rank}]"

    def shutdown(self) -> None:
        pass


#: every backend, by the name ``flowrl run --backend`` takes: name → factory(address=None)
BACKENDS: dict[str, Callable[..., Backend]] = {}


def backend(name: str) -> Callable[[type[Backend]], type[Backend]]:
    """Register a backend class under ``name`` (like role kinds and data sources)."""

    def wrap(cls: type[Backend]) -> type[Backend]:
        BACKENDS[name] = cls
        cls.name = name
        return cls

    return wrap


# ---------------------------------------------------------------- local
@backend("local")
class LocalBackend(Backend):
    """Everything in this process; threads stand in for worker processes."""

    def __init__(self, address: str | None = None) -> None:
        self.workers: dict[tuple[str, int], Worker] = {}
        self.queues: dict[tuple[str, int], _DaemonExecutor] = {}
        self.driver_pool = _DaemonExecutor(serial=False, name="flowrl-driver")

    def start(self, pools: list[PoolSpec], nodes: dict[str, NodeEntry], seed: int, driver: bool = True) -> None:
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

    def shutdown(self) -> None:
        for q in self.queues.values():
            q.shutdown()
        self.driver_pool.shutdown()


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
                self.thread.join(timeout=2.0)


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


# ---------------------------------------------------------------- ray
@backend("ray")
class RayBackend(Backend):
    """One Ray actor per (pool, rank) in the pool's placement group; the actors of a pool
    of N > 1 form one torch.distributed group before their roles are built."""

    process_groups = True

    def __init__(self, address: str | None = None, placement_timeout_s: float = 60.0) -> None:
        self.address = address
        self.placement_timeout_s = placement_timeout_s
        self.actors: dict[tuple[str, int], Any] = {}
        self.groups: list[Any] = []
        self._pg_of: dict[str, Any] = {}  # pool → its placement group
        self._started_ray = False
        self.pids: dict[tuple[str, int], int] = {}

    def _init_ray(self) -> Any:
        """Join ``address`` (or ``RAY_ADDRESS``), else start a local Ray listening on 127.0.0.1 only.

        An unauthenticated Ray runs code for whoever reaches it, so the local one is
        closed to the network unless ``FLOWRL_RAY_LISTEN_ALL=1`` (``flowrl run
        --ray-listen-all``) opens it.
        """
        address = self.address or os.environ.get("RAY_ADDRESS") or None
        loopback = not address and os.environ.get("FLOWRL_RAY_LISTEN_ALL", "") not in ("1", "true", "yes")
        if loopback:
            # Ray binds every server to its node address and takes 127.0.0.1 as that address
            # only with its single-machine switch; set before Ray reads it (here and in the
            # processes ray.init starts) — _node_ip_address="127.0.0.1" is rewritten to the LAN IP
            os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        import ray

        if not ray.is_initialized():
            if loopback:
                from ray._private import ray_constants

                ray_constants.ENABLE_RAY_CLUSTER = False
            env = {"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}}
            # Ray's own start-up chatter would interleave with the run's view; errors still show
            quiet = {"logging_level": logging.ERROR, "log_to_driver": True}
            if address:
                _reachable(address, "--address" if self.address else "RAY_ADDRESS in the environment")
                try:
                    ray.init(address=address, runtime_env=env, **quiet)
                except ConnectionError as e:
                    origin = "--address" if self.address else "RAY_ADDRESS in the environment"
                    raise PlacementError(f"cannot join the Ray cluster at {address} ({origin}): {e}. Start it, "
                                         f"or unset RAY_ADDRESS to run on a local Ray") from None
            else:  # a Ray of its own: ray.init() alone would join whatever local cluster another process started
                ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, runtime_env=env, **quiet)
            self._started_ray = True
        return ray

    def start(self, pools: list[PoolSpec], nodes: dict[str, NodeEntry], seed: int, driver: bool = True) -> None:
        ray = self._init_ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        total = ray.cluster_resources()
        need_cpu = sum(p.workers * p.cpus for p in pools)
        need_gpu = sum(p.workers * p.gpus for p in pools)
        if need_cpu > total.get("CPU", 0) + 1e-9 or need_gpu > total.get("GPU", 0) + 1e-9:
            raise PlacementError(
                f"the pools ask for {need_cpu:g} CPUs and {need_gpu:g} GPUs; the Ray cluster has "
                f"{total.get('CPU', 0):g} CPUs and {total.get('GPU', 0):g} GPUs "
                f"({', '.join(f'{p.name}: {p.workers}×({p.cpus:g} CPU, {p.gpus:g} GPU)' for p in pools)})"
            )
        actor_cls = ray.remote(Worker)
        for p in pools:
            bundle = {"CPU": p.cpus} if p.cpus else {}
            if p.gpus:
                bundle["GPU"] = p.gpus
            if not bundle:
                bundle = {"CPU": 0.001}
            pg = placement_group([dict(bundle) for _ in range(p.workers)], strategy="PACK",
                                 name=f"flowrl-{p.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
            self.groups.append(pg)
            self._pg_of[p.name] = pg
            try:
                ray.get(pg.ready(), timeout=self.placement_timeout_s)
            except Exception:
                avail = ray.available_resources()
                raise PlacementError(
                    f"pool {p.name!r}: {p.workers} worker(s) × {bundle} could not be placed within "
                    f"{self.placement_timeout_s:g}s; available now: CPU {avail.get('CPU', 0):g}, "
                    f"GPU {avail.get('GPU', 0):g}"
                ) from None
            for rank in range(p.workers):
                strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=rank)
                self.actors[(p.name, rank)] = actor_cls.options(
                    num_cpus=p.cpus, num_gpus=p.gpus, scheduling_strategy=strategy,
                    name=None, max_restarts=0,
                ).remote(p.name, rank, p.workers, p.roles, nodes, seed, max(1, int(p.cpus)), p.gpus, True)
        self._form_groups(ray, [p for p in pools if p.workers > 1])
        if driver:  # a threaded 0-CPU actor for stateless nodes; none when no node runs there
            self.actors[(DRIVER, 0)] = actor_cls.options(num_cpus=0, max_concurrency=32).remote(
                DRIVER, 0, 1, [], nodes, seed, 1)
        # surface role-construction errors and dead workers now, not mid-step
        keys = list(self.actors)
        pids = ray.get([self.actors[k].ping.remote() for k in keys])
        self.pids = dict(zip(keys, pids))

    def _form_groups(self, ray: Any, pools: list[PoolSpec]) -> None:
        """Every pool of N > 1: rank 0 listens, all ranks join (at once) and build their roles."""
        joins = []
        for p in pools:
            address = ray.get(self.actors[(p.name, 0)].listen.remote(_group_host(ray, self._pg_of[p.name])))
            joins += [self.actors[(p.name, r)].join_group.remote(address, p.backend, p.timeout_s)
                      for r in range(p.workers)]
        ray.get(joins)

    def submit(self, pool: str, rank: int, call: Call, inputs: list[Any]) -> tuple[Any, Any]:
        return self.actors[(pool, rank)].execute.options(num_returns=2).remote(call, *inputs)

    def call(self, pool: str, rank: int, method: str, *args: Any) -> Any:
        return getattr(self.actors[(pool, rank)], method).remote(*args)

    def put(self, value: Any) -> Any:
        import ray

        return ray.put(value)

    def get(self, handle: Any, timeout: float | None = None) -> Any:
        import ray

        return ray.get(handle, timeout=timeout)

    def wait(self, handles: list[Any], timeout: float) -> tuple[list[Any], list[Any]]:
        import ray

        # one wait for everything pending, bounded by the poll interval: the tasks of a step
        # finish close together, and one wait (and one fetch) beats one per finished task
        return ray.wait(handles, num_returns=len(handles), timeout=timeout, fetch_local=False)

    def get_many(self, handles: list[Any]) -> list[Any]:
        import ray

        return ray.get(handles)

    def worker_label(self, pool: str, rank: int) -> str:
        pid = self.pids.get((pool, rank))
        return f"{pool}[{rank}]" + (f" (pid {pid})" if pid else "")

    def shutdown(self) -> None:
        import ray

        if not ray.is_initialized():
            return
        for actor in self.actors.values():
            try:
                ray.kill(actor, no_restart=True)
            except Exception:
                pass
        from ray.util.placement_group import remove_placement_group

        for pg in self.groups:
            try:
                remove_placement_group(pg)
            except Exception:
                pass
        self.actors.clear()
        self.groups.clear()
        self._pg_of.clear()
        if self._started_ray:
            ray.shutdown()


def _reachable(address: str, origin: str, timeout_s: float = 5.0) -> None:
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


def _group_host(ray: Any, pg: Any) -> str:
    """Where a pool's process group meets: loopback when its workers share a machine, else the
    address of rank 0's node (a pool spread over the machines of a cluster the user joined)."""
    bundles = ray.util.placement_group_table(pg).get("bundles_to_node_id") or {}
    if len(set(bundles.values())) <= 1:
        return "127.0.0.1"
    addresses = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    hosts = {addresses.get(node) for node in bundles.values()}
    if len(hosts) == 1:  # nodes of one machine (ray.cluster_utils.Cluster): loopback still reaches them
        return "127.0.0.1"
    return addresses[bundles[0]]


def make_backend(name: str, address: str | None = None) -> Backend:
    """A new backend of the registered kind ``name``."""
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; registered backends: {', '.join(sorted(BACKENDS))}")
    return BACKENDS[name](address=address)


def describe_death(exc: BaseException) -> str | None:
    """A readable cause when ``exc`` says a worker process died, else None."""
    name = type(exc).__name__
    if name in ("ActorDiedError", "RayActorError", "ActorUnavailableError", "WorkerCrashedError",
                "OutOfMemoryError", "NodeDiedError"):
        text = str(exc).strip().splitlines()
        return f"{name}: {text[0] if text else ''}"
    return None


__all__ = ["BACKENDS", "Backend", "backend", "LocalBackend", "RayBackend", "PoolSpec", "make_backend", "describe_death"]
