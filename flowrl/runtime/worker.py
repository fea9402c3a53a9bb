"""A worker: one process of a pool, hosting every role of that pool (colocation).

The worker owns the role objects (models, optimizers) and runs a task in three
steps: **assemble** its input — the task's read is a
:class:`~flowrl.data.DataProtoFuture` whose shape comes in the :class:`Call` and
whose shards come resolved as arguments; collecting it runs each producer's
collect (its dispatch mode) and takes the columns, rows and repeat factor the
plan's reads say — and take its rank's part (the task's dispatch mode's split);
**run** the operator, checking it returned its input rows times its declared
expansion, and let the mode tag the output for its collect; **report** what
happened (weight version, metrics, operator state, and what each hook adds). What
cuts across every task — timing, fingerprints, the node's ``on_error`` policy, the
fault switch — runs as the node's hooks (:mod:`flowrl.runtime.hooks`), registered by
their wings and built here once per worker. The same class runs in-process (local
backend) and as a Ray actor (ray backend).
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
from flowrl.graph import OperatorSpec, Params, Role, Stateful
from flowrl.graph.role import RoleContext
from flowrl.timeouts import COLLECTIVE_S
from flowrl.store.checkpoint_state import load_states, save_states
from flowrl.runtime.distributed import DEFAULT_BACKEND, PoolGroup, listen
from flowrl.errors import NodeError, RefillNeeded, RunError, StalenessError
from flowrl.runtime.hangs import thread_stacks
from flowrl.runtime.hooks import HookSpec, TaskHook, TaskRun, Timing, hook_specs, wrapped
from flowrl.plan.pools import RoleBuild

if TYPE_CHECKING:
    from flowrl.plan.planner import Plan


@dataclass
class NodeEntry:
    """What a worker needs to run one node: the operator, its parameters, its
    role, the node's field renames (graph name → the operator's own name) and the
    hooks its tasks run with (:mod:`flowrl.runtime.hooks`)."""

    op: OperatorSpec
    params: Params
    role: str | None
    inputs: dict[str, str] = field(default_factory=dict)  # graph field → operator field
    outputs: dict[str, str] = field(default_factory=dict)  # operator field → graph field
    name: str = ""  # the node's name, for errors
    hooks: tuple[HookSpec, ...] = ()  # built once per worker, in this order (the first wraps the others)


def node_entries(plan: Plan) -> dict[str, NodeEntry]:
    """What workers need to run each node of ``plan``'s graph, with the hooks the registered
    providers give it (:func:`~flowrl.runtime.hooks.hook_specs`)."""
    hooks = hook_specs(plan)
    return {
        n: NodeEntry(node.op, node.params, node.role,
                     inputs={g_name: op_name for op_name, g_name in node.config.inputs.items()},
                     outputs=dict(node.config.outputs), name=n, hooks=hooks.get(n, ()))
        for n, node in plan.graph.nodes.items()
    }


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
        self.first_process = first_process
        self._hooks = self._build_hooks(nodes)
        self.group = PoolGroup.single(pool, _device(gpus))
        if not (distributed and world_size > 1):
            self._build_roles()

    def listen(self, host: str = "127.0.0.1") -> str:
        """Rank 0: open the rendezvous on a free port of ``host`` (loopback unless the pool spans
        machines); the address the other ranks join."""
        self._listener = listen(host)
        return f"{host}:{self._listener.getsockname()[1]}"

    def join_group(self, address: str, backend: str = DEFAULT_BACKEND, timeout_s: float = COLLECTIVE_S) -> int:
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
            if rb.view is not None:  # its own weight version (the frozen base's: 0), nothing to checkpoint
                self.roles[rb.name] = self.roles[rb.shares].frozen_view()
                self.owner[rb.name], self.versions[rb.name] = rb.name, 0
                continue
            if rb.shares is not None:
                self.roles[rb.name] = self.roles[rb.shares]
                self.owner[rb.name] = self.owner[rb.shares]
                continue
            ctx = RoleContext(rb.name, self.rank, self.world_size, self._seed, rb.frozen, _device(self._gpus),
                              self.group)
            try:
                obj = rb.factory(rb.config, ctx)
            except Exception as e:
                raise NodeError(f"<role {rb.name}>", -1, None, self.label,
                                f"building role {rb.name!r} ({rb.kind}) failed: {type(e).__name__}: {e}",
                                traceback.format_exc()) from None
            if not isinstance(obj, Role):
                raise NodeError(f"<role {rb.name}>", -1, None, self.label,
                                f"role kind {rb.kind!r} built a {type(obj).__name__}, which is not a "
                                f"flowrl.graph.Role: derive it from Role, the contract the worker calls")
            self.roles[rb.name] = obj
            self.owner[rb.name] = rb.name
            self.versions[rb.name] = 0
            self._set_version(rb.name)

    def _build_hooks(self, nodes: dict[str, dict[str, NodeEntry]]) -> dict[tuple[str, str], list[TaskHook]]:
        """Each node's hooks, timing first. Each spec is built once for this worker: nodes that share a
        spec share its hook (one digest cache of the weights, one count of a fault's firings)."""
        built: dict[int, TaskHook] = {}
        for entries in nodes.values():
            for entry in entries.values():
                for spec in entry.hooks:
                    if id(spec) not in built:
                        built[id(spec)] = spec.build(self)
        self._loaded_hooks = list(built.values())
        timing = Timing()
        return {(plan, n): [timing, *(built[id(spec)] for spec in e.hooks)]
                for plan, entries in nodes.items() for n, e in entries.items()}

    # ------------------------------------------------------------------ tasks
    def execute(self, call: Call, *inputs: Any) -> tuple[DataProto, Info]:
        """Assemble → run → report one task (see the module docstring), through the node's hooks."""
        hooks = self._hooks[(call.plan, call.node)]
        task = TaskRun(call, self.nodes[call.plan][call.node])
        try:
            for hook in hooks:
                hook.before(task)
            state, tags = self._assemble(task, inputs)
            run = wrapped(hooks, task, lambda rows: self._run(task.entry, task.role, rows))
            out, metrics = run(task.batch)
            out, moved = self._settle(task, out, state, tags)
            metrics = {**metrics, **moved}
            report = {k: v for hook in hooks for k, v in hook.after(task, out).items()}
        except RefillNeeded:
            raise  # a request to the driver (flowrl.recovery.refill), not a failure of the node
        except (StalenessError, NonFiniteOutput, RowCountError) as e:
            raise NodeError(call.node, call.step, call.mb, self.label, str(e)) from None
        except Exception as e:
            raise NodeError(call.node, call.step, call.mb, self.label, f"{type(e).__name__}: {e}",
                            traceback.format_exc()) from None
        info = Info(call.node, call.step, call.mb, self.pool, self.rank, os.getpid(), rows=len(task.batch),
                    version=task.version, metrics=metrics, state=state, plan=call.plan, **report)
        return out, info

    def _assemble(self, task: TaskRun, inputs: tuple[Any, ...]) -> tuple[dict[str, Any] | None, Any]:
        """``task``'s input (its rank's part of the collected read, the operator state put in), role and
        weight version, checked against the plan's minimum; the state and the split's tags."""
        import torch

        # OpenMP's thread count is per OS thread: a task may run on a thread other than
        # the one that built this worker (local backend, threaded driver actor), and
        # two spinning threads per process on shared cores run many times slower
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        call, entry = task.call, task.entry
        task.role = self.roles.get(entry.role) if entry.role else None
        task.version = self.versions[self.owner[entry.role]] if entry.role else None
        if call.min_version is not None and task.version is not None and task.version < call.min_version:
            raise StalenessError(f"role {entry.role!r} is at weight version {task.version}, but step {call.step} "
                                 f"may use no older than {call.min_version}")
        shards = inputs[call.n_gates:]
        state = self._state_in(entry, shards[0]) if call.stateful else None
        reads = shards[1:] if call.stateful else shards
        whole = call.inputs.collect(reads) if call.inputs is not None else DataProto()
        task.batch, tags = get_mode(call.dispatch).split(whole, call.rank, call.world, call.keys)
        if state is not None:
            task.batch.meta_info[entry.op.state.key] = state
        return state, tags

    def _settle(self, task: TaskRun, out: DataProto, state: dict[str, Any] | None,
                tags: Any) -> tuple[DataProto, dict[str, float]]:
        """``out`` tagged for its mode's collect; the operator state taken back out of the input; an
        update's weight version moved (the worker decides it; the role is told, and reports what its
        engines did with it)."""
        out = get_mode(task.call.dispatch).tag(out, tags, task.call.factor)
        if state is not None:
            task.batch.meta_info.pop(task.entry.op.state.key, None)
        if not task.entry.op.updates_role:
            return out, {}
        owner = self.owner[task.entry.role]
        self.versions[owner] += 1
        return out, self._set_version(owner)

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
        """The weights of ``role`` and their version (what another pool's :meth:`set_weights` loads)."""
        return self.roles[role].get_weights(), self.versions[self.owner[role]]

    def set_weights(self, role: str, payload: tuple[Any, int], step: int | None = None) -> Info:
        """Load ``(weights, version)`` from another pool's :meth:`get_weights` into ``role`` (for a task of
        0-based ``step``, when told): the version they carry becomes this worker's for it, and the role is
        told it."""
        if step is not None:
            for hook in self._loaded_hooks:
                hook.entering("sync", step, self.rank)
        start = time.time()
        weights, version = payload
        self.roles[role].set_weights(weights)
        owner = self.owner[role]
        self.versions[owner] = version
        self._set_version(owner)
        report = {k: v for hook in self._loaded_hooks for k, v in hook.loaded(role).items()}
        return Info(f"sync:{role}", -1, None, self.pool, self.rank, os.getpid(), start, time.time(), 0, version,
                    **report)

    def get_state(self, shards: str | None = None, step: int | None = None) -> dict[str, Any]:
        """Every role's state and weight version, for a checkpoint (of 0-based ``step``, when told): the
        roles' tensors written under ``shards`` (with the other ranks of the pool: a collective), the
        rest returned.

        Queued like any task, so it captures the state exactly between two tasks."""
        if shards is None:
            raise ValueError("get_state writes the roles' tensors to a directory: pass shards=")
        if step is not None:
            for hook in self._loaded_hooks:
                hook.entering("checkpoint", step, self.rank)
        roles = {name: self.roles[name] for name in self._stateful()}
        return {"roles": save_states(shards, roles, self.group, self.rank), "versions": dict(self.versions)}

    def set_state(self, state: dict[str, Any], shards: str | None = None, own: bool = True) -> int:
        """Load :meth:`get_state`'s output (``shards``: the checkpoint it was written into);
        ``own``: written by this very rank (else by another rank of the pool, whose per-rank
        parts, such as its sampling stream, are not taken)."""
        load_states(shards, self.roles, state["roles"], self.group, self.rank, own)
        for hook in self._loaded_hooks:
            hook.loaded(None)
        # the run goes on from the versions it saved: the next update moves each one up by one
        self.versions.update(state["versions"])
        for owner in self.versions:
            self._set_version(owner)
        return len(state["roles"])

    def _owned(self) -> list[str]:
        """The roles whose objects this worker built (a role sharing another's object is not one)."""
        return [name for name, owner in self.owner.items() if owner == name]

    def _stateful(self) -> list[str]:
        """The roles this worker owns that have a state to checkpoint."""
        return [name for name in self._owned() if isinstance(self.roles[name], Stateful)]

    def held_bytes(self) -> dict[str, dict[str, int]]:
        """Per role that holds any: the bytes of parameters and optimizer state this rank holds."""
        held = {name: self.roles[name].held_bytes() for name in self._owned()}
        return {name: b for name, b in held.items() if b}

    def ping(self) -> int:
        return os.getpid()

    def stacks(self) -> str:
        """Every thread's Python stack in this process (asked on a control thread while a task may be stuck),
        headed by the collective of the pool's group it is inside, if any."""
        return self.group.where() + thread_stacks()

    def _set_version(self, owner: str) -> dict[str, float]:
        """Tell ``owner`` the version of the weights it now holds (this worker's count, the only
        one); the metrics of handing them on (a rollout engine's push) are the task's."""
        return self.roles[owner].set_version(self.versions[owner])


def _device(gpus: float) -> str:
    """``cuda`` when this worker was given a GPU (Ray sets CUDA_VISIBLE_DEVICES), else ``cpu``."""
    if gpus > 0:
        import torch

        if torch.cuda.is_available():
            return "cuda"
    return "cpu"
