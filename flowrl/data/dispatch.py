"""Dispatch modes: how a task's rows are split across the ranks of a pool and how
the ranks' outputs are collected — registered split/collect pairs, by name.

An operator names its mode (``dispatch="split"``); the plan records it for every
task, with the columns the mode may read (:class:`RowKeys`, taken from the
node's declared inputs). A worker asks the mode for its rank's part of the
task's batch and, when the operator has run, to tag the output the way the
mode's collect needs it (:meth:`DispatchMode.tag`); a consumer's read is a
:class:`~flowrl.data.future.DataProtoFuture` whose collect is the producer's
mode, so the outputs of the ranks become the task's result in one place.
verl's ``DP_COMPUTE_PROTO`` and ``ONE_TO_ALL`` are the same idea; here a misuse
raises :class:`DispatchError` naming the mode and the counts instead of an
assert.

Built in:

* ``split`` — every rank runs its contiguous share of the rows; the result is
  the ranks' outputs concatenated in rank order.
* ``all`` — every rank runs the whole batch (each keeps the same state); the
  result, and the metrics, are rank 0's.
* ``driver`` — one run, on rank 0, with the whole batch.
* ``balanced`` / ``balanced_groups`` — data parallel: every rank its rows of the
  batch, assigned by :func:`~flowrl.data.balance.balance_ranks` so each holds
  about the same number of real tokens (the ones of the ``tokens`` column;
  ``balanced_groups`` keeps the rows of one ``groups`` value whole on one
  rank); every rank reports, and the outputs are put back in the batch's row
  order by the row tags :meth:`DispatchMode.tag` wrote. :func:`data_parallel`
  says which of the two a pool whose ranks form a process group runs.

A new mode (one that orders rows by length, say) registers a
:class:`DispatchMode` with :func:`dispatch_mode`; nothing else changes.

Example::

    mode = DISPATCH_MODES["split"]
    mode.ranks(2)                                    # [0, 1]
    part, tags = mode.split(batch, 1, 2, RowKeys())  # the second half of the rows
    mode.collect([out0, out1])                       # their concatenation
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable
from flowrl.errors import RunError

if TYPE_CHECKING:  # torch-backed; the registry itself stays light
    from flowrl.data.proto import DataProto


class DispatchError(RunError, ValueError):
    """A dispatch mode was misused: unknown name, or outputs that do not match its ranks."""


@dataclass(frozen=True)
class RowKeys:
    """The columns of a task's batch a dispatch mode may read, by their names in the batch.

    The plan fills them from the node's declaration (``balance_by=``, ``group_key=``
    of its operator, renamed as the node renames its inputs); flowrl/data names no
    column of its own. ``tokens``: a column whose ones are a row's real tokens (what
    a balanced split evens out; without one every row counts one). ``groups``: a
    column whose equal values mark rows that stay on one rank.
    """

    tokens: str | None = None
    groups: str | None = None


#: what a split hands the worker with a rank's part: the mode's own record of it (row tags)
Tags = Any


def _untagged(out: "DataProto", tags: Tags, factor: int) -> "DataProto":
    return out


@dataclass(frozen=True)
class DispatchMode:
    """One way of running a task on a pool's ranks: a split and its collect.

    ``runs_on(world)`` is the ranks that run it; ``split(batch, rank, world, keys)``
    the part of the batch a rank gets, with the mode's record of which rows they
    are; ``tag(out, tags, factor)`` marks the operator's output (``factor`` rows per
    input row) with that record; ``collected(world)`` the ranks whose outputs (and
    metrics) form the result; ``collect(parts)`` merges those outputs, in rank
    order, into the task's result. ``needs``: the :class:`RowKeys` fields it cannot
    run without; ``every_rank_rows``: its ranks run collectives together, so each
    needs at least one row.
    """

    name: str
    runs_on: Callable[[int], list[int]]
    split: Callable[["DataProto", int, int, RowKeys], tuple["DataProto", Tags]]
    collected: Callable[[int], list[int]]
    collect: Callable[[list["DataProto"]], "DataProto"]
    tag: Callable[["DataProto", Tags, int], "DataProto"] = _untagged
    needs: tuple[str, ...] = ()
    every_rank_rows: bool = False
    doc: str = ""

    def ranks(self, world: int) -> list[int]:
        """The ranks that run a task of this mode on a pool of ``world`` workers."""
        return self.runs_on(world)


#: every registered dispatch mode, by name
DISPATCH_MODES: dict[str, DispatchMode] = {}


def dispatch_mode(mode: DispatchMode) -> DispatchMode:
    """Register ``mode`` (a second mode of the same name is an error)."""
    if mode.name in DISPATCH_MODES and DISPATCH_MODES[mode.name] != mode:
        raise DispatchError(f"dispatch mode {mode.name!r} is registered twice")
    DISPATCH_MODES[mode.name] = mode
    return mode


def get_mode(name: str) -> DispatchMode:
    """The registered mode ``name``, or a :class:`DispatchError` listing the known ones."""
    try:
        return DISPATCH_MODES[name]
    except KeyError:
        raise DispatchError(f"unknown dispatch mode {name!r}; registered: {', '.join(DISPATCH_MODES)}") from None


def rank_rows(n: int, rank: int, world: int) -> tuple[int, int]:
    """Rows ``[lo, hi)`` of ``n`` that ``rank`` of ``world`` owns: contiguous, the
    first ``n % world`` ranks one row more."""
    per, extra = divmod(n, world)
    lo = rank * per + min(rank, extra)
    return lo, lo + per + (1 if rank < extra else 0)


def _split_rows(batch: "DataProto", rank: int, world: int, keys: RowKeys) -> tuple["DataProto", Tags]:
    lo, hi = rank_rows(len(batch), rank, world)
    return batch[lo:hi], None


def concat_rows(parts: list["DataProto"]) -> "DataProto":
    """Parts concatenated in order, response columns right-padded to one width (parts of one
    step may differ); empty parts skipped."""
    from flowrl.data.padding import concat_padded  # torch-backed: imported when data moves, not to register

    parts = [p for p in parts if len(p)] or parts[:1]
    return parts[0] if len(parts) == 1 else concat_padded(parts)  # ranks' response widths may differ


def _first(parts: list["DataProto"]) -> "DataProto":
    if len(parts) != 1:
        raise DispatchError(f"a one-result dispatch mode got {len(parts)} outputs to collect; it takes rank 0's")
    return parts[0]


def _whole(batch: "DataProto", rank: int, world: int, keys: RowKeys) -> tuple["DataProto", Tags]:
    return batch, None


#: the column a balanced task's outputs carry each row's index in the task's batch in, so
#: collect puts them back in order; written by :meth:`DispatchMode.tag`, removed by collect.
#: Columns of this prefix belong to the dispatch modes (:func:`narrow` keeps them)
ROW_INDEX = "_dispatch_row"
TAG_PREFIX = "_dispatch"
#: the meta_info key of a balanced part: its rows' places in the task's batch and that batch's row
#: count, so an update can cut the whole batch's mini-batches from its part
TASK_ROWS = "task_rows"
#: the column that marks rows left out of a step (a node's ``on_error: drop_group``): every
#: read keeps it, and every task runs its operator on the unmarked rows only
DROPPED = "_dropped"


def real_tokens(batch: "DataProto", tokens: str | None):
    """Each row's real token count: the ones of column ``tokens``; one per row without it."""
    import torch

    if tokens is not None and batch.batch is not None and tokens in batch.batch.keys():
        return batch.batch[tokens].sum(-1)
    return torch.ones(len(batch), dtype=torch.int64)


def balanced_rows(batch: "DataProto", world: int, keys: RowKeys, keep_groups: bool) -> list[list[int]]:
    """Each rank's row indices: balanced real tokens, groups of ``keys.groups`` whole when ``keep_groups``."""
    from flowrl.data.balance import balance_ranks

    groups = None
    if keep_groups:
        if keys.groups is None or keys.groups not in batch.non_tensor_batch:
            raise DispatchError(f"balanced_groups needs its group column ({keys.groups or 'none declared'}) "
                                f"in the batch; the node's operator declares it with group_key=")
        groups = batch.non_tensor_batch[keys.groups]
    parts = balance_ranks(real_tokens(batch, keys.tokens).tolist(), world, groups)
    if len(batch) >= world and any(not p for p in parts):
        raise DispatchError(f"balanced dispatch left a rank without rows ({[len(p) for p in parts]} of "
                            f"{len(batch)} rows): every rank of a data-parallel pass needs one")
    return parts


def _balanced_split(keep_groups: bool) -> Callable[["DataProto", int, int, RowKeys], tuple["DataProto", Tags]]:
    def split(batch: "DataProto", rank: int, world: int, keys: RowKeys) -> tuple["DataProto", Tags]:
        import numpy as np

        if world == 1:
            return batch, None
        rows = np.asarray(balanced_rows(batch, world, keys, keep_groups)[rank], dtype=np.int64)
        part = batch[rows.tolist()]
        part.meta_info[TASK_ROWS] = (rows, len(batch))
        return part, rows
    return split


def _tag_rows(out: "DataProto", rows: Tags, factor: int) -> "DataProto":
    """Tag each output row with its index in the task's output: input row ``i`` became rows
    ``i*factor .. i*factor+factor-1`` (an expanding operator), so the order is kept across ranks."""
    import numpy as np

    if rows is None or not len(out) or len(out) != len(rows) * factor:
        return out  # one rank (nothing to reorder) or an output without rows
    out.non_tensor_batch[ROW_INDEX] = (np.repeat(rows, factor) * factor + np.tile(np.arange(factor), len(rows)))
    return out


def task_rows(part: "DataProto"):
    """Which rows of its task a rank's output of a balanced task holds, in the output's
    order; ``None`` when it is not tagged (another mode, or one rank)."""
    import numpy as np

    tags = part.non_tensor_batch.get(ROW_INDEX)
    return None if tags is None else np.asarray(tags, dtype=np.int64)


def _collect_in_order(parts: list["DataProto"]) -> "DataProto":
    """The ranks' outputs of one balanced task, concatenated, then in the task's row order
    (without the :data:`ROW_INDEX` column)."""
    import numpy as np

    out = concat_rows(parts)
    tags = out.non_tensor_batch.pop(ROW_INDEX, None)
    if tags is None or len(out) == 0:
        return out
    rows = np.asarray(tags, dtype=np.int64)
    if sorted(rows.tolist()) != list(range(len(out))):
        raise DispatchError(f"the {len(parts)} outputs of a balanced task hold rows {sorted(rows.tolist())[:8]}... "
                            f"of {len(out)}, not each row once (a rank's output is missing, or from another task)")
    return out[np.argsort(rows, kind="stable").tolist()]


def narrow(part: "DataProto", columns: tuple[str, ...]) -> "DataProto":
    """``part`` with only ``columns`` (those it has) and the dispatch modes' own tag columns."""
    tensor_keys = set(part.batch.keys()) if part.batch is not None else set()
    tags = tuple(k for k in part.non_tensor_batch if k.startswith(TAG_PREFIX) or k == DROPPED)
    return part.select([c for c in columns if c in tensor_keys],
                       [c for c in columns + tags if c in part.non_tensor_batch],
                       [c for c in columns if c in part.meta_info])


SPLIT = dispatch_mode(DispatchMode(
    "split", runs_on=lambda world: list(range(world)), split=_split_rows,
    collected=lambda world: list(range(world)), collect=concat_rows,
    doc="each rank its share of the rows; outputs concatenated in rank order"))
ALL = dispatch_mode(DispatchMode(
    "all", runs_on=lambda world: list(range(world)), split=_whole,
    collected=lambda world: [0], collect=_first,
    doc="every rank the whole batch; rank 0's output and metrics"))
DRIVER = dispatch_mode(DispatchMode(
    "driver", runs_on=lambda world: [0], split=_whole, collected=lambda world: [0], collect=_first,
    doc="one run on rank 0 with the whole batch"))

BALANCED = dispatch_mode(DispatchMode(
    "balanced", runs_on=lambda world: list(range(world)), split=_balanced_split(False),
    collected=lambda world: list(range(world)), collect=_collect_in_order, tag=_tag_rows, every_rank_rows=True,
    doc="data parallel: each rank rows of about equal real tokens; outputs in the batch's row order"))
BALANCED_GROUPS = dispatch_mode(DispatchMode(
    "balanced_groups", runs_on=lambda world: list(range(world)), split=_balanced_split(True),
    collected=lambda world: list(range(world)), collect=_collect_in_order, tag=_tag_rows, needs=("groups",),
    every_rank_rows=True,
    doc="data parallel: as balanced, each group whole on one rank; outputs in the batch's row order"))


def data_parallel(keep_groups: bool) -> DispatchMode:
    """The mode a data-parallel pass runs as on a pool whose ranks form a process group:
    rows balanced by real tokens, each group whole on one rank when ``keep_groups``."""
    return BALANCED_GROUPS if keep_groups else BALANCED


__all__ = ["BALANCED", "BALANCED_GROUPS", "DROPPED", "ROW_INDEX", "TAG_PREFIX", "TASK_ROWS", "DISPATCH_MODES", "DispatchError",
           "DispatchMode", "RowKeys", "balanced_rows", "concat_rows", "data_parallel", "dispatch_mode", "get_mode",
           "narrow", "rank_rows", "real_tokens", "task_rows"]
