"""DataProto's columns as field specs (``fields``, ``check_fields``) and its column and row selection
(``select``, ``select_idxs``, ``slice``, ``pop``, ``rename``, ``union``): a part of :class:`~flowrl.data.proto.DataProto`, kept in its own module."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import numpy as np
import torch

from flowrl.data.columns import (
    DataProtoError,
    batch_from as _batch_from,
    merge_tensors as _merge_tensors,
    union_numpy_dict,
    values_equal as _values_equal,
)
from flowrl.data.fields import Field

if TYPE_CHECKING:
    from flowrl.data.proto import DataProto


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


class ColumnOps:
    """A DataProto's columns as field specs; selecting, removing, renaming and joining columns, and
    selecting rows."""

    # ------------------------------------------------------------ fields
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
