"""Which rows each optimizer step of an update takes: one pure function of the batch's shape.

An update runs ``epochs`` passes over the batch; each pass cuts one
permutation of the *whole* batch (keyed by the update's seed) into
mini-batches of ``mini_batch_size`` rows, one optimizer step each. On a pool
of N ranks each rank holds some of the batch's rows (``positions``: their
places in the whole batch) and takes, of every mini-batch, the rows it holds,
in the permutation's order. So the N ranks' parts of a mini-batch are exactly
the mini-batch one process takes on the whole batch, and with the loss
normalised over the whole mini-batch (:class:`~operators.models.data_parallel.LossNorm`)
N ranks take the step one process takes.

Each rank then cuts its part into micro-batches (forward/backward passes):
``micro_batch_size`` rows, or length buckets under a token budget
(:func:`~operators.models.microbatch.token_budget_split`). How the part is
cut changes only the order of float sums, never the step.

Example (8 rows on 2 ranks, mini-batches of 4, 2 epochs)::

    >>> plan = update_schedule(8, mini_batch_size=4, epochs=2, seed=3, positions=torch.tensor([0, 2, 4, 6]))
    >>> len(plan), [len(rows) for rows in plan]          # 2 epochs x 2 mini-batches, this rank's rows
    (4, [2, 2, 1, 3])
"""

from __future__ import annotations

import torch


def update_schedule(total: int, *, mini_batch_size: int | None, epochs: int, seed: int,
                    positions: torch.Tensor | None = None) -> list[torch.Tensor]:
    """This rank's rows (indices into its own part of the batch) of every mini-batch, in step order.

    ``total``: the whole batch's rows over all ranks. ``positions``: where this
    rank's rows sit in the whole batch (``None``: one process holding all of
    it). The permutation is drawn only when mini-batches are smaller than the
    batch; a rank may hold no row of some mini-batch (an empty tensor: it
    still takes part in the step's collectives).
    """
    mini = min(mini_batch_size or total, total)
    gen = torch.Generator().manual_seed(seed)
    if positions is None:
        local = torch.arange(total)
    else:  # local[global row] = its index in this rank's part, -1 where another rank holds it
        local = torch.full((total,), -1, dtype=torch.long)
        local[positions] = torch.arange(len(positions))
    steps = []
    for _ in range(epochs):
        order = torch.randperm(total, generator=gen) if mini < total else torch.arange(total)
        for start in range(0, total, mini):
            mine = local[order[start:start + mini]]
            steps.append(mine[mine >= 0])
    return steps


__all__ = ["update_schedule"]
