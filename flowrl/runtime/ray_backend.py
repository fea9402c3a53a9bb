"""The ``ray`` backend (the default): one Ray actor per (pool, rank) in the pool's placement group.

The actors of a pool of N > 1 form one torch.distributed group before their
roles are built (rank 0 listens on a free port, every rank joins), so the plan
runs updates and forward passes data parallel on them. A local Ray is started,
listening on loopback only, unless a cluster address is given.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flowrl.runtime import ray_start
from flowrl.runtime.backend import Backend, Death, Supervisor, backend, describe_death
from flowrl.errors import PlacementError, RuntimeFailure
from flowrl.timeouts import PLACEMENT_S
from flowrl.runtime.hangs import STACKS_TIMEOUT_S, unanswered
from flowrl.plan.pools import DRIVER, PoolSpec
from flowrl.store.runlog import log_offset, quiet_known_warnings, warning_notes
from flowrl.runtime.timeline import Span, process_start, span
from flowrl.plan.traits import RAY

if TYPE_CHECKING:  # imported where the workers are asked for, on the thread that waits for Ray
    from flowrl.graph import Graph
    from flowrl.runtime.worker import Call, NodeEntry


#: a thread of each actor that answers while its task thread is busy (or stuck): stacks
CONTROL = {"control": 1}


@backend(RAY)
class RayBackend(Backend):
    """One Ray actor per (pool, rank) in the pool's placement group; the actors of a pool
    of N > 1 form one torch.distributed group before their roles are built."""

    def __init__(self, address: str | None = None, placement_timeout_s: float = PLACEMENT_S) -> None:
        self.address = address
        self.placement_timeout_s = placement_timeout_s
        self.actors: dict[tuple[str, int], Any] = {}
        self.groups: list[Any] = []
        self._pg_of: dict[str, Any] = {}  # pool → its placement group
        self._pools: dict[str, PoolSpec] = {}  # what a replaced worker is started with
        self._started_ray = False
        self._boot: ray_start.RayStart | None = None
        self.pids: dict[tuple[str, int], int] = {}
        self.spans: list[Span] = []  # the start-up of the driver's side and of every worker
        self._log_offset = 0  # where this run's part of the log starts
        self._early: threading.Thread | None = None  # asking for the workers before start() (prepare)
        self._early_error: BaseException | None = None
        self._want_driver = False  # prepare was told the plan runs tasks on the driver's worker
        self._nodes: dict[str, dict[str, NodeEntry]] = {}
        self._seed = 0

    @classmethod
    def asked_early(cls, graph: Graph, address: str | None, log_path: Path) -> "RayBackend":
        """A backend that asks for ``graph``'s pools' worker processes as soon as Ray is up (:meth:`prepare`),
        made before the driver has imported flowrl's runtime (``flowrl run``, right after the graph is
        checked); a :class:`~flowrl.run.trainer.Trainer` given it adopts those workers."""
        from flowrl.plan.pools import pool_specs

        quiet_known_warnings()
        made = cls(address=address)
        made.log_path = log_path
        made.prepare(pool_specs(graph), driver=False)  # the plan, made later, says whether it needs one
        return made

    def prepare(self, pools: list[PoolSpec], driver: bool = True) -> None:
        """Ask for ``pools``' worker processes (and, where ``driver``, the driver's worker) as soon as Ray
        is up, on a thread (returns at once): they start and import their roles' modules while the driver
        finishes its own start; :meth:`start` (with the plan's nodes) has them build their roles. A second
        call only adds the driver's worker to what is asked for (:meth:`start` asks for it if the first
        call's thread has already asked for the rest)."""
        self._want_driver = self._want_driver or driver
        if self._early is not None:
            return
        self._boot = ray_start.take(self.address)  # begun early by `flowrl run`, else here
        self._log_offset = log_offset(self.log_path)
        self._early = threading.Thread(target=self._launch_early, args=(pools, driver), name="flowrl-workers",
                                       daemon=True)
        self._early.start()

    def _launch_early(self, pools: list[PoolSpec], driver: bool) -> None:
        try:
            self._launch(pools, driver)
        except BaseException as e:  # noqa: BLE001 - raised again by start(), in the caller's thread
            self._early_error = e

    def start(self, pools: list[PoolSpec], nodes: dict[str, dict[str, NodeEntry]], seed: int,
              driver: bool = True) -> None:
        self.spans.insert(0, Span("driver", "command started, graph loaded, plan made", process_start(),
                                  time.time(), os.getpid()))
        self._nodes, self._seed = nodes, seed
        if self._early is None:
            self._boot = ray_start.take(self.address)  # begun early by `flowrl run`, else here
            self._log_offset = log_offset(self.log_path)
            self._launch(pools, driver)
        else:
            with span(self.spans, "driver", "waited for the workers asked for early"):
                self._early.join()
            if self._early_error is not None:
                raise self._early_error  # what it placed is given back by drop_unstarted
            self._early = None  # adopted: shut down with the run
            if self._pools != {p.name: p for p in pools}:  # not the pools it was prepared for
                self._drop_workers()
                self._launch(pools, driver)
            elif driver:  # the plan's word on the driver's worker came after the others were asked for
                self._driver_worker()
        ray = self._ray
        with span(self.spans, "driver", "workers started, roles built"):
            setups = [self.actors[(p.name, rank)].setup.remote(*self._setup_args(p)) for p in pools
                      for rank in range(p.workers)]
            if driver:
                setups.append(self.actors[(DRIVER, 0)].setup.remote([], nodes, seed, 1))
            self._form_groups(ray, [p for p in pools if p.workers > 1])
            # surface role-construction errors and dead workers now, not mid-step; one wait for all
            keys = list(self.actors)
            answers = self._get(ray, [*setups, *[self.actors[k].ping.remote() for k in keys],
                                      *[self.actors[k].startup_spans.remote() for k in keys]])
        self.pids = dict(zip(keys, answers[len(setups):len(setups) + len(keys)]))
        for spans in answers[len(setups) + len(keys):]:
            self.spans += spans

    def _launch(self, pools: list[PoolSpec], driver: bool) -> None:
        """Wait for Ray, place ``pools`` and ask for every worker process, and the driver's where ``driver``
        (their roles are built later)."""
        # flowrl's runtime (torch, tensordict) imports while Ray may still be starting
        from flowrl.runtime.worker_process import ProcessWorker

        with span(self.spans, "driver", "waited for Ray's start"):
            ray = self._boot.ready()
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._started_ray = self._boot.started_ray
        self.spans += [self._boot.span] if self._boot.span is not None else []
        total = ray.cluster_resources()
        need_cpu = sum(p.workers * p.cpus for p in pools)
        need_gpu = sum(p.workers * p.gpus for p in pools)
        if need_cpu > total.get("CPU", 0) + 1e-9 or need_gpu > total.get("GPU", 0) + 1e-9:
            raise PlacementError(
                f"the pools ask for {need_cpu:g} CPUs and {need_gpu:g} GPUs; the Ray cluster has "
                f"{total.get('CPU', 0):g} CPUs and {total.get('GPU', 0):g} GPUs "
                f"({', '.join(f'{p.name}: {p.workers}×({p.cpus:g} CPU, {p.gpus:g} GPU)' for p in pools)})"
            )
        self._actor_cls = ray.remote(concurrency_groups=CONTROL)(ProcessWorker)
        self._strategy, self._ray = PlacementGroupSchedulingStrategy, ray
        with span(self.spans, "driver", "placement groups ready"):
            self._place(ray, pools)
        # every worker process is asked for before any is waited on: they start (import, build
        # their roles) side by side
        for p in pools:
            self._pools[p.name] = p
            for rank in range(p.workers):
                self.actors[(p.name, rank)] = self._worker(p, rank, now=False)
        if driver or self._want_driver:
            self._driver_worker()
        self.spans.append(Span("driver", "worker processes asked for", time.time(), time.time(), os.getpid()))

    def _driver_worker(self) -> None:
        """Ask for the driver's worker, a threaded 0-CPU actor for stateless nodes (none when no node runs
        there), unless it is asked for already."""
        if (DRIVER, 0) not in self.actors:
            self.actors[(DRIVER, 0)] = self._actor_cls.options(num_cpus=0, max_concurrency=32).remote(
                DRIVER, 0, 1, self._log())

    def _log(self) -> str | None:
        """The run's log, where each worker process writes what it prints (:mod:`flowrl.store.runlog`)."""
        return str(self.log_path) if self.log_path is not None else None

    def _place(self, ray: Any, pools: list[PoolSpec]) -> None:
        """A placement group per pool (bundle: a worker's resources), all asked for, then waited on together."""
        bundles = {}
        for p in pools:
            bundle = {"CPU": p.cpus} if p.cpus else {}
            if p.gpus:
                bundle["GPU"] = p.gpus
            bundles[p.name] = bundle or {"CPU": 0.001}
            pg = ray.util.placement_group([dict(bundles[p.name]) for _ in range(p.workers)], strategy="PACK",
                                          name=f"flowrl-{p.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
            self.groups.append(pg)
            self._pg_of[p.name] = pg
        try:
            ray.get([self._pg_of[p.name].ready() for p in pools], timeout=self.placement_timeout_s)
        except Exception:
            avail = ray.available_resources()
            p = next((p for p in pools if not self._pg_of[p.name].wait(timeout_seconds=0)), pools[0])
            raise PlacementError(
                f"pool {p.name!r}: {p.workers} worker(s) × {bundles[p.name]} could not be placed within "
                f"{self.placement_timeout_s:g}s; available now: CPU {avail.get('CPU', 0):g}, "
                f"GPU {avail.get('GPU', 0):g}"
            ) from None

    @staticmethod
    def _get(ray: Any, handles: Any, timeout: float | None = None) -> Any:
        """``ray.get``, raising a worker's own error (a :class:`NodeError`) as the worker raised it, without
        Ray's wrapping (its ``ray::Worker.execute()`` header and its copy of the traceback)."""
        try:
            return ray.get(handles, timeout=timeout)
        except ray.exceptions.RayTaskError as e:
            cause = getattr(e, "cause", None)
            if isinstance(cause, RuntimeFailure):
                raise cause from None
            raise

    def startup_spans(self) -> list[Span]:
        return list(self.spans)

    def notes(self) -> list[str]:
        return warning_notes(self.log_path, self._log_offset)

    def _worker(self, p: PoolSpec, rank: int, first_process: bool = True, now: bool = True) -> Any:
        """The actor of (pool ``p``, ``rank``) in its bundle of the pool's placement group; it builds its
        roles at once when ``now``, else when :meth:`start` sends them."""
        strategy = self._strategy(placement_group=self._pg_of[p.name], placement_group_bundle_index=rank)
        return self._actor_cls.options(
            num_cpus=p.cpus, num_gpus=p.gpus, scheduling_strategy=strategy, name=None, max_restarts=0,
        ).remote(p.name, rank, p.workers, self._log(), p.role_modules(),
                 self._setup_args(p, first_process) if now else None)

    def _setup_args(self, p: PoolSpec, first_process: bool = True) -> tuple[Any, ...]:
        """What :meth:`ProcessWorker.setup` takes for a worker of pool ``p``."""
        return p.roles, self._nodes, self._seed, max(1, int(p.cpus)), p.gpus, True, first_process

    def make_supervisor(self) -> "RaySupervisor":
        return RaySupervisor(self)

    def discard(self, handles: list[Any]) -> None:
        # an ObjectRef whose error is never read is printed as an "Unhandled error" when it goes:
        # read each (on a thread: the doomed tasks fail when their inputs do) and let it go
        def drain() -> None:
            for h in handles:
                try:
                    self._ray.get(h)
                except Exception:  # noqa: BLE001 - the task was run again; its error means nothing now
                    pass

        threading.Thread(target=drain, name="flowrl-discard", daemon=True).start()

    def _form_groups(self, ray: Any, pools: list[PoolSpec]) -> None:
        """Every pool of N > 1: rank 0 listens, all ranks join (at once) and build their roles; the
        pools side by side."""
        listening = [self.actors[(p.name, 0)].listen.remote(_group_host(ray, self._pg_of[p.name])) for p in pools]
        joins = [self.actors[(p.name, r)].join_group.remote(address, p.backend, p.timeout_s)
                 for p, address in zip(pools, self._get(ray, listening)) for r in range(p.workers)]
        self._get(ray, joins)

    def submit(self, pool: str, rank: int, call: Call, inputs: list[Any]) -> tuple[Any, Any]:
        return self.actors[(pool, rank)].execute.options(num_returns=2).remote(call, *inputs)

    def call(self, pool: str, rank: int, method: str, *args: Any) -> Any:
        return getattr(self.actors[(pool, rank)], method).remote(*args)

    def put(self, value: Any) -> Any:
        import ray

        return ray.put(value)

    def get(self, handle: Any, timeout: float | None = None) -> Any:
        import ray

        return self._get(ray, handle, timeout)

    def wait(self, handles: list[Any], timeout: float) -> tuple[list[Any], list[Any]]:
        import ray

        # one wait for everything pending, bounded by the poll interval: the tasks of a step
        # finish close together, and one wait (and one fetch) beats one per finished task
        return ray.wait(handles, num_returns=len(handles), timeout=timeout, fetch_local=False)

    def get_many(self, handles: list[Any]) -> list[Any]:
        import ray

        return self._get(ray, handles)

    def worker_label(self, pool: str, rank: int) -> str:
        pid = self.pids.get((pool, rank))
        return f"{pool}[{rank}]" + (f" (pid {pid})" if pid else "")

    def shutdown(self) -> None:
        import ray

        if self._early is not None:
            self._early.join()
        if not ray.is_initialized():
            return
        self._drop_workers()
        if self._started_ray:
            ray.shutdown()
            self._boot.release()

    def drop_unstarted(self) -> None:
        """Shut down what :meth:`prepare` started when :meth:`start` never came (the run ended before)."""
        if self._early is not None:
            self.shutdown()

    def _drop_workers(self) -> None:
        """End every worker process and give back every placement group."""
        if not self.actors and not self.groups:
            return
        ray = self._ray
        from ray.util.placement_group import remove_placement_group

        for actor in self.actors.values():
            try:
                ray.kill(actor, no_restart=True)
            except Exception:
                pass
        for pg in self.groups:
            try:
                remove_placement_group(pg)
            except Exception:
                pass
        self.actors.clear()
        self.groups.clear()
        self._pg_of.clear()
        self._pools.clear()


class RaySupervisor(Supervisor):
    """Looks after the Ray actors: pings them on their control thread, replaces a dead one in its bundle,
    starts a pool anew (its group formed again), and reads a stuck one's stacks."""

    backend: RayBackend

    def dead_now(self) -> dict[tuple[str, int], Death]:
        b = self.backend
        ray = b._ray
        # asked on the control thread, so a busy (or stopped) worker is not taken for dead
        pings = {k: a.ping.options(concurrency_group="control").remote() for k, a in b.actors.items()}
        dead = {}
        for key, ref in pings.items():
            try:
                ray.get(ref, timeout=STACKS_TIMEOUT_S)
            except ray.exceptions.GetTimeoutError:
                pass
            except ray.exceptions.RayActorError as e:
                dead[key] = Death(b.worker_label(*key), describe_death(e) or type(e).__name__)
        return dead

    def restart_pool(self, pool: str) -> None:
        b = self.backend
        p = b._pools[pool]
        for rank in range(p.workers):  # a live rank may be stuck in a collective with the dead one
            b._ray.kill(b.actors.pop((pool, rank)), no_restart=True)
        for rank in range(p.workers):
            b.actors[(pool, rank)] = b._worker(p, rank, first_process=False)
        if p.workers > 1:
            b._form_groups(b._ray, [p])
        keys = [(pool, rank) for rank in range(p.workers)]
        b.pids.update(zip(keys, b._get(b._ray, [b.actors[k].ping.remote() for k in keys])))

    def replace(self, pool: str, rank: int) -> None:
        b = self.backend
        actor = b._worker(b._pools[pool], rank, first_process=False)
        b.pids[(pool, rank)] = b._ray.get(actor.ping.remote())
        b.actors[(pool, rank)] = actor

    def stacks(self, pool: str, rank: int, timeout: float = STACKS_TIMEOUT_S) -> str:
        b = self.backend
        ray = b._ray
        # answered on the actor's control thread: its task thread may be the one that is stuck
        ref = b.actors[(pool, rank)].stacks.options(concurrency_group="control").remote()
        try:
            return ray.get(ref, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            return unanswered(b.worker_label(pool, rank), b.pids.get((pool, rank)), timeout)
        except ray.exceptions.RayError as e:
            return f"{b.worker_label(pool, rank)} could not send its stacks: {type(e).__name__}"


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


__all__ = ["RayBackend", "RaySupervisor"]
