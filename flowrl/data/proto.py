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
from typing import Any, Iterable, Sequence

import numpy as np
import torch
from tensordict import TensorDict

from flowrl.data.columns import (
    DataProtoError,
    batch_from as _batch_from,
    describe as _describe,
    list_of_dict_to_dict_of_list,
    merge_tensors as _merge_tensors,
    object_array as _object_array,
    union_numpy_dict,
    values_equal as _values_equal,
)
from flowrl.data.fields import Field
from flowrl.data.serialize import _decode_tensordict, serialize_tensordict
from flowrl.data.verl_compat import (
    AUTO_PADDING_KEY,
    PADDING_SIZE_KEY,
    DataProtoItem,
    VerlDataProtoAPI,
    pad_dataproto_to_divisor,
)

__all__ = ["DataProto", "DataProtoError", "collate_fn"]

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


def _take(value: Any, idx: torch.Tensor) -> Any:
    if isinstance(value, torch.Tensor) and not value.is_nested:
        return torch.index_select(value, 0, idx.to(value.device))
    return value[idx]


# ---------------------------------------------------------------------- items
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
class DataProto(VerlDataProtoAPI):
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
                    raise DataProtoError(
                        f"concat: meta_info[{key!r}] differs between parts: {meta[key]!r} vs {value!r} "
                        f"(Conflicting values for meta_info key {key!r}); make the parts agree or pop it"
                    )
                else:
                    meta[key] = value
        if metrics:
            meta["metrics"] = list_of_dict_to_dict_of_list(metrics) if isinstance(metrics[0], dict) else metrics
        cls = type(first)
        return cls(batch=batch, non_tensor_batch=non_tensor, meta_info=meta)

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
