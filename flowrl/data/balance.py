"""Which rows go to which rank: whole groups, about the same number of real tokens per rank.

Before a data-parallel pass (an update, log-probs over a pool of N workers),
the batch's rows are assigned to ranks so that the slowest rank — the one with
the most real tokens — waits as little as possible (verl's ``balance_batch``).
Rows of one group (the ``n`` samples of one prompt) stay on one rank, so a
group statistic needs no gather. Groups are placed heaviest first on the
lightest rank. When every group has the same size (GRPO's ``n``, or single
rows) every rank also gets the same number of groups (±1), so the ranks run
the same number of micro-batches.

Example::

    >>> tokens = [9, 1, 8, 2, 5, 5, 3, 7]
    >>> balance_ranks(tokens, world=2)
    [[0, 1, 4, 5], [2, 3, 6, 7]]
    >>> [sum(tokens[i] for i in part) for part in balance_ranks(tokens, world=2)]
    [20, 20]
    >>> balance_ranks(tokens, world=2, groups=[0, 0, 0, 0, 1, 1, 2, 2])   # groups stay whole
    [[0, 1, 2, 3], [4, 5, 6, 7]]
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np


def balance_ranks(tokens: Sequence[int] | np.ndarray, world: int,
                  groups: Sequence[Any] | np.ndarray | None = None) -> list[list[int]]:
    """Row indices for each of ``world`` ranks (ascending within a rank).

    ``tokens[i]``: the real (unpadded) token count of row ``i``. ``groups[i]``:
    the group row ``i`` belongs to (``None``: every row its own group). The
    token totals are balanced greedily (largest group first, onto the rank with
    the fewest tokens); when all groups have one size, every rank gets
    ``floor`` or ``ceil`` of ``groups / world`` of them. Deterministic: ties go to the lower rank and
    to the group seen first.
    """
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    tokens = np.asarray(tokens, dtype=np.int64)
    keys = np.arange(len(tokens)) if groups is None else np.asarray(groups, dtype=object)
    if len(keys) != len(tokens):
        raise ValueError(f"groups has {len(keys)} entries for {len(tokens)} rows")
    members: dict[Any, list[int]] = {}
    for row, key in enumerate(keys.tolist()):
        members.setdefault(key, []).append(row)
    order = sorted(members.values(), key=lambda rows: (-int(tokens[rows].sum()), rows[0]))
    base, extra = divmod(len(order), world)
    if len({len(rows) for rows in order}) > 1:  # ragged groups: balance tokens only
        base, extra = len(order), 0
    load, count, parts = [0] * world, [0] * world, [[] for _ in range(world)]
    for rows in order:
        full = sum(c > base for c in count) >= extra  # the ranks allowed one extra group are taken
        rank = min((r for r in range(world) if count[r] < base or (count[r] == base and not full)),
                   key=lambda r: (load[r], r))
        parts[rank].extend(rows)
        load[rank] += int(tokens[rows].sum())
        count[rank] += 1
    return [sorted(p) for p in parts]
