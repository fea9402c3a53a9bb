"""Digests of tensors: 64-bit sums of mixed rows, exact in every bit and additive over row shards.

A row's digest weights its bytes, read as 64-bit words, by fixed odd multipliers,
sums them with wrapping int64 arithmetic (one integer matmul on the CPU), mixes in
the row's index and a key (name, dtype, shape), and finishes with a splitmix-style
mix. A tensor's digest is the sum of its rows' mod 2^64, so the parts of weights
sharded by rows (FSDP2) add up to the whole's at any worker count. Used by
:mod:`flowrl.provenance.fingerprints` for node outputs (one digest per row) and for
a role's weights (one digest for all).

Example::

    weights_digest(model.state_dict().items())   # 16 hex digits, the same for every copy of these weights
"""

from __future__ import annotations

import functools
import hashlib
from typing import Iterable

import numpy as np
import torch
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


@functools.lru_cache(maxsize=4096)
def _odd(text: str) -> int:
    """A 64-bit odd multiplier from ``text``, as torch's signed int64 holds it."""
    v = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") | 1
    return v - (1 << 64) if v >= 1 << 63 else v


_COLUMN_WEIGHTS: dict[int, torch.Tensor] = {}


def _column_weights(width: int) -> torch.Tensor:
    """Fixed odd int64 multipliers, one per 64-bit word of a row of ``width`` words (an odd multiplier
    is a bijection mod 2^64: no bit is lost)."""
    if width not in _COLUMN_WEIGHTS:
        g = torch.Generator().manual_seed(1009 * width)
        _COLUMN_WEIGHTS[width] = torch.randint(-(1 << 62), 1 << 62, (width,), generator=g, dtype=torch.int64) * 2 + 1
    return _COLUMN_WEIGHTS[width]


def mixed_rows(local: torch.Tensor, first: int | None, key: str) -> np.ndarray:
    """Per row of ``local`` (rows: the first dimension; a 1-D tensor's elements), an int64 that
    mixes the row's exact bits, its index ``first + i`` in the whole tensor (``None``: the row's
    content alone, wherever it sits) and ``key``: the row's
    64-bit words weighted by fixed odd multipliers and summed, then a splitmix-style finish
    (every output bit depends on every input bit)."""
    m = _weighted_rows(local, key)
    return _finish(m, None if first is None else _row_index(m.shape[0], first))


def _words(local: torch.Tensor) -> torch.Tensor:
    """``local``'s rows as int64 words, ``(rows, words)``: each row's bytes as 64-bit words (a row whose
    bytes are not a whole number of words: each element widened to one, a bijection on its bits)."""
    local = local.contiguous()
    size = local.element_size()
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]
    rows = local.shape[0] if local.dim() else 1
    width = local.numel() // rows if rows else 1
    bits = local.reshape(-1).view(ints).reshape(rows, width)
    if size < 8 and (width * size) % 8 == 0 and (bits.storage_offset() * size) % 8 == 0:
        return bits.view(torch.int64)
    return bits.to(torch.int64)


def _weighted_rows(local: torch.Tensor, key: str) -> np.ndarray:
    """:func:`mixed_rows` before the row index and the finish (int64 per row): the row's words
    (:func:`_words`) weighted and summed with wrapping int64 arithmetic, as a product with the column
    weights (:func:`_row_sums`; 64-bit words, half the products of 32-bit ones: format
    :data:`~flowrl.provenance.rundiff.FORMAT` 2)."""
    words = _words(local)
    summed = np.empty(words.shape[0], dtype=np.int64)
    _row_sums(_host(words), _column_weights(words.shape[1]).numpy(), summed)
    return summed + np.int64(_odd(key))


def _row_sums(words: np.ndarray | torch.Tensor, weights: np.ndarray, out: np.ndarray) -> None:
    """``out[i] = sum_j words[i, j] * weights[j]`` with wrapping int64 arithmetic: numpy's einsum on the
    CPU (it beats numpy's integer matmul, except on small ones), torch on an accelerator (only the sums move)."""
    if isinstance(words, torch.Tensor):
        out[:] = (words * torch.from_numpy(weights).to(words.device)).sum(dim=1).cpu().numpy()
    elif words.size > 4096:
        np.einsum("ij,j->i", words, weights, out=out)
    else:
        np.matmul(words, weights, out=out)


_BLOCKS: dict[tuple[int, ...], np.ndarray] = {}


def mixed_rows_of(tensors: list[torch.Tensor], keys: list[str]) -> np.ndarray:
    """:func:`mixed_rows` (no row index) of several CPU tensors with one row count, at once:
    ``(rows, len(tensors))``, column k equal to ``mixed_rows(tensors[k], None, keys[k])`` — their words
    side by side, times a block-diagonal matrix of each one's column weights, finished together (a
    task's outputs in a few operations instead of a few dozen each)."""
    words = [_words(t).numpy() for t in tensors]
    widths = tuple(w.shape[1] for w in words)
    if widths not in _BLOCKS:
        if len(_BLOCKS) >= 256:  # response widths vary by step: keep the cache bounded
            _BLOCKS.clear()
        block, at = np.zeros((sum(widths), len(widths)), dtype=np.int64), 0
        for k, w in enumerate(widths):
            block[at:at + w, k] = _column_weights(w).numpy()
            at += w
        _BLOCKS[widths] = block
    odd = np.array([_odd(k) for k in keys], dtype=np.int64)
    return _finish(np.concatenate(words, axis=1) @ _BLOCKS[widths] + odd, None)


def _finish(m: np.ndarray, index: np.ndarray | None) -> np.ndarray:
    """The row index (``None``: none) and a splitmix-style finish of :func:`_weighted_rows`, in uint64:
    logical shifts (torch's int64 shift is arithmetic), products that wrap as int64's do."""
    if index is not None:
        m = m + index * np.int64(_odd("row"))
    u = m.view(np.uint64)
    u = (u ^ (u >> np.uint64(31))) * np.uint64(_odd("mix1") % (1 << 64))
    u = (u ^ (u >> np.uint64(29))) * np.uint64(_odd("mix2") % (1 << 64))
    return (u ^ (u >> np.uint64(32))).view(np.int64)


def _local_rows(name: str, t: torch.Tensor) -> tuple[torch.Tensor, int, str, bool] | None:
    """This rank's rows of ``t``, the index of the first in the whole tensor, the digest's key and
    whether they are a part; ``None`` for a part that is not whole rows."""
    local, first, shape = t, 0, list(t.shape)
    part = hasattr(t, "to_local") and t.device_mesh.size() > 1
    if hasattr(t, "to_local"):
        local_shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        if list(local_shape[1:]) != shape[1:]:
            return None
        first, local = int(offset[0]) if offset else 0, t.to_local()
    return local.detach(), first, f"{name}|{t.dtype}|{tuple(shape)}", part


def weights_digest(named: Iterable[tuple[str, torch.Tensor]] | None) -> str | None:
    """A 64-bit digest of ``(name, tensor)`` pairs (names, dtypes, shapes, exact bits), additive
    over shards: this rank's part of sharded weights is marked ``p:`` (:func:`combine_digests`
    adds the ranks' parts into the whole's).

    The sum mod 2^64 of :func:`mixed_rows` over every row of every tensor (finished together, in one
    pass): a sum over disjoint sets of rows equals the whole tensor's, so the digest of weights sharded
    by rows (FSDP2) is the same at any worker count. What depends only on the names, dtypes and shapes
    (each tensor's column weights, its rows' place in one buffer, the keys and row indices mixed in) is
    worked out once per layout (:class:`_Layout`): per step only the products are computed."""
    if named is None:
        return None
    tensors, keys, partial = [], [], False
    for name, t in named:
        rows = _local_rows(name, t)
        if rows is None:  # sharded other than by rows: no digest rather than a wrong one
            return None
        local, first, key, part = rows
        tensors.append(local)
        keys.append((key, first))
        partial = partial or part
    words = [_words(t) for t in tensors]
    return ("p:" if partial else "") + f"{_layout(words, keys).digest([_host(w) for w in words]):016x}"


class WeightsDigester:
    """:func:`weights_digest` of one model's weights, called after update after update: the words of each
    CPU tensor are viewed once and reused while the tensors keep their storage (an optimizer updates in
    place), so a call is one product per tensor. It holds the storage of the weights it last digested:
    keep it no longer than the model (:class:`~flowrl.provenance.fingerprints.WeightDigests` drops it on a load).
    Sharded or accelerator tensors: :func:`weights_digest` each time."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._layout: _Layout | None = None
        self._words: list[np.ndarray | None] = []  # a tensor's words when they are its memory (else made per call)

    def __call__(self, named: Iterable[tuple[str, torch.Tensor]] | None) -> str | None:
        if named is None:
            return None
        pairs = list(named)
        if any(hasattr(t, "to_local") or t.device.type != "cpu" for _, t in pairs):
            return weights_digest(pairs)
        key = tuple((name, t.data_ptr(), t.dtype, t.shape, t.stride()) for name, t in pairs)
        if key != self._key:
            words = [_words(t.detach()).numpy() for _, t in pairs]
            self._layout = _layout(words, [(_local_rows(name, t)[2], 0) for name, t in pairs])
            self._words = [w if w.size and w.ctypes.data == t.data_ptr() else None for w, (_, t) in zip(words, pairs)]
            self._key = key
        words = [w if w is not None else _words(t.detach()).numpy() for w, (_, t) in zip(self._words, pairs)]
        return f"{self._layout.digest(words):016x}"


def _host(words: torch.Tensor) -> np.ndarray | torch.Tensor:
    return words.numpy() if words.device.type == "cpu" else words


def _layout(words: list[np.ndarray | torch.Tensor], keys: list[tuple[str, int]]) -> "_Layout":
    layout = _LAYOUTS.get(tuple(keys))
    if layout is None:
        if len(_LAYOUTS) >= 16:  # a handful of roles per worker; anything else is a reshaped model
            _LAYOUTS.clear()
        layout = _LAYOUTS[tuple(keys)] = _Layout([w.shape for w in words], keys)
    return layout


class _Layout:
    """The constant part of :func:`weights_digest` for one list of (key, first row): where each
    tensor's row sums go in one buffer, its column weights, and what each row adds before the finish
    (its key's multiplier and its index's)."""

    def __init__(self, shapes: list[tuple[int, int]], keys: list[tuple[str, int]]) -> None:
        self.parts: list[tuple[int, int, np.ndarray]] = []  # (start, end, column weights) per tensor
        adds, at = [], 0
        for (rows, width), (key, first) in zip(shapes, keys):
            self.parts.append((at, at + rows, _column_weights(width).numpy()))
            adds.append(np.int64(_odd(key)) + _row_index(rows, first) * np.int64(_odd("row")))
            at += rows
        self.adds = np.concatenate(adds) if adds else np.zeros(0, dtype=np.int64)

    def digest(self, words: list[np.ndarray | torch.Tensor]) -> int:
        """The digest of tensors with these keys, from their words (:func:`_words`; numpy on the CPU)."""
        sums = np.empty_like(self.adds)
        for w, (start, end, weights) in zip(words, self.parts):
            _row_sums(w, weights, sums[start:end])
        sums += self.adds
        return int(_finish(sums, None).sum(dtype=np.uint64)) if len(sums) else 0


_LAYOUTS: dict[tuple[tuple[str, int], ...], _Layout] = {}


@functools.lru_cache(maxsize=4096)
def _row_index(rows: int, first: int) -> np.ndarray:
    return np.arange(first, first + rows, dtype=np.int64)


def combine_digests(digests: list[str | None]) -> str | None:
    """One digest from the ranks' :func:`weights_digest`: parts (``p:``) added, else the first."""
    parts = [d for d in digests if d is not None and d.startswith("p:")]
    if not parts:
        return next((d for d in digests if d is not None), None)
    return f"{sum(int(d[2:], 16) for d in parts) % (1 << 64):016x}"


__all__ = ["WeightsDigester", "combine_digests", "mixed_rows", "mixed_rows_of", "weights_digest"]
