"""What a task is handed: its reads as one :class:`~flowrl.data.DataProtoFuture`.

A producer task's output is a future over the handles of the ranks its
dispatch mode collects, with that mode's collect. A consumer's read of it takes
the read's columns from every shard (before anything is merged), merges the
producer tasks it reads (a barrier reads every micro-batch) in order, then
takes the read's rows and repeats them to the consumer's row space
(:func:`~flowrl.data.expand.take_rows`); a task reading several producers gets
their reads side by side. The runtime sends the future's shape in the task's
``Call`` and its handles as top-level arguments (Ray resolves those before the
task starts); the worker collects it. The rows the driver fetches for a dump
are read the same way.

Example::

    fut = task_input(plan.tasks[("reward", 0)], source_handle, outputs)
    batch = fut.collect(backend.get_many(fut.handles()))
"""

from __future__ import annotations

import functools

import numpy as np
from typing import Any, Iterable

from flowrl.data import DataProto, DataProtoFuture
from flowrl.data.dispatch import DROPPED, concat_rows
from flowrl.data.expand import take_rows
from flowrl.graph import SOURCE
from flowrl.plan.planner import Plan, Read, Task, TaskKey


def union_columns(parts: list[DataProto]) -> DataProto:
    """The reads of one task side by side: one batch with every read's columns; a row
    dropped in any read (``on_error: drop_group``) is dropped in the union."""
    marks = [p.non_tensor_batch.pop(DROPPED) for p in parts if DROPPED in p.non_tensor_batch]
    out = parts[0]
    for p in parts[1:]:
        out = out.union(p)
    if marks:
        out.non_tensor_batch[DROPPED] = np.logical_or.reduce([np.asarray(m, dtype=bool) for m in marks])
    return out


def read_future(read: Read, src: Any, outputs: dict[TaskKey, DataProtoFuture]) -> DataProtoFuture:
    """The future of one read: its producer tasks' outputs (``src``: the source batch's handle),
    narrowed to its columns, merged in order, then its rows repeated to the consumer's space."""
    parts = [(DataProtoFuture([src]) if key[0] == SOURCE else outputs[key]).select(read.fields)
             for key in read.srcs]
    pick = (functools.partial(take_rows, rows=read.rows, repeat=read.repeat)
            if read.rows is not None or read.repeat > 1 else None)
    return DataProtoFuture(parts, collect_fn=concat_rows, dispatch_fn=pick)


def task_input(task: Task, src: Any, outputs: dict[TaskKey, DataProtoFuture]) -> DataProtoFuture | None:
    """Everything ``task`` reads, as one future (None when it reads nothing)."""
    reads = [read_future(r, src, outputs) for r in task.reads]
    if not reads:
        return None
    return reads[0] if len(reads) == 1 else DataProtoFuture(reads, collect_fn=union_columns)


def fetched(plan: Plan, fields: Iterable[str], src: Any, outputs: dict[TaskKey, DataProtoFuture]) -> DataProtoFuture:
    """``fields`` of a finished step, at the finest row space among them (prompt-level columns
    repeated to the sample rows, as a consumer sees them): a read of every task of their producers."""
    producers = plan.graph.producers()
    by_node: dict[str, list[str]] = {}
    for f in fields:
        by_node.setdefault(producers[f][0], []).append(f)
    target = max(plan.spaces[n].factor for n in by_node)
    reads = [Read(tuple(sorted((k for k in outputs if k[0] == node), key=lambda k: k[1] or 0))
                  if node != SOURCE else ((SOURCE, None),), tuple(names), None, target // plan.spaces[node].factor)
             for node, names in by_node.items()]
    futures = [read_future(r, src, outputs) for r in reads]
    return DataProtoFuture([futures[0] if len(futures) == 1 else DataProtoFuture(futures, collect_fn=union_columns)],
                           collect_fn=complete_rows)


def complete_rows(parts: list[DataProto]) -> DataProto:
    """The rows of a fetch no node dropped (``on_error: drop_group``): a dump never shows a dropped
    row's placeholder values as if they were results."""
    data = parts[0]
    mask = data.non_tensor_batch.pop(DROPPED, None)
    return data if mask is None or not np.any(mask) else data.select_idxs(~np.asarray(mask, dtype=bool))


__all__ = ["complete_rows", "fetched", "read_future", "task_input", "union_columns"]
