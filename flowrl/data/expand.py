"""Row expansion: the one place rows are repeated to match an expanding operator.

An operator that turns each input row into ``n`` rows (``rollout.generate``
with ``n`` samples per prompt) declares it (``expands="n"``); the plan derives
each task's repeat factor from it, and this helper does the repeating — for
the worker (prompt-level columns reaching a sample-level consumer), for the
rollout engines (prompts repeated to their samples) and for the eager path.
Row ``i`` becomes rows ``i*n .. i*n+n-1`` (verl's ``repeat(n, interleave=True)``),
so the samples of one prompt stay next to each other.

:func:`check_rows` is the matching check on an operator's output: a batch of
the wrong length is a :class:`RowCountError` naming the node, the expected and
the actual row count.

Example::

    expand_rows(torch.tensor([[1], [2]]), 2)     # tensor([[1], [1], [2], [2]])
    check_rows("generate", rows_in=4, factor=8, rows_out=32)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar
from flowrl.errors import RunError

if TYPE_CHECKING:
    import torch

    from flowrl.data.proto import DataProto

Rows = TypeVar("Rows", "DataProto", "torch.Tensor")


class RowCountError(RunError, ValueError):
    """An operator returned a batch whose length is not its input's times its expansion."""

    def __init__(self, node: str, expected: int, actual: int) -> None:
        self.node, self.expected, self.actual = node, expected, actual
        super().__init__(
            f"node {node!r} returned {actual} rows, expected {expected} (its input rows times its declared "
            f"expansion); an operator returns one output row per input row, or n per row when it declares "
            f"expands='n'"
        )

    def __reduce__(self):
        return (RowCountError, (self.node, self.expected, self.actual))


def expand_rows(rows: Rows, factor: int) -> Rows:
    """``rows`` (a DataProto or a tensor) with each row repeated ``factor`` times, in place order."""
    if factor < 1:
        raise ValueError(f"expand_rows: factor must be >= 1, got {factor}")
    if factor == 1:
        return rows
    if hasattr(rows, "repeat_interleave"):
        return rows.repeat_interleave(factor, dim=0)
    return rows.repeat(factor, interleave=True)


def take_rows(batch: "DataProto", rows: tuple[int, int] | None = None, repeat: int = 1) -> "DataProto":
    """Rows ``[lo, hi)`` of ``batch`` (all when ``rows`` is None), each repeated ``repeat`` times:
    what a consumer reads of a producer in another row space (a streamed slice of a barrier's
    output, prompt columns reaching the samples of each prompt)."""
    if rows is not None:
        batch = batch[rows[0] : rows[1]]
    return expand_rows(batch, repeat)


def check_rows(node: str, rows_in: int, factor: int, rows_out: int) -> None:
    """Raise :class:`RowCountError` unless ``rows_out == rows_in * factor``."""
    if rows_out != rows_in * factor:
        raise RowCountError(node, rows_in * factor, rows_out)


__all__ = ["RowCountError", "check_rows", "expand_rows", "take_rows"]
