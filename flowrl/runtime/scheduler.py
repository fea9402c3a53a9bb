"""The runtime: a submit-and-wait loop over the plan.

The driver submits a whole step at once — every task of the plan, on the ranks
its dispatch mode names, in the plan's per-pool order — handing each task the
:class:`~flowrl.data.DataProtoFuture` of its inputs (per-shard handles), never
their values. Pools then run concurrently; a streaming node's micro-batch m
starts as soon as its upstream's micro-batch m is done. Steps overlap within
the staleness bound (:mod:`flowrl.plan.staleness` holds every rule of it).

Then it waits: the reports of every finished task are taken together, the
watchdog (:mod:`flowrl.recovery.watchdog`) checks what is still running, and a
finished step becomes a :class:`~flowrl.runtime.reports.StepResult`
(:mod:`flowrl.runtime.reports`). The driver reads only reports and, on request,
a few fields.

Example::

    rt = Runtime(graph, backend="local")
    for result in rt.run(source_batches, steps=3):
        print(result.metrics["scheduler/efficiency"])
    rt.close()
"""

from __future__ import annotations

import os
import tempfile
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from flowrl.data import DataProto, DataProtoFuture
from flowrl.data.dispatch import get_mode
from flowrl.graph import Graph
from flowrl.runtime.backends import Backend, describe_death, make_backend
from flowrl.errors import NodeError, RuntimeFailure, WorkerDiedError
from flowrl.plan.planner import Plan, Task, make_plan
from flowrl.runtime.reads import fetched, task_input
from flowrl.provenance.record import collect_records
from flowrl.recovery.refill import keyed_draw, refill_of, refill_step
from flowrl.runtime.reports import StepResult, node_states, pipeline_metrics, step_metrics
from flowrl.recovery.restarts import Restarts, RollbackNeeded, replace_dead
from flowrl.plan.staleness import Versions, window
from flowrl.runtime.timeline import Timeline
from flowrl.recovery.watchdog import TaskTimeout, check_timeouts, get_within
from flowrl.runtime.worker import Call, Info, node_entries
from flowrl.store.checkpoint import CheckpointStore

TaskKey = tuple[str, int | None]


class DataSourceMismatch(RuntimeFailure):
    """A data source yielded a batch that differs from the columns it declares."""


@dataclass
class _Step:
    """A submitted run of a plan on one batch (a training step, or validation after it):
    its tasks' output futures and report handles."""

    step: int
    submitted_at: float
    plan: Plan
    src: Any = None  # the handle of the step's source batch
    snapshot: dict[str, Any] | None = None  # checkpoint handles queued right after this step
    validation: "_Step | None" = None  # a validation run queued right behind this step
    outputs: dict[TaskKey, DataProtoFuture] = field(default_factory=dict)
    reports: dict[Any, tuple[TaskKey | None, str, int]] = field(default_factory=dict)  # handle → (task, pool, rank)
    first_report: dict[TaskKey, Any] = field(default_factory=dict)  # a task's report on its first rank
    batch: DataProto | None = None  # the source batch (a refill replaces prompts in it)
    state_in: dict[str, Any] = field(default_factory=dict)  # operator states the step started from
    faults: Counter[str] = field(default_factory=Counter)  # restarts, refills: faults/<name>


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
        stage: Callable[[int], Path] | None = None,
        record: Callable[[int], dict[str, list[str]]] | None = None,
    ) -> None:
        """``stage(step)``: the directory where the ranks of a sharded role write its shards for
        step ``step``'s checkpoint (a :class:`~flowrl.store.checkpoint.CheckpointStore`'s
        staging directory); default: one under the system's temporary directory. The plan
        is made for the backend's traits; with ``trainer.val_every`` it carries the
        validation plan, run by the same loop. ``record(step)``: the fields of each node whose
        outputs step ``step``'s result carries as ``records`` (:mod:`flowrl.provenance.record`)."""
        graph.check(resources=resources).raise_if_errors()
        self.graph = graph
        self.backend = make_backend(backend, address) if isinstance(backend, str) else backend
        self.plan: Plan = make_plan(graph, self.backend.traits)
        self.timeline = Timeline()
        self.fetch = tuple(fetch)
        self.record = record
        self.poll_s = poll_s
        self.on_progress = on_progress
        self.max_staleness = max((e.staleness for e in graph.state_edges), default=0)
        self.forget_steps()
        self._stop = False
        self._started = False
        self._in_flight: deque[_Step] = deque()  # the steps submitted behind the one being finished
        self.restarts = Restarts.for_graph(graph)
        self._stage = stage or CheckpointStore(Path(tempfile.gettempdir())
                                               / f"flowrl-shards-{os.getpid()}-{id(self)}").path

    # ------------------------------------------------------------------ placement
    def start(self) -> "Runtime":
        if self._started:
            return self
        nodes = {p.kind: node_entries(p) for p in self.plan.runs()}
        # no idle driver process when every node runs in a pool
        self.backend.start(self.plan.pools, nodes, self.graph.config.trainer.seed, driver=self.plan.driver)
        self._started = True
        return self

    def forget_steps(self) -> None:
        """No step in flight, no weight version moved (at the start, and for a rollback: :meth:`restore` next)."""
        self.versions = Versions(self.max_staleness, self.backend.call, lambda: self.backend.put(None))
        # per plan: stateful node → handle of its latest state (a report)
        self._op_state: dict[str, dict[str, Any]] = {p.kind: {} for p in self.plan.runs()}
        self._last_step_end: float | None = None
        self._worker_free: dict[tuple[str, int], float] = {}  # when each worker last finished a task

    # ------------------------------------------------------------------ running
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
        batch (when ``batches`` has a ``state_dict``), the operator states and the
        weights that in-flight steps will still load. ``validate(step)`` says after
        which steps the validation plan runs on the next of ``val_batches`` (its
        metrics come back as ``val/...``). :meth:`request_stop` ends the run after
        the steps already submitted.
        """
        self.start()
        self._stop = False
        source = batches if hasattr(batches, "__next__") else iter(batches)
        in_flight: deque[_Step] = deque()
        self._in_flight = in_flight
        t = start_step
        end = start_step + steps
        try:
            while t < end or in_flight:
                while t < end and not self._stop and len(in_flight) < window(self.max_staleness):
                    st = self._submit_step(t, next(source), self.plan)
                    if checkpoint is not None and checkpoint(t):
                        st.snapshot = self._queue_snapshot(t, batches)
                    if validate is not None and self.plan.validation is not None and validate(t):
                        assert val_batches is not None, "validate needs val_batches"
                        st.validation = self._submit_step(t, next(val_batches), self.plan.validation)
                    in_flight.append(st)
                    t += 1
                if not in_flight:
                    break
                result = self._finish(in_flight.popleft())
                if on_step is not None:
                    on_step(result)
                yield result
        except (GeneratorExit, RollbackNeeded):  # the caller stopped iterating (run_step), or rolls back: stays up
            raise
        except BaseException:
            self.close()
            raise

    def request_stop(self) -> None:
        """Submit no further steps; the ones in flight finish (a graceful Ctrl-C)."""
        self._stop = True

    def run_step(self, batch: DataProto, step: int = 0) -> StepResult:
        """Run one step on ``batch`` (synchronously) and return its result."""
        return next(self.run([batch], steps=1, start_step=step))

    # ------------------------------------------------------------------ submitting
    def _submit_step(self, t: int, batch: DataProto, plan: Plan) -> _Step:
        problems = batch.check_fields(plan.graph.source_fields)
        if problems:
            raise DataSourceMismatch(f"step {t + 1}: the data source's batch does not match the columns it declares: "
                                     + "; ".join(problems))
        st = _Step(t, time.time(), plan, src=self.backend.put(batch), batch=batch,
                   state_in=dict(self._op_state[plan.kind]))
        for key in plan.order:
            self._submit_task(st, plan.tasks[key])
        return st

    def _submit_task(self, st: _Step, task: Task) -> None:
        """Submit one task of step ``st`` on every rank its dispatch mode runs it on."""
        t, kind = st.step, st.plan.kind
        read = task_input(task, st.src, st.outputs)
        shards = read.handles() if read is not None else []
        shape = read.shape() if read is not None else None
        read_srcs = {k for r in task.reads for k in r.srcs}
        # after: and role-order edges carry no data; their tasks still must finish first
        order_gates = [st.first_report[d] for d in sorted(task.deps - read_srcs, key=str)]
        op_state = self._op_state[kind]
        state = [op_state.get(task.node) or self.backend.put(None)] if task.stateful else []
        outputs: dict[int, Any] = {}
        for rank in task.ranks:
            waits = list(order_gates)
            for gate in task.gates:
                found = self.versions.gate(gate, t, task.pool, rank)
                if found is not None:
                    waits.append(found[0])
                    if found[1] is not None:
                        st.reports[found[1]] = (None, task.pool, rank)
            min_version = max((g.min_version(t) for g in task.gates), default=None)
            call = Call(task.node, t, task.mb, shape, len(waits), rank, task.world, task.dispatch, task.keys,
                        task.factor, min_version, task.stateful, kind)
            data, report = self.backend.submit(task.pool, rank, call, waits + state + shards)
            st.reports[report] = (task.key, task.pool, rank)
            if rank in task.collected:
                outputs[rank] = data
            st.first_report.setdefault(task.key, report)
        # what consumers read: the collected ranks' outputs, merged by the task's dispatch mode
        st.outputs[task.key] = DataProtoFuture([outputs[r] for r in task.collected],
                                               collect_fn=get_mode(task.dispatch).collect)
        if task.stateful:  # the next task of this node starts from its first rank's state after this one
            op_state[task.node] = st.first_report[task.key]
        if task.updates is not None:
            self.versions.updated(task.updates, t, task.pool, st.first_report[task.key], task.publishes, task.gather)

    # ------------------------------------------------------------------ waiting
    def _finish(self, st: _Step) -> StepResult:
        pending = dict(st.reports)
        received: set[Any] = set()
        ended: dict[TaskKey, float] = {}
        infos: list[Info] = []
        syncs: list[Info] = []  # weight loads on other pools (their fingerprints)
        label = self.backend.worker_label
        training = st.plan.kind == "train"  # validation reports no progress and moves no weight version
        while pending:
            done = self.backend.wait_reports(list(pending), timeout=self.poll_s)
            for h, outcome in done:
                key, pool, rank = pending.pop(h)
                if isinstance(outcome, BaseException):
                    if self._recovered(st, outcome):  # the lost tasks run again (new worker, new prompts)
                        pending = {h: v for h, v in st.reports.items() if h not in received}
                        break
                    if self.on_progress is not None and key is not None and training:
                        self.on_progress(st.step, {**node_states(st.plan, ended), key[0]: "failed"})
                    raise self._failure(outcome, st.step, key, pool, rank) from None
                info: Info = outcome
                received.add(h)
                if key is not None:
                    ended[key] = max(ended.get(key, 0.0), info.end)
                    infos.append(info)
                elif info.prints is not None:
                    syncs.append(info)
                self._worker_free[(pool, rank)] = max(self._worker_free.get((pool, rank), 0.0), info.end)
                self.timeline.add(info)
            if done and self.on_progress is not None and training:
                self.on_progress(st.step, node_states(st.plan, ended))
            try:
                check_timeouts(st.step, st.plan, st.plan.graph, pending, ended, st.submitted_at, self._worker_free,
                               label, self.backend.stacks)
            except TaskTimeout as e:  # the live view marks the stuck node
                if self.on_progress is not None and training and e.node is not None:
                    self.on_progress(st.step, {**node_states(st.plan, ended), e.node: "stuck"})
                raise
        if training:
            self.versions.finished(st.step)
        metrics, makespan, bound = step_metrics(st.plan, infos, st.submitted_at)
        if training:
            extra, self._last_step_end = pipeline_metrics(st.plan, infos, self._last_step_end)
            metrics.update(extra)
        metrics.update({f"faults/{k}": float(v) for k, v in st.faults.items() if k != "refill_rounds"})
        data = self._collect(st) if self.fetch and training else None
        result = StepResult(st.step, metrics, infos, makespan, bound, data, syncs=syncs)
        wanted = self.record(st.step) if self.record is not None and training else None
        if wanted:
            result.records = collect_records(self.plan, wanted, st.src, st.outputs, self.backend.get_many)
        if st.snapshot is not None:
            result.checkpoint = self._resolve_snapshot(st.snapshot)
        if st.validation is not None:
            val = self._finish(st.validation)
            result.val_metrics = {f"val/{k}": v for k, v in val.metrics.items() if not k.startswith("scheduler/")}
        return result

    def _recovered(self, st: _Step, exc: BaseException) -> bool:
        steps, op_state = [st, *self._in_flight], self._op_state[st.plan.kind]
        need = refill_of(exc)
        if need is not None:  # raises when the step cannot be refilled
            return refill_step(need, steps, self.backend, self.versions.syncs, self._submit_task, op_state,
                               keyed_draw(self.graph.config), self._requeue_snapshot)
        return replace_dead(self.backend, self.restarts, self.versions.syncs, steps, self._submit_task, op_state, exc,
                            self._requeue_snapshot)

    def _requeue_snapshot(self, st: _Step) -> None:
        """A step run again: its checkpoint is taken again behind it (with the data position it had)."""
        if st.snapshot is not None:
            st.snapshot = {**self._queue_snapshot(st.step, None), "source": st.snapshot["source"]}

    def _failure(self, exc: BaseException, step: int, key: TaskKey | None, pool: str, rank: int) -> RuntimeFailure:
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

    def _collect(self, st: _Step) -> DataProto:
        """The fetched fields of a step, at the finest row space among them
        (prompt-level columns repeated to sample rows, as a consumer sees them)."""
        fut = fetched(self.plan, self.fetch, st.src, st.outputs)
        return fut.collect(self.backend.get_many(fut.handles()))

    # ------------------------------------------------------------------ checkpoints
    def _queue_snapshot(self, t: int, source: Any) -> dict[str, Any]:
        shards = str(self._stage(t))
        workers = {key: self.backend.call(key[0], key[1], "get_state", shards) for key in self._worker_keys()}
        return {
            "step": t,
            "workers": workers,
            "shards": shards,  # sharded roles' states, written there by their ranks
            "source": source.state_dict() if hasattr(source, "state_dict") else None,
            # weights already fetched for steps still to come (staleness >= 1)
            "weights": self.versions.in_flight_weights(t),
            "operator_state": dict(self._op_state["train"]),
        }

    def _worker_keys(self) -> list[tuple[str, int]]:
        return [(pool, rank) for pool, cfg in self.graph.config.pools.items() for rank in range(cfg.workers)]

    def snapshot_now(self, step: int, source: Any = None) -> dict[str, Any]:
        """A checkpoint payload of the current state (call when no step is in flight)."""
        return self._resolve_snapshot(self._queue_snapshot(step, source))

    def _resolve_snapshot(self, snap: dict[str, Any]) -> dict[str, Any]:
        def state_of(h: Any) -> Any:
            value = self.backend.get(h)
            return value.state if isinstance(value, Info) else value

        limit, get = self.graph.config.schedule.timeout_s, self.backend.get
        return {**snap, "workers": {k: get_within(get, h, limit, f"the state of {self.backend.worker_label(*k)} for "
                                                  f"the checkpoint of step {snap['step'] + 1}")
                                    for k, h in snap["workers"].items()},
                "weights": {k: self.backend.get(h) for k, h in snap["weights"].items()},
                "operator_state": {n: state_of(h) for n, h in snap["operator_state"].items()}}

    def restore(self, payload: dict[str, Any]) -> None:
        """Load a checkpoint payload into the (started) workers; the next step is ``payload['step'] + 1``.

        A pool may now have another number of workers than the payload's: a rank the
        checkpoint has no state for takes rank 0's, without its own (per-rank) parts,
        and sharded roles reshard from ``payload['shards']``.
        """
        self.start()
        saved = payload["workers"]
        handles = []
        for pool, rank in self._worker_keys():
            own = (pool, rank) in saved
            state = saved[(pool, rank)] if own else saved.get((pool, 0))
            if state is None:
                raise KeyError(f"no state for pool {pool!r} (the checkpoint holds "
                               f"{', '.join(sorted({p for p, _ in saved})) or 'no pools'})")
            handles.append(self.backend.call(pool, rank, "set_state", state, payload.get("shards"), own))
        for h in handles:
            self.backend.get(h)
        # updates before the checkpoint are done: same-pool gates for them are satisfied
        self.versions.restore(payload["step"], {k: self.backend.put(w) for k, w in payload["weights"].items()})
        self._op_state["train"] = {n: self.backend.put(s) for n, s in payload.get("operator_state", {}).items()}

    def close(self) -> None:
        if self._started:
            self.backend.shutdown()
            self._started = False

    def __enter__(self) -> "Runtime":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()
