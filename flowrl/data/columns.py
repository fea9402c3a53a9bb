"""Column-level pieces under :mod:`flowrl.data.proto` and :mod:`flowrl.data.verl_compat`:
the error type, object columns, deep equality, and merging two sets of columns.

Imports nothing else from flowrl, so both the batch and its verl-compatible
API build on it without a cycle.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import numpy as np
import torch
from tensordict import TensorDict
from flowrl.errors import RunError

__all__ = [
    "DataProtoError",
    "list_of_dict_to_dict_of_list",
    "union_numpy_dict",
    "union_tensor_dict",
]


class DataProtoError(RunError, ValueError, AssertionError):
    """A DataProto was built or used inconsistently (sizes, keys, types).

    Also an ``AssertionError``: where verl's DataProto asserts, code ported
    from verl catches ``AssertionError`` and keeps working; flowrl's message
    names the keys and sizes (and carries verl's wording where verl's tests
    match it).
    """


def object_array(values: Iterable[Any], n: int | None = None) -> np.ndarray:
    """A 1-D object array with one element per value (lists stay elements, never a 2nd dim)."""
    if n is None:
        values = list(values)
        n = len(values)
    return np.fromiter(values, dtype=object, count=n)


def values_equal(a: Any, b: Any, _seen: set[tuple[int, int]] | None = None) -> bool:
    """Deep equality for meta values and object-array elements; NaN equals NaN.

    Self-referencing containers compare equal when they have the same shape of
    reference (a pair under comparison is assumed equal when met again).
    """
    if a is b:
        return True
    seen = set() if _seen is None else _seen
    pair = (id(a), id(b))
    if pair in seen:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and tensors_equal(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)):
            return False
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        if a.dtype == object:
            seen.add(pair)
            return all(values_equal(x, y, seen) for x, y in zip(a.flat, b.flat))
        return bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        seen.add(pair)
        return a.keys() == b.keys() and all(values_equal(a[k], b[k], seen) for k in a)
    if isinstance(a, (list, tuple)):
        seen.add(pair)
        return len(a) == len(b) and all(values_equal(x, y, seen) for x, y in zip(a, b))
    if isinstance(a, float) and math.isnan(a) and math.isnan(b):
        return True
    return bool(a == b)


def tensors_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    # The same view of the same memory is equal without reading it: the common
    # case when two branches of a graph carry an input column back.
    if (
        a.device == b.device
        and a.data_ptr() == b.data_ptr()
        and a.stride() == b.stride()
    ):
        return True
    return bool(torch.equal(a, b.to(a.device)))


def batch_from(tensors: dict[str, Any], n: int, like: TensorDict | None) -> TensorDict:
    """A TensorDict of ``n`` rows on ``like``'s device."""
    return TensorDict(tensors, batch_size=[n], device=like.device if like is not None else None)


def describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
    if isinstance(value, np.ndarray):
        return f"ndarray {value.dtype}{list(value.shape)}"
    return type(value).__name__


def list_of_dict_to_dict_of_list(list_of_dict: list[dict]) -> dict[str, list]:
    """``[{"a": 1}, {"a": 2}]`` → ``{"a": [1, 2]}``; every dict must have the first one's keys."""
    if not list_of_dict:
        return {}
    keys = list(list_of_dict[0])
    out: dict[str, list] = {k: [] for k in keys}
    for i, d in enumerate(list_of_dict):
        if d.keys() != out.keys():
            raise DataProtoError(
                f"item {i} has keys {sorted(d)} but item 0 has {sorted(keys)}; every item needs the same keys"
            )
        for k, v in d.items():
            out[k].append(v)
    return out


def union_tensor_dict(tensor_dict1: TensorDict, tensor_dict2: TensorDict) -> TensorDict:
    """Add ``tensor_dict2``'s tensors to ``tensor_dict1`` (in place; returns it).

    A key in both must hold equal tensors (checked without reading memory when
    both are the same view), else :class:`DataProtoError` naming the key.

    Example::

        >>> td = TensorDict({"a": torch.zeros(2)}, batch_size=[2])
        >>> sorted(union_tensor_dict(td, TensorDict({"b": torch.ones(2)}, batch_size=[2])).keys())
        ['a', 'b']
    """
    if tensor_dict1.batch_size != tensor_dict2.batch_size:
        raise DataProtoError(
            f"union: batch sizes differ: {list(tensor_dict1.batch_size)} vs {list(tensor_dict2.batch_size)}"
        )
    merge_tensors(tensor_dict1, set(tensor_dict1.keys()), dict(tensor_dict2.items()))
    return tensor_dict1


def merge_tensors(target: TensorDict, target_keys: set[str], extra: dict[str, Any]) -> None:
    """Add ``extra`` to ``target`` in place; a shared key must hold an equal tensor."""
    new = {}
    for key, value in extra.items():
        if key not in target_keys:
            new[key] = value
        elif not tensors_equal(target[key], value):
            raise DataProtoError(
                f"union: column {key!r} differs between the two batches "
                f"({describe(target[key])} vs {describe(value)}); rename or pop one before union"
            )
    if new:
        target.update(new)


def union_numpy_dict(tensor_dict1: dict[str, np.ndarray], tensor_dict2: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Add ``tensor_dict2``'s arrays to ``tensor_dict1`` (in place; returns it).

    A key in both must hold deeply equal arrays (NaN equals NaN), else
    :class:`DataProtoError` naming the key.
    """
    for key, value in tensor_dict2.items():
        if key in tensor_dict1 and not values_equal(tensor_dict1[key], value):
            raise DataProtoError(
                f"union: non-tensor column {key!r} differs between the two batches "
                f"(`{key}` in tensor_dict1 and tensor_dict2 are not the same object.); rename or pop one before union"
            )
        tensor_dict1[key] = value
    return tensor_dict1
