"""Tensor and TensorDict (de)serialisation without copies.

A tensor is encoded as ``(dtype_name, shape, bytes_view)`` where ``bytes_view``
is a flat ``uint8`` numpy *view* of the tensor's memory — no copy for a
contiguous CPU tensor. Pickled with protocol 5 and a ``buffer_callback`` (what
Ray's object store does), numpy hands that view over as an out-of-band
:class:`pickle.PickleBuffer`, so the bytes go straight from the tensor into the
object store and come back as a view of it. Every dtype round-trips through
``uint8``, including ``bfloat16``, which numpy cannot represent.

Read-only buffers
-----------------
Ray returns objects from its shared-memory store as **read-only** buffers, and
``pickle.loads(..., buffers=[bytes, ...])`` does the same. torch has no
read-only tensors, and copy-on-first-write cannot be done in torch: a tensor
on such a buffer accepts in-place writes (it does not crash), and they change
the shared object under every other reader on the node (measured: ``t[0] = 7``
after ``ray.get`` succeeds, and a second ``ray.get`` of the same ref sees 7).
So the receiver chooses, when bytes are decoded:

* ``"view"`` (the default): tensors alias the read-only memory — zero-copy and
  no extra memory; the :class:`~flowrl.data.DataProto` lists those columns in
  ``readonly_keys`` (and in its repr), and
  :meth:`~flowrl.data.DataProto.to_writable` copies just those columns before
  code that writes in place.
* ``"copy"``: every read-only buffer is copied once into private memory, so
  every tensor is safely writable, at the price of one memcpy of the payload
  and +1x private memory in the receiver.

Measured on the 64 MiB benchmark batch (``benchmarks/dataproto.py``, 2-core
VM): ``ray.put`` + ``ray.get`` takes ~20 ms with ``"view"`` and ~40 ms with
``"copy"`` (up to ~130 ms when the copy lands on fresh pages: page faults
dominate), against 200-300 ms for verl's default; peak private memory is 1.0x
the payload with ``"view"``, 2.0x with ``"copy"``, 4.0x for verl. ``"view"`` is the default because in a flowrl graph
an operator's inputs are fields produced by another node: writing into them in
place would be a second producer of the field, which the graph forbids, so
read-only inputs are the contract — not a restriction. Views keep the whole
Ray object pinned in the store while any of its tensors is alive.
Set ``FLOWRL_READONLY_POLICY=copy`` (or :func:`set_readonly_policy` in a
worker) for code that mutates its inputs in place.

Writable buffers (in-process ``pickle.loads`` with the sender's own buffers,
in-band pickles, protocol < 5) are never copied: they are already private.
Under ``"copy"``, :meth:`~flowrl.data.DataProtoFuture.get` still decodes its
shards as views and copies only what its collect step left aliased, so a
concat of shards costs one copy, not two.

Example::

    >>> import pickle, torch
    >>> t = torch.arange(6, dtype=torch.bfloat16).view(2, 3)
    >>> bufs = []
    >>> blob = pickle.dumps(serialize_single_tensor(t), protocol=5, buffer_callback=bufs.append)
    >>> back = deserialize_single_tensor(pickle.loads(blob, buffers=bufs))
    >>> back.dtype, back.tolist()
    (torch.bfloat16, [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]])
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from typing import Any, Iterator, Literal

import numpy as np
import torch
from tensordict import TensorDict

__all__ = [
    "ReadonlyPolicy",
    "get_readonly_policy",
    "set_readonly_policy",
    "readonly_policy",
    "serialize_single_tensor",
    "deserialize_single_tensor",
    "serialize_tensordict",
    "deserialize_tensordict",
]

ReadonlyPolicy = Literal["copy", "view"]
_POLICIES = ("copy", "view")

# Thread-local so that DataProtoFuture.get() in one thread of an actor cannot
# change what another thread decodes; the process default comes from the env.
_state = threading.local()


def _default_policy() -> ReadonlyPolicy:
    policy = os.environ.get("FLOWRL_READONLY_POLICY", "view")
    if policy not in _POLICIES:
        raise ValueError(
            f"FLOWRL_READONLY_POLICY={policy!r} is not a policy; use 'copy' (safe) or 'view' (zero-copy)"
        )
    return policy  # type: ignore[return-value]


def get_readonly_policy() -> ReadonlyPolicy:
    """What decoding does with a read-only buffer: ``"view"`` (default) or ``"copy"``."""
    return getattr(_state, "policy", None) or _default_policy()


def set_readonly_policy(policy: ReadonlyPolicy) -> None:
    """Set the read-only policy of this thread (e.g. at a worker's start-up).

    ``set_readonly_policy("copy")`` makes every later ``ray.get`` of a
    DataProto return private, writable tensors (one copy); the default
    ``"view"`` is zero-copy.
    """
    if policy not in _POLICIES:
        raise ValueError(f"unknown read-only policy {policy!r}; use 'copy' (safe) or 'view' (zero-copy)")
    _state.policy = policy


@contextlib.contextmanager
def readonly_policy(policy: ReadonlyPolicy) -> Iterator[None]:
    """Use ``policy`` for decodes inside the block.

    Example::

        with readonly_policy("copy"):
            dp = ray.get(ref)          # private, writable tensors
    """
    previous = getattr(_state, "policy", None)
    set_readonly_policy(policy)
    try:
        yield
    finally:
        _state.policy = previous


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def serialize_single_tensor(tensor: torch.Tensor) -> tuple[str, tuple[int, ...], np.ndarray]:
    """Encode a tensor as ``(dtype_name, shape, flat uint8 numpy view)``.

    No copy for a contiguous CPU tensor; a non-contiguous one is made
    contiguous first (one copy), a GPU one is moved to CPU.

    Example::

        >>> serialize_single_tensor(torch.ones(2, 2, dtype=torch.int32))[:2]
        ('int32', (2, 2))
    """
    flat = tensor.detach()
    if flat.device.type != "cpu":
        flat = flat.cpu()
    flat = flat.contiguous().reshape(-1)
    return _dtype_name(tensor.dtype), tuple(tensor.shape), flat.view(torch.uint8).numpy()


def deserialize_single_tensor(encoded: tuple[str, tuple[int, ...], Any]) -> torch.Tensor:
    """Decode ``(dtype_name, shape, bytes)`` back into a tensor.

    ``bytes`` may be a numpy array, ``bytes``, ``bytearray`` or any buffer. A
    read-only buffer is copied or aliased according to :func:`get_readonly_policy`.
    """
    return _decode_tensor(encoded)[0]


def _decode_tensor(encoded: tuple[str, tuple[int, ...], Any]) -> tuple[torch.Tensor, bool]:
    """The tensor, and whether it aliases read-only memory."""
    dtype_name, shape, data = encoded
    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"cannot decode a tensor of dtype {dtype_name!r}: torch has no such dtype")
    array = data if isinstance(data, np.ndarray) else np.frombuffer(data, dtype=np.uint8)
    if array.flags.writeable:
        return torch.from_numpy(array).view(dtype).view(shape), False
    if get_readonly_policy() == "copy":
        return torch.from_numpy(array.copy()).view(dtype).view(shape), False
    # torch warns that it cannot mark the tensor read-only; the DataProto
    # records the column in readonly_keys instead.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array).view(dtype).view(shape), True


def serialize_tensordict(batch: TensorDict) -> tuple[tuple[int, ...], str | None, dict[Any, Any]]:
    """Encode a TensorDict as ``(batch_size, device, {key: encoded_tensor})``.

    Nested (jagged) tensors are encoded as ``(layout, [encoded rows])``; nested
    TensorDicts appear under tuple keys.

    Example::

        >>> td = TensorDict({"x": torch.zeros(2, 3)}, batch_size=[2])
        >>> size, device, items = serialize_tensordict(td)
        >>> size, device, items["x"][:2]
        ((2,), None, ('float32', (2, 3)))
    """
    encoded: dict[Any, Any] = {}
    _encode_items(batch, (), encoded)
    device = str(batch.device) if batch.device is not None else None
    return tuple(batch.batch_size), device, encoded


def _encode_items(batch: TensorDict, prefix: tuple[str, ...], encoded: dict[Any, Any]) -> None:
    for key, value in batch.items():
        path = prefix + (key,)
        name = path if prefix else key  # nested TensorDicts appear under tuple keys
        if isinstance(value, TensorDict):
            _encode_items(value, path, encoded)
        elif not isinstance(value, torch.Tensor):
            raise TypeError(
                f"cannot serialise batch[{name!r}] of type {type(value).__name__}: "
                "a DataProto batch holds tensors only; put other values in non_tensor_batch"
            )
        elif value.is_nested:
            layout = str(value.layout).removeprefix("torch.")
            encoded[name] = (layout, [serialize_single_tensor(row) for row in value.unbind()])
        else:
            encoded[name] = serialize_single_tensor(value)


def _target_device(device: str | None) -> str | None:
    # Restore the sender's device when this process has one of that type,
    # else keep the tensors on CPU (a GPU worker's output read by the driver).
    if device is None or device.startswith("cpu"):
        return device
    kind = device.split(":")[0]
    backend = getattr(torch, kind, None)
    if backend is not None and hasattr(backend, "is_available") and backend.is_available():
        return device
    return "cpu"


def deserialize_tensordict(encoded: tuple[tuple[int, ...], str | None, dict[Any, Any]]) -> TensorDict:
    """Decode the output of :func:`serialize_tensordict`.

    Example::

        >>> td = TensorDict({"x": torch.arange(4)}, batch_size=[4])
        >>> deserialize_tensordict(serialize_tensordict(td))["x"].tolist()
        [0, 1, 2, 3]
    """
    return _decode_tensordict(encoded)[0]


def _decode_tensordict(encoded: tuple[tuple[int, ...], str | None, dict[Any, Any]]) -> tuple[TensorDict, set[int]]:
    """The TensorDict, and the storage addresses of its read-only (aliased) tensors."""
    batch_size, device, items = encoded
    flat: dict[str, torch.Tensor] = {}
    nested: dict[tuple[str, ...], torch.Tensor] = {}
    readonly: set[int] = set()
    for key, value in items.items():
        if len(value) == 2:  # a nested tensor: as_nested_tensor copies the rows
            layout, rows = value
            tensor = torch.nested.as_nested_tensor(
                [_decode_tensor(row)[0] for row in rows], layout=getattr(torch, layout)
            )
        elif len(value) == 3:
            tensor, aliased = _decode_tensor(value)
            if aliased:
                readonly.add(tensor.untyped_storage().data_ptr())
        else:
            raise ValueError(f"cannot decode batch[{key!r}]: expected 2 or 3 fields, got {len(value)}")
        if isinstance(key, tuple):
            nested[key] = tensor
        else:
            flat[key] = tensor
    td = TensorDict(flat, batch_size=batch_size)
    for key, tensor in nested.items():
        td.set(key, tensor)
    target = _target_device(device)
    if target is not None and target != "cpu":
        td = td.to(target)
        readonly = set()  # moved off the shared buffer
    elif target == "cpu":
        td = td.to("cpu")
    return td, readonly
