"""DataProto: the batch that flows along every edge of a flowrl graph.

A :class:`DataProto` holds

* ``batch`` — a :class:`tensordict.TensorDict` of tensors whose first dimension
  is the batch (``B`` rows),
* ``non_tensor_batch`` — numpy **object** arrays of ``B`` rows (strings, dicts,
  ragged lists: anything that is not a tensor),
* ``meta_info`` — a dict of batch-level values (temperature, metrics...).

This module is the batch as flowrl's runtime and operators use it: building,
checking, selecting, splitting, merging, repeating, read-only memory and
pickling. The rest of verl's DataProto API, for code ported from verl, lives in
:mod:`flowrl.data.verl_compat` (``DataProto`` inherits it). Names and semantics
are verl's (``verl/protocol.py``); where verl asserts, flowrl raises a
:class:`DataProtoError` (also an ``AssertionError``) that names the keys and
sizes. Two deliberate differences: pickling is zero-copy (see
:mod:`flowrl.data.serialize`), and a string column must be an object array (a
fixed-width ``<U5`` array silently truncates longer strings assigned into it);
numeric numpy columns are accepted.

Example::

    >>> import numpy as np, torch
    >>> dp = DataProto.from_dict(
    ...     tensors={"responses": torch.arange(6).view(3, 2)},
    ...     non_tensors={"uid": np.array(["a", "b", "c"], dtype=object)},
    ...     meta_info={"temperature": 1.0},
    ... )
    >>> len(dp), dp[1:].non_tensor_batch["uid"].tolist()
    (3, ['b', 'c'])
    >>> dp.repeat(2, interleave=True).batch["responses"][:, 0].tolist()
    [0, 0, 2, 2, 4, 4]
"""

from __future__ import annotations

import copy
from typing import Any, Sequence

import numpy as np
import torch
from tensordict import TensorDict

from flowrl.data.columns import (
    DataProtoError,
    describe as _describe,
    object_array as _object_array,
)
from flowrl.data.serialize import _decode_tensordict, serialize_tensordict
from flowrl.data.proto_columns import ColumnOps
from flowrl.data.proto_rows import RowOps
from flowrl.data.verl_compat import AUTO_PADDING_KEY, DataProtoItem, VerlDataProtoAPI

__all__ = ["DataProto", "DataProtoError"]

Index = int | np.integer | slice | Sequence[int] | Sequence[bool] | np.ndarray | torch.Tensor | str


# ---------------------------------------------------------------------- helpers
#: numpy dtype kinds a non-tensor column may have: objects, and numbers (verl's
#: multi-turn code keeps ``num_turns`` as int32). Fixed-width strings are refused.
_COLUMN_KINDS = frozenset("Obiufc")


def _non_tensor_problem(key: str, value: Any) -> str | None:
    """Why ``value`` cannot be the non-tensor column ``key`` (None when it can)."""
    if type(value) is not np.ndarray:
        return (
            f"non_tensor_batch[{key!r}] is a {type(value).__name__}; non-tensor columns must be numpy "
            f"object arrays: np.array(values, dtype=object)"
        )
    if value.dtype.kind not in _COLUMN_KINDS:
        return (
            f"non_tensor_batch[{key!r}] has dtype {value.dtype}; a string column must have dtype=object "
            f"(a fixed-width array truncates or coerces values assigned into it). Use value.astype(object)"
        )
    if value.ndim == 0:
        return f"non_tensor_batch[{key!r}] is 0-dimensional; a column needs one row per sample"
    return None


def _tensors_problem(tensors: dict[str, Any]) -> str | None:
    """Why ``tensors`` cannot be one batch (types, scalars, disagreeing row counts)."""
    pivot = None
    for key, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            return f"from_dict: tensors[{key!r}] is a {type(tensor).__name__}, expected a torch.Tensor"
        if tensor.dim() == 0:
            return f"from_dict: tensors[{key!r}] is a scalar; a column needs a batch dimension (put scalars in meta_info)"
        if pivot is None:
            pivot = key
        elif tensor.shape[0] != tensors[pivot].shape[0]:
            return (
                f"from_dict: tensors disagree on the batch size: {pivot!r} has "
                f"{tensors[pivot].shape[0]} rows, {key!r} has {tensor.shape[0]}"
            )
    return None


# ---------------------------------------------------------------------- proto
class DataProto(ColumnOps, RowOps, VerlDataProtoAPI):
    """A batch: tensors (``batch``), object columns (``non_tensor_batch``), ``meta_info``.

    Build one with :meth:`from_dict` / :meth:`from_single_dict`; every
    operation keeps the row order and the ``B`` rows of every column together.
    ``select``, ``pop``, ``union``, slices, ``chunk`` and ``split`` share the
    tensors' memory; indexing, ``concat`` and ``repeat`` make new tensors.

    Pickling never copies a contiguous tensor: with protocol 5 and a
    ``buffer_callback`` (what Ray does) each tensor leaves as an out-of-band
    buffer of its own memory. What comes back from Ray's object store is a
    *read-only view* of the store (zero-copy; the default policy): torch cannot
    mark a tensor read-only, so an in-place write would not crash — it would
    change the stored object for every other reader. Such columns are listed in
    :attr:`readonly_keys`; call :meth:`to_writable` (copies just those columns)
    before writing into them in place, or choose the ``"copy"`` policy
    (``FLOWRL_READONLY_POLICY=copy``) to always receive private tensors at the
    price of one copy. The trade-off is measured in :mod:`flowrl.data.serialize`.

    Example::

        >>> dp = DataProto.from_single_dict({
        ...     "input_ids": torch.tensor([[1, 2], [3, 4]]),
        ...     "uid": np.array(["p0", "p1"], dtype=object),
        ... })
        >>> dp.fields()["input_ids"].spec, dp.fields()["uid"].spec
        ('int64[2, 2]', 'object[2]')
    """

    def __init__(
        self,
        batch: TensorDict | None = None,
        non_tensor_batch: dict[str, np.ndarray] | None = None,
        meta_info: dict[str, Any] | None = None,
    ) -> None:
        self.batch = batch
        self.non_tensor_batch = {} if non_tensor_batch is None else non_tensor_batch
        self.meta_info = {} if meta_info is None else meta_info
        # Storage addresses of tensors that alias read-only memory (a Ray
        # object store buffer decoded with the "view" policy).
        self._readonly: frozenset[int] = frozenset()
        self.check_consistency()

    def _derive(
        self,
        batch: TensorDict | None,
        non_tensor_batch: dict[str, np.ndarray],
        meta_info: dict[str, Any],
        *,
        readonly: frozenset[int] | None = None,
    ) -> DataProto:
        """A DataProto of ``self``'s type from parts that are consistent by construction.

        Skips :meth:`check_consistency`: every caller derives the parts from a
        checked DataProto with row-preserving operations.
        """
        out = object.__new__(type(self))
        out.batch, out.non_tensor_batch, out.meta_info = batch, non_tensor_batch, meta_info
        out._readonly = self._readonly if readonly is None else readonly
        return out

    # ------------------------------------------------------------ build
    @classmethod
    def from_dict(
        cls,
        tensors: dict[str, torch.Tensor] | None = None,
        non_tensors: dict[str, np.ndarray | list] | None = None,
        meta_info: dict[str, Any] | None = None,
        num_batch_dims: int = 1,
        auto_padding: bool = False,
    ) -> DataProto:
        """Build from a dict of tensors (dim 0 is the batch) and a dict of non-tensor columns.

        Lists in ``non_tensors`` become 1-D object arrays (one element per row).

        Example::

            >>> dp = DataProto.from_dict({"x": torch.arange(4)}, {"tag": ["a", "b", "c", "d"]})
            >>> dp.non_tensor_batch["tag"].dtype
            dtype('O')
        """
        if num_batch_dims != 1:
            raise DataProtoError(
                f"from_dict: num_batch_dims={num_batch_dims} is not supported; a DataProto has one batch "
                "dimension. Build it flat and use fold_batch_dim(dp, n) for a [n, B//n, ...] view"
            )
        tensors = dict(tensors or {})
        non_tensors = dict(non_tensors or {})
        meta_info = dict(meta_info or {})
        for key, value in non_tensors.items():
            if isinstance(value, (list, tuple)):
                non_tensors[key] = _object_array(value, len(value))
        batch = None
        if tensors:
            try:
                batch = TensorDict(tensors, batch_size=[next(iter(tensors.values())).shape[0]])
            except Exception as exc:  # say which column is wrong, in flowrl's words
                raise DataProtoError(_tensors_problem(tensors) or f"from_dict: {exc}") from exc
        if auto_padding:
            meta_info[AUTO_PADDING_KEY] = True
        return cls(batch=batch, non_tensor_batch=non_tensors, meta_info=meta_info)

    # ------------------------------------------------------------ checks
    def check_consistency(self) -> None:
        """Raise :class:`DataProtoError` unless every column has the same number of rows,
        ``batch`` is a 1-batch-dim TensorDict and every non-tensor column is a
        numpy object array.

        Example::

            >>> try:
            ...     DataProto(non_tensor_batch={"uid": ["a", "b"]})
            ... except DataProtoError as err:
            ...     print(err)
            non_tensor_batch['uid'] is a list; non-tensor columns must be numpy object arrays: np.array(values, dtype=object)
        """
        batch, non_tensor = self.batch, self.non_tensor_batch
        rows, pivot = None, ""
        if batch is not None:
            if not isinstance(batch, TensorDict):
                raise DataProtoError(
                    f"DataProto.batch must be a tensordict.TensorDict or None, got {type(batch).__name__}; "
                    "build with DataProto.from_dict(tensors=...)"
                )
            size = batch.batch_size
            if len(size) != 1:
                raise DataProtoError(
                    f"DataProto.batch must have exactly one batch dimension; got batch_size "
                    f"{list(size)}. Use unfold_batch_dim(...) to flatten it"
                )
            rows, pivot = size[0], "the tensor batch"
        if type(non_tensor) is not dict and not isinstance(non_tensor, dict):
            raise DataProtoError(f"non_tensor_batch must be a dict, got {type(non_tensor).__name__}")
        if type(self.meta_info) is not dict and not isinstance(self.meta_info, dict):
            raise DataProtoError(f"meta_info must be a dict, got {type(self.meta_info).__name__}")
        for key, value in non_tensor.items():
            problem = _non_tensor_problem(key, value)
            if problem:
                raise DataProtoError(problem)
            if rows is None:
                rows, pivot = value.shape[0], f"non_tensor_batch[{key!r}]"
            elif value.shape[0] != rows:
                raise DataProtoError(
                    f"non_tensor_batch[{key!r}] has {value.shape[0]} rows but {pivot} has {rows}; "
                    "every column needs the same number of rows"
                )
        if batch is not None and non_tensor:
            tensor_keys = batch.keys()
            both = [k for k in non_tensor if k in tensor_keys]
            if both:
                raise DataProtoError(
                    f"{', '.join(map(repr, both))} is both a tensor and a non-tensor column; a field has one home"
                )

    # ------------------------------------------------------------ basics
    def _has_columns(self) -> bool:
        return bool(self.non_tensor_batch) or (self.batch is not None and len(self.batch.keys()) > 0)

    def __len__(self) -> int:
        if self.batch is not None:
            return int(self.batch.batch_size[0])
        for column in self.non_tensor_batch.values():
            return int(column.shape[0])
        return 0

    def __getitem__(self, item: Index) -> DataProto | DataProtoItem:
        """``dp[i]`` → :class:`DataProtoItem` (one row, as verl); a slice, an index
        list/array/tensor or a boolean mask → a DataProto. A column name →
        that column (a tensor, or a numpy object array): ``dp["responses"]``,
        flowrl's addition so operator bodies read like the math."""
        if isinstance(item, str):
            if self.batch is not None and item in self.batch.keys():
                return self.batch[item]
            if item in self.non_tensor_batch:
                return self.non_tensor_batch[item]
            cols = sorted(list(self.batch.keys()) if self.batch is not None else []) + sorted(self.non_tensor_batch)
            raise KeyError(f"no column {item!r} in this DataProto; it has: {', '.join(cols) or '(none)'}")
        if isinstance(item, slice):
            return self.slice(item.start, item.stop, item.step)
        if isinstance(item, (list, tuple, np.ndarray, torch.Tensor)):
            if getattr(item, "ndim", 1) == 0:
                item = int(item)
            else:
                return self.select_idxs(item)
        if isinstance(item, (int, np.integer)) and not isinstance(item, bool):
            n = len(self)
            if not -n <= item < n:
                raise IndexError(f"row {item} is out of range for a DataProto of {n} rows")
            batch = self.batch[int(item)] if self.batch is not None else None
            return DataProtoItem(
                batch=batch,
                non_tensor_batch={k: v[item] for k, v in self.non_tensor_batch.items()},
                meta_info=self.meta_info,
            )
        raise TypeError(
            f"cannot index a DataProto with {type(item).__name__}; use an int, slice, list, ndarray, tensor, "
            "bool mask or a column name"
        )

    def __contains__(self, key: object) -> bool:
        """``"responses" in dp``: whether ``key`` is a column (tensor or non-tensor).

        Without it Python would answer ``in`` by comparing every row with the key.
        """
        if self.batch is not None and isinstance(key, str) and key in self.batch.keys():
            return True
        return key in self.non_tensor_batch

    def __repr__(self) -> str:
        lines = [f"{type(self).__name__}(rows={len(self)}"]
        fields = self.fields()
        for kind, title in (("tensor", "batch"), ("non_tensor", "non_tensor_batch")):
            entries = [f for f in fields.values() if f.kind == kind]
            if entries:
                lines.append(f"  {title}:")
                lines.extend(f"    {f}" for f in entries)
        if self.meta_info:
            lines.append("  meta_info:")
            lines.extend(f"    {k}: {_describe(v)}" for k, v in self.meta_info.items())
        if self.readonly_keys:
            lines.append(f"  read-only (call to_writable()): {', '.join(self.readonly_keys)}")
        return "\n".join(lines) + ")"

    def to(self, device: torch.device | str) -> DataProto:
        """Move the tensors to ``device`` in place; returns ``self``."""
        if self.batch is not None:
            self.batch = self.batch.to(device)
        return self

    # ------------------------------------------------------------ read-only memory
    @property
    def readonly_keys(self) -> list[str]:
        """Tensor columns that alias read-only memory (decoded with the ``"view"``
        policy, see :mod:`flowrl.data.serialize`); empty by default."""
        if not self._readonly or self.batch is None:
            return []
        return [
            k for k, t in self.batch.items()
            if isinstance(t, torch.Tensor) and not t.is_nested and t.untyped_storage().data_ptr() in self._readonly
        ]

    def to_writable(self) -> DataProto:
        """Copy the columns in :attr:`readonly_keys` into private memory, in place;
        returns ``self``. A no-op (no copy) when nothing is read-only.

        Example::

            >>> dp = DataProto.from_dict({"x": torch.zeros(2)})
            >>> dp.to_writable() is dp, dp.readonly_keys
            (True, [])
        """
        for key in self.readonly_keys:
            self.batch[key] = self.batch[key].clone()
        self._readonly = frozenset()
        return self

    # ------------------------------------------------------------ pickling
    def __reduce_ex__(self, protocol: int) -> tuple:
        # Tensors travel as flat uint8 numpy views: with protocol 5 and a
        # buffer_callback (Ray) numpy hands them over out-of-band, without a copy.
        batch = serialize_tensordict(self.batch) if self.batch is not None else None
        return _rebuild_dataproto, (type(self), batch, self.non_tensor_batch, self.meta_info)

    def __copy__(self) -> DataProto:
        batch = None if self.batch is None else self.batch.copy()
        return self._derive(batch, dict(self.non_tensor_batch), dict(self.meta_info))

    def __deepcopy__(self, memo: dict) -> DataProto:
        batch = None if self.batch is None else self.batch.clone()
        return type(self)(
            batch=batch,
            non_tensor_batch=copy.deepcopy(self.non_tensor_batch, memo),
            meta_info=copy.deepcopy(self.meta_info, memo),
        )

def _rebuild_dataproto(cls: type, batch: Any, non_tensor_batch: dict, meta_info: dict) -> DataProto:
    readonly: set[int] = set()
    td = None
    if batch is not None:
        td, readonly = _decode_tensordict(batch)
    out = cls.__new__(cls)
    DataProto.__init__(out, batch=td, non_tensor_batch=non_tensor_batch, meta_info=meta_info)
    out._readonly = frozenset(readonly)
    return out


# ---------------------------------------------------------------------- module helpers
