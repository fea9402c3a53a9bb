"""DataProto: the batch that flows along every edge of a flowrl graph.

A :class:`DataProto` holds

* ``batch`` — a :class:`tensordict.TensorDict` of tensors whose first dimension
  is the batch (``B`` rows),
* ``non_tensor_batch`` — numpy **object** arrays of ``B`` rows (strings, dicts,
  ragged lists: anything that is not a tensor),
* ``meta_info`` — a dict of batch-level values (temperature, metrics...).

The API has verl's names and semantics (``verl/protocol.py``) so that verl code
ports by changing the import; where verl asserts, flowrl raises a
:class:`DataProtoError` that names the keys and sizes. Two deliberate
differences: pickling is zero-copy (see :mod:`flowrl.data.serialize`), and a
non-tensor column must be an object array (a fixed-width ``<U5`` string array
silently truncates longer strings assigned into it).

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
import math
import os
import pickle
from dataclasses import dataclass, field as dataclass_field
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

from flowrl.data.fields import Field
from flowrl.data.serialize import _decode_tensordict, serialize_tensordict

__all__ = [
    "DataProto",
    "DataProtoItem",
    "DataProtoError",
    "DataProtoConfig",
    "pad_dataproto_to_divisor",
    "unpad_dataproto",
    "union_tensor_dict",
    "union_numpy_dict",
    "fold_batch_dim",
    "unfold_batch_dim",
    "collate_fn",
    "list_of_dict_to_dict_of_list",
]

Index = int | np.integer | slice | Sequence[int] | Sequence[bool] | np.ndarray | torch.Tensor | str

#: meta_info key that turns auto padding on for one DataProto (set by ``auto_padding=True``)
AUTO_PADDING_KEY = "_flowrl_auto_padding"
#: meta_info key where :meth:`DataProto.chunk` records how many rows it padded
PADDING_SIZE_KEY = "_flowrl_padding_size"


class DataProtoError(ValueError):
    """A DataProto was built or used inconsistently (sizes, keys, types)."""


class _DataProtoConfigMeta(type):
    _auto_padding = False

    @property
    def auto_padding(cls) -> bool:
        by_env = os.getenv("FLOWRL_AUTO_PADDING", "false").lower() in ("1", "true")
        return by_env or cls._auto_padding

    @auto_padding.setter
    def auto_padding(cls, enabled: bool) -> None:
        if not isinstance(enabled, bool):
            raise DataProtoError(f"DataProtoConfig.auto_padding must be a bool, got {enabled!r}")
        cls._auto_padding = enabled


class DataProtoConfig(metaclass=_DataProtoConfigMeta):
    """Process-wide switches. ``DataProtoConfig.auto_padding = True`` (or the
    env ``FLOWRL_AUTO_PADDING=1``) lets :meth:`DataProto.chunk` pad every batch."""


# ---------------------------------------------------------------------- helpers
def _object_array(values: Iterable[Any], n: int | None = None) -> np.ndarray:
    """A 1-D object array with one element per value (lists stay elements, never a 2nd dim)."""
    if n is None:
        values = list(values)
        n = len(values)
    return np.fromiter(values, dtype=object, count=n)


def _values_equal(a: Any, b: Any) -> bool:
    """Deep equality for meta values and object-array elements; NaN equals NaN."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and _tensors_equal(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)):
            return False
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        if a.dtype == object:
            return all(_values_equal(x, y) for x, y in zip(a.flat, b.flat))
        return bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_values_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_values_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and math.isnan(a) and math.isnan(b):
        return True
    return bool(a == b)


def _tensors_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
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


_OBJECT = np.dtype(object)


def _non_tensor_problem(key: str, value: Any) -> str:
    """Why ``value`` cannot be the non-tensor column ``key``."""
    if not isinstance(value, np.ndarray):
        return (
            f"non_tensor_batch[{key!r}] is a {type(value).__name__}; non-tensor columns must be numpy "
            f"object arrays: np.array(values, dtype=object)"
        )
    if value.dtype != _OBJECT:
        return (
            f"non_tensor_batch[{key!r}] has dtype {value.dtype}; non-tensor columns must have dtype=object "
            f"(a fixed-width array truncates or coerces values assigned into it). Use "
            f"value.astype(object), or put numeric data in batch as a tensor (torch.from_numpy(value))"
        )
    return f"non_tensor_batch[{key!r}] is 0-dimensional; a column needs one row per sample"


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


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
    if isinstance(value, np.ndarray):
        return f"ndarray {value.dtype}{list(value.shape)}"
    return type(value).__name__


def _as_index(idxs: Any, n: int) -> tuple[torch.Tensor, np.ndarray]:
    """Normalise an index (list, ndarray, tensor; ints or a bool mask) to int64 row numbers."""
    if isinstance(idxs, torch.Tensor):
        idx = idxs.detach().cpu()
    elif isinstance(idxs, np.ndarray):
        idx = torch.from_numpy(idxs)
    elif isinstance(idxs, (list, tuple, range)):
        idx = torch.as_tensor(list(idxs)) if len(idxs) else torch.zeros(0, dtype=torch.int64)
    else:
        raise TypeError(f"cannot index a DataProto with {type(idxs).__name__}; use an int, slice, list, ndarray or tensor")
    if idx.dtype == torch.bool:
        if idx.shape != (n,):
            raise DataProtoError(f"boolean mask has shape {list(idx.shape)} but the DataProto has {n} rows")
        idx = idx.nonzero().view(-1)
    elif idx.dtype.is_floating_point or idx.dtype.is_complex or idx.dim() != 1:
        raise DataProtoError(
            f"row index must be a 1-D integer or boolean sequence; got {idx.dtype} of shape {list(idx.shape)}"
        )
    idx = idx.to(torch.int64)
    if idx.numel():
        lo, hi = int(idx.min()), int(idx.max())
        if lo < -n or hi >= n:
            bad = lo if lo < -n else hi
            raise DataProtoError(f"row index {bad} is out of range for a DataProto of {n} rows")
        if lo < 0:
            idx = torch.where(idx < 0, idx + n, idx)
    return idx, idx.numpy()


def _dataloader_epoch_order(n: int, shuffle: bool, generator: torch.Generator | None) -> torch.Tensor | None:
    """One epoch's row order, drawn as ``DataLoader(shuffle=shuffle, generator=generator)`` draws it.

    The DataLoader's iterator first draws a base seed from ``generator`` (the
    global RNG when None); ``RandomSampler`` then draws its permutation, and one
    more (for the ``num_samples % n == 0`` remainder) when the epoch is read to
    its end. Drawing the same keeps a ported verl run's mini-batches — and its
    RNG state — identical.
    """
    torch.empty((), dtype=torch.int64).random_(generator=generator)
    if not shuffle:
        return None
    if generator is None:
        seed = int(torch.empty((), dtype=torch.int64).random_().item())
        generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(n, generator=generator)
    torch.randperm(n, generator=generator)  # the sampler's empty remainder draw
    return order


def _take(value: Any, idx: torch.Tensor) -> Any:
    if isinstance(value, torch.Tensor) and not value.is_nested:
        return torch.index_select(value, 0, idx.to(value.device))
    return value[idx]


def _batch_from(tensors: dict[str, Any], n: int, like: TensorDict | None) -> TensorDict:
    return TensorDict(tensors, batch_size=[n], device=like.device if like is not None else None)


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


# ---------------------------------------------------------------------- items
@dataclass
class DataProtoItem:
    """One row of a DataProto (what ``dp[i]`` returns, as in verl)."""

    batch: TensorDict | None = None
    non_tensor_batch: dict = dataclass_field(default_factory=dict)
    meta_info: dict = dataclass_field(default_factory=dict)


def collate_fn(items: list[DataProtoItem]) -> DataProto:
    """Stack rows back into a DataProto (the DataLoader ``collate_fn`` verl uses).

    Example::

        >>> dp = DataProto.from_dict({"x": torch.arange(3)})
        >>> collate_fn([dp[2], dp[0]]).batch["x"].tolist()
        [2, 0]
    """
    if not items:
        raise DataProtoError("collate_fn got no items; pass at least one DataProtoItem")
    batch = None if items[0].batch is None else torch.stack([it.batch for it in items]).contiguous()
    columns = list_of_dict_to_dict_of_list([it.non_tensor_batch for it in items])
    non_tensor = {k: _object_array(v, len(v)) for k, v in columns.items()}
    return DataProto(batch=batch, non_tensor_batch=non_tensor)


# ---------------------------------------------------------------------- proto
class DataProto:
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
    def from_single_dict(
        cls,
        data: dict[str, torch.Tensor | np.ndarray],
        meta_info: dict[str, Any] | None = None,
        auto_padding: bool = False,
    ) -> DataProto:
        """Tensors go to ``batch``, numpy arrays to ``non_tensor_batch``.

        Example::

            >>> dp = DataProto.from_single_dict({"x": torch.zeros(2, 3), "uid": np.array(["a", "b"], dtype=object)})
            >>> list(dp.batch.keys()), list(dp.non_tensor_batch)
            (['x'], ['uid'])
        """
        tensors, non_tensors = {}, {}
        for key, value in data.items():
            if isinstance(value, torch.Tensor):
                tensors[key] = value
            elif isinstance(value, np.ndarray):
                non_tensors[key] = value
            else:
                raise DataProtoError(
                    f"from_single_dict: {key!r} is a {type(value).__name__}; pass a torch.Tensor "
                    f"(a batch column) or a numpy array (np.array(values, dtype=object) for a non-tensor column)"
                )
        return cls.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=meta_info, auto_padding=auto_padding)

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

    @classmethod
    def from_tensordict(
        cls,
        tensor_dict: TensorDict,
        meta_info: dict[str, Any] | None = None,
        num_batch_dims: int = 1,
    ) -> DataProto:
        """Inverse of :meth:`to_tensordict`: tensors → batch, ``NonTensorStack`` →
        object columns, ``NonTensorData`` → meta_info.

        Example::

            >>> dp = DataProto.from_dict({"x": torch.arange(2)}, {"uid": ["a", "b"]}, {"t": 1.0})
            >>> back = DataProto.from_tensordict(dp.to_tensordict())
            >>> back.non_tensor_batch["uid"].tolist(), back.meta_info
            (['a', 'b'], {'t': 1.0})
        """
        if num_batch_dims != 1:
            raise DataProtoError(f"from_tensordict: num_batch_dims={num_batch_dims} is not supported; use 1")
        meta = dict(meta_info or {})
        tensors: dict[str, torch.Tensor] = {}
        non_tensors: dict[str, np.ndarray] = {}
        for key, value in tensor_dict.items():
            if isinstance(value, torch.Tensor):
                tensors[key] = value
            elif isinstance(value, NonTensorStack):
                rows = value.tolist()
                non_tensors[key] = _object_array(rows, len(rows))
            elif isinstance(value, NonTensorData):
                meta[key] = value.data
            else:
                raise DataProtoError(f"from_tensordict: {key!r} is a {type(value).__name__}; expected a tensor, NonTensorStack or NonTensorData")
        batch = TensorDict(tensors, batch_size=tensor_dict.batch_size[:1]) if tensors else None
        return cls(batch=batch, non_tensor_batch=non_tensors, meta_info=meta)

    def to_tensordict(self) -> TensorDict:
        """One TensorDict: tensors, each object column as a ``NonTensorStack``,
        each meta value as ``NonTensorData`` (verl's layout)."""
        items: dict[str, Any] = {} if self.batch is None else dict(self.batch.items())
        for key, column in self.non_tensor_batch.items():
            if key in items:
                raise DataProtoError(f"to_tensordict: {key!r} is both a tensor and a non-tensor column; rename one")
            items[key] = NonTensorStack.from_list([NonTensorData(v) for v in column])
        for key, value in self.meta_info.items():
            if key in items:
                raise DataProtoError(f"to_tensordict: meta_info key {key!r} collides with a column; rename one")
            items[key] = NonTensorData(value)
        return TensorDict(items, batch_size=[len(self)])

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
            if type(value) is not np.ndarray or value.dtype != _OBJECT or value.ndim == 0:
                raise DataProtoError(_non_tensor_problem(key, value))
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

    def fields(self) -> dict[str, Field]:
        """The columns as concrete :class:`Field` specs: dtype names and integer shapes.

        Tensors have their torch dtype (``"int64"``), non-tensor columns
        ``"object"``, meta_info keys kind ``"meta"`` (a column wins a name clash).
        Ragged dims of a jagged nested tensor are ``"*"``.

        Example::

            >>> dp = DataProto.from_dict({"r": torch.zeros(4, 8, dtype=torch.int64)}, {"uid": list("abcd")}, {"t": 0.7})
            >>> [str(f) for f in dp.fields().values()]
            ['r: int64[4, 8]', 'uid: object[4]', 't: meta']
        """
        out: dict[str, Field] = {}
        if self.batch is not None:
            for key, tensor in self.batch.items(include_nested=True, leaves_only=True):
                name = ".".join(key) if isinstance(key, tuple) else key
                # a jagged (nested) tensor's ragged dims have no size: "*"
                shape = tuple(d if isinstance(d, int) else "*" for d in tensor.shape)
                out[name] = Field(name=name, dtype=str(tensor.dtype).removeprefix("torch."), shape=shape, kind="tensor")
        for key, column in self.non_tensor_batch.items():
            out[key] = Field(name=key, dtype="object", shape=tuple(column.shape), kind="non_tensor")
        for key in self.meta_info:
            out.setdefault(key, Field(name=key, kind="meta"))
        return out

    def check_fields(self, specs: Iterable[Field], bindings: dict[str, int] | None = None) -> list[str]:
        """The problems with this batch against ``specs``; empty when it conforms.

        One ``bindings`` dict (symbol → size) is shared by every spec, so ``B``
        or ``R`` bound by one column must match in all others; pass your own to
        keep checking across calls (it is extended in place).

        Example::

            >>> dp = DataProto.from_dict({"responses": torch.zeros(4, 8, dtype=torch.int64),
            ...                           "mask": torch.zeros(4, 6)})
            >>> dp.check_fields([Field.parse("responses", "int64[B, R]"), Field.parse("mask", "float32[B, R]"),
            ...                  Field.parse("uid", "object[B]")])
            ['mask: R=6 but R=8 elsewhere in the batch (float32[B, R])', "missing non_tensor column 'uid' (object[B]); the batch has mask, responses"]
        """
        bindings = {} if bindings is None else bindings
        have = self.fields()
        problems: list[str] = []
        for spec in specs:
            found = have.get(spec.name)
            if found is None or (spec.kind != "meta" and found.kind == "meta"):
                columns = ", ".join(sorted(k for k, f in have.items() if f.kind != "meta")) or "no columns"
                where = "meta_info key" if spec.kind == "meta" else f"{spec.kind} column"
                problems.append(f"missing {where} {spec.name!r} ({spec.spec}); the batch has {columns}")
                continue
            if spec.kind == "meta":
                continue  # a meta key may share its name with a column; present is enough
            if found.kind != spec.kind:
                problems.append(
                    f"{spec.name}: is a {found.kind} column ({found.spec}) but a {spec.kind} column ({spec.spec}) is expected"
                )
                continue
            problem = spec.check_value(found.dtype, found.shape, bindings)
            if problem:
                problems.append(problem)
        return problems

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

    def get_data_info(self) -> str:
        """A readable summary of columns and meta types (verl's name for :func:`repr`)."""
        return repr(self)

    def print_size(self, prefix: str = "") -> None:
        """Print the tensor and non-tensor sizes in GiB (verl's debugging helper)."""
        tensors = 0 if self.batch is None else sum(t.numel() * t.element_size() for t in self.batch.values(True, True))
        arrays = sum(a.nbytes for a in self.non_tensor_batch.values())
        message = f"Size of tensordict: {tensors / 1024**3} GB, size of non_tensor_batch: {arrays / 1024**3} GB"
        print(f"{prefix}, {message}" if prefix else message)

    def to(self, device: torch.device | str) -> DataProto:
        """Move the tensors to ``device`` in place; returns ``self``."""
        if self.batch is not None:
            self.batch = self.batch.to(device)
        return self

    # ------------------------------------------------------------ selection
    def _tensor_keys(self) -> list[str]:
        return [] if self.batch is None else list(self.batch.keys())

    def _check_keys(self, what: str, asked: Iterable[str] | None, have: Iterable[str], op: str) -> None:
        if asked is None:
            return
        missing = [k for k in asked if k not in have]
        if missing:
            raise DataProtoError(
                f"{op}: unknown {what} {', '.join(map(repr, missing))}; "
                f"available: {', '.join(map(repr, have)) or 'none'}"
            )

    def select(
        self,
        batch_keys: Iterable[str] | None = None,
        non_tensor_batch_keys: Iterable[str] | None = None,
        meta_info_keys: Iterable[str] | None = None,
        deepcopy: bool = False,
    ) -> DataProto:
        """A DataProto with only the given keys (``None`` keeps all of that kind).

        Tensors are shared, not copied; ``deepcopy=True`` deep-copies the
        non-tensor columns and meta_info (as in verl).

        Example::

            >>> dp = DataProto.from_dict({"a": torch.zeros(2), "b": torch.ones(2)})
            >>> list(dp.select(batch_keys=["b"]).batch.keys())
            ['b']
        """
        batch_keys = None if batch_keys is None else list(batch_keys)
        non_tensor_batch_keys = None if non_tensor_batch_keys is None else list(non_tensor_batch_keys)
        meta_info_keys = None if meta_info_keys is None else list(meta_info_keys)
        try:
            # New containers (sharing the tensors), so mutating the selection never
            # changes self — verl returns self.batch itself when batch_keys is None.
            batch = self.batch
            if batch is not None:
                batch = batch.select(*batch_keys) if batch_keys is not None else batch.copy()
            elif batch_keys:
                raise KeyError(batch_keys)
            if non_tensor_batch_keys is None:
                non_tensor = dict(self.non_tensor_batch)
            else:
                non_tensor = {k: self.non_tensor_batch[k] for k in non_tensor_batch_keys}
            if meta_info_keys is None:
                meta = dict(self.meta_info)
            else:
                meta = {k: self.meta_info[k] for k in meta_info_keys}
        except KeyError:
            self._check_keys("batch key(s)", batch_keys, self._tensor_keys(), "select")
            self._check_keys("non_tensor_batch key(s)", non_tensor_batch_keys, list(self.non_tensor_batch), "select")
            self._check_keys("meta_info key(s)", meta_info_keys, list(self.meta_info), "select")
            raise
        if deepcopy:
            non_tensor, meta = copy.deepcopy(non_tensor), copy.deepcopy(meta)
        return self._derive(batch, non_tensor, meta)

    def select_idxs(self, idxs: Sequence[int] | Sequence[bool] | np.ndarray | torch.Tensor) -> DataProto:
        """The rows at ``idxs`` (ints, negative allowed, or a boolean mask), in that order.

        Example::

            >>> dp = DataProto.from_dict({"x": torch.arange(5) * 10})
            >>> dp.select_idxs([4, 0]).batch["x"].tolist(), dp.select_idxs(torch.arange(5) > 2).batch["x"].tolist()
            ([40, 0], [30, 40])
        """
        idx, idx_np = _as_index(idxs, len(self))
        batch = None
        if self.batch is not None:
            batch = _batch_from({k: _take(v, idx) for k, v in self.batch.items()}, len(idx), self.batch)
        non_tensor = {k: v[idx_np] for k, v in self.non_tensor_batch.items()}
        return self._derive(batch, non_tensor, self.meta_info, readonly=frozenset())

    def slice(self, start: int | None = None, end: int | None = None, step: int | None = None) -> DataProto:
        """Rows ``start:end:step`` as a DataProto of views (no copy).

        Example::

            >>> DataProto.from_dict({"x": torch.arange(6)}).slice(1, 6, 2).batch["x"].tolist()
            [1, 3, 5]
        """
        s = slice(start, end, step)
        n = len(range(*s.indices(len(self))))
        batch = None
        if self.batch is not None:
            batch = _batch_from({k: v[s] for k, v in self.batch.items()}, n, self.batch)
        non_tensor = {k: v[s] for k, v in self.non_tensor_batch.items()}
        return self._derive(batch, non_tensor, self.meta_info)

    def pop(
        self,
        batch_keys: Iterable[str] | None = None,
        non_tensor_batch_keys: Iterable[str] | None = None,
        meta_info_keys: Iterable[str] | None = None,
    ) -> DataProto:
        """Remove the given keys from ``self`` and return them as a new DataProto (no copy).

        Every key is checked before anything is removed.

        Example::

            >>> dp = DataProto.from_dict({"a": torch.zeros(2), "b": torch.ones(2)})
            >>> list(dp.pop(batch_keys=["a"]).batch.keys()), list(dp.batch.keys())
            (['a'], ['b'])
        """
        batch_keys = list(batch_keys or [])
        non_tensor_batch_keys = list(non_tensor_batch_keys or [])
        meta_info_keys = list(meta_info_keys or [])
        tensor_keys = [] if self.batch is None else list(self.batch.keys())
        self._check_keys("batch key(s)", batch_keys, tensor_keys, "pop")
        self._check_keys("non_tensor_batch key(s)", non_tensor_batch_keys, list(self.non_tensor_batch), "pop")
        self._check_keys("meta_info key(s)", meta_info_keys, list(self.meta_info), "pop")
        n = len(self)
        batch = None
        if batch_keys:
            batch = _batch_from({k: self.batch.pop(k) for k in batch_keys}, n, self.batch)
        non_tensor = {k: self.non_tensor_batch.pop(k) for k in non_tensor_batch_keys}
        meta = {k: self.meta_info.pop(k) for k in meta_info_keys}
        return self._derive(batch, non_tensor, meta)

    def rename(self, old_keys: str | list[str] | None = None, new_keys: str | list[str] | None = None) -> DataProto:
        """Rename columns in place (tensor or non-tensor); returns ``self``.

        Example::

            >>> dp = DataProto.from_dict({"a": torch.zeros(2)})
            >>> list(dp.rename("a", "b").batch.keys())
            ['b']
        """
        old = [old_keys] if isinstance(old_keys, str) else list(old_keys or [])
        new = [new_keys] if isinstance(new_keys, str) else list(new_keys or [])
        if len(old) != len(new):
            raise DataProtoError(f"rename: {len(old)} old key(s) {old} but {len(new)} new key(s) {new}; pass one new name per old name")
        tensor_keys = set() if self.batch is None else set(self.batch.keys())
        columns = tensor_keys | set(self.non_tensor_batch)
        self._check_keys("column(s)", old, sorted(columns), "rename")
        taken = [n for o, n in zip(old, new) if n in columns and n not in old]
        if taken:
            raise DataProtoError(f"rename: {', '.join(map(repr, taken))} already exist; pop them first")
        tensors = {o: self.batch.pop(o) for o in old if o in tensor_keys}
        arrays = {o: self.non_tensor_batch.pop(o) for o in old if o not in tensor_keys}
        for o, n in zip(old, new):
            if o in tensors:
                self.batch[n] = tensors[o]
            else:
                self.non_tensor_batch[n] = arrays[o]
        return self

    def union(self, other: DataProto) -> DataProto:
        """Merge ``other`` into ``self`` (in place, returns ``self``), sharing its tensors.

        A key present in both must hold equal values, else :class:`DataProtoError`.

        Example::

            >>> a = DataProto.from_dict({"x": torch.arange(2)})
            >>> b = DataProto.from_dict({"y": torch.ones(2)}, meta_info={"t": 1})
            >>> sorted(a.union(b).batch.keys()), a.meta_info
            (['x', 'y'], {'t': 1})
        """
        if len(self) != len(other) and self._has_columns() and other._has_columns():
            raise DataProtoError(f"union: batch sizes differ: {len(self)} rows vs {len(other)} rows")
        mine = set() if self.batch is None else set(self.batch.keys())
        theirs = {} if other.batch is None else dict(other.batch.items())
        clash = [k for k in other.non_tensor_batch if k in mine] + [k for k in self.non_tensor_batch if k in theirs]
        if clash:
            raise DataProtoError(
                f"union: {', '.join(map(repr, sorted(clash)))} is a tensor on one side and a non-tensor column on the other"
            )
        if self.batch is None:
            self.batch = None if other.batch is None else other.batch.copy()
        elif theirs:
            _merge_tensors(self.batch, mine, theirs)
        self.non_tensor_batch = union_numpy_dict(self.non_tensor_batch, other.non_tensor_batch)
        for key, value in other.meta_info.items():
            if key in self.meta_info and not _values_equal(self.meta_info[key], value):
                raise DataProtoError(
                    f"union: meta_info[{key!r}] differs: {self.meta_info[key]!r} vs {value!r}; pop one before union"
                )
            self.meta_info[key] = value
        self._readonly = self._readonly | other._readonly
        return self

    # ------------------------------------------------------------ split & merge
    def is_padding_enabled(self) -> bool:
        """Whether :meth:`chunk` may pad (``auto_padding=True`` at build time, or DataProtoConfig)."""
        return bool(self.meta_info.get(AUTO_PADDING_KEY, False)) or DataProtoConfig.auto_padding

    def padding(self, padding_size: int, padding_candidate: str = "") -> None:
        """Append ``padding_size`` copies of the first (``"first"``) or last row, in place."""
        if padding_size == 0:
            return
        row = self.select_idxs([0 if padding_candidate == "first" else len(self) - 1])
        padded = DataProto.concat([self, row.repeat(padding_size)])
        self.batch, self.non_tensor_batch = padded.batch, padded.non_tensor_batch

    def chunk(self, chunks: int) -> list[DataProto]:
        """Split into ``chunks`` equal parts (views; meta_info is shared).

        A length not divisible by ``chunks`` is an error unless padding is
        enabled; then the batch is first padded with its leading rows
        (:func:`pad_dataproto_to_divisor`) and every chunk's
        ``meta_info[PADDING_SIZE_KEY]`` says how many rows were added —
        ``unpad_dataproto(DataProto.concat(chunks))`` drops them.

        Example::

            >>> dp = DataProto.from_dict({"x": torch.arange(6)})
            >>> [c.batch["x"].tolist() for c in dp.chunk(3)]
            [[0, 1], [2, 3], [4, 5]]
            >>> padded = DataProto.from_dict({"x": torch.arange(5)}, auto_padding=True).chunk(2)
            >>> [c.batch["x"].tolist() for c in padded], unpad_dataproto(DataProto.concat(padded)).batch["x"].tolist()
            ([[0, 1, 2], [3, 4, 0]], [0, 1, 2, 3, 4])
        """
        if not isinstance(chunks, int) or chunks < 1:
            raise DataProtoError(f"chunk: chunks must be a positive int, got {chunks!r}")
        data, pad = self, 0
        if len(self) % chunks:
            if not self.is_padding_enabled():
                raise DataProtoError(
                    f"chunk: cannot split {len(self)} rows into {chunks} equal chunks ({len(self)} % {chunks} = "
                    f"{len(self) % chunks}); pad first with pad_dataproto_to_divisor(dp, {chunks}), or enable "
                    "padding (DataProto.from_dict(..., auto_padding=True) or DataProtoConfig.auto_padding = True)"
                )
            data, pad = pad_dataproto_to_divisor(self, chunks)
        parts = data._split_rows([len(data) // chunks] * chunks)
        if pad:
            for part in parts:
                part.meta_info = {**part.meta_info, PADDING_SIZE_KEY: pad}
        return parts

    def split(self, split_size: int) -> list[DataProto]:
        """Consecutive parts of ``split_size`` rows (the last may be shorter).

        Example::

            >>> [len(p) for p in DataProto.from_dict({"x": torch.arange(5)}).split(2)]
            [2, 2, 1]
        """
        if not isinstance(split_size, int) or split_size < 1:
            raise DataProtoError(f"split: split_size must be a positive int, got {split_size!r}")
        n = len(self)
        return self._split_rows([min(split_size, n - start) for start in range(0, n, split_size)])

    def _split_rows(self, sizes: list[int]) -> list[DataProto]:
        """Consecutive views of ``sizes`` rows each (``sum(sizes) == len(self)``)."""
        if self.batch is not None:
            # one tensordict split (one torch.split per column) beats a slice per part
            batches: list[TensorDict | None] = list(self.batch.split(sizes, dim=0)) if sizes else []
        else:
            batches = [None] * len(sizes)
        starts = [0]
        for size in sizes:
            starts.append(starts[-1] + size)
        return [
            self._derive(batch, {k: v[starts[i] : starts[i + 1]] for k, v in self.non_tensor_batch.items()}, self.meta_info)
            for i, batch in enumerate(batches)
        ]

    @staticmethod
    def concat(data: list[DataProto]) -> DataProto:
        """Concatenate along the batch. meta_info is merged: equal keys must agree,
        ``"metrics"`` from every part are gathered into a dict of lists (as verl).

        Example::

            >>> a, b = DataProto.from_dict({"x": torch.arange(2)}), DataProto.from_dict({"x": torch.arange(3)})
            >>> DataProto.concat([a, b]).batch["x"].tolist()
            [0, 1, 0, 1, 2]
        """
        if not data:
            raise DataProtoError("concat: got an empty list; pass at least one DataProto")
        first = data[0]
        keys0 = None if first.batch is None else list(first.batch.keys())
        for i, d in enumerate(data[1:], start=1):
            keys = None if d.batch is None else list(d.batch.keys())
            if (keys is None) != (keys0 is None) or (keys is not None and set(keys) != set(keys0)):
                raise DataProtoError(
                    f"concat: part {i} has tensor keys {sorted(keys or [])} but part 0 has {sorted(keys0 or [])}"
                )
            if d.non_tensor_batch.keys() != first.non_tensor_batch.keys():
                raise DataProtoError(
                    f"concat: part {i} has non-tensor keys {sorted(d.non_tensor_batch)} but part 0 has "
                    f"{sorted(first.non_tensor_batch)}"
                )
        n = sum(len(d) for d in data)
        batch = None
        if keys0 is not None:
            batch = _batch_from({k: torch.cat([d.batch[k] for d in data]) for k in keys0}, n, first.batch)
        non_tensor = {k: np.concatenate([d.non_tensor_batch[k] for d in data]) for k in first.non_tensor_batch}

        meta: dict[str, Any] = {}
        metrics: list[Any] = []
        for d in data:
            for key, value in d.meta_info.items():
                if key == "metrics":
                    if value is not None:
                        metrics.extend(value if isinstance(value, list) else [value])
                elif key in meta and not _values_equal(meta[key], value):
                    raise DataProtoError(f"concat: meta_info[{key!r}] differs between parts: {meta[key]!r} vs {value!r}")
                else:
                    meta[key] = value
        if metrics:
            meta["metrics"] = list_of_dict_to_dict_of_list(metrics) if isinstance(metrics[0], dict) else metrics
        cls = type(first)
        return cls(batch=batch, non_tensor_batch=non_tensor, meta_info=meta)

    def reorder(self, indices: torch.Tensor | np.ndarray | Sequence[int]) -> None:
        """Permute the rows in place: row ``i`` becomes old row ``indices[i]``."""
        reordered = self.select_idxs(indices)
        self.batch, self.non_tensor_batch = reordered.batch, reordered.non_tensor_batch
        self._readonly = frozenset()

    def repeat(self, repeat_times: int = 2, interleave: bool = True) -> DataProto:
        """Each row ``repeat_times`` times: ``aabb`` (interleave) or ``abab`` (tiled).

        Example::

            >>> dp = DataProto.from_dict({"x": torch.tensor([1, 2])}, {"u": ["a", "b"]})
            >>> dp.repeat(2).non_tensor_batch["u"].tolist(), dp.repeat(2, interleave=False).batch["x"].tolist()
            (['a', 'a', 'b', 'b'], [1, 2, 1, 2])
        """
        if not isinstance(repeat_times, int) or repeat_times < 1:
            raise DataProtoError(f"repeat: repeat_times must be a positive int, got {repeat_times!r}")
        n = len(self)

        def rep(t: torch.Tensor) -> torch.Tensor:
            # expand + reshape is one copy, faster than repeat_interleave's gather
            if interleave:
                return t.unsqueeze(1).expand(n, repeat_times, *t.shape[1:]).reshape(n * repeat_times, *t.shape[1:])
            return t.unsqueeze(0).expand(repeat_times, *t.shape).reshape(n * repeat_times, *t.shape[1:])

        batch = None
        if self.batch is not None:
            batch = _batch_from({k: rep(v) for k, v in self.batch.items()}, n * repeat_times, self.batch)
        if interleave:
            non_tensor = {k: np.repeat(v, repeat_times, axis=0) for k, v in self.non_tensor_batch.items()}
        else:
            non_tensor = {k: np.tile(v, (repeat_times,) + (1,) * (v.ndim - 1)) for k, v in self.non_tensor_batch.items()}
        return self._derive(batch, non_tensor, self.meta_info, readonly=frozenset())

    def sample_level_repeat(self, repeat_times: Sequence[int] | np.ndarray | torch.Tensor) -> DataProto:
        """Row ``i`` repeated ``repeat_times[i]`` times (interleaved).

        Example::

            >>> DataProto.from_dict({"x": torch.tensor([7, 8, 9])}).sample_level_repeat([2, 0, 1]).batch["x"].tolist()
            [7, 7, 9]
        """
        counts = torch.as_tensor(
            repeat_times.tolist() if isinstance(repeat_times, (np.ndarray, torch.Tensor)) else list(repeat_times),
            dtype=torch.int64,
        )
        if counts.dim() != 1 or counts.numel() != len(self):
            raise DataProtoError(
                f"sample_level_repeat: need one count per row ({len(self)}), got shape {list(counts.shape)}"
            )
        if counts.numel() and int(counts.min()) < 0:
            raise DataProtoError(f"sample_level_repeat: counts must be >= 0, got {counts.tolist()}")
        total = int(counts.sum())
        batch = None
        if self.batch is not None:
            batch = _batch_from(
                {k: v.repeat_interleave(counts.to(v.device), dim=0) for k, v in self.batch.items()}, total, self.batch
            )
        counts_np = counts.numpy()
        non_tensor = {k: np.repeat(v, counts_np, axis=0) for k, v in self.non_tensor_batch.items()}
        return self._derive(batch, non_tensor, self.meta_info, readonly=frozenset())

    def make_iterator(
        self,
        mini_batch_size: int,
        epochs: int,
        seed: int | None = None,
        dataloader_kwargs: dict[str, Any] | None = None,
    ) -> Iterator[DataProto]:
        """Mini-batches of ``mini_batch_size`` rows, ``epochs`` times over (verl's PPO loop).

        ``dataloader_kwargs={"shuffle": True}`` permutes the rows each epoch
        with a generator seeded by ``seed``, drawing exactly what verl's
        ``DataLoader`` draws (same mini-batches for the same seed); other
        DataLoader options that do not change the rows (``num_workers``,
        ``pin_memory``...) are accepted and ignored.

        Example::

            >>> it = DataProto.from_dict({"x": torch.arange(4)}).make_iterator(mini_batch_size=2, epochs=2)
            >>> [mb.batch["x"].tolist() for mb in it]
            [[0, 1], [2, 3], [0, 1], [2, 3]]
        """
        n = len(self)
        if mini_batch_size < 1 or n % mini_batch_size:
            raise DataProtoError(
                f"make_iterator: {n} rows do not split into mini-batches of {mini_batch_size}; "
                f"pick a mini_batch_size that divides {n}"
            )
        options = dict(dataloader_kwargs or {})
        shuffle = bool(options.pop("shuffle", False))
        ignored = {"num_workers", "pin_memory", "drop_last", "persistent_workers", "prefetch_factor", "timeout"}
        unknown = sorted(set(options) - ignored)
        if unknown:
            raise DataProtoError(f"make_iterator: unsupported dataloader_kwargs {unknown}; supported: shuffle, {sorted(ignored)}")
        generator = torch.Generator().manual_seed(seed) if seed is not None else None

        def batches() -> Iterator[DataProto]:
            for _ in range(epochs):
                order = _dataloader_epoch_order(n, shuffle, generator)
                for start in range(0, n, mini_batch_size):
                    if order is None:
                        part = self.slice(start, start + mini_batch_size)
                    else:
                        part = self.select_idxs(order[start : start + mini_batch_size])
                    part.meta_info = self.meta_info
                    yield part

        return batches()

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

    def save_to_disk(self, filepath: str | os.PathLike) -> None:
        """Pickle to ``filepath`` (protocol 5: tensor bytes are written straight from memory)."""
        with open(filepath, "wb") as f:
            pickle.dump(self, f, protocol=5)

    @staticmethod
    def load_from_disk(filepath: str | os.PathLike) -> DataProto:
        """Load what :meth:`save_to_disk` wrote.

        Example::

            >>> import tempfile, os
            >>> path = os.path.join(tempfile.mkdtemp(), "b.pkl")
            >>> DataProto.from_dict({"x": torch.arange(3)}).save_to_disk(path)
            >>> DataProto.load_from_disk(path).batch["x"].tolist()
            [0, 1, 2]
        """
        with open(filepath, "rb") as f:
            data = pickle.load(f)
        if not isinstance(data, DataProto):
            raise DataProtoError(f"{os.fspath(filepath)} holds a {type(data).__name__}, not a DataProto")
        return data


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
    return DataProto.concat(parts), pad


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
    _merge_tensors(tensor_dict1, set(tensor_dict1.keys()), dict(tensor_dict2.items()))
    return tensor_dict1


def _merge_tensors(target: TensorDict, target_keys: set[str], extra: dict[str, Any]) -> None:
    """Add ``extra`` to ``target`` in place; a shared key must hold an equal tensor."""
    new = {}
    for key, value in extra.items():
        if key not in target_keys:
            new[key] = value
        elif not _tensors_equal(target[key], value):
            raise DataProtoError(
                f"union: column {key!r} differs between the two batches "
                f"({_describe(target[key])} vs {_describe(value)}); rename or pop one before union"
            )
    if new:
        target.update(new)


def union_numpy_dict(tensor_dict1: dict[str, np.ndarray], tensor_dict2: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Add ``tensor_dict2``'s arrays to ``tensor_dict1`` (in place; returns it).

    A key in both must hold deeply equal arrays (NaN equals NaN), else
    :class:`DataProtoError` naming the key.
    """
    for key, value in tensor_dict2.items():
        if key in tensor_dict1 and not _values_equal(tensor_dict1[key], value):
            raise DataProtoError(
                f"union: non-tensor column {key!r} differs between the two batches; rename or pop one before union"
            )
        tensor_dict1[key] = value
    return tensor_dict1


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
        batch = _batch_from(
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
        batch = _batch_from({k: v.reshape(n, *v.shape[batch_dims:]) for k, v in data.batch.items()}, n, data.batch)
    non_tensor = {k: v.reshape(n, *v.shape[batch_dims:]) for k, v in data.non_tensor_batch.items()}
    return data._derive(batch, non_tensor, data.meta_info)
