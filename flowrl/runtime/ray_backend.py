"""The ``ray`` backend (the default): one Ray actor per (pool, rank) in the pool's placement group.

The actors of a pool of N > 1 form one torch.distributed group before their
roles are built (rank 0 listens on a free port, every rank joins), so the plan
runs updates and forward passes data parallel on them. A local Ray is started,
listening on loopback only, unless a cluster address is given.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from typing import Any

from flowrl.runtime.backend import Backend, backend
from flowrl.runtime.errors import PlacementError
from flowrl.runtime.hangs import STACKS_TIMEOUT_S, unanswered
from flowrl.runtime.pools import DRIVER, PoolSpec
from flowrl.runtime.traits import RAY
from flowrl.runtime.worker import Call, NodeEntry, Worker


#: a thread of each actor that answers while its task thread is busy (or stuck): stacks
CONTROL = {"control": 1}


@backend(RAY)
class RayBackend(Backend):
    """One Ray actor per (pool, rank) in the pool's placement group; the actors of a pool
    of N > 1 form one torch.distributed group before their roles are built."""

    def __init__(self, address: str | None = None, placement_timeout_s: float = 60.0) -> None:
        self.address = address
        self.placement_timeout_s = placement_timeout_s
        self.actors: dict[tuple[str, int], Any] = {}
        self.groups: list[Any] = []
        self._pg_of: dict[str, Any] = {}  # pool → its placement group
        self._pools: dict[str, PoolSpec] = {}  # what a replaced worker is started with
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

    def start(self, pools: list[PoolSpec], nodes: dict[str, dict[str, NodeEntry]], seed: int,
              driver: bool = True) -> None:
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
        self._actor_cls = actor_cls = ray.remote(concurrency_groups=CONTROL)(Worker)
        self._nodes, self._seed, self._strategy, self._ray = nodes, seed, PlacementGroupSchedulingStrategy, ray
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
            self._pools[p.name] = p
            for rank in range(p.workers):
                self.actors[(p.name, rank)] = self._worker(p, rank)
        self._form_groups(ray, [p for p in pools if p.workers > 1])
        if driver:  # a threaded 0-CPU actor for stateless nodes; none when no node runs there
            self.actors[(DRIVER, 0)] = actor_cls.options(num_cpus=0, max_concurrency=32).remote(
                DRIVER, 0, 1, [], nodes, seed, 1)
        # surface role-construction errors and dead workers now, not mid-step
        keys = list(self.actors)
        pids = ray.get([self.actors[k].ping.remote() for k in keys])
        self.pids = dict(zip(keys, pids))

    def _worker(self, p: PoolSpec, rank: int, first_process: bool = True) -> Any:
        """The actor of (pool ``p``, ``rank``) in its bundle of the pool's placement group."""
        strategy = self._strategy(placement_group=self._pg_of[p.name], placement_group_bundle_index=rank)
        return self._actor_cls.options(
            num_cpus=p.cpus, num_gpus=p.gpus, scheduling_strategy=strategy, name=None, max_restarts=0,
        ).remote(p.name, rank, p.workers, p.roles, self._nodes, self._seed, max(1, int(p.cpus)), p.gpus, True,
                 first_process)

    def dead_workers(self) -> list[tuple[str, int]]:
        ray = self._ray
        # asked on the control thread, so a busy (or stopped) worker is not taken for dead
        pings = {k: a.ping.options(concurrency_group="control").remote() for k, a in self.actors.items()}
        dead = []
        for key, ref in pings.items():
            try:
                ray.get(ref, timeout=STACKS_TIMEOUT_S)
            except ray.exceptions.GetTimeoutError:
                pass
            except ray.exceptions.RayActorError:
                dead.append(key)
        return dead

    def replace(self, pool: str, rank: int) -> None:
        actor = self._worker(self._pools[pool], rank, first_process=False)
        self.pids[(pool, rank)] = self._ray.get(actor.ping.remote())
        self.actors[(pool, rank)] = actor

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

    def stacks(self, pool: str, rank: int, timeout: float = STACKS_TIMEOUT_S) -> str:
        ray = self._ray
        # answered on the actor's control thread: its task thread may be the one that is stuck
        ref = self.actors[(pool, rank)].stacks.options(concurrency_group="control").remote()
        try:
            return ray.get(ref, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            return unanswered(self.worker_label(pool, rank), self.pids.get((pool, rank)), timeout)
        except ray.exceptions.RayError as e:
            return f"{self.worker_label(pool, rank)} could not send its stacks: {type(e).__name__}"

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
        self._pools.clear()
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


__all__ = ["RayBackend"]
