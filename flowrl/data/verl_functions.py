"""verl's module-level DataProto helpers (``get_tensordict``, padding to a divisor, folding the batch
dimension, the DataLoader's ``collate_fn``), kept so verl code ports by changing an import; :mod:`flowrl.data.verl_compat` holds the
methods. flowrl itself never calls them."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

from flowrl.data.columns import DataProtoError, batch_from, list_of_dict_to_dict_of_list, object_array
from flowrl.data.verl_compat import PADDING_SIZE_KEY, DataProtoItem

if TYPE_CHECKING:
    from flowrl.data.proto import DataProto


def get_tensordict(tensor_dict: dict[str, Any], non_tensor_dict: dict[str, Any] | None = None) -> TensorDict:
    """One TensorDict from columns and batch-level values (verl's ``tensordict_utils.get_tensordict``).

    Tensors stay tensors; lists and numpy arrays become ``NonTensorStack`` columns (one element
    per row, nested lists and dicts included); ``non_tensor_dict`` values become ``NonTensorData``.

    Example::

        >>> td = get_tensordict({"x": torch.arange(2), "tags": [["a"], []]}, {"name": "run"})
        >>> td["tags"], td["name"], td.batch_size
        ([['a'], []], 'run', torch.Size([2]))
    """
    items: dict[str, Any] = {}
    rows, pivot = None, ""
    for key, value in tensor_dict.items():
        if isinstance(value, torch.Tensor) and value.is_nested and value.layout != torch.jagged:
            raise DataProtoError(f"get_tensordict: nested tensor {key!r} must use layout=torch.jagged")
        if isinstance(value, (list, np.ndarray)) and not isinstance(value, NonTensorStack):
            if any(isinstance(v, torch.Tensor) for v in value):
                raise DataProtoError(
                    f"get_tensordict: list {key!r} holds tensors; a list becomes a NonTensorStack, which "
                    "cannot hold tensors — convert them to numpy first"
                )
            items[key] = NonTensorStack.from_list([NonTensorData(v) for v in value])
        elif isinstance(value, (torch.Tensor, NonTensorStack)):
            items[key] = value
        else:
            raise DataProtoError(
                f"get_tensordict: {key!r} is a {type(value).__name__}; pass a tensor, a list or a numpy array"
            )
        n = len(value) if not isinstance(value, torch.Tensor) else value.size(0)
        if rows is None:
            rows, pivot = n, key
        elif n != rows:
            raise DataProtoError(f"get_tensordict: {key!r} has {n} rows but {pivot!r} has {rows}")
    for key, value in (non_tensor_dict or {}).items():
        if key in items:
            raise DataProtoError(f"get_tensordict: {key!r} is both a column and a batch-level value")
        items[key] = NonTensorData(value)
    return TensorDict(items, batch_size=[] if rows is None else [rows])


def pad_dataproto_to_divisor(data: DataProto, size_divisor: int) -> tuple[DataProto, int]:
    """Pad ``data`` with its own leading rows until its length divides ``size_divisor``.

    Returns the padded DataProto (``data`` itself when no padding is needed)
    and the number of rows added.

    Example::

        >>> padded, pad = pad_dataproto_to_divisor(DataProto.from_dict({"x": torch.arange(3)}), 4)
        >>> padded.batch["x"].tolist(), pad
        ([0, 1, 2, 0], 1)
    """
    if size_divisor < 1:
        raise DataProtoError(f"pad_dataproto_to_divisor: size_divisor must be >= 1, got {size_divisor}")
    n = len(data)
    if n % size_divisor == 0:
        return data, 0
    if n == 0:
        raise DataProtoError("pad_dataproto_to_divisor: cannot pad an empty DataProto (no row to repeat)")
    pad = size_divisor - n % size_divisor
    parts = [data]
    remaining = pad
    while remaining > 0:
        take = min(remaining, n)
        parts.append(data.slice(0, take))
        remaining -= take
    return type(data).concat(parts), pad


def unpad_dataproto(data: DataProto, pad_size: int | None = None) -> DataProto:
    """Drop the last ``pad_size`` rows; with ``pad_size=None`` read (and remove) the
    count :meth:`DataProto.chunk` recorded in ``meta_info[PADDING_SIZE_KEY]``."""
    if pad_size is None:
        pad_size = int(data.meta_info.get(PADDING_SIZE_KEY, 0))
        if PADDING_SIZE_KEY in data.meta_info:
            data.meta_info = {k: v for k, v in data.meta_info.items() if k != PADDING_SIZE_KEY}
    if pad_size:
        data = data.slice(0, len(data) - pad_size)
    return data


def fold_batch_dim(data: DataProto, new_batch_size: int) -> DataProto:
    """View ``[B, ...]`` columns as ``[new_batch_size, B // new_batch_size, ...]``.

    Example::

        >>> folded = fold_batch_dim(DataProto.from_dict({"x": torch.arange(6)}), 2)
        >>> len(folded), folded.batch["x"].tolist()
        (2, [[0, 1, 2], [3, 4, 5]])
    """
    n = len(data)
    if new_batch_size < 1 or n % new_batch_size:
        raise DataProtoError(f"fold_batch_dim: {n} rows do not fold into {new_batch_size} groups; pick a divisor of {n}")
    per = n // new_batch_size
    batch = None
    if data.batch is not None:
        batch = batch_from(
            {k: v.reshape(new_batch_size, per, *v.shape[1:]) for k, v in data.batch.items()}, new_batch_size, data.batch
        )
    non_tensor = {k: v.reshape(new_batch_size, per, *v.shape[1:]) for k, v in data.non_tensor_batch.items()}
    return data._derive(batch, non_tensor, data.meta_info)


def unfold_batch_dim(data: DataProto, batch_dims: int = 2) -> DataProto:
    """Inverse of :func:`fold_batch_dim`: merge the first ``batch_dims`` dims into the batch.

    Example::

        >>> folded = fold_batch_dim(DataProto.from_dict({"x": torch.arange(6)}), 3)
        >>> unfold_batch_dim(folded).batch["x"].tolist()
        [0, 1, 2, 3, 4, 5]
    """
    columns: dict[str, Any] = {} if data.batch is None else dict(data.batch.items())
    columns.update(data.non_tensor_batch)
    lead = {k: tuple(v.shape[:batch_dims]) for k, v in columns.items()}
    if len(set(lead.values())) > 1:
        raise DataProtoError(f"unfold_batch_dim: columns disagree on their first {batch_dims} dims: {lead}")
    n = math.prod(next(iter(lead.values()))) if lead else 0
    batch = None
    if data.batch is not None:
        batch = batch_from({k: v.reshape(n, *v.shape[batch_dims:]) for k, v in data.batch.items()}, n, data.batch)
    non_tensor = {k: v.reshape(n, *v.shape[batch_dims:]) for k, v in data.non_tensor_batch.items()}
    return data._derive(batch, non_tensor, data.meta_info)


def collate_fn(items: list[DataProtoItem]) -> DataProto:
    """Stack rows back into a DataProto (the DataLoader ``collate_fn`` verl uses).

    Example::

        >>> dp = DataProto.from_dict({"x": torch.arange(3)})
        >>> collate_fn([dp[2], dp[0]]).batch["x"].tolist()
        [2, 0]
    """
    from flowrl.data.proto import DataProto

    if not items:
        raise DataProtoError("collate_fn got no items; pass at least one DataProtoItem")
    batch = None if items[0].batch is None else torch.stack([it.batch for it in items]).contiguous()
    columns = list_of_dict_to_dict_of_list([it.non_tensor_batch for it in items])
    non_tensor = {k: object_array(v, len(v)) for k, v in columns.items()}
    return DataProto(batch=batch, non_tensor_batch=non_tensor)
