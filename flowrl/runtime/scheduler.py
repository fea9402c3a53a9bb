"""Runs a graph's steps on a backend: everything that can overlap does.

The driver submits a whole step at once — every task, on every rank, in the
plan's per-pool order — handing each task the *handles* of its inputs, never
their values. Pools then run concurrently; a streaming (row/group-scoped)
node's micro-batch m starts as soon as its upstream's micro-batch m is done.

Steps overlap within the staleness bound. A node using a role at step t reads
weights no older than version ``t - s`` (version = number of updates applied),
so it is gated on the update of step ``t - 1 - s``. With ``s = 0`` this is the
synchronous step, exactly. The driver keeps ``s + 2`` steps submitted: with
``s >= 1`` rollout on its own pool starts step t+1 while step t trains; the
extra step only hides the driver's own work (loading data, submitting). When a role's weights are used on another pool, they move after the
update: fetched right behind the update in the trainer's queue, loaded into the
other pool right before the first task that needs them. Every task records the
version it ran with; a worker refuses to run on weights older than the bound.

The driver reads only task reports (timings, metrics) and, on request, a few
fields. A watchdog knows what every task waits on: a node past its timeout, a
raising operator or a dead worker fails the step with the node, the step and
the worker named.

Example::

    rt = Runtime(graph, backend="local")
    for result in rt.run(source_batches, steps=3):
        print(result.metrics["scheduler/efficiency"])
    rt.close()
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

from flowrl.data import DataProto
from flowrl.graph import Graph, StateEdge
from flowrl.runtime.backends import DRIVER, Backend, PoolSpec, describe_death, make_backend
from flowrl.runtime.errors import NodeError, NodeTimeoutError, RuntimeFailure, WorkerDiedError


class DataSourceMismatch(RuntimeFailure):
    """A data source yielded a batch that differs from the columns it declares."""
from flowrl.runtime.plan import Plan, bounds_of, make_plan, pool_work
from flowrl.runtime.timeline import Timeline
from flowrl.runtime.worker import Call, Info, NodeEntry, ReadSpec, RoleBuild, assemble


@dataclass
class StepResult:
    """One finished step: metrics, its task reports, and any fetched fields."""

    step: int
    metrics: dict[str, float]
    infos: list[Info]
    makespan: float
    lower_bound: float
    data: DataProto | None = None
    checkpoint: dict[str, Any] | None = None  # states taken right after this step (see run())
    val_metrics: dict[str, float] | None = None  # greedy validation right after this step

    @property
    def efficiency(self) -> float:
        return self.lower_bound / self.makespan if self.makespan > 0 else 1.0


@dataclass
class _Sub:
    """A submitted task on all its ranks."""

    key: tuple[str, int | None]
    pool: str
    data: list[Any]  # output shards, in row order
    infos: list[tuple[Any, int]]  # (info handle, rank)


@dataclass
class _Step:
    step: int
    submitted_at: float
    src: Any = None  # the handle of the step's source batch
    snapshot: dict[str, Any] | None = None  # checkpoint handles queued right after this step
    graph: Graph | None = None  # what this step runs (the training graph, or the validation graph)
    plan: Plan | None = None
    prefix: str = ""  # "" for training steps, "val:" for validation
    validation: "_Step | None" = None  # a validation run queued right behind this step
    subs: dict[tuple[str, int | None], _Sub] = field(default_factory=dict)
    extra: list[tuple[Any, str, int]] = field(default_factory=list)  # (info handle, pool, rank): syncs


class Runtime:
    """Places a checked graph on a backend and runs its steps."""

    def __init__(
        self,
        graph: Graph,
        backend: str | Backend = "ray",
        *,
        address: str | None = None,
        resources: dict[str, float] | None = None,
        fetch: Iterable[str] = (),
        poll_s: float = 0.05,
        on_progress: Callable[[int, dict[str, str]], None] | None = None,
        validation: Graph | None = None,
    ) -> None:
        report = graph.check(resources=resources)
        report.raise_if_errors()
        self.graph = graph
        self.plan: Plan = make_plan(graph)
        self.val_graph = validation
        self.val_plan = make_plan(validation, micro_batches=1) if validation is not None else None
        self.backend = make_backend(backend, address) if isinstance(backend, str) else backend
        self.timeline = Timeline()
        self.fetch = tuple(fetch)
        self.poll_s = poll_s
        self.on_progress = on_progress
        self._weights: dict[tuple[str, int], Any] = {}  # (role, step) → weights handle
        self._syncs: dict[tuple[str, int, int], Any] = {}  # (role, step, rank) → set_weights handle
        self._updates: dict[tuple[str, int], list[Any]] = {}  # (role, step) → update info handles
        self._restored_step = -1
        self._last_step_end: float | None = None
        self._worker_free: dict[tuple[str, int], float] = {}  # when each worker last finished a task
        self._stop = False
        self._started = False

    # ------------------------------------------------------------------ placement
    def start(self) -> "Runtime":
        if self._started:
            return self
        g = self.graph
        nodes = _entries(g)
        if self.val_graph is not None:
            nodes.update(_entries(self.val_graph, prefix="val:"))
        pools = [
            PoolSpec(name, cfg.workers, cfg.cpus, cfg.gpus, self._role_builds(cfg.roles))
            for name, cfg in g.config.pools.items()
        ]
        self.backend.start(pools, nodes, g.config.trainer.seed)
        self._started = True
        return self

    def _role_builds(self, names: list[str]) -> list[RoleBuild]:
        from flowrl.graph import REGISTRY

        g = self.graph
        roles = g.config.roles
        builds: list[RoleBuild] = []
        done: set[str] = set()

        def root(name: str) -> str:
            while roles[name].from_ is not None:
                name = roles[name].from_
            return name

        def add(name: str) -> None:
            if name in done:
                return
            cfg = roles[name]
            kind = g.role_kinds[name]
            rk = REGISTRY.role_kind(kind)
            if cfg.from_ is not None and cfg.from_ in names and not cfg.frozen:
                add(cfg.from_)
                builds.append(RoleBuild(name, kind, rk.factory, None, shares=cfg.from_))
            else:
                settings = rk.config.model_validate(roles[root(name)].settings)
                builds.append(RoleBuild(name, kind, rk.factory, settings, frozen=cfg.frozen))
            done.add(name)

        for n in names:
            add(n)
        return builds

    # ------------------------------------------------------------------ running
    @property
    def max_staleness(self) -> int:
        return max((e.staleness for e in self.graph.state_edges), default=0)

    def run(
        self,
        batches: Iterable[DataProto],
        steps: int,
        start_step: int = 0,
        on_step: Callable[[StepResult], None] | None = None,
        checkpoint: Callable[[int], bool] | None = None,
        validate: Callable[[int], bool] | None = None,
        val_batches: Iterator[DataProto] | None = None,
    ) -> Iterator[StepResult]:
        """Run ``steps`` steps, yielding each result in order as it finishes.

        ``checkpoint(step)`` says which steps' results carry a checkpoint: every
        worker's state queued right behind that step's tasks (so later steps,
        already submitted, are not in it), the data position after that step's
        batch (when ``batches`` has a ``state_dict``) and the weights that
        in-flight steps will still load. ``validate(step)`` says after which
        steps the validation graph runs on the next of ``val_batches`` (its
        metrics come back as ``val/...``). :meth:`request_stop` ends the run
        after the steps already submitted.
        """
        self.start()
        self._stop = False
        source = batches if hasattr(batches, "__next__") else iter(batches)
        in_flight: deque[_Step] = deque()
        t = start_step
        end = start_step + steps
        try:
            while t < end or in_flight:
                # one step beyond the staleness bound is always submitted ahead: the
                # state-edge gates keep it from running early, and its data loading
                # and submission overlap the step in flight instead of following it
                while t < end and not self._stop and len(in_flight) <= self.max_staleness + 1:
                    st = self._submit_step(t, next(source))
                    if checkpoint is not None and checkpoint(t):
                        st.snapshot = self._queue_snapshot(t, batches)
                    if validate is not None and self.val_plan is not None and validate(t):
                        assert val_batches is not None, "validate needs val_batches"
                        st.validation = self._submit_step(t, next(val_batches), self.val_graph, self.val_plan,
                                                          "val:")
                    in_flight.append(st)
                    t += 1
                if not in_flight:
                    break
                result = self._finish(in_flight.popleft())
                if on_step is not None:
                    on_step(result)
                yield result
        except GeneratorExit:  # the caller stopped iterating (run_step): the runtime stays up
            raise
        except BaseException:
            self.close()
            raise

    def request_stop(self) -> None:
        """Submit no further steps; the ones in flight finish (a graceful Ctrl-C)."""
        self._stop = True

    def _queue_snapshot(self, t: int, source: Any) -> dict[str, Any]:
        workers = {key: self.backend.call(key[0], key[1], "get_state") for key in self._worker_keys()}
        return {
            "step": t,
            "workers": workers,
            "source": source.state_dict() if hasattr(source, "state_dict") else None,
            # weights already fetched for steps still to come (staleness >= 1)
            "weights": {k: h for k, h in self._weights.items() if k[1] >= t - self.max_staleness},
        }

    def _worker_keys(self) -> list[tuple[str, int]]:
        return [(pool, rank) for pool, cfg in self.graph.config.pools.items() for rank in range(cfg.workers)]

    def snapshot_now(self, step: int, source: Any = None) -> dict[str, Any]:
        """A checkpoint payload of the current state (call when no step is in flight)."""
        return self._resolve_snapshot(self._queue_snapshot(step, source))

    def _resolve_snapshot(self, snap: dict[str, Any]) -> dict[str, Any]:
        return {**snap, "workers": {k: self.backend.get(h) for k, h in snap["workers"].items()},
                "weights": {k: self.backend.get(h) for k, h in snap["weights"].items()}}

    def restore(self, payload: dict[str, Any]) -> None:
        """Load a checkpoint payload into the (started) workers; the next step is ``payload['step'] + 1``."""
        self.start()
        handles = [self.backend.call(pool, rank, "set_state", state)
                   for (pool, rank), state in payload["workers"].items()]
        for h in handles:
            self.backend.get(h)
        self._weights = {k: self.backend.put(w) for k, w in payload["weights"].items()}
        # updates before the checkpoint are done: same-pool gates for them are satisfied
        self._restored_step = payload["step"]

    def run_step(self, batch: DataProto, step: int = 0) -> StepResult:
        """Run one step on ``batch`` (synchronously) and return its result."""
        return next(self.run([batch], steps=1, start_step=step))

    def _submit_step(self, t: int, batch: DataProto, graph: Graph | None = None, plan: Plan | None = None,
                     prefix: str = "") -> _Step:
        g, plan = graph or self.graph, plan or self.plan
        problems = batch.check_fields(g.source_fields)
        if problems:
            raise DataSourceMismatch(f"step {t + 1}: the data source's batch does not match the columns it declares: "
                                     + "; ".join(problems))
        src = self.backend.put(batch)
        st = _Step(t, time.time(), src, graph=g, plan=plan, prefix=prefix)
        edges_to: dict[str, list[StateEdge]] = {}
        for e in g.state_edges if not prefix else ():
            edges_to.setdefault(e.dst, []).append(e)
        for key in plan.order:
            task = plan.tasks[key]
            node = g.nodes[task.node]
            inputs: list[Any] = []
            reads = []
            for r in task.reads:
                shards = [h for k in r.srcs for h in ([src] if k[0] == "data" else st.subs[k].data)]
                inputs.extend(shards)
                reads.append(ReadSpec(len(shards), r.fields, r.rows, r.repeat))
            if task.pool == DRIVER or node.op.dispatch == "driver":
                ranks, world = [0], 1  # a light node moved onto a pool runs once, on its rank 0
            else:
                n_workers = g.config.pools[task.pool].workers
                ranks = list(range(n_workers))
                world = n_workers if node.op.dispatch == "split" else 1
            min_version = None
            sub = _Sub(key, task.pool, [], [])
            read_srcs = {k for r in task.reads for k in r.srcs}
            # after: and role-order edges carry no data; their tasks still must finish first
            order_gates = [st.subs[d].infos[0][0] for d in sorted(task.deps - read_srcs, key=str)]
            for rank in ranks:
                gates = list(order_gates)
                for e in edges_to.get(task.node, []):
                    j = t - 1 - e.staleness
                    min_version = max(0, t - e.staleness)
                    if j >= 0:
                        gates.append(self._gate(e, j, task.pool, rank, st))
                call = Call(prefix + task.node, t, task.mb, tuple(reads), len(gates), rank, world, min_version)
                data, info = self.backend.submit(task.pool, rank, call, gates + inputs)
                sub.infos.append((info, rank))
                if world > 1 or rank == 0:
                    sub.data.append(data)
            st.subs[key] = sub
            if not prefix and node.updates_role and (task.mb is None or task.mb == plan.micro_batches - 1):
                self._after_update(node.role, t, sub)
        return st

    def _after_update(self, role: str, t: int, sub: _Sub) -> None:
        self._updates[(role, t)] = [h for h, _ in sub.infos]
        if any(self._crosses_pools(e) for e in self.graph.state_edges if e.role == role):
            # fetched right behind the update in the same queue: ready the moment it ends
            self._weights[(role, t)] = self.backend.call(sub.pool, 0, "get_weights", role)

    def _crosses_pools(self, e: StateEdge) -> bool:
        return self.graph.pool_of(e.src) != self.graph.pool_of(e.dst)

    def _gate(self, e: StateEdge, j: int, pool: str, rank: int, st: _Step) -> Any:
        """A handle that is ready once the update of step j is visible to (pool, rank)."""
        if not self._crosses_pools(e):
            if (e.role, j) not in self._updates and j <= self._restored_step:
                return self.backend.put(None)  # done before the checkpoint this run resumed from
            return self._updates[(e.role, j)][0]
        dst_role = self.graph.nodes[e.dst].role
        key = (dst_role, j, rank)
        if key not in self._syncs:
            handle = self.backend.call(pool, rank, "set_weights", dst_role, self._weights[(e.role, j)])
            self._syncs[key] = handle
            st.extra.append((handle, pool, rank))
        return self._syncs[key]

    # ------------------------------------------------------------------ collecting
    def _finish(self, st: _Step) -> StepResult:
        pending: dict[Any, tuple[tuple[str, int | None] | None, str, int]] = {}
        for key, sub in st.subs.items():
            for h, rank in sub.infos:
                pending[h] = (key, sub.pool, rank)
        for h, pool, rank in st.extra:
            pending[h] = (None, pool, rank)
        ended: dict[tuple[str, int | None], float] = {}
        infos: list[Info] = []
        while pending:
            done, _ = self.backend.wait(list(pending), timeout=self.poll_s)
            for h in done:
                key, pool, rank = pending.pop(h)
                try:
                    info = self.backend.get(h)
                except BaseException as exc:  # noqa: BLE001 - every failure becomes a named one
                    if self.on_progress is not None and key is not None and not st.prefix:
                        self.on_progress(st.step, {**self._states(st, ended), key[0]: "failed"})
                    raise self._failure(exc, st.step, key, pool, rank) from None
                if key is not None:
                    ended[key] = max(ended.get(key, 0.0), info.end)
                    infos.append(info)
                self._worker_free[(pool, rank)] = max(self._worker_free.get((pool, rank), 0.0), info.end)
                self.timeline.add(info)
            if done and self.on_progress is not None and not st.prefix:
                self.on_progress(st.step, self._states(st, ended))
            self._watchdog(st, pending, ended)
        if not st.prefix:
            self._clear_before(st.step)
        result = self._result(st, infos)
        if st.snapshot is not None:
            result.checkpoint = self._resolve_snapshot(st.snapshot)
        if st.validation is not None:
            val = self._finish(st.validation)
            result.val_metrics = {f"val/{k}": v for k, v in val.metrics.items() if not k.startswith("scheduler/")}
        return result

    def _states(self, st: _Step, ended: dict) -> dict[str, str]:
        """Each node's state in step ``st``: done, running (inputs ready) or waiting."""
        states: dict[str, str] = {}
        for key, task in st.plan.tasks.items():
            if key in ended:
                state = "done"
            elif all(d in ended for d in task.deps):
                state = "running"
            else:
                state = "waiting"
            prev = states.get(task.node)
            # a node is done when all its micro-batches are; running when any is
            if prev is None or state == "running" or (prev == "done" and state != "done"):
                states[task.node] = state
        return states

    def _watchdog(self, st: _Step, pending: dict, ended: dict) -> None:
        """Fail a task that has *run* past its timeout: timed from when its inputs were done
        and its worker was free for it (not from when it was queued)."""
        now = time.time()
        default = self.graph.config.schedule.timeout_s
        busy = {(pool, rank) for k, pool, rank in pending.values() if k is None}  # syncs, snapshots
        for key, pool, rank in pending.values():
            if key is None:
                continue
            limit = st.graph.nodes[key[0]].timeout_s or default
            if limit is None:
                continue
            deps = st.plan.tasks[key].deps
            if any(d not in ended for d in deps):
                continue  # still waiting on its inputs; that node's own watchdog fires first
            ready = max([ended[d] for d in deps] + [st.submitted_at])
            if pool != DRIVER:
                queue = st.plan.pool_order[pool]
                before = queue[: queue.index(key)]
                if (pool, rank) in busy or any(k not in ended for k in before):
                    continue  # queued behind other work on its worker
                ready = max([ready, self._worker_free.get((pool, rank), 0.0)] + [ended[k] for k in before])
            if now - ready > limit:
                waited = [f"{d[0]}" + (f"[{d[1]}]" if d[1] is not None else "") for d in deps]
                raise NodeTimeoutError(
                    f"node {key[0]!r} (step {st.step + 1}" + (f", micro-batch {key[1]}" if key[1] is not None else "")
                    + f") has run {now - ready:.1f}s on {self.backend.worker_label(pool, rank)}, past its "
                    f"timeout_s={limit:g}; its inputs ({', '.join(waited) or 'the data'}) were ready and its "
                    f"worker free, so it is the operator itself that is slow or stuck"
                )

    def _failure(self, exc: BaseException, step: int, key, pool: str, rank: int) -> RuntimeFailure:
        cause = getattr(exc, "cause", None)
        if isinstance(exc, NodeError):
            return exc
        if isinstance(cause, NodeError):
            return cause
        death = describe_death(exc) or (describe_death(cause) if cause is not None else None)
        node = key[0] if key else "(weight sync)"
        where = self.backend.worker_label(pool, rank)
        if death:
            return WorkerDiedError(f"worker {where} died while running node {node!r} at step {step + 1}: {death}")
        return RuntimeFailure(f"node {node!r} at step {step + 1} on {where} failed: {type(exc).__name__}: {exc}")

    def _clear_before(self, step: int) -> None:
        keep = step - self.max_staleness - 1
        for d in (self._weights, self._updates):
            for k in [k for k in d if k[1] < keep]:
                del d[k]
        for k in [k for k in self._syncs if k[1] < keep]:
            del self._syncs[k]

    def _result(self, st: _Step, infos: list[Info]) -> StepResult:
        g = st.graph
        metrics: dict[str, float] = {}
        sums: dict[str, tuple[float, float]] = {}
        durations: dict[tuple[str, int | None], float] = {}
        timing: dict[str, float] = {}
        for info in infos:
            node_name = info.node[len(st.prefix):]
            key = (node_name, info.mb)
            d = info.end - info.start
            durations[key] = max(durations.get(key, 0.0), d)
            all_ranks_same = g.nodes[node_name].op.dispatch == "all"
            if all_ranks_same and info.rank != 0:
                continue
            w = float(max(info.rows, 1))
            for name, v in info.metrics.items():
                s, n = sums.get(name, (0.0, 0.0))
                sums[name] = (s + w * v, n + w)
        for key, d in durations.items():
            timing[key[0]] = timing.get(key[0], 0.0) + d
        for name, (s, n) in sums.items():
            metrics[name] = s / n
        for node, d in timing.items():
            metrics[f"timing/{node}"] = d
        start = min((i.start for i in infos), default=st.submitted_at)
        makespan = max((i.end for i in infos), default=start) - start
        critical, (pool, work) = bounds_of(st.plan, durations)
        bound = max(critical, work)
        metrics["timing/step"] = makespan
        metrics["scheduler/lower_bound"] = bound
        metrics["scheduler/critical_path"] = critical
        metrics["scheduler/efficiency"] = bound / makespan if makespan > 0 else 1.0
        if not st.prefix:
            # steps overlap when staleness >= 1: a step's own makespan then includes waiting
            # behind the previous one; what counts is the interval between finished steps
            # against the busiest pool's work per step
            end = max((i.end for i in infos), default=start)
            if self._last_step_end is not None and end > self._last_step_end:
                interval = end - self._last_step_end
                work = max(pool_work(st.plan, durations).values(), default=0.0)
                metrics["timing/interval"] = interval
                metrics["scheduler/pipeline_efficiency"] = min(1.0, work / interval)
            self._last_step_end = end
        versions = [i.version for i in infos if i.version is not None and g.nodes[i.node[len(st.prefix):]].op.role]
        if g.state_edges and versions:
            metrics["scheduler/min_weight_version"] = float(min(versions))
        data = self._collect(st) if self.fetch and not st.prefix else None
        return StepResult(st.step, metrics, infos, makespan, bound, data)

    def _collect(self, st: _Step) -> DataProto:
        """The fetched fields of a step, at the finest row space among them
        (prompt-level columns repeated to sample rows, as a consumer sees them)."""
        producers = self.graph.producers()
        spaces = self.plan.spaces
        target = max((spaces[producers[f][0]] for f in self.fetch), key=lambda sp: sp.factor)
        handles: list[Any] = []
        reads: list[ReadSpec] = []
        by_node: dict[str, list[str]] = {}
        for f in self.fetch:
            by_node.setdefault(producers[f][0], []).append(f)
        for node, fields in by_node.items():
            if node == "data":
                shards = [st.src]
            else:
                subs = sorted((s for s in st.subs.values() if s.key[0] == node), key=lambda s: s.key[1] or 0)
                shards = [h for s in subs for h in s.data]
            handles.extend(shards)
            reads.append(ReadSpec(len(shards), tuple(fields), None, target.factor // spaces[node].factor))
        return assemble([self.backend.get(h) for h in handles], tuple(reads))

    def close(self) -> None:
        if self._started:
            self.backend.shutdown()
            self._started = False

    def __enter__(self) -> "Runtime":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _entries(graph: Graph, prefix: str = "") -> dict[str, NodeEntry]:
    """What workers need to run each node of ``graph`` (keys prefixed for a validation graph)."""
    return {
        prefix + n: NodeEntry(node.op, node.params, node.role,
                              inputs={g_name: op_name for op_name, g_name in node.config.inputs.items()},
                              outputs=dict(node.config.outputs))
        for n, node in graph.nodes.items()
    }

