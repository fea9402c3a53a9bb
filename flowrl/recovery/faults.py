"""A node's failure policy (``on_error``) and the fault switch, as hooks on the worker's tasks.

``on_error: {retries: N, backoff_s: S, then: fail | drop_group}`` on a node:

* the operator is run again on the same rows up to ``N`` times, ``S`` seconds
  before the first retry, doubling after each (``faults/retries``);
* then ``fail`` (the default) fails the step, naming the node and the attempts;
* or ``drop_group``: the operator is run on one group at a time (the rows of one
  value of the node's declared ``group_key``, verl's ``uid``; without one, each run
  of rows of one prompt) to find the groups it fails on; those rows are marked in the
  :data:`~flowrl.data.dispatch.DROPPED` column (``faults/dropped_groups``,
  ``faults/dropped_rows``) and every later task of the step runs its operator on the
  unmarked rows only, so the advantage and loss statistics are those of a step that
  never held the failed groups. A marked row's columns hold no value anyone reads: an
  error never becomes a zero reward. When every group fails, the step fails.

The fault switch: ``trainer.fault: "node=reward,step=3,rank=0,kind=raise"`` in the graph, or
``flowrl run --fault SPEC`` (``kind``: ``raise``, ``hang`` or ``kill``; ``step`` counts from 1
like the metrics; ``rank`` and ``mb`` narrow it; ``times=N`` fires it on the first N attempts
only) makes that node's task fail that way, for tests and rehearsals. ``node=checkpoint`` fires
instead where a worker's state is taken for that step's checkpoint, ``node=validation`` in the
tasks of the validation run after that step, ``node=sync`` where a worker loads another pool's
weights for a task of that step. A ``kill`` fires in the
worker's first process only, so a replaced worker runs the task again.

Both are :mod:`hooks <flowrl.runtime.hooks>` this module registers: :class:`FailurePolicy` on
every node (it also keeps rows an earlier node dropped out of the operator), outside
:class:`FaultSwitch` on the node the switch names, so a retry fires the switch again.

Example::

    out, metrics = run_guarded(lambda b: op(b), batch, OnErrorConfig(retries=1), group=8, factor=1)
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from flowrl.errors import RefillNeeded, RunError
from flowrl.data import DataProto
from flowrl.data.dispatch import DROPPED, TASK_ROWS
from flowrl.data.metrics import total
from flowrl.graph.config import FAULT_WINDOWS, Fault, FaultSpecError, OnErrorConfig, parse_fault
from flowrl.plan.rowspace import input_space
from flowrl.runtime.hooks import HookSpec, Run, TaskHook, TaskRun, task_hooks

if TYPE_CHECKING:
    from flowrl.plan.planner import Plan


#: the window of :data:`FAULT_WINDOWS` fired from a task (validation's); the worker fires the others itself
#: (``TaskHook.entering``: ``checkpoint``, ``sync``)
VALIDATION = "validation"
assert VALIDATION in FAULT_WINDOWS
#: the kind of plan validation runs (:mod:`flowrl.plan.validation`)
VALIDATION_PLAN = "val"


class InjectedFault(RunError):
    """Raised by the fault switch (``kind=raise``)."""


class Injector(TaskHook):
    """Fires a :class:`~flowrl.graph.config.Fault` in a worker's tasks; counts attempts so ``times``
    holds across retries. ``first_process``: False in a worker that replaced a dead one."""

    def __init__(self, fault: Fault | None, first_process: bool = True) -> None:
        self.fault, self.first_process = fault, first_process
        self._fired = 0
        self._lock = threading.Lock()

    def around(self, task: TaskRun, run: Run) -> Run:
        call = task.call

        def injected(rows: DataProto) -> tuple[DataProto, dict[str, float]]:
            self.fire(call.node, call.step, call.rank, call.mb)
            if call.plan == VALIDATION_PLAN:
                self.fire(VALIDATION, call.step, call.rank, call.mb)
            return run(rows)

        return injected

    def entering(self, window: str, step: int, rank: int) -> None:
        self.fire(window, step, rank, None)

    def fire(self, node: str, step: int, rank: int, mb: int | None) -> None:
        """Fail the way the fault says when it names this task (and has attempts left)."""
        f = self.fault
        if f is None or not f.matches(node, step, rank, mb):
            return
        with self._lock:
            if f.times is not None and self._fired >= f.times:
                return
            self._fired += 1
        if f.kind == "kill":
            if self.first_process:
                os.kill(os.getpid(), signal.SIGKILL)
            return
        if f.kind == "hang":
            _sleep_forever()
        raise InjectedFault(f"injected by trainer.fault (node={f.node}, step={f.step}, kind=raise)")


@dataclass(frozen=True, eq=False)
class FaultSwitch(HookSpec):
    """The fault switch on the node it names: an :class:`Injector` per worker."""

    fault: Fault

    def build(self, worker: Any) -> TaskHook:
        return Injector(self.fault, worker.first_process)


@dataclass(frozen=True, eq=False)
class FailurePolicy(HookSpec, TaskHook):
    """A node's ``on_error`` around its operator (:func:`run_guarded`); ``group``: input rows per
    prompt; the group key is the node's declared one, from the plan (``Call.keys``)."""

    policy: OnErrorConfig | None
    group: int = 1

    def build(self, worker: Any) -> TaskHook:
        return self  # keeps no state

    def around(self, task: TaskRun, run: Run) -> Run:
        call = task.call
        return lambda rows: run_guarded(run, rows, self.policy, self.group, call.factor,
                                        (call.node, call.step, call.mb), call.keys.groups)


@task_hooks
def failure_policies(plan: "Plan") -> dict[str, HookSpec]:
    """Every node's :class:`FailurePolicy` (a node without ``on_error`` still leaves dropped rows out)."""
    graph = plan.graph
    return {n: FailurePolicy(node.config.on_error, input_space(graph, plan.spaces, n).factor)
            for n, node in graph.nodes.items()}


@task_hooks  # registered after failure_policies: the policy wraps the switch
def fault_switch(plan: "Plan") -> dict[str, HookSpec]:
    """The node ``trainer.fault`` names, with its :class:`FaultSwitch` (for this plan's tasks)."""
    text = plan.graph.config.trainer.fault
    fault = parse_fault(text) if text is not None else None
    if fault is not None and fault.node in FAULT_WINDOWS:  # not a node's task: every worker holds the switch
        switch = FaultSwitch(fault)
        return {n: switch for n in plan.graph.nodes}
    return {fault.node: FaultSwitch(fault)} if fault is not None and fault.node in plan.graph.nodes else {}


def _sleep_forever() -> None:
    while True:
        time.sleep(3600)


def run_guarded(run: Run, batch: DataProto, policy: OnErrorConfig | None, group: int = 1,
                factor: int = 1, where: tuple[str, int, int | None] = ("", 0, None),
                key: str | None = None) -> tuple[DataProto, dict[str, float]]:
    """``run(batch)`` under the node's ``policy``, on the rows no earlier node dropped.

    ``group``: rows per prompt in ``batch`` (used when it has no ``key`` column: the node's
    declared ``group_key``); ``factor``: output rows per input row; ``where``: (node, step,
    micro-batch), for a refill.
    The output has the input's rows (times ``factor``), the dropped ones marked, whenever the
    input or this node dropped any.
    """
    mask = batch.non_tensor_batch.pop(DROPPED, None)
    marked = mask is not None
    dropped = np.zeros(len(batch), dtype=bool) if mask is None else np.asarray(mask, dtype=bool)
    kept = np.flatnonzero(~dropped)
    part = batch if not dropped.any() else _keep(batch, kept, dropped)
    try:
        out, metrics = _with_retries(run, part, policy)
    except Exception as e:
        if policy is None or policy.then == "fail":
            raise
        failed = _failed_groups(run, part, group, key)
        if policy.then == "refill" and failed:
            keys = batch.non_tensor_batch.get(key) if key is not None else None
            rows = [int(kept[r[0]]) for r in failed]
            raise RefillNeeded(*where, [r // max(1, group) for r in rows],
                               None if keys is None else [keys[r] for r in rows], f"{type(e).__name__}: {e}") from None
        if len(failed) == len(_groups(part, group, key)):
            raise  # nothing left to go on with: the step fails, with the operator's own error
        now = np.zeros(len(part), dtype=bool)
        for rows in failed:
            now[rows] = True
        metrics = {"faults/dropped_groups": total(len(failed)), "faults/dropped_rows": total(int(now.sum()))}
        out, more = run(_keep(part, np.flatnonzero(~now), now))
        metrics = {**more, **metrics}
        dropped[kept[now]] = True
        kept = np.flatnonzero(~dropped)
        marked = True
    if not marked or not (out.batch is not None or out.non_tensor_batch):
        return out, metrics  # nothing dropped upstream or here (or an output of metadata only)
    out = _scatter(out, kept, len(batch), factor)
    out.non_tensor_batch[DROPPED] = np.repeat(dropped, factor)
    return out, metrics


def _with_retries(run: Run, batch: DataProto, policy: OnErrorConfig | None) -> tuple[DataProto, dict[str, float]]:
    retries = policy.retries if policy is not None else 0
    attempt = 0
    while True:
        try:
            out, got = run(batch)
        except Exception as e:
            if attempt == retries:
                if retries:
                    e.add_note(f"(failed on each of {retries + 1} attempts: on_error.retries={retries})")
                raise
            time.sleep(policy.backoff_s * 2 ** attempt)
            attempt += 1
            continue
        return out, ({**got, "faults/retries": total(attempt)} if attempt else got)


def _groups(batch: DataProto, group: int, key: str | None) -> list[np.ndarray]:
    """The row indices of each group: rows of one value of the ``key`` column, else runs of ``group`` rows."""
    keys = batch.non_tensor_batch.get(key) if key is not None else None
    if keys is not None:
        order: dict[Any, list[int]] = {}
        for i, u in enumerate(keys):
            order.setdefault(u, []).append(i)
        return [np.asarray(rows) for rows in order.values()]
    step = max(1, group)
    return [np.arange(s, min(s + step, len(batch))) for s in range(0, len(batch), step)]


def _failed_groups(run: Run, batch: DataProto, group: int, key: str | None) -> list[np.ndarray]:
    failed = []
    for rows in _groups(batch, group, key):
        try:
            run(batch[rows.tolist()])
        except Exception:  # noqa: BLE001 - the group is left out of the step, counted
            failed.append(rows)
    return failed


def _keep(batch: DataProto, kept: np.ndarray, dropped: np.ndarray) -> DataProto:
    """``batch``'s rows ``kept``; a balanced part's places in its task renumbered among the kept rows."""
    part = batch[kept.tolist()]
    places = batch.meta_info.get(TASK_ROWS)
    if places is not None:
        rows, n = places
        task_dropped = np.zeros(n, dtype=bool)
        task_dropped[np.asarray(rows)[dropped]] = True
        renumber = np.cumsum(~task_dropped) - 1
        part.meta_info[TASK_ROWS] = (renumber[np.asarray(rows)[kept]], int((~task_dropped).sum()))
    return part


def _scatter(out: DataProto, kept: np.ndarray, rows: int, factor: int) -> DataProto:
    """``out`` (the kept rows' outputs) back at their places among ``rows`` input rows; the other
    rows hold zeros (tensors) or None, and are marked dropped by the caller."""
    places = (np.repeat(kept, factor) * factor + np.tile(np.arange(factor), len(kept))).astype(np.int64)
    n = rows * factor
    tensors = {}
    if out.batch is not None:
        index = torch.as_tensor(places)
        for k, t in out.batch.items():
            full = torch.zeros((n,) + tuple(t.shape[1:]), dtype=t.dtype)
            full[index] = t
            tensors[k] = full
    non_tensors = {}
    for k, a in out.non_tensor_batch.items():
        full = np.empty(n, dtype=object) if a.dtype == object else np.zeros((n,) + a.shape[1:], dtype=a.dtype)
        full[places] = a
        non_tensors[k] = full
    return DataProto.from_dict(tensors=tensors or None, non_tensors=non_tensors, meta_info=dict(out.meta_info))


__all__ = ["Fault", "FailurePolicy", "FaultSpecError", "FaultSwitch", "InjectedFault", "Injector", "RefillNeeded",
           "failure_policies", "fault_switch", "parse_fault", "run_guarded"]
