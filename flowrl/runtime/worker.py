"""A worker: one process of a pool, hosting every role of that pool (colocation).

The worker owns the role objects (models, optimizers) and runs a task in three
steps: **assemble** its input — the task's read is a
:class:`~flowrl.data.DataProtoFuture` whose shape comes in the :class:`Call` and
whose shards come resolved as arguments; collecting it runs each producer's
collect (its dispatch mode) and takes the columns, rows and repeat factor the
plan's reads say — and take its rank's part (the task's dispatch mode's split);
**run** the operator, checking it returned its input rows times its declared
expansion, and let the mode tag the output for its collect; **report** what
happened (start, end, weight version, metrics, operator state). The same class
runs in-process (local backend) and as a Ray actor (ray backend).
"""

from __future__ import annotations

import os
import time
import traceback
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from flowrl.data import DataProto, DataProtoFuture
from flowrl.data.dispatch import RowKeys, get_mode
from flowrl.data.expand import RowCountError, check_rows
from flowrl.graph import OperatorSpec, Params
from flowrl.graph.config import OnErrorConfig
from flowrl.store.checkpoint_state import load_states, save_states
from flowrl.runtime.distributed import DEFAULT_BACKEND, PoolGroup, listen
from flowrl.errors import NodeError, RunError, StalenessError
from flowrl.recovery.faults import Fault, Injector, RefillNeeded, fault_from_env, run_guarded
from flowrl.runtime.hangs import thread_stacks
from flowrl.provenance.fingerprints import WeightDigests, source_prints, source_readers, task_prints
from flowrl.plan.pools import RoleBuild
from flowrl.plan.rowspace import input_space

if TYPE_CHECKING:
    from flowrl.plan.planner import Plan


@dataclass(frozen=True)
class RoleContext:
    """What a role factory learns about where it lives."""

    name: str
    rank: int
    world_size: int
    seed: int
    frozen: bool = False
    device: str = "cpu"
    #: the pool's process group (:class:`~flowrl.runtime.distributed.PoolGroup`): every rank of a
    #: pool of N workers on the ray backend; a group of one where the ranks share no group
    group: Any = None


@dataclass
class NodeEntry:
    """What a worker needs to run one node: the operator, its parameters, its
    role, and the node's field renames (graph name → the operator's own name)."""

    op: OperatorSpec
    params: Params
    role: str | None
    inputs: dict[str, str] = field(default_factory=dict)  # graph field → operator field
    outputs: dict[str, str] = field(default_factory=dict)  # operator field → graph field
    name: str = ""  # the node's name, for errors
    on_error: OnErrorConfig | None = None  # the node's failure policy (:mod:`flowrl.recovery.faults`)
    group: int = 1  # input rows per prompt: a group, for on_error drop_group without a uid column
    fault: Fault | None = None  # the fault switch, when it names this node
    fingerprint: bool = False  # report the output's fingerprints (flowrl.provenance.fingerprints)
    source_inputs: tuple[str, ...] = ()  # the data-source fields it is the first to read (it fingerprints them)


def node_entries(plan: Plan) -> dict[str, NodeEntry]:
    """What workers need to run each node of ``plan``'s graph, the fault switch read here, in the driver."""
    graph = plan.graph
    fault = fault_from_env()
    printed = source_readers(graph)
    return {
        n: NodeEntry(node.op, node.params, node.role,
                     inputs={g_name: op_name for op_name, g_name in node.config.inputs.items()},
                     outputs=dict(node.config.outputs), name=n, on_error=node.config.on_error,
                     group=input_space(graph, plan.spaces, n).factor,
                     fault=fault if fault is not None and fault.node == n else None,
                     fingerprint=graph.config.trainer.fingerprints,
                     source_inputs=printed.get(n, ()))
        for n, node in graph.nodes.items()
    }


__all__ = ["DataSourceMismatch", "Runtime", "StepResult"]


@dataclass
class Call:
    """One task on one rank: the plan's task, with the step filled in.

    Positional inputs are ``n_gates`` handles to wait on, then (when ``stateful``)
    the operator's state from the previous step, then the values of the handles
    of ``inputs`` (the task's read, a :meth:`~flowrl.data.DataProtoFuture.shape`), in order.
    """

    node: str
    step: int
    mb: int | None
    inputs: DataProtoFuture | None  # None: the task reads nothing
    n_gates: int = 0
    rank: int = 0
    world: int = 1
    dispatch: str = "driver"  # the registered mode that gives this rank its part
    keys: RowKeys = RowKeys()  # the columns that mode may read
    factor: int = 1  # output rows per input row
    min_version: int | None = None
    stateful: bool = False
    plan: str = "train"  # which plan's node: "train", or "val" for the validation run


@dataclass
class Info:
    """What a task reports back to the driver."""

    node: str
    step: int
    mb: int | None
    pool: str
    rank: int
    pid: int
    start: float
    end: float
    rows: int
    version: int | None
    metrics: dict[str, float] = field(default_factory=dict)
    state: dict[str, Any] | None = None  # a stateful operator's state after this task
    plan: str = "train"  # the plan its task belongs to ("val": the validation run)
    prints: dict[str, Any] | None = None  # fingerprints of the output and the weights used


class NonFiniteOutput(RunError, ValueError):
    """An operator produced NaN or infinity."""


def non_finite(out: DataProto, metrics: dict[str, float]) -> list[str]:
    """Names of metrics and float columns holding NaN or infinity."""
    import math

    import torch

    bad = [f"{k}={v}" for k, v in metrics.items() if not math.isfinite(v)]
    if out.batch is not None:
        for k, t in out.batch.items():
            rows = (~torch.isfinite(t.reshape(len(t), -1))).any(dim=1).nonzero() if t.is_floating_point() else []
            if len(rows):  # the first row, so that it can be found in a dump or a replay
                bad.append(f"{k} (first at row {int(rows[0])} of {len(t)})")
    return bad


class Worker:
    """Hosts the roles of one pool at one rank and runs tasks against them."""

    def __init__(
        self,
        pool: str,
        rank: int,
        world_size: int,
        roles: list[RoleBuild],
        nodes: dict[str, dict[str, NodeEntry]],
        seed: int = 0,
        threads: int = 1,
        gpus: float = 0.0,
        distributed: bool = False,
        first_process: bool = True,
    ) -> None:
        """``distributed``: the pool's ranks form a process group, so the roles are built
        by :meth:`join_group` once every rank has started (rank 0 first calls :meth:`listen`).
        ``nodes``: per plan (``train``, ``val``), what running each of its nodes needs.
        ``first_process``: False for a worker that replaces a dead one (a ``kill`` fault fires once)."""
        import torch

        self.threads = max(1, threads)
        torch.set_num_threads(self.threads)
        self.pool, self.rank, self.world_size = pool, rank, world_size
        self.label = f"{pool}[{rank}] (pid {os.getpid()})"
        self.nodes = nodes
        self.roles: dict[str, Any] = {}
        self.owner: dict[str, str] = {}  # role → the role whose object (and weights) it uses
        self.versions: dict[str, int] = {}
        self._builds, self._seed, self._gpus = roles, seed, gpus
        self._listener = None
        self._faults = {(plan, n): Injector(e.fault, first_process) for plan, es in nodes.items()
                        for n, e in es.items() if e.fault is not None}
        self.digests = WeightDigests()
        self.group = PoolGroup.single(pool, _device(gpus))
        if not (distributed and world_size > 1):
            self._build_roles()

    def listen(self, host: str = "127.0.0.1") -> str:
        """Rank 0: open the rendezvous on a free port of ``host`` (loopback unless the pool spans
        machines); the address the other ranks join."""
        self._listener = listen(host)
        return f"{host}:{self._listener.getsockname()[1]}"

    def join_group(self, address: str, backend: str = DEFAULT_BACKEND, timeout_s: float = 300.0) -> int:
        """Join the pool's process group at ``address`` (every rank at once), then build the roles on it."""
        try:
            self.group = PoolGroup.join(self.pool, self.rank, self.world_size, address, backend=backend,
                                        timeout_s=timeout_s, listener=self._listener, device_type=_device(self._gpus))
        finally:
            self._listener = None
        self._build_roles()
        return os.getpid()

    def _build_roles(self) -> None:
        for rb in self._builds:
            if rb.shares is not None:
                self.roles[rb.name] = self.roles[rb.shares]
                self.owner[rb.name] = self.owner[rb.shares]
                continue
            ctx = RoleContext(rb.name, self.rank, self.world_size, self._seed, rb.frozen, _device(self._gpus),
                              self.group)
            try:
                self.roles[rb.name] = rb.factory(rb.config, ctx)
            except Exception as e:
                raise NodeError(f"<role {rb.name}>", -1, None, self.label,
                                f"building role {rb.name!r} ({rb.kind}) failed: {type(e).__name__}: {e}",
                                traceback.format_exc()) from None
            self.owner[rb.name] = rb.name
            self.versions[rb.name] = 0
            self._set_version(rb.name)

    # ------------------------------------------------------------------ tasks
    def execute(self, call: Call, *inputs: Any) -> tuple[DataProto, Info]:
        """Assemble → run → report one task (see the module docstring)."""
        import torch

        # OpenMP's thread count is per OS thread: a task may run on a thread other than
        # the one that built this worker (local backend, threaded driver actor), and
        # two spinning threads per process on shared cores run many times slower
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        start = time.time()
        entry = self.nodes[call.plan][call.node]
        role_obj = self.roles.get(entry.role) if entry.role else None
        version = self.versions[self.owner[entry.role]] if entry.role else None
        state = prints = None
        try:
            if call.min_version is not None and version is not None and version < call.min_version:
                raise StalenessError(
                    f"role {entry.role!r} is at weight version {version}, but step {call.step} may use "
                    f"no older than {call.min_version}"
                )
            shards = inputs[call.n_gates:]
            if call.stateful:
                state = self._state_in(entry, shards[0])
                shards = shards[1:]
            mode = get_mode(call.dispatch)
            whole = call.inputs.collect(shards) if call.inputs is not None else DataProto()
            batch, tags = mode.split(whole, call.rank, call.world, call.keys)
            if state is not None:
                batch.meta_info[entry.op.state.key] = state
            printing = entry.fingerprint and call.plan == "train"  # training steps only
            used = self._digest(entry.role) if printing and entry.role else None
            source = source_prints(batch, entry.source_inputs) if printing else {}
            inject = self._faults.get((call.plan, call.node))

            def run(rows: DataProto) -> tuple[DataProto, dict[str, float]]:
                if inject is not None:
                    inject(call.node, call.step, call.rank, call.mb)
                return self._run(entry, role_obj, rows)

            out, metrics = run_guarded(run, batch, entry.on_error, entry.group, call.factor,
                                       (call.node, call.step, call.mb))
            out = mode.tag(out, tags, call.factor)
            if state is not None:
                batch.meta_info.pop(entry.op.state.key, None)
            if entry.op.updates_role:
                owner = self.owner[entry.role]
                self.versions[owner] += 1
                self._set_version(owner)
            if printing:  # after the update moved the version: "after" is the new weights' digest
                after = self._digest(entry.role) if entry.op.updates_role and used is not None else None
                prints = task_prints(out, batch, source, entry.role, used, after)
        except RefillNeeded:
            raise  # the driver refills the step (flowrl.recovery.refill)
        except (StalenessError, NonFiniteOutput, RowCountError) as e:
            raise NodeError(call.node, call.step, call.mb, self.label, str(e)) from None
        except Exception as e:
            raise NodeError(call.node, call.step, call.mb, self.label, f"{type(e).__name__}: {e}",
                            traceback.format_exc()) from None
        info = Info(call.node, call.step, call.mb, self.pool, self.rank, os.getpid(), start, time.time(),
                    len(batch), version, metrics, state, call.plan, prints)
        return out, info

    def _digest(self, role: str) -> str | None:
        owner = self.owner[role]
        return self.digests.of(owner, self.versions[owner], self.roles[owner])

    def _run(self, entry: NodeEntry, role_obj: Any, batch: DataProto) -> tuple[DataProto, dict[str, float]]:
        """The operator on ``batch`` (graph field names in and out), its output checked."""
        rows_in = len(batch)
        if entry.inputs:
            batch.rename(list(entry.inputs), list(entry.inputs.values()))
        out, metrics = entry.op.run(role_obj, batch, entry.params)
        if entry.outputs:
            out.rename(list(entry.outputs), list(entry.outputs.values()))
        if out.batch is not None or out.non_tensor_batch:  # an output with rows (not only metadata)
            check_rows(entry.name, rows_in, entry.op.expansion(entry.params), len(out))
        bad = non_finite(out, metrics)
        if bad:  # stop here, before any consumer (an update) uses it
            raise NonFiniteOutput(f"non-finite values in {', '.join(bad)}")
        return out, metrics

    @staticmethod
    def _state_in(entry: NodeEntry, previous: Any) -> dict[str, Any]:
        """The operator state this task starts from: the previous task's report, a
        restored value, or (first step) the declared initial state."""
        if isinstance(previous, Info):
            previous = previous.state
        return dict(previous) if previous is not None else dict(entry.op.state.init(entry.params))

    # ------------------------------------------------------------------ weights
    def get_weights(self, role: str) -> tuple[Any, int]:
        """The weights of ``role`` and their version."""
        obj = self.roles[role]
        weights = obj.get_weights() if hasattr(obj, "get_weights") else obj.state_dict()
        return weights, self.versions[self.owner[role]]

    def set_weights(self, role: str, payload: tuple[Any, int]) -> Info:
        start = time.time()
        weights, version = payload
        obj = self.roles[role]
        if hasattr(obj, "set_weights"):
            obj.set_weights(weights)
        else:
            obj.load_state_dict(weights)
        owner = self.owner[role]
        self.versions[owner] = version
        self._set_version(owner)
        self.digests.forget(owner)
        # what the invariants compare with what the update left
        arrived = self._digest(role) if any(e.fingerprint for e in self.nodes.get("train", {}).values()) else None
        return Info(f"sync:{role}", -1, None, self.pool, self.rank, os.getpid(), start, time.time(), 0, version,
                    prints={"role": role, "digest": arrived} if arrived is not None else None)

    def get_state(self, shards: str | None = None) -> dict[str, Any]:
        """Every role's state and weight version, for a checkpoint: the roles' tensors written
        under ``shards`` (with the other ranks of the pool: a collective), the rest returned.

        Queued like any task, so it captures the state exactly between two tasks."""
        if shards is None:
            raise ValueError("get_state writes the roles' tensors to a directory: pass shards=")
        roles = {name: self.roles[name] for name in self._stateful()}
        return {"roles": save_states(shards, roles, self.group, self.rank), "versions": dict(self.versions)}

    def set_state(self, state: dict[str, Any], shards: str | None = None, own: bool = True) -> int:
        """Load :meth:`get_state`'s output (``shards``: the checkpoint it was written into);
        ``own``: written by this very rank (else by another rank of the pool, whose per-rank
        parts, such as its sampling stream, are not taken)."""
        load_states(shards, self.roles, state["roles"], self.group, self.rank, own)
        self.digests.forget()
        self.versions.update(state["versions"])
        for owner in self.versions:
            self._set_version(owner)
        return len(state["roles"])

    def _stateful(self) -> list[str]:
        """The roles this worker owns that have a state to checkpoint."""
        return [name for name, owner in self.owner.items()
                if owner == name and hasattr(self.roles[name], "state_dict")]

    def held_bytes(self) -> dict[str, dict[str, int]]:
        """Per role that can say: the bytes of parameters and optimizer state this rank holds."""
        return {name: self.roles[name].held_bytes() for name, owner in self.owner.items()
                if owner == name and hasattr(self.roles[name], "held_bytes")}

    def ping(self) -> int:
        return os.getpid()

    def stacks(self) -> str:
        """Every thread's Python stack in this process (asked on a control thread while a task may be stuck),
        headed by the collective of the pool's group it is inside, if any."""
        return self.group.where() + thread_stacks()

    def _set_version(self, owner: str) -> None:
        for name, o in self.owner.items():
            if o == owner:
                try:
                    setattr(self.roles[name], "version", self.versions[owner])
                except AttributeError:
                    pass


def _device(gpus: float) -> str:
    """``cuda`` when this worker was given a GPU (Ray sets CUDA_VISIBLE_DEVICES), else ``cpu``."""
    if gpus > 0:
        import torch

        if torch.cuda.is_available():
            return "cuda"
    return "cpu"
