"""verl's DataProto API that flowrl itself never calls, kept so verl code ports by changing an import.

:mod:`flowrl.data.proto` is the batch flowrl's runtime and operators use;
this module adds, to the same class, what verl users call and flowrl does
not: constructors from single dicts and TensorDicts, the PPO mini-batch
iterator (``make_iterator``), per-sample repeats, ``unfold_column_chunks``,
auto padding (``DataProtoConfig``, ``pad_dataproto_to_divisor``), folding the
batch dimension, disk save/load, ``__getstate__``/``__setstate__``, and
``get_tensordict`` (verl's ``verl.utils.tensordict_utils``).

``from flowrl.data import DataProto`` is the whole API. Errors are
:class:`~flowrl.data.columns.DataProtoError`, also an ``AssertionError`` as
verl raises. Numeric numpy columns (``num_turns`` as int32) are accepted as
verl accepts them.

Example::

    >>> import torch
    >>> from flowrl.data import DataProto
    >>> dp = DataProto.from_dict({"x": torch.arange(4)}, {"u": ["a", "b", "c", "d"]})
    >>> [mb.batch["x"].tolist() for mb in dp.make_iterator(mini_batch_size=2, epochs=1)]
    [[0, 1], [2, 3]]
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass, field as dataclass_field
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import numpy as np
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

from flowrl.data.columns import DataProtoError, batch_from, object_array
from flowrl.data.serialize import _decode_tensordict, serialize_tensordict

if TYPE_CHECKING:  # annotations only: proto imports this module
    from flowrl.data.proto import DataProto

__all__ = [
    "AUTO_PADDING_KEY",
    "PADDING_SIZE_KEY",
    "DataProtoConfig",
    "DataProtoItem",
    "VerlDataProtoAPI",
]

#: meta_info key that turns auto padding on for one DataProto (set by ``auto_padding=True``)
AUTO_PADDING_KEY = "_flowrl_auto_padding"
#: meta_info key where :meth:`DataProto.chunk` records how many rows it padded
PADDING_SIZE_KEY = "_flowrl_padding_size"


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



@dataclass
class DataProtoItem:
    """One row of a DataProto (what ``dp[i]`` returns, as in verl)."""

    batch: TensorDict | None = None
    non_tensor_batch: dict = dataclass_field(default_factory=dict)
    meta_info: dict = dataclass_field(default_factory=dict)




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



class VerlDataProtoAPI:
    """The part of verl's DataProto API flowrl does not use itself; :class:`DataProto` inherits it."""

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
                non_tensors[key] = object_array(rows, len(rows))
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


    def get_data_info(self) -> str:
        """A readable summary of columns and meta types (verl's name for :func:`repr`)."""
        return repr(self)

    def is_padding_enabled(self) -> bool:
        """Whether :meth:`chunk` may pad (``auto_padding=True`` at build time, or DataProtoConfig)."""
        return bool(self.meta_info.get(AUTO_PADDING_KEY, False)) or DataProtoConfig.auto_padding

    def padding(self, padding_size: int, padding_candidate: str = "") -> None:
        """Append ``padding_size`` copies of the first (``"first"``) or last row, in place."""
        if padding_size == 0:
            return
        row = self.select_idxs([0 if padding_candidate == "first" else len(self) - 1])
        padded = type(self).concat([self, row.repeat(padding_size)])
        self.batch, self.non_tensor_batch = padded.batch, padded.non_tensor_batch

    def reorder(self, indices: torch.Tensor | np.ndarray | Sequence[int]) -> None:
        """Permute the rows in place: row ``i`` becomes old row ``indices[i]``."""
        reordered = self.select_idxs(indices)
        self.batch, self.non_tensor_batch = reordered.batch, reordered.non_tensor_batch
        self._readonly = frozenset()

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
            batch = batch_from(
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


    def save_to_disk(self, filepath: str | os.PathLike) -> None:
        """Pickle to ``filepath`` (protocol 5: tensor bytes are written straight from memory)."""
        with open(filepath, "wb") as f:
            pickle.dump(self, f, protocol=5)

    @classmethod
    def load_from_disk(cls, filepath: str | os.PathLike) -> DataProto:
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
        if not isinstance(data, cls):
            raise DataProtoError(f"{os.fspath(filepath)} holds a {type(data).__name__}, not a DataProto")
        return data


    def unfold_column_chunks(self, n_split: int, split_keys: Sequence[str] | None = None) -> DataProto:
        """Cut the columns in ``split_keys`` into ``n_split`` chunks along dim 1 and move the chunks
        into the batch dimension (``[B, n·k] → [B·n, k]``); every other column repeats each row
        ``n_split`` times. A 1-D object column of equal-length sequences splits its sequences.

        Example::

            >>> dp = DataProto.from_dict({"x": torch.tensor([[1, 2, 3, 4]]), "y": torch.tensor([7])})
            >>> out = dp.unfold_column_chunks(2, split_keys=["x"])
            >>> out.batch["x"].tolist(), out.batch["y"].tolist()
            ([[1, 2], [3, 4]], [7, 7])
        """
        split = set(split_keys or [])
        n = len(self)

        def unfold(key: str, value: Any) -> Any:
            if key not in split:
                if isinstance(value, torch.Tensor):
                    return value.repeat_interleave(n_split, dim=0)
                return np.repeat(value, n_split, axis=0)
            if isinstance(value, np.ndarray) and value.ndim == 1 and value.dtype == object:
                value = _stack_sequences(key, value)
            if value.ndim < 2 or value.shape[1] % n_split:
                raise DataProtoError(
                    f"unfold_column_chunks: column {key!r} of shape {list(value.shape)} cannot be cut into "
                    f"{n_split} equal chunks along dim 1"
                )
            return value.reshape(value.shape[0] * n_split, value.shape[1] // n_split, *value.shape[2:])

        batch = None
        if self.batch is not None:
            batch = TensorDict({k: unfold(k, v) for k, v in self.batch.items()}, batch_size=[n * n_split],
                               device=self.batch.device)
        non_tensor = {k: unfold(k, v) for k, v in self.non_tensor_batch.items()}
        return type(self)(batch=batch, non_tensor_batch=non_tensor, meta_info=self.meta_info)

    def __getstate__(self) -> tuple:
        """verl's pickling state ``(batch, non_tensor_batch, meta_info)``; the batch is serialised
        zero-copy as flowrl's pickling does (never consolidated)."""
        batch = serialize_tensordict(self.batch) if self.batch is not None else None
        return batch, self.non_tensor_batch, self.meta_info

    def __setstate__(self, state: tuple) -> None:
        batch, non_tensor_batch, meta_info = state
        td, readonly = (None, set()) if batch is None else _decode_tensordict(batch)
        self.batch, self.non_tensor_batch, self.meta_info = td, non_tensor_batch, meta_info
        self._readonly = frozenset(readonly)


def _stack_sequences(key: str, column: np.ndarray) -> np.ndarray:
    """A 1-D object column of equal-length sequences as a 2-D object array (one element per item)."""
    rows = [list(v) if isinstance(v, (list, tuple, np.ndarray)) else None for v in column]
    if any(r is None for r in rows) or len({len(r) for r in rows}) > 1:
        raise DataProtoError(
            f"unfold_column_chunks: non-tensor column {key!r} must hold sequences of one length to be split"
        )
    out = np.empty((len(rows), len(rows[0]) if rows else 0), dtype=object)
    for i, r in enumerate(rows):
        out[i, :] = r
    return out
