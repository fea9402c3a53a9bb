"""Dispatch modes: how a task's rows are split across the ranks of a pool and how
the ranks' outputs are collected — registered by name, like role kinds.

An operator names its mode (``dispatch="split"``); the plan records it for every
task; the runtime asks the mode which ranks run, which outputs form the task's
result, and each rank's part of the input. verl's ``DP_COMPUTE_PROTO`` and
``ONE_TO_ALL`` are the same idea; here a misuse raises :class:`DispatchError`
naming the mode and the counts instead of an assert.

Built in:

* ``split`` — every rank runs its contiguous share of the rows; the result is
  the ranks' outputs concatenated in rank order.
* ``all`` — every rank runs the whole batch (each keeps the same state); the
  result, and the metrics, are rank 0's.
* ``driver`` — one run, on rank 0, with the whole batch.
* ``balanced`` / ``balanced_groups`` — data parallel: every rank its rows of the
  batch, assigned by :func:`~flowrl.data.balance.balance_ranks` so each holds
  about the same number of real tokens (:data:`TOKEN_MASK` ones;
  ``balanced_groups`` keeps the rows of one ``uid`` whole on one rank); every
  rank reports, and the outputs are put back in the batch's row order. The
  plan picks these on a pool whose ranks form a process group, for updates and
  for forward passes (log-probs, values, reward models) that read
  :data:`TOKEN_MASK` and do not expand rows.

A new mode (one that orders rows by length, say) registers a
:class:`DispatchMode` with :func:`dispatch_mode`; nothing else changes.

Example::

    mode = DISPATCH_MODES["split"]
    mode.ranks(2)                       # [0, 1]
    mode.split(batch, rank=1, world=2)  # the second half of the rows
    mode.collect([out0, out1])          # their concatenation
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # torch-backed; the registry itself stays light
    from flowrl.data.proto import DataProto


class DispatchError(ValueError):
    """A dispatch mode was misused: unknown name, or outputs that do not match its ranks."""


@dataclass(frozen=True)
class DispatchMode:
    """One way of running a task on a pool's ranks.

    ``runs_on(world)`` is the ranks that run it; ``split(batch, rank, world)``
    the part of the batch a rank gets; ``collected(world)`` the ranks whose
    outputs (and metrics) form the result; ``collect(parts)`` merges those
    outputs, in rank order.
    """

    name: str
    runs_on: Callable[[int], list[int]]
    split: Callable[["DataProto", int, int], "DataProto"]
    collected: Callable[[int], list[int]]
    collect: Callable[[list["DataProto"]], "DataProto"]
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


def _split_rows(batch: "DataProto", rank: int, world: int) -> "DataProto":
    lo, hi = rank_rows(len(batch), rank, world)
    return batch[lo:hi]


def _concat(parts: list["DataProto"]) -> "DataProto":
    from flowrl.data.padding import concat_padded  # torch-backed: imported when data moves, not to register

    parts = [p for p in parts if len(p)] or parts[:1]
    return parts[0] if len(parts) == 1 else concat_padded(parts)  # ranks' response widths may differ


def _first(parts: list["DataProto"]) -> "DataProto":
    if len(parts) != 1:
        raise DispatchError(f"a one-result dispatch mode got {len(parts)} outputs to collect; it takes rank 0's")
    return parts[0]


def _whole(batch: "DataProto", rank: int, world: int) -> "DataProto":
    return batch


#: the column a balanced split tags each row with, so the outputs can be put back in
#: order; the worker carries it from a task's input to its output (see :func:`_tags`)
ROW_INDEX = "_dispatch_row"
#: the meta_info key of a balanced part: its rows' places in the task's batch and that batch's row
#: count, so an update can cut the whole batch's mini-batches from its part
TASK_ROWS = "task_rows"
#: the column whose ones are a row's real tokens: what balanced dispatch evens out
TOKEN_MASK = "attention_mask"
#: a row's tag is ``rows of its task << _TASK_BITS | its index in the task``
_TASK_BITS = 32
_ROW_MASK = (1 << _TASK_BITS) - 1


def real_tokens(batch: "DataProto"):
    """Each row's real token count (:data:`TOKEN_MASK` ones; else one per row)."""
    import torch

    if batch.batch is not None and TOKEN_MASK in batch.batch.keys():
        return batch.batch[TOKEN_MASK].sum(-1)
    return torch.ones(len(batch), dtype=torch.int64)


def balanced_rows(batch: "DataProto", world: int, keep_groups: bool) -> list[list[int]]:
    """Each rank's row indices: balanced real tokens, ``uid`` groups whole when ``keep_groups``."""
    from flowrl.data.balance import balance_ranks

    groups = batch.non_tensor_batch.get("uid") if keep_groups else None
    parts = balance_ranks(real_tokens(batch).tolist(), world, groups)
    if len(batch) >= world and any(not p for p in parts):
        raise DispatchError(f"balanced dispatch left a rank without rows ({[len(p) for p in parts]} of "
                            f"{len(batch)} rows): every rank of a data-parallel pass needs one")
    return parts


def _balanced_split(keep_groups: bool) -> Callable[["DataProto", int, int], "DataProto"]:
    def split(batch: "DataProto", rank: int, world: int) -> "DataProto":
        import numpy as np

        if world == 1:
            return batch
        rows = balanced_rows(batch, world, keep_groups)[rank]
        part = batch[rows]
        part.non_tensor_batch[ROW_INDEX] = _tags(np.asarray(rows, dtype=np.int64), len(batch))
        part.meta_info[TASK_ROWS] = (np.asarray(rows, dtype=np.int64), len(batch))
        return part
    return split


def _tags(rows, total: int):
    """Row tags of one task: its row count and each row's index in it, as one int64.

    A consumer may concatenate the outputs of several balanced tasks (a barrier
    reads every micro-batch of its producer); the count says where each task's
    rows end, so each is put back in order on its own. The tag is linear, so a
    task that expands every row ``f`` times maps it with ``tag * f + j`` and
    its output is tagged as a task of ``total * f`` rows.
    """
    return (total << _TASK_BITS) + rows


def _collect_in_order(parts: list["DataProto"]) -> "DataProto":
    """The ranks' outputs concatenated, then back in the whole batch's row order."""
    return in_row_order(_concat(parts))


def task_rows(part: "DataProto"):
    """Which rows of its task's batch a rank's part (or output) of a balanced task holds,
    in the part's order; ``None`` when it is not tagged (another mode)."""
    import numpy as np

    tags = part.non_tensor_batch.get(ROW_INDEX)
    return None if tags is None else np.asarray(tags, dtype=np.int64) & _ROW_MASK


def in_row_order(out: "DataProto") -> "DataProto":
    """``out`` (the ranks' outputs of balanced tasks, concatenated task after task) with each
    task's rows back in its batch's order, without the :data:`ROW_INDEX` column; unchanged
    when it has none."""
    import numpy as np

    tags = out.non_tensor_batch.pop(ROW_INDEX, None)
    if tags is None or len(out) == 0:
        return out
    tags = np.asarray(tags, dtype=np.int64)
    totals, index = tags >> _TASK_BITS, tags & _ROW_MASK
    order, start = [], 0
    while start < len(tags):  # one task's rows: as many as its tag says it has
        end = start + int(totals[start])
        rows = index[start:end]
        if end <= start or end > len(tags) or sorted(rows.tolist()) != list(range(end - start)):
            raise DispatchError(f"rows {start}:{end} of a balanced collect are not one task's rows "
                                f"(a rank's output is missing or out of order)")
        order.extend((start + np.argsort(rows, kind="stable")).tolist())
        start = end
    return out[order]


SPLIT = dispatch_mode(DispatchMode(
    "split", runs_on=lambda world: list(range(world)), split=_split_rows,
    collected=lambda world: list(range(world)), collect=_concat,
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
    collected=lambda world: list(range(world)), collect=_collect_in_order,
    doc="data parallel: each rank rows of about equal real tokens; outputs in the batch's row order"))
BALANCED_GROUPS = dispatch_mode(DispatchMode(
    "balanced_groups", runs_on=lambda world: list(range(world)), split=_balanced_split(True),
    collected=lambda world: list(range(world)), collect=_collect_in_order,
    doc="data parallel: as balanced, each uid group whole on one rank; outputs in the batch's row order"))

#: what the plan runs a node of dispatch ``all`` as, on a pool whose ranks form a process group
DATA_PARALLEL = {"batch": "balanced", "row": "balanced", "group": "balanced_groups"}


__all__ = ["BALANCED", "BALANCED_GROUPS", "DATA_PARALLEL", "ROW_INDEX", "TASK_ROWS", "TOKEN_MASK", "balanced_rows", "in_row_order", "real_tokens", "task_rows", "DISPATCH_MODES", "DispatchError", "DispatchMode", "dispatch_mode", "get_mode", "rank_rows"]
