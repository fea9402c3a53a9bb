"""Worker-task hooks: what runs with every task without being the task (Hamilton's lifecycle adapters).

A worker runs a task as assemble → run → report (:meth:`~flowrl.runtime.worker.Worker.execute`).
Work that cuts across every task — fingerprints (:mod:`flowrl.provenance.fingerprints`), a node's
``on_error`` policy and the fault switch (:mod:`flowrl.recovery.faults`), timing (here) — is a
:class:`TaskHook` with four points, each a no-op unless the hook overrides it:

* :meth:`~TaskHook.before`: the task arrived, its input not assembled yet;
* :meth:`~TaskHook.around`: wraps the operator call once the input is assembled (``task.batch``):
  a failure policy runs it again, the fault switch fires inside it. The first hook of a task's
  list is the outermost wrapper;
* :meth:`~TaskHook.after`: the output is made and tagged, weight versions moved; returns the
  fields the hook adds to the task's report (an :class:`~flowrl.runtime.worker.Info`);
* :meth:`~TaskHook.loaded`: weights arrived from another pool (or every role from a checkpoint);
  returns what the hook adds to that load's report.

Hooks cross to worker processes as :class:`HookSpec`\\ s: picklable (a Ray actor unpickles one and
imports its wing), carried per node in :class:`~flowrl.runtime.worker.NodeEntry` ``.hooks``; each
worker builds each spec once (``spec.build(worker)``), so a hook keeps per-worker state (a digest
cache, a fault's count of firings). A wing offers its hooks by registering a provider with
:func:`task_hooks`: called on the driver for each plan, it returns the spec each node runs with.
A wing's providers register when its module is imported; every module named in the
``flowrl.hooks`` entry-point group (flowrl's own: fingerprints, then the failure policies and the
fault switch; a plugin may add its own) is imported before the first plan's hooks are asked for,
so a :class:`~flowrl.runtime.scheduler.Runtime` built without the run wing runs the same hooks.

Example::

    @task_hooks
    def _timing_of_updates(plan):                    # node → spec, for the nodes it applies to
        return {n: UpdateTimer() for n, node in plan.graph.nodes.items() if node.updates_role}
"""

from __future__ import annotations

import abc
import importlib
import time
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, Callable, Mapping

if TYPE_CHECKING:  # the worker imports this module; hooks only read its types
    from flowrl.data import DataProto
    from flowrl.plan.planner import Plan
    from flowrl.runtime.worker import Call, NodeEntry, Worker

#: an operator call on some rows: (output, metrics)
Run = Callable[["DataProto"], tuple["DataProto", dict[str, float]]]


@dataclass
class TaskRun:
    """One task as its hooks see it: the call, the node, the role and weight version it runs on,
    its assembled input (``batch``, None before) and ``notes``, where a hook keeps what it
    carries from one point of this task to the next (tasks of one worker may run at once)."""

    call: "Call"
    entry: "NodeEntry"
    role: Any = None
    version: int | None = None
    batch: "DataProto | None" = None
    notes: dict[Any, Any] = field(default_factory=dict)


class TaskHook:
    """A hook on a worker's tasks; override the points it needs (see the module docstring)."""

    def before(self, task: TaskRun) -> None:
        """The task arrived; its input is not assembled yet."""

    def around(self, task: TaskRun, run: Run) -> Run:
        """The operator call, wrapped (``task.batch``: the assembled input)."""
        return run

    def after(self, task: TaskRun, out: "DataProto") -> dict[str, Any]:
        """The task's output made; the :class:`~flowrl.runtime.worker.Info` fields this hook reports
        (those the worker does not fill itself: ``start``, ``end``, ``prints``). Metrics come
        from the run: a hook adds its own by wrapping it (:meth:`around`)."""
        return {}

    def loaded(self, role: str | None) -> dict[str, Any]:
        """``role``'s weights were loaded (None: every role, restored from a checkpoint); what the
        load's report carries from this hook."""
        return {}

    def entering(self, window: str, step: int, rank: int) -> None:
        """The worker is at a moment of 0-based ``step`` that is no task (``FAULT_WINDOWS``): ``checkpoint``, its
        state about to be taken for that step's checkpoint; ``sync``, another pool's weights about to be loaded
        for a task of that step."""


class HookSpec(abc.ABC):
    """What crosses to a worker: a picklable description of a hook, built once per worker."""

    @abc.abstractmethod
    def build(self, worker: "Worker") -> TaskHook:
        """The hook for ``worker`` (which it may read: ``first_process``, ``roles``, ``owner``, ``versions``)."""


class Timing(TaskHook):
    """When the task arrived and when it was done: the report's ``start`` and ``end``."""

    def before(self, task: TaskRun) -> None:
        task.notes[Timing] = time.time()

    def after(self, task: TaskRun, out: "DataProto") -> dict[str, Any]:
        return {"start": task.notes[Timing], "end": time.time()}


#: a wing's hooks for one plan: node → the spec it runs with
HookProvider = Callable[["Plan"], Mapping[str, HookSpec]]

_PROVIDERS: list[HookProvider] = []


def task_hooks(provider: HookProvider) -> HookProvider:
    """Register ``provider`` (a decorator): asked for every plan a run starts, on the driver."""
    if provider not in _PROVIDERS:
        _PROVIDERS.append(provider)
    return provider


#: the entry-point group whose modules register task hooks (pyproject.toml)
ENTRY_POINT_GROUP = "flowrl.hooks"
_plugins_loaded = False


def load_hook_plugins() -> None:
    """Import every module of the ``flowrl.hooks`` entry points once, by entry-point name (a fixed order)."""
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: ep.name):
        importlib.import_module(ep.value.split(":")[0])


def hook_specs(plan: "Plan") -> dict[str, tuple[HookSpec, ...]]:
    """Node → the specs of every registered provider for ``plan``, in registration order."""
    load_hook_plugins()
    out: dict[str, tuple[HookSpec, ...]] = {}
    for provider in _PROVIDERS:
        for node, spec in provider(plan).items():
            out[node] = out.get(node, ()) + (spec,)
    return out


def wrapped(hooks: list[TaskHook], task: TaskRun, run: Run) -> Run:
    """``run`` inside every hook's :meth:`~TaskHook.around`, the first hook outermost."""
    for hook in reversed(hooks):
        run = hook.around(task, run)
    return run


__all__ = ["HookProvider", "HookSpec", "Run", "TaskHook", "TaskRun", "Timing", "hook_specs", "task_hooks", "wrapped"]
