"""A node's failure policy (``on_error``) and the fault-injection switch, inside the worker.

``on_error: {retries: N, backoff_s: S, then: fail | drop_group}`` on a node:

* the operator is run again on the same rows up to ``N`` times, ``S`` seconds
  before the first retry, doubling after each (``faults/retries``);
* then ``fail`` (the default) fails the step, naming the node and the attempts;
* or ``drop_group``: the operator is run on one group at a time (the rows of one
  ``uid``; without a ``uid`` column, each run of rows of one prompt) to find the
  groups it fails on; those rows are marked in the :data:`~flowrl.data.dispatch.DROPPED`
  column (``faults/dropped_groups``, ``faults/dropped_rows``) and every later task
  of the step runs its operator on the unmarked rows only, so the advantage and
  loss statistics are those of a step that never held the failed groups. A marked
  row's columns hold no value anyone reads: an error never becomes a zero reward.
  When every group fails, the step fails.

The fault switch: ``FLOWRL_FAULT="node=reward,step=3,rank=0,kind=raise"`` (``kind``:
``raise``, ``hang`` or ``kill``; ``step`` counts from 1 like the metrics; ``rank``
and ``mb`` narrow it; ``times=N`` fires it on the first N attempts only) makes that
node's task fail that way, for tests and rehearsals. The driver reads it once
when the run starts (:func:`fault_from_env`) and hands it to the workers; a
``kill`` fires in the worker's first process only, so a replaced worker runs the
task again.

Example::

    out, metrics = run_guarded(lambda b: op(b), batch, OnErrorConfig(retries=1), group=8, factor=1)
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from flowrl.errors import ConfigError, RunError
from flowrl.data import DataProto
from flowrl.data.dispatch import DROPPED, TASK_ROWS
from flowrl.data.metrics import total
from flowrl.graph.config import OnErrorConfig

#: the environment variable of the fault switch
FAULT_ENV = "FLOWRL_FAULT"
KINDS = ("raise", "hang", "kill")

Run = Callable[[DataProto], tuple[DataProto, dict[str, float]]]


class InjectedFault(RunError):
    """Raised by the fault switch (``kind=raise``)."""


class RefillNeeded(RunError):
    """A node with ``on_error: refill`` failed on some groups: the driver replaces their prompts
    (:mod:`flowrl.recovery.refill`). ``groups``: their places among the task's groups; ``uids``:
    their ``uid`` when the node read it."""

    def __init__(self, node: str, step: int, mb: int | None, groups: list[int], uids: list | None, cause: str):
        self.node, self.step, self.mb, self.groups, self.uids, self.cause = node, step, mb, groups, uids, cause
        super().__init__(f"node {node!r} at step {step + 1} failed on {len(groups)} group(s): {cause}")

    def __reduce__(self):
        return (RefillNeeded, (self.node, self.step, self.mb, self.groups, self.uids, self.cause))


class FaultSpecError(ConfigError, ValueError):
    """``FLOWRL_FAULT`` does not parse."""


@dataclass(frozen=True)
class Fault:
    """Where the fault switch fires: ``node`` at ``step`` (1-based), optionally one ``rank`` / ``mb``."""

    node: str
    step: int
    kind: str = "raise"
    rank: int | None = None
    mb: int | None = None
    times: int | None = None  # None: every attempt

    def matches(self, node: str, step: int, rank: int, mb: int | None) -> bool:
        return (node == self.node and step + 1 == self.step and self.rank in (None, rank)
                and self.mb in (None, mb))


def parse_fault(text: str) -> Fault:
    """``node=reward,step=3,rank=0,kind=raise`` as a :class:`Fault` (a :class:`FaultSpecError` naming the bad part)."""
    fields: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or key.strip() not in ("node", "step", "rank", "mb", "kind", "times"):
            raise FaultSpecError(f"{FAULT_ENV}={text!r}: {part!r} is not one of node=, step=, rank=, mb=, kind=, "
                                 f"times= (e.g. {FAULT_ENV}='node=reward,step=3,kind=raise')")
        fields[key.strip()] = value.strip()
    if "node" not in fields or "step" not in fields:
        raise FaultSpecError(f"{FAULT_ENV}={text!r}: name the node and the step (node=reward,step=3)")
    kind = fields.get("kind", "raise")
    if kind not in KINDS:
        raise FaultSpecError(f"{FAULT_ENV}={text!r}: kind={kind!r} is not one of {', '.join(KINDS)}")
    try:
        ints = {k: int(fields[k]) for k in ("step", "rank", "mb", "times") if k in fields}
    except ValueError as e:
        raise FaultSpecError(f"{FAULT_ENV}={text!r}: step, rank, mb and times are whole numbers ({e})") from None
    if ints["step"] < 1:
        raise FaultSpecError(f"{FAULT_ENV}={text!r}: steps count from 1")
    return Fault(fields["node"], ints["step"], kind, ints.get("rank"), ints.get("mb"), ints.get("times"))


def fault_from_env() -> Fault | None:
    """The fault switch's setting, read in the driver (None when unset)."""
    text = os.environ.get(FAULT_ENV, "").strip()
    return parse_fault(text) if text else None


class Injector:
    """Fires a :class:`Fault` in a worker; counts attempts so ``times`` holds across retries."""

    def __init__(self, fault: Fault | None, first_process: bool = True) -> None:
        self.fault, self.first_process = fault, first_process
        self._fired = 0
        self._lock = threading.Lock()

    def __call__(self, node: str, step: int, rank: int, mb: int | None) -> None:
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
        raise InjectedFault(f"injected by {FAULT_ENV} (node={f.node}, step={f.step}, kind=raise)")


def _sleep_forever() -> None:
    while True:
        time.sleep(3600)


def run_guarded(run: Run, batch: DataProto, policy: OnErrorConfig | None, group: int = 1,
                factor: int = 1, where: tuple[str, int, int | None] = ("", 0, None)) -> tuple[DataProto, dict[str, float]]:
    """``run(batch)`` under the node's ``policy``, on the rows no earlier node dropped.

    ``group``: rows per prompt in ``batch`` (used when it has no ``uid`` column);
    ``factor``: output rows per input row; ``where``: (node, step, micro-batch), for a refill.
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
        failed = _failed_groups(run, part, group)
        if policy.then == "refill" and failed:
            uid = batch.non_tensor_batch.get("uid")
            rows = [int(kept[r[0]]) for r in failed]
            raise RefillNeeded(*where, [r // max(1, group) for r in rows],
                               None if uid is None else [uid[r] for r in rows], f"{type(e).__name__}: {e}") from None
        if len(failed) == len(_groups(part, group)):
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


def _groups(batch: DataProto, group: int) -> list[np.ndarray]:
    """The row indices of each group: rows of one ``uid``, else runs of ``group`` rows."""
    uid = batch.non_tensor_batch.get("uid")
    if uid is not None:
        order: dict[Any, list[int]] = {}
        for i, u in enumerate(uid):
            order.setdefault(u, []).append(i)
        return [np.asarray(rows) for rows in order.values()]
    step = max(1, group)
    return [np.arange(s, min(s + step, len(batch))) for s in range(0, len(batch), step)]


def _failed_groups(run: Run, batch: DataProto, group: int) -> list[np.ndarray]:
    failed = []
    for rows in _groups(batch, group):
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


__all__ = ["FAULT_ENV", "Fault", "FaultSpecError", "InjectedFault", "Injector", "RefillNeeded", "fault_from_env",
           "parse_fault", "run_guarded"]
