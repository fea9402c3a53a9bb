"""Micro-batches that pay for tokens, not padding.

A batch's response columns are as wide as its longest response, and a forward
pass costs every position of ``[rows, P + R]``. Grouping rows of similar
length and cutting each group to its own longest response removes most of
the padding. Because the model is causal and responses are right-padded,
cutting columns past a micro-batch's longest response changes no real
position's output, so the results (restored to row order, padded back with 0)
equal one full-width pass up to float reordering.

* :func:`token_budget_split` — rows bucketed by length under a token budget
  (verl's ``use_dynamic_bsz``), or fixed-size row chunks without one.
* :func:`trim` — a micro-batch cut to its own longest response.
* :func:`response_lengths` — each row's response length, from the attention mask.

Example::

    >>> mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])   # response masks, R = 4
    >>> [m.tolist() for m in token_budget_split(mask.sum(-1), prompt_length=2, max_tokens=8)]
    [[1], [0, 2]]
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

# tensordict (under DataProto and padding) is imported where a batch is cut: roles that
# declare operators (``flowrl validate``) import this module without building one
if TYPE_CHECKING:
    from flowrl.data import DataProto


def response_lengths(batch: Any) -> torch.Tensor:
    """Per row, the position after its last real response token (its length when right-padded).

    Read from ``attention_mask[:, P:]`` (``P = T - R``), which every sequence
    operator has; a mask with interior zeros (multi-turn tool tokens) counts up
    to its last 1.
    """
    width = batch["responses"].shape[1]
    mask = batch["attention_mask"][:, batch["attention_mask"].shape[1] - width:]
    positions = torch.arange(1, width + 1, device=mask.device)
    return (mask.bool() * positions).amax(-1) if width else mask.sum(-1)


#: what one more micro-batch costs, in token positions: a pass's fixed cost (kernel launches,
#: Python, small-matrix inefficiency), so splitting stops paying once buckets are this fine
MICRO_BATCH_COST = 128


def token_budget_split(lengths: torch.Tensor, prompt_length: int, max_tokens: int | None,
                       max_rows: int | None = None) -> list[torch.Tensor]:
    """Row indices of each micro-batch.

    With ``max_tokens``: rows sorted longest first and cut into runs, each
    within ``rows × (prompt_length + longest response) ≤ max_tokens`` (a row
    longer than the budget goes alone), choosing the cuts that minimise the
    positions computed plus :data:`MICRO_BATCH_COST` per micro-batch (a
    dynamic programme over the sorted rows; greedy filling to the budget pads
    twice as much on long-tailed lengths). Without: consecutive chunks of
    ``max_rows`` rows (all rows when ``None``). Every row lands in exactly one
    micro-batch.
    """
    n = len(lengths)
    if max_tokens is None:
        step = max_rows or max(n, 1)
        return [torch.arange(s, min(s + step, n)) for s in range(0, n, step)]
    order = sorted(range(n), key=lambda i: (-int(lengths[i]), i))
    widths = [prompt_length + int(lengths[i]) for i in order]
    # best[j]: least cost of cutting the j longest rows; a run i..j-1 is as wide as row i
    best, cut = [0.0] + [float("inf")] * n, [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j - 1, -1, -1):
            size = (j - i) * widths[i]
            if size > max_tokens and j - i > 1:
                break
            cost = best[i] + size + MICRO_BATCH_COST
            if cost < best[j]:
                best[j], cut[j] = cost, i
    groups, j = [], n
    while j > 0:
        groups.append(torch.tensor(order[cut[j]:j], dtype=torch.long))
        j = cut[j]
    return groups[::-1]


def trim(batch: DataProto, length: int) -> DataProto:
    """``batch`` with its response-aligned columns cut to ``length`` responses.

    A column as wide as ``responses`` (``[B, R]``) keeps its first ``length``
    columns; one as wide as ``input_ids`` (``[B, P + R]``) its first
    ``P + length``; any other is unchanged.
    """
    from flowrl.data import DataProto

    width, total = batch["responses"].shape[1], batch["input_ids"].shape[1]
    out = {}
    for key, t in batch.batch.items():
        if t.dim() >= 2 and t.shape[1] == width:
            t = t[:, :length]
        elif t.dim() >= 2 and t.shape[1] == total:
            t = t[:, :total - width + length]
        out[key] = t
    return DataProto.from_dict(out, batch.non_tensor_batch, batch.meta_info)


def restore(parts: list[torch.Tensor], rows: list[torch.Tensor], width: int) -> torch.Tensor:
    """Per-micro-batch ``[b_i, r_i, ...]`` results back in row order, right-padded with 0 to ``width``."""
    from flowrl.data.padding import pad_width

    first = parts[0]
    out = first.new_zeros((sum(len(r) for r in rows), width, *first.shape[2:]))
    for part, idx in zip(parts, rows):
        out[idx] = pad_width(part, width)
    return out
