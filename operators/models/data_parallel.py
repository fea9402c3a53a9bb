"""Data-parallel passes: every rank's share of a mini-batch, one global normaliser.

Each rank holds its rows of the mini-batch (:func:`operators.models.schedule.update_schedule`)
cut into micro-batches. The loss of a micro-batch is divided by the
mini-batch's real token count over *all* ranks (:class:`LossNorm`, one
all-reduce), so summing the gradients over micro-batches and ranks (FSDP2's
reduce-scatter with SUM, see :func:`operators.models.fsdp.shard_model`) gives
exactly the gradient one process computes on the whole mini-batch, however
ragged the responses are and however they are split.

The training engine (:class:`operators.models.engine.TrainEngine`) hands a
loss function ``loss_fn(micro_batch, norm) -> (loss, metrics)`` this norm:
token-mean divides by ``norm.tokens``, seq-mean modes by ``norm.seqs``.
Forward-only passes use :func:`data_parallel_forward`: the same pass count on
every rank, no gradients.

Example (every rank of the pool runs the same call on its own rows)::

    norm = LossNorm.of([mb["response_mask"] for mb in micro_batches], group)
    log_probs = data_parallel_forward(micro_batches, forward, group)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from operators.models.fsdp import Group


@dataclass(frozen=True)
class LossNorm:
    """The mini-batch's real token count and its number of rows with a real token, over all ranks."""

    tokens: float
    seqs: float

    @classmethod
    def of(cls, masks: Sequence[torch.Tensor], group: Group | None = None) -> "LossNorm":
        """Count ``masks`` (this rank's response masks) and sum the counts over ``group``.

        One all-reduce of two numbers (SUM; a pool of one or ``group=None``
        reduces nothing). Counts are floats in float64, exact up to 2**53.
        """
        counts = torch.zeros(2, dtype=torch.float64)
        for mask in masks:
            counts[0] += float(mask.sum())
            counts[1] += float((mask.sum(-1) > 0).sum())
        if group is not None:
            group.all_reduce(counts, name="loss normaliser (token and row counts)")
        return cls(tokens=max(float(counts[0]), 1.0), seqs=max(float(counts[1]), 1.0))

    def weight(self, mask: torch.Tensor) -> float:
        """A micro-batch's share of the mini-batch's tokens: the weight of a mean over its tokens."""
        return float(mask.sum()) / max(self.tokens, 1.0)


def pass_count(micro_batches: Sequence[Any], group: Group) -> int:
    """How many passes every rank runs: the most micro-batches any rank holds (one all-reduce)."""
    if not micro_batches:
        raise ValueError(f"rank {group.rank}: no rows for this rank; give every rank at least one row "
                         f"(FSDP2 needs every rank in every forward)")
    count = torch.tensor([len(micro_batches)], dtype=torch.int64)
    return int(group.all_reduce(count, name="micro-batch count", op="max"))


def data_parallel_forward(micro_batches: Sequence[Any], forward: Callable[[Any], Any], group: Group) -> list[Any]:
    """``forward(mb)`` without gradients for each of this rank's micro-batches (log-probs, values).

    Every rank runs as many passes as the busiest one (a sharded model's
    forward is a collective); the outputs of the extra passes are dropped, so
    the result has one entry per micro-batch of this rank.
    """
    passes = pass_count(micro_batches, group)
    outputs = []
    with torch.no_grad(), group.guard("forward-only passes"):
        for i in range(passes):
            out = forward(micro_batches[min(i, len(micro_batches) - 1)])
            if i < len(micro_batches):
                outputs.append(out)
    return outputs
