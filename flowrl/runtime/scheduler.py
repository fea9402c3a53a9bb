"""The runtime: a submit-and-wait loop over the plan.

The driver submits a whole step at once — every task of the plan, on the ranks its dispatch
mode names, in the plan's per-pool order — handing each task the :class:`~flowrl.data.DataProtoFuture`
of its inputs, never their values. Pools run concurrently; a streaming node's micro-batch m starts as
soon as its upstream's is done; steps overlap within the staleness bound (:mod:`flowrl.plan.staleness`).
Then it waits: the reports of every finished task are taken together, and a finished step, each task's
weight version checked against the plan's, becomes a :class:`~flowrl.runtime.reports.StepResult`. The
driver reads only reports and, on request, a few fields. The rest attaches from outside
(:mod:`flowrl.runtime.steps`): driver-step hooks see each finished step; a recovery guard decides on
each failed report and watches the pending ones.

Example::

    with Runtime(graph, backend="local") as rt:
        print([r.metrics["scheduler/efficiency"] for r in rt.run(source_batches, steps=3)])
"""

from __future__ import annotations

import os
import tempfile
import time
from collections import Counter, defaultdict, deque
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from flowrl.data import DataProto, DataProtoFuture
from flowrl.data.dispatch import get_mode
from flowrl.errors import RuntimeFailure
from flowrl.graph import Graph
from flowrl.plan.planner import Plan, Task, TaskKey, make_plan
from flowrl.plan.staleness import Versions, window
from flowrl.runtime.backends import Backend, make_backend
from flowrl.plan.reads import fetched, task_input
from flowrl.runtime.reports import StepResult, check_versions, node_states, pipeline_metrics, step_metrics
from flowrl.runtime.steps import (Fail, Failure, FinishedStep, Guard, Outcome, RollBack, StateNotTaken, StepHook, StepRun, Where,
                                  forget, hand_back_state, lost_tasks, report_status, resolve_snapshot)
from flowrl.runtime.timeline import Timeline
from flowrl.runtime.worker import Call, Info, node_entries
from flowrl.store.checkpoint import CheckpointStore


class DataSourceMismatch(RuntimeFailure):
    """A data source yielded a batch that differs from the columns it declares."""


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
        recovery: Guard | None = None,
        hooks: Iterable[StepHook] = (),
    ) -> None:
        """``stage(step)``: the directory where the ranks of a sharded role write its shards for
        step ``step``'s checkpoint (a :class:`~flowrl.store.checkpoint.CheckpointStore`'s
        staging directory); default: one under the system's temporary directory. ``recovery``
        (default: a failure fails its step, named; nothing is watched) and ``hooks``: see
        :mod:`flowrl.runtime.steps`."""
        graph.check(resources=resources).raise_if_errors()
        self.graph = graph
        self.backend = make_backend(backend, address) if isinstance(backend, str) else backend
        self.plan: Plan = make_plan(graph, self.backend.traits)
        self.timeline = Timeline()
        self.fetch, self.poll_s, self.on_progress = tuple(fetch), poll_s, on_progress
        self.max_staleness = max((e.staleness for e in graph.state_edges), default=0)
        self.checks_versions = True  # off only where runtimes take turns on one set of workers (a benchmark)
        self.hooks = list(hooks)
        self.recovery = recovery if recovery is not None else Guard()
        self.recovery.attach(self, self.backend.supervisor)
        self._reset()
        self._stop = self._started = False
        self._carried: defaultdict[int, Counter[str]] = defaultdict(Counter)  # faults of steps to run again
        self._stage = stage or CheckpointStore(Path(tempfile.gettempdir())
                                               / f"flowrl-shards-{os.getpid()}-{id(self)}").path

    # ------------------------------------------------------------------ placement
    def start(self) -> "Runtime":
        if self._started:
            return self
        nodes = {p.kind: node_entries(p) for p in self.plan.runs()}  # no driver process when no node runs there
        self.backend.start(self.plan.pools, nodes, self.graph.config.trainer.seed, driver=self.plan.driver)
        self._started = True
        return self

    def _reset(self) -> None:
        """No step in flight, no weight version moved."""
        self._in_flight: deque[StepRun] = deque()  # the steps submitted behind the one being finished
        self._finishing: StepRun | None = None  # the step whose reports are awaited
        self.versions = Versions(self.max_staleness, self.backend.call, lambda: self.backend.put(None))
        self._op_state: dict[str, dict[str, Any]] = {p.kind: {} for p in self.plan.runs()}  # node → latest state
        self._last_step_end: float | None = None
        self.worker_free: dict[tuple[str, int], float] = {}  # when each worker last finished a task

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
        """Run ``steps`` steps, yielding each result in order as it finishes (after a rollback, the
        steps behind its checkpoint run, and are yielded, again).

        ``checkpoint(step)``: which steps' results carry a checkpoint — every worker's state queued
        right behind that step's tasks (later steps, already submitted, are not in it), the data
        position after its batch (when ``batches`` has a ``state_dict``), the operator states and
        the weights in-flight steps will still load. ``validate(step)``: after which steps the
        validation plan runs on the next of ``val_batches`` (``val/...`` metrics).
        :meth:`request_stop` ends the run after the steps already submitted."""
        self.start()
        self._stop = False
        source = batches if hasattr(batches, "__next__") else iter(batches)
        self._in_flight = deque()  # restore (a rollback) replaces it: read through self, never aliased
        t, end = start_step, start_step + steps
        try:
            while t < end or self._in_flight:
                while t < end and not self._stop and len(self._in_flight) < window(self.max_staleness):
                    st = self._submit_step(t, next(source), self.plan)
                    if checkpoint is not None and checkpoint(t):
                        st.snapshot = self._queue_snapshot(t, batches)
                    if validate is not None and self.plan.validation is not None and validate(t):
                        assert val_batches is not None, "validate needs val_batches"
                        st.validation = self._submit_step(t, next(val_batches), self.plan.validation)
                    self._in_flight.append(st)
                    t += 1
                if not self._in_flight:
                    break
                result = self._finish(self._in_flight.popleft())
                if isinstance(result, RollBack):  # a checkpoint was loaded: go on from the step after it
                    t = result.step
                    continue
                if on_step is not None:
                    on_step(result)
                yield result
        except GeneratorExit:  # the caller stopped iterating (run_step): stays up
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
    def _submit_step(self, t: int, batch: DataProto, plan: Plan) -> StepRun:
        problems = batch.check_fields(plan.graph.source_fields)
        if problems:
            raise DataSourceMismatch(f"step {t + 1}: the data source's batch does not match the columns it declares: "
                                     + "; ".join(problems))
        st = StepRun(t, time.time(), plan, src=self.backend.put(batch), batch=batch,
                     state_in=dict(self._op_state[plan.kind]))
        if plan.kind == "train":
            st.faults.update(self._carried.pop(t, {}))
        for key in plan.order:
            self._submit_task(st, plan.tasks[key])
        return st

    def _submit_task(self, st: StepRun, task: Task) -> None:
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
    def _finish(self, st: StepRun) -> StepResult | RollBack:
        """Wait for every report of ``st``, then its result; recovery decides on each failed report."""
        self._finishing = st
        pending, received, ended = dict(st.reports), set(), {}
        infos: list[Info] = []
        syncs: list[Info] = []  # weight loads on other pools (their fingerprints)
        while pending:
            done = self.backend.wait_reports(list(pending), timeout=self.poll_s)
            for h, report in done:
                where = pending.pop(h)
                if isinstance(report, BaseException):
                    outcome = self.recovery.failed(st, self._failure(report), where)
                    if isinstance(outcome, RollBack):
                        return outcome
                    self._fail_on(st, outcome, ended, where[0] and where[0][0], "failed")
                    pending = {k: v for k, v in st.reports.items() if k not in received}  # the lost tasks, again
                    break
                received.add(h)
                self._take(report, where, ended, infos, syncs)
            if done and self.on_progress is not None and st.plan.kind == "train":
                self.on_progress(st.step, node_states(st.plan, ended))
            stuck = self.recovery.watch(st, pending, ended)
            self._fail_on(st, stuck, ended, getattr(stuck and stuck.error, "node", None), "stuck")
        return self._result(st, infos, syncs)

    def _failure(self, error: BaseException) -> Failure:
        """A failed report for recovery: with the dead workers behind it when a pool may restart one."""
        return Failure(error, self.backend.supervisor.deaths(error) if self.recovery.wants_deaths else {})

    def _take(self, info: Info, where: Where, ended: dict[TaskKey, float], infos: list[Info],
              syncs: list[Info]) -> None:
        """A report that came back: a task's (its end), or a weight sync's (its fingerprints)."""
        key, pool, rank = where
        if key is not None:
            ended[key] = max(ended.get(key, 0.0), info.end)
            infos.append(info)
        elif info.prints is not None:
            syncs.append(info)
        self.worker_free[(pool, rank)] = max(self.worker_free.get((pool, rank), 0.0), info.end)
        self.timeline.add(info)

    def _fail_on(self, st: StepRun, outcome: Outcome | None, ended: dict[TaskKey, float], node: str | None,
                 state: str) -> None:
        """Raise a :class:`Fail`'s error, the live view marking ``node`` (``failed``, ``stuck``)."""
        if not isinstance(outcome, Fail):
            return
        if self.on_progress is not None and node is not None and st.plan.kind == "train":
            self.on_progress(st.step, {**node_states(st.plan, ended), node: state})
        raise outcome.error from None

    def _result(self, st: StepRun, infos: list[Info], syncs: list[Info]) -> StepResult | RollBack:
        """A finished run's result (metrics, fields, checkpoint, validation); hooks see a training step's."""
        training = st.plan.kind == "train"  # validation reports no progress and moves no weight version
        if training:
            self.versions.finished(st.step)
            if self.checks_versions:
                check_versions(st.plan, infos)
        metrics, makespan, bound = step_metrics(st.plan, infos, st.submitted_at)
        if training:
            extra, self._last_step_end = pipeline_metrics(st.plan, infos, self._last_step_end)
            metrics.update(extra)
        metrics.update({f"faults/{k}": float(v) for k, v in st.faults.items() if k != "refill_rounds"})
        data = self._read(st, self.fetch) if self.fetch and training else None
        result = StepResult(st.step, metrics, infos, makespan, bound, data, syncs=syncs)
        if st.snapshot is not None:
            taken = self._take_snapshot(st)
            if isinstance(taken, RollBack):
                return taken
            result.checkpoint = taken
        if st.validation is not None:
            val = self._finish(st.validation)
            if isinstance(val, RollBack):
                return val
            result.val_metrics = {f"val/{k}": v for k, v in val.metrics.items() if not k.startswith("scheduler/")}
        if training:
            done = FinishedStep(result, result.row(), lambda names: self._read(st, names))
            for hook in self.hooks:
                hook.step_done(done)
        return result

    def _read(self, st: StepRun, names: Iterable[str]) -> DataProto:
        """Fields of a step at the finest row space among them, as a consumer sees them."""
        fut = fetched(self.plan, tuple(names), st.src, st.outputs)
        return fut.collect(self.backend.get_many(fut.handles()))

    # ------------------------------------------------------------------ recovery's port
    def steps(self) -> list[StepRun]:
        """The step being finished, then the steps submitted behind it."""
        return [s for s in (self._finishing, *self._in_flight) if s is not None]

    def reported(self, handle: Any) -> bool | None:
        """True: the report came back; False: not yet; None: it failed."""
        return report_status(self.backend, handle)

    def resubmit_lost(self, dead: set[tuple[str, int]], whole_first: bool = False) -> int:
        """Submit again, step by step in plan order, the tasks lost to ``dead`` (``whole_first``: and every
        task of the step being finished; :func:`~flowrl.runtime.steps.lost_tasks`); how many."""
        steps = self.steps()
        first = frozenset(steps[0].plan.order) if whole_first else frozenset()
        lost, lost_updates = lost_tasks(steps, dead, self.reported, first)
        self.backend.discard([h for st, keys in zip(steps, lost)
                              for h in forget(st, keys, dead, self.versions.syncs, lost_updates)])
        op_state = self._op_state[steps[0].plan.kind]
        for st, keys in zip(steps, lost):
            for key in keys:
                if st.plan.tasks[key].stateful:
                    hand_back_state(op_state, st, key)
                self._submit_task(st, st.plan.tasks[key])
            if keys and st.snapshot is not None:  # with the data position it had
                st.snapshot = {**self._queue_snapshot(st.step, None), "source": st.snapshot["source"]}
        return sum(map(len, lost))

    def rebatch(self, st: StepRun, batch: DataProto) -> None:
        """Give step ``st`` another source batch (before its tasks are submitted again)."""
        st.batch, st.src = batch, self.backend.put(batch)

    def count(self, step: int, fault: str, n: int = 1) -> None:
        """Add ``n`` to ``faults/<fault>`` of 0-based step ``step`` when it runs again (after a rollback)."""
        self._carried[step][fault] += n

    # ------------------------------------------------------------------ checkpoints
    def _queue_snapshot(self, t: int, source: Any) -> dict[str, Any]:
        shards = str(self._stage(t))
        workers = {key: self.backend.call(key[0], key[1], "get_state", shards, t) for key in self._worker_keys()}
        # shards: sharded roles' states, written there by their ranks; weights: those already fetched for steps
        # still to come (staleness >= 1)
        return {"step": t, "workers": workers, "shards": shards,
                "source": source.state_dict() if hasattr(source, "state_dict") else None,
                "weights": self.versions.in_flight_weights(t), "operator_state": dict(self._op_state["train"])}

    def _worker_keys(self) -> list[tuple[str, int]]:
        return [(pool, rank) for pool, cfg in self.graph.config.pools.items() for rank in range(cfg.workers)]

    def snapshot_now(self, step: int, source: Any = None) -> dict[str, Any]:
        """A checkpoint payload of the current state (call when no step is in flight)."""
        return resolve_snapshot(self.backend, self._queue_snapshot(step, source), self.graph.config.schedule.timeout_s)

    def _take_snapshot(self, st: StepRun) -> dict[str, Any] | RollBack:
        """Step ``st``'s checkpoint payload. A worker that fails while its state is taken goes to recovery as a
        failed task does: a dead rank of a trained pool rolls the run back; a replaced one is asked again."""
        while True:
            try:
                return resolve_snapshot(self.backend, st.snapshot, self.graph.config.schedule.timeout_s)
            except StateNotTaken as e:
                outcome = self.recovery.failed(st, self._failure(e.cause), (None, *e.worker))
                if isinstance(outcome, RollBack):
                    return outcome
                if isinstance(outcome, Fail):
                    raise e.cause from None  # as it came: a timeout names the worker and the checkpoint
                st.snapshot = {**self._queue_snapshot(st.step, None), "source": st.snapshot["source"]}

    def restore(self, payload: dict[str, Any] | None) -> None:
        """Drop every step in flight and weight version moved, then load a checkpoint payload into the
        (started) workers (``None``: nothing, their pools were started anew); the next step is ``payload['step']
        + 1``. A rank with no state there (another worker count) takes rank 0's, without its per-rank parts."""
        self.start()
        self.backend.discard([h for st in self.steps()
                              for h in [*st.reports, *(h for o in st.outputs.values() for h in o.handles())]])
        self._reset()
        if payload is None:
            return
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
