"""DataProtoFuture: a batch that is still being computed, passed around unread.

A future is a list of shards — handles (Ray ``ObjectRef``s, or any backend's
handles), one per worker that produced part of the batch, or nested futures —
plus how to turn the shards into the DataProto a consumer wants:

* ``collect_fn`` merges the shards (default: :meth:`DataProto.concat`); the
  output of a task carries its dispatch mode's collect
  (:mod:`flowrl.data.dispatch`), so its ranks' outputs become one result,
* ``columns`` (optional) narrows every handle's shard to the columns read
  before anything is merged, so merging copies only what is read,
* ``dispatch_fn`` (optional) then picks this consumer's part of it — e.g.
  "chunk into 4 and take part 2", or "rows 8 to 16, each repeated 4 times".

Passing a future to a Ray task or actor method does **not** make the driver
wait: a future pickles as its refs (Ray resolves only top-level ``ObjectRef``
arguments, never refs nested inside an object), so the consumer is submitted
at once and calls :meth:`get` itself, where the data is needed. The runtime
instead hands a task the future's :meth:`shape` and its :meth:`handles` as
top-level arguments; the worker gets the resolved values and calls
:meth:`collect` — the same collect as :meth:`get`, without a fetch.

``import flowrl.data`` does not import Ray; a future imports it when it
resolves or creates refs.

Example (a producer on one worker, a consumer on another; the driver never reads)::

    @ray.remote
    def produce() -> DataProto: ...

    @ray.remote
    def consume(batch: DataProtoFuture) -> int:
        return len(batch.get())          # resolved inside the worker

    fut = DataProtoFuture.concat([produce.remote(), produce.remote()])
    ray.get([consume.remote(part) for part in fut.chunk(2)])
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence, Union

from flowrl.data.dispatch import narrow
from flowrl.data.proto import DataProto, DataProtoError
from flowrl.data.serialize import get_readonly_policy, readonly_policy

if TYPE_CHECKING:
    from ray import ObjectRef

__all__ = ["DataProtoFuture", "resolve"]

Shard = Union["ObjectRef", "DataProtoFuture"]


def _take_chunk(data: DataProto, index: int, chunks: int, then: Callable[[DataProto], DataProto] | None) -> DataProto:
    """Dispatch function of :meth:`DataProtoFuture.chunk`: part ``index`` of ``chunks``."""
    if then is not None:
        data = then(data)
    return data.chunk(chunks)[index]


class DataProtoFuture:
    """Shards of a batch in Ray's object store, and how to assemble them.

    Args:
        futures: one ``ObjectRef`` (to a DataProto) or nested DataProtoFuture per shard.
        collect_fn: merges the resolved shards; ``None`` means :meth:`DataProto.concat`.
        dispatch_fn: applied to the collected batch, e.g. to take one chunk of it.
        columns: the columns taken from each handle's shard before collecting (``None``: all).

    Example::

        fut = DataProtoFuture([ref0, ref1])               # collect = concat
        half = fut.chunk(2)[0]                            # lazy: just [ref0]
        batch = half.get()                                # a DataProto
    """

    def __init__(
        self,
        futures: Sequence[Shard],
        collect_fn: Callable[[list[DataProto]], DataProto] | None = None,
        dispatch_fn: Callable[[DataProto], DataProto] | None = None,
        columns: tuple[str, ...] | None = None,
    ) -> None:
        self.futures: list[Shard] = list(futures)
        if not self.futures:
            raise DataProtoError("DataProtoFuture needs at least one shard (an ObjectRef or DataProtoFuture)")
        self.collect_fn = collect_fn
        self.dispatch_fn = dispatch_fn
        self.columns = tuple(columns) if columns is not None else None

    # ------------------------------------------------------------ build
    @staticmethod
    def concat(data: Sequence[Shard]) -> DataProtoFuture:
        """A future of the concatenation of ``data`` (ObjectRefs and/or futures).

        Futures that are themselves plain concatenations are flattened, so
        chunking the result can still hand out whole shards.
        """
        flat: list[Shard] = []
        for item in data:
            if isinstance(item, DataProtoFuture) and item._is_plain_concat():
                flat.extend(item.futures)
            else:
                flat.append(item)
        return DataProtoFuture(flat)

    @staticmethod
    def put(data: DataProto, chunks: int = 1) -> DataProtoFuture:
        """Put ``data`` into Ray's object store as ``chunks`` shards (zero-copy for tensors).

        Example::

            fut = DataProtoFuture.put(batch, chunks=2)    # two ObjectRefs
        """
        import ray

        parts = data.chunk(chunks) if chunks > 1 else [data]
        return DataProtoFuture([ray.put(part) for part in parts])

    def _is_plain_concat(self) -> bool:
        return self.dispatch_fn is None and self.columns is None and self.collect_fn in (None, DataProto.concat)

    def select(self, columns: Sequence[str]) -> DataProtoFuture:
        """The same future reading only ``columns`` of its shards (narrowed before they are
        merged, so merging copies only what is read; a dispatch mode's own tag columns stay)."""
        return DataProtoFuture(self.futures, self.collect_fn, self.dispatch_fn, tuple(columns))

    # ------------------------------------------------------------ derive
    def chunk(self, chunks: int) -> list[DataProtoFuture]:
        """``chunks`` futures, part ``i`` being ``self.get().chunk(chunks)[i]``.

        Lazy where possible: when this future is a plain concatenation whose
        shard count divides by ``chunks``, part ``i`` is just the ``i``-th group
        of shards — no shard is fetched by a consumer that does not need it.
        That equals ``get().chunk(chunks)[i]`` when the shards have equal
        lengths (the outputs of an evenly dispatched node); with unequal shards
        each part still holds whole shards, in order. Otherwise every part
        fetches the whole batch and takes its chunk (verl's behaviour).
        """
        if not isinstance(chunks, int) or chunks < 1:
            raise DataProtoError(f"DataProtoFuture.chunk: chunks must be a positive int, got {chunks!r}")
        n = len(self.futures)
        if self._is_plain_concat() and n % chunks == 0:
            per = n // chunks
            return [DataProtoFuture(self.futures[i * per : (i + 1) * per]) for i in range(chunks)]
        return [
            DataProtoFuture(
                self.futures,
                collect_fn=self.collect_fn,
                dispatch_fn=functools.partial(_take_chunk, index=i, chunks=chunks, then=self.dispatch_fn),
                columns=self.columns,
            )
            for i in range(chunks)
        ]

    def object_refs(self) -> list[ObjectRef]:
        """Every ObjectRef this future depends on (nested futures flattened), e.g. for ``ray.wait``."""
        refs: list[ObjectRef] = []
        for item in self.futures:
            refs.extend(item.object_refs() if isinstance(item, DataProtoFuture) else [item])
        return refs

    def handles(self) -> list[Any]:
        """Every handle this future depends on, nested futures flattened, in the order
        :meth:`collect` takes their values."""
        return self.object_refs()

    def shape(self) -> DataProtoFuture:
        """This future without its handles (each replaced by ``None``): what it does with its
        shards, small to send; :meth:`collect` it with the handles' values."""
        return DataProtoFuture([item.shape() if isinstance(item, DataProtoFuture) else None
                                for item in self.futures], self.collect_fn, self.dispatch_fn, self.columns)

    # ------------------------------------------------------------ resolve
    def collect(self, values: Sequence[DataProto]) -> DataProto:
        """The batch this future stands for, given the values of its :meth:`handles` (in that
        order): each level narrows its shards to its columns, collects, then dispatches."""
        it = iter(values)
        out = self._collect(it)
        if next(it, None) is not None:
            raise DataProtoError(f"DataProtoFuture.collect got more values than its {len(self.handles())} handles")
        return out

    def _collect(self, values: Iterator[DataProto]) -> DataProto:
        parts = []
        for i, item in enumerate(self.futures):
            if isinstance(item, DataProtoFuture):
                part = item._collect(values)
            else:
                part = next(values, None)
                if part is None:
                    raise DataProtoError("DataProtoFuture.collect got fewer values than its handles")
                if self.columns is not None and isinstance(part, DataProto):
                    part = narrow(part, self.columns)
            if not isinstance(part, DataProto):
                raise DataProtoError(
                    f"DataProtoFuture shard {i} resolved to a {type(part).__name__}, not a DataProto; "
                    "the producing task must return a DataProto"
                )
            parts.append(part)
        if self.collect_fn is None and len(parts) == 1:
            out = parts[0]
        else:
            out = (self.collect_fn or DataProto.concat)(parts)
        if self.dispatch_fn is not None:
            out = self.dispatch_fn(out)
        if not isinstance(out, DataProto):
            raise DataProtoError(f"DataProtoFuture: collect/dispatch returned a {type(out).__name__}, not a DataProto")
        return out

    def get(self) -> DataProto:
        """Fetch the shards, collect, dispatch; returns the DataProto.

        Follows the read-only policy (:mod:`flowrl.data.serialize`): under the
        default ``"view"``, columns still on the object store's memory are
        listed in ``readonly_keys``; under ``"copy"``, only the columns that
        collect/dispatch left aliased are copied (a concat of several shards
        already made fresh memory, so nothing more is copied).
        """
        import ray

        policy = get_readonly_policy()
        with readonly_policy("view"):
            values = ray.get(self.handles())
        readonly: frozenset[int] = frozenset()
        for part in values:
            if isinstance(part, DataProto):
                readonly |= part._readonly
        out = self.collect(values)
        # Whatever collect/dispatch did, a column still on a shard's read-only
        # buffer is found by its storage address.
        out._readonly = out._readonly | readonly
        return out.to_writable() if policy == "copy" else out

    def __repr__(self) -> str:
        collect = "concat" if self.collect_fn in (None, DataProto.concat) else getattr(self.collect_fn, "__name__", repr(self.collect_fn))
        text = f"DataProtoFuture({len(self.futures)} shard(s), collect={collect}"
        if self.columns is not None:
            text += f", columns={', '.join(self.columns)}"
        fn = self.dispatch_fn
        if isinstance(fn, functools.partial) and fn.func is _take_chunk:
            text += f", dispatch=chunk {fn.keywords['index']}/{fn.keywords['chunks']}"
        elif fn is not None:
            text += f", dispatch={getattr(fn, '__name__', repr(fn))}"
        return text + ")"


def resolve(value: Any) -> Any:
    """Replace every DataProtoFuture in ``value`` (nested in lists, tuples, dicts) by its DataProto.

    What a worker calls on the arguments it received.

    Example::

        args, kwargs = resolve(args), resolve(kwargs)
    """
    if isinstance(value, DataProtoFuture):
        return value.get()
    if isinstance(value, list):
        return [resolve(v) for v in value]
    if isinstance(value, tuple):
        return tuple(resolve(v) for v in value)
    if isinstance(value, dict):
        return {k: resolve(v) for k, v in value.items()}
    return value
