"""One torch.distributed process group per pool, with collectives that never wait forever.

The workers of a pool form one group: rank 0 opens a rendezvous store on a
free loopback port (:func:`listen`), hands its address to the other ranks
(through the driver, which starts the workers), and every rank calls
:meth:`PoolGroup.join`. The backend string names one backend per device type
(``"cpu:gloo,cuda:nccl"``); device types the machine lacks are dropped.

Every collective runs with the group's timeout. A collective that fails —
a peer died, or one rank never arrived — raises :class:`CollectiveError`
naming the pool, this rank, the collective and, from what every rank recorded
in the store, which rank is dead or where the missing one last was. Collectives
issued inside torch (FSDP2's all-gathers and reduce-scatters) are covered the
same way by wrapping the code that issues them in :meth:`PoolGroup.guard`.

A pool of one has no group (:meth:`PoolGroup.single`): the same methods, and
every collective returns its input.

Example (rank 0 of a 2-worker pool; rank 1 calls ``join`` with ``rank=1`` and
the same address, without ``listener``)::

    listener = listen()                                    # 127.0.0.1, a free port
    address = f"127.0.0.1:{listener.getsockname()[1]}"     # sent to the other ranks
    group = PoolGroup.join("train", rank=0, world_size=2, address=address, listener=listener)
    total = group.all_reduce(torch.tensor([3.0]), name="token count")
    with group.guard("actor update"):                      # FSDP2's own collectives
        loss.backward()
"""

from __future__ import annotations

import datetime
import errno
import os
import socket
import time
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from flowrl.errors import RuntimeFailure
from flowrl.timeouts import COLLECTIVE_S, DIAGNOSE_S, GROUP_JOIN_S
from flowrl.runtime.hangs import collective_line

#: gloo between CPU tensors, NCCL between CUDA tensors
DEFAULT_BACKEND = "cpu:gloo,cuda:nccl"
_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class CollectiveError(RuntimeFailure):
    """A collective of a pool's group failed or timed out on one rank.

    ``pool``, ``rank`` (the rank that raised), ``collective`` (its name) and
    ``reason`` (what the other ranks' records and the backend say). Picklable,
    so a Ray actor's failure reaches the driver intact.
    """

    def __init__(self, pool: str, rank: int, collective: str, reason: str):
        self.pool, self.rank, self.collective, self.reason = pool, rank, collective, reason
        super().__init__(f"pool {pool!r}: collective {collective!r} failed on rank {rank}: {reason}")

    def __reduce__(self):
        return (CollectiveError, (self.pool, self.rank, self.collective, self.reason))


def listen(host: str = "127.0.0.1", port: int = 0, attempts: int = 5) -> socket.socket:
    """A listening socket for the rendezvous store, bound to ``host`` only.

    ``port=0`` takes a free port (no race: the socket holds it until the store
    takes it over). A fixed port that is busy (a previous run's socket in
    TIME_WAIT) is retried ``attempts`` times with a growing pause, then is an
    error that says to pick another.
    """
    for attempt in range(attempts):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
            sock.listen(128)
            return sock
        except OSError as err:
            sock.close()
            if err.errno != errno.EADDRINUSE or attempt == attempts - 1:
                raise RuntimeFailure(f"cannot listen on {host}:{port} for the rendezvous: {err}; "
                                     f"pass port 0 (a free port) or another port") from err
            time.sleep(0.2 * 2 ** attempt)
    raise AssertionError("unreachable")


def backend_for(spec: str = DEFAULT_BACKEND) -> str:
    """``spec`` without the device types this process cannot use (no CUDA → no nccl).

    Example::

        >>> backend_for("cpu:gloo,cuda:nccl")            # on a machine without a GPU
        'cpu:gloo'
    """
    parts = []
    for item in spec.split(","):
        device, sep, backend = item.strip().partition(":")
        if not sep or not backend:
            raise ValueError(f"backend {spec!r}: {item!r} is not 'device:backend' "
                             f"(write e.g. 'cpu:gloo,cuda:nccl')")
        if device == "cuda" and not torch.cuda.is_available():
            continue
        parts.append(f"{device}:{backend}")
    if not parts:
        raise ValueError(f"backend {spec!r} names no device type this machine has; add 'cpu:gloo'")
    return ",".join(parts)


class PoolGroup:
    """The ranks of one pool: collectives with a timeout, failures named.

    Build with :meth:`join` (``world_size > 1``) or :meth:`single`.
    """

    def __init__(self, pool: str, rank: int, world_size: int, timeout_s: float,
                 store: dist.Store | None = None, device_type: str = "cpu") -> None:
        self.pool, self.rank, self.world_size = pool, rank, world_size
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.device_type = device_type
        self._store = store
        self._seq = 0
        self._mesh = None
        self._inside: list[tuple[int, str, float]] = []  # (seq, name, entered at) of the collectives not left
        self._left: tuple[int, str] | None = None  # the last collective left

    @classmethod
    def single(cls, pool: str, device_type: str = "cpu") -> "PoolGroup":
        """A pool of one worker: no process group, every collective is the identity."""
        return cls(pool, 0, 1, timeout_s=0.0, device_type=device_type)

    @classmethod
    def join(cls, pool: str, rank: int, world_size: int, address: str, *,
             backend: str = DEFAULT_BACKEND, timeout_s: float = COLLECTIVE_S, join_timeout_s: float = GROUP_JOIN_S,
             listener: socket.socket | None = None, device_type: str | None = None) -> "PoolGroup":
        """Join the pool's group: rank 0 passes the ``listener`` from :func:`listen`.

        Blocks until all ``world_size`` ranks have joined, at most ``join_timeout_s``
        (starting a worker and importing torch takes seconds); each collective
        after that waits at most ``timeout_s``.
        """
        if world_size == 1:
            return cls.single(pool, device_type or "cpu")
        if (rank == 0) != (listener is not None):
            raise ValueError(f"pool {pool!r}: rank 0, and only rank 0, passes the listener socket")
        host, _, port = address.rpartition(":")
        join_timeout = datetime.timedelta(seconds=join_timeout_s)
        # gloo binds its own sockets to the interface that reaches `host`; keep them on loopback too
        if host in ("127.0.0.1", "localhost"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        # the store takes the socket over: detach it, or Python closes the fd under the store when
        # the socket object is collected (and a later socket reusing the number gets closed with it)
        store = dist.TCPStore(host, int(port), world_size, rank == 0, timeout=join_timeout,
                              wait_for_workers=False,
                              master_listen_fd=listener.detach() if listener is not None else None)
        group = cls(pool, rank, world_size, timeout_s, store,
                    device_type or ("cuda" if torch.cuda.is_available() else "cpu"))
        store.set(f"proc/{rank}", f"{socket.gethostname()}\t{os.getpid()}")
        with group.guard("rendezvous"):
            dist.init_process_group(backend_for(backend), store=dist.PrefixStore("pg", store),
                                    rank=rank, world_size=world_size, timeout=join_timeout)
            group.barrier("rendezvous")
        # every collective from here on, FSDP2's own included, waits at most timeout_s
        _set_timeout(datetime.timedelta(seconds=timeout_s))
        store.set_timeout(group.timeout)
        return group

    @property
    def mesh(self):
        """The pool's 1-D device mesh (built on first use; ``None`` for a pool of one)."""
        if self.world_size == 1:
            return None
        if self._mesh is None:
            self._mesh = init_device_mesh(self.device_type, (self.world_size,))
        return self._mesh

    def set_timeout(self, seconds: float) -> None:
        """How long each collective from now on may wait (call on every rank)."""
        self.timeout = datetime.timedelta(seconds=seconds)
        if self.world_size > 1:
            _set_timeout(self.timeout)
            self._store.set_timeout(self.timeout)

    # -- collectives ------------------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor, name: str = "all_reduce", op: str = "sum") -> torch.Tensor:
        """Reduce ``tensor`` in place over the pool's ranks (``sum``/``max``/``min``) and return it.

        There is no ``avg``: divide the sum yourself (gloo's AVG has silently
        returned wrong results, pytorch#162338).
        """
        if self.world_size > 1:
            with self.guard(name):
                dist.all_reduce(tensor, op=_REDUCE_OPS[op], async_op=True).wait(self.timeout)
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int = 0, name: str = "broadcast") -> torch.Tensor:
        """Overwrite ``tensor`` on every rank with rank ``src``'s copy and return it."""
        if self.world_size > 1:
            with self.guard(name):
                dist.broadcast(tensor, src=src, async_op=True).wait(self.timeout)
        return tensor

    def barrier(self, name: str = "barrier") -> None:
        """Wait until every rank reached the barrier of the same name."""
        if self.world_size > 1:
            with self.guard(name):
                dist.barrier(async_op=True).wait(self.timeout)

    @contextmanager
    def guard(self, name: str) -> Iterator[None]:
        """Run collectives issued inside (by this class or by torch) under the name ``name``.

        Records the arrival in the store (so a failing peer can say where this
        rank was) and turns any failure of the process group — a peer's closed
        connection, a timeout — into a :class:`CollectiveError`.
        """
        if self.world_size == 1:
            yield
            return
        self._seq += 1
        seq, start = self._seq, time.monotonic()
        self._store.set(f"at/{self.rank}", f"{seq}\t{name}")
        self._inside.append((seq, name, start))
        try:
            yield
        except CollectiveError:
            raise
        except (RuntimeError, dist.DistError) as err:
            if not _is_comm_failure(err):
                raise
            waited = time.monotonic() - start
            reason = (f"after {waited:.1f}s (timeout {self.timeout.total_seconds():g}s): {self._diagnose(seq)}; "
                     f"backend said: {str(err).strip().splitlines()[0][:300]}")
            raise CollectiveError(self.pool, self.rank, f"{name} #{seq}", reason) from err
        finally:
            self._inside.pop()
            self._left = (seq, name)

    def where(self) -> str:
        """The collective this rank is inside, or the last it left, as a line for its stacks
        (:func:`flowrl.runtime.hangs.collective_line`, read on a control thread: no lock, no store); ''
        for a pool of one."""
        if self.world_size == 1:
            return ""
        inside = list(self._inside)  # the task thread may enter or leave one meanwhile
        now = (inside[-1][0], inside[-1][1], time.monotonic() - inside[-1][2]) if inside else None
        return collective_line(self.rank, now, self._left)

    def _diagnose(self, seq: int) -> str:
        """Which peers are dead, and where the live ones last were, from the store and /proc."""
        try:
            self._store.set_timeout(datetime.timedelta(seconds=DIAGNOSE_S))
            notes = []
            # a killed peer's sockets close before its process is gone: give it a moment to finish dying
            dying_until = time.monotonic() + DIAGNOSE_S
            for peer in range(self.world_size):
                if peer == self.rank:
                    continue
                host, pid = (self._store.get(f"proc/{peer}").decode().split("\t") + [""])[:2]
                if host == socket.gethostname() and pid and not _alive(int(pid), until=dying_until):
                    notes.append(f"rank {peer} (pid {pid}) is dead")
                    continue
                where = (self._store.get(f"at/{peer}").decode().split("\t", 1)
                         if self._store.check([f"at/{peer}"]) else None)
                if where is None or int(where[0]) < seq:
                    last = f"its last was {where[1]!r} #{where[0]}" if where else "it entered none"
                    notes.append(f"rank {peer} never reached it ({last}): hung, slow or dead")
            return "; ".join(notes) or "every rank reached it"
        except Exception:  # noqa: BLE001 - the store itself lives in rank 0
            return "the rendezvous store (hosted by rank 0) is unreachable: rank 0 is dead or hung"
        finally:
            self._store.set_timeout(self.timeout)

    def close(self) -> None:
        """Leave the group (a failed group is torn down too, so the pool can form a new one)."""
        if self.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()
        self._mesh = None
        self._store = None


def _set_timeout(timeout: datetime.timedelta) -> None:
    """The default timeout of every backend of the default group (gloo and NCCL alike)."""
    dist.distributed_c10d._get_default_group().set_timeout(timeout)


def _is_comm_failure(err: BaseException) -> bool:
    if isinstance(err, dist.DistError):
        return True
    text = str(err).lower()
    return any(s in text for s in ("gloo", "nccl", "timed out", "timeout", "connection", "peer", "socket"))


def _alive(pid: int, until: float = 0.0) -> bool:
    """Whether process ``pid`` (this host) is alive, polling until ``until`` (monotonic) for it to die."""
    while True:
        try:
            with open(f"/proc/{pid}/status") as f:
                state = next((line.split()[1] for line in f if line.startswith("State:")), "")
            if state in ("Z", "X"):
                return False
        except FileNotFoundError:
            return False
        if time.monotonic() >= until:
            return True
        time.sleep(0.05)
