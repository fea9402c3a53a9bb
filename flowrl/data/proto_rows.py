"""DataProto's row splitting and joining (``chunk``, ``split``, ``concat``, ``repeat``): a part of
:class:`~flowrl.data.proto.DataProto`, kept in its own module."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from tensordict import TensorDict

from flowrl.data.columns import (
    DataProtoError,
    batch_from as _batch_from,
    list_of_dict_to_dict_of_list,
    values_equal as _values_equal,
)
from flowrl.data.verl_compat import PADDING_SIZE_KEY
from flowrl.data.verl_functions import pad_dataproto_to_divisor

if TYPE_CHECKING:
    from flowrl.data.proto import DataProto


class RowOps:
    """Cutting a DataProto into parts by rows, joining parts, repeating rows."""

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
