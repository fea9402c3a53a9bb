"""Joining batches whose response columns have different widths.

A rollout engine returns responses only as wide as the longest one it made, so
two micro-batches of one step can come back ``[b, 5]`` and ``[b, 9]`` wide.
Every response-aligned column (``[B, R]``: ``responses``, ``response_mask``,
log-probs, values; ``[B, P + R]``: ``input_ids``, ``attention_mask``,
``position_ids``) ends with the response, so right-padding restores a common
width without moving a real token: padded positions hold 0 (a masked token,
a masked log-prob), exactly what a wider rollout writes after a row stops.

Prompt columns (``[B, P]``, left-padded) never differ between the parts of one
step — the loader pads the whole step's prompts at once — so a column whose
width differs is a response-aligned one, and right-padding is its fill.

Example::

    >>> a = DataProto.from_dict({"responses": torch.tensor([[5, 2]])})
    >>> b = DataProto.from_dict({"responses": torch.tensor([[7, 8, 2]])})
    >>> concat_padded([a, b]).batch["responses"].tolist()
    [[5, 2, 0], [7, 8, 2]]
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from tensordict import TensorDict

from flowrl.data.proto import DataProto


def pad_width(t: torch.Tensor, width: int, value: float = 0) -> torch.Tensor:
    """Right-pad dim 1 of ``t`` to ``width`` with ``value`` (``t`` itself when already that wide).

    Example::

        >>> pad_width(torch.tensor([[1, 2]]), 4).tolist()
        [[1, 2, 0, 0]]
    """
    extra = width - t.shape[1]
    if extra < 0:
        raise ValueError(f"cannot pad a column {t.shape[1]} wide down to {width}")
    if extra == 0:
        return t
    return F.pad(t, (0, 0) * (t.dim() - 2) + (0, extra), value=value)


def pad_to_common_width(parts: Sequence[DataProto]) -> list[DataProto]:
    """``parts`` with every tensor column right-padded (with 0) to its widest part's width.

    Parts whose columns already agree are returned as they are (no copy).
    """
    parts = list(parts)
    if len(parts) < 2 or parts[0].batch is None:
        return parts
    widths: dict[str, int] = {}
    for key in parts[0].batch.keys():
        if parts[0].batch[key].dim() < 2:
            continue
        ws = {p.batch[key].shape[1] for p in parts if p.batch is not None and key in p.batch.keys()}
        if len(ws) > 1:
            widths[key] = max(ws)
    if not widths:
        return parts
    out = []
    for p in parts:
        tensors = {k: pad_width(t, widths[k]) if k in widths else t for k, t in p.batch.items()}
        batch = TensorDict(tensors, batch_size=p.batch.batch_size, device=p.batch.device)
        out.append(type(p)(batch=batch, non_tensor_batch=p.non_tensor_batch, meta_info=p.meta_info))
    return out


def concat_padded(parts: Sequence[DataProto]) -> DataProto:
    """:meth:`DataProto.concat` of ``parts`` after :func:`pad_to_common_width`: the join of
    the shards or micro-batches of one step, whose response widths may differ."""
    return DataProto.concat(pad_to_common_width(parts))
