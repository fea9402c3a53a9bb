"""Measured costs: each node's seconds as a function of its rows, weight syncs per byte, memory per role.

A cost file is fitted (:mod:`flowrl.plan.costfit`) from a run's task records
(the per-task timings of a Chrome trace, or the per-node ``timing/<node>`` of
its ``metrics.jsonl``). A task's seconds on one rank, alone on a core, are
``fixed_s + per_row_s × rows`` where ``rows`` is what that rank runs: the task's rows in its node's row space (samples, not
prompts, after ``n``), divided over the ranks its dispatch mode splits them
across. Real tokens per row are fixed by the graph (its ``max_new_tokens``,
its data), which the search never changes, so rows carry them. A weight sync
(and an update's gradient all-reduce on more than one rank) costs
``fixed_s + per_byte_s × bytes`` of the role's parameters. Each role's memory
per device: parameters, gradients and optimizer state (trainable roles),
activations per token in a training pass, KV cache per token for generation.

The file is versioned JSON validated on load and keyed to the graph's
algorithm (roles, nodes and their parameters, data source); pools, schedule,
batch size and trainer keys may differ, which is what the search varies.

Example::

    records = task_records(trace)            # fitted by flowrl profile (flowrl.plan.costfit)
    save_costs(costs, Path("runs/grpo/costs.json"))
    costs = load_costs(Path("runs/grpo/costs.json"), graph)   # CostFileError if from another graph
    seconds = task_seconds(plan, costs)                         # task key → predicted seconds
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from flowrl.errors import ConfigError
from flowrl.graph import Graph
from flowrl.plan.planner import Plan, Task, TaskKey
from flowrl.plan.pools import DRIVER

COST_VERSION = 1
COST_FILE = "costs.json"
GIB = 1024 ** 3
#: steps left out of every fit and measure: a run's first two steps measure slower (allocations, Adam's
#: state, caches filling; profiling grpo here, 2-3x the update's later seconds), the ones after are alike
WARMUP = 2


class CostFileError(ConfigError, ValueError):
    """A cost file that cannot be used: unreadable, another version, or another graph's."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class NodeCost(_Strict):
    """Seconds of one task on one rank: ``fixed_s + per_row_s × rows``."""

    fixed_s: float = Field(0.0, ge=0)
    per_row_s: float = Field(0.0, ge=0)
    fit: Literal["affine", "proportional", "fixed"] = "affine"
    rows_seen: list[float] = Field(default_factory=list)  # the distinct row counts it was fitted on
    samples: int = Field(0, ge=0)
    residual: float = Field(0.0, ge=0)  # median |fitted / measured - 1| over its samples
    #: measured on a pool of N workers: seconds there are this many times the line's, at the rows profiled
    world_factor: dict[int, float] = Field(default_factory=dict)
    #: measured on a pool of N workers: the line there, ``[fixed_s, per_row_s]`` (:meth:`on`)
    world_line: dict[int, tuple[float, float]] = Field(default_factory=dict)

    def seconds(self, rows: float) -> float:
        return self.fixed_s + self.per_row_s * rows

    def on(self, world: int, rows: float) -> float | None:
        """Seconds of a task on one of ``world`` ranks, when profiled on that many workers (else None):
        the line measured there, else (a cost file without one) the line times the factor measured there."""
        if world in self.world_line:
            fixed, per_row = self.world_line[world]
            return fixed + per_row * rows
        return self.seconds(rows) * self.world_factor[world] if world in self.world_factor else None


class Transfer(_Strict):
    """Moving a role's weights (a sync to another pool, a gradient all-reduce): ``fixed_s + per_byte_s × bytes``."""

    fixed_s: float = Field(0.0, ge=0)
    per_byte_s: float = Field(0.0, ge=0)
    how: str = ""

    def seconds(self, nbytes: float) -> float:
        return self.fixed_s + self.per_byte_s * nbytes


class RoleMemory(_Strict):
    """What one copy of a role holds, from its model's config."""

    params: int = Field(0, ge=0)
    bytes_per_param: int = Field(4, ge=1)
    trainable: bool = False
    optimizer_bytes_per_param: int = Field(8, ge=0)  # Adam: two fp32 moments
    activation_bytes_per_token: int = Field(0, ge=0)
    kv_bytes_per_token: int = Field(0, ge=0)

    @property
    def weight_bytes(self) -> int:
        return self.params * self.bytes_per_param


class CostFile(_Strict):
    version: Literal[1] = COST_VERSION
    graph: str  # the graph's name, for messages
    key: str  # graph_key(): what the costs depend on
    source: str = ""  # the run directory they were fitted from
    nodes: dict[str, NodeCost]
    task_latency_s: float = Field(0.0, ge=0)  # per task: dispatch and moving its inputs (calibrated)
    step_overhead_s: float = Field(0.0, ge=0)  # per step: the driver's work after it (calibrated)
    transfer: Transfer = Transfer()
    roles: dict[str, RoleMemory] = Field(default_factory=dict)
    tokens_per_row: float = Field(0.0, ge=0)  # prompt + response tokens of a sample, as measured
    measured_with: dict[str, Any] = Field(default_factory=dict)  # workers per pool, backend, steps, cpus


def graph_key(graph: Graph) -> str:
    """A digest of what the costs depend on: roles, nodes with their parameters, data source.
    Pools, schedule, batch size and trainer keys are left out: the search varies them."""
    cfg = graph.config.dump()
    what = {"roles": cfg.get("roles"), "data": cfg.get("data", {}).get("source"),
            "nodes": {n: {k: v for k, v in c.items() if k != "micro_batch_size"}
                      for n, c in (cfg.get("nodes") or {}).items()}}
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:16]


def load_costs(path: Path, graph: Graph) -> CostFile:
    """A cost file fitted for ``graph``'s algorithm, or :class:`CostFileError` saying why not."""
    try:
        raw = json.loads(Path(path).read_text())
    except OSError as e:
        raise CostFileError(f"cost file {path}: cannot read it ({e.strerror or e}); write one with "
                            f"`flowrl profile {graph.name}`") from None
    except ValueError as e:
        raise CostFileError(f"cost file {path}: not JSON ({e})") from None
    if isinstance(raw, dict) and raw.get("version") not in (None, COST_VERSION):
        raise CostFileError(f"cost file {path} is version {raw.get('version')!r}; this flowrl reads version "
                            f"{COST_VERSION}: profile again with `flowrl profile {graph.name}`")
    try:
        costs = CostFile.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(top level)"
        raise CostFileError(f"cost file {path}: {where}: {first['msg']}") from None
    if costs.key != graph_key(graph):
        raise CostFileError(
            f"cost file {path} was profiled for graph {costs.graph!r} (key {costs.key}), not this graph "
            f"{graph.name!r} (key {graph_key(graph)}): its roles, nodes or data differ. Profile this graph "
            f"with `flowrl profile {graph.name}`")
    missing = [n for n in graph.nodes if n not in costs.nodes]
    if missing:
        raise CostFileError(f"cost file {path} has no cost for node(s) {', '.join(missing)}")
    return costs


def save_costs(costs: CostFile, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(costs.model_dump(), indent=1, sort_keys=True) + "\n")
    return path


# ---------------------------------------------------------------- rows and records
def rank_rows(plan: Plan, task: Task) -> float:
    """Rows one rank runs: the task's rows in its node's space, split across ranks unless every rank gets all."""
    lo, hi = plan.rows(plan.spaces[task.node], task.mb)
    splits = task.pool != DRIVER and task.dispatch != "all" and len(task.ranks) > 1
    return (hi - lo) / len(task.ranks) if splits else float(hi - lo)


@dataclass(frozen=True)
class Record:
    """One task on one rank, as a run recorded it."""

    node: str
    mb: int | None
    step: int
    rank: int
    start: float
    end: float


def task_records(trace: dict[str, Any]) -> list[Record]:
    """The training tasks of a Chrome trace written by a run (``--trace``, :meth:`Timeline.to_chrome_trace`)."""
    out = []
    for ev in trace.get("traceEvents", []):
        args = ev.get("args") or {}
        if ev.get("ph") != "X" or args.get("plan", "train") != "train":
            continue
        mb = args.get("micro_batch")
        node = ev["name"].rsplit("[", 1)[0] if mb is not None else ev["name"]
        start = ev["ts"] / 1e6
        out.append(Record(node, mb, int(args.get("step", 0)), int(ev.get("tid", 0)), start, start + ev["dur"] / 1e6))
    return out


def records_of(infos: Iterable[Any]) -> list[Record]:
    """Records from a timeline's reports (:class:`~flowrl.runtime.worker.Info`), training plan only."""
    return [Record(i.node, i.mb, i.step, i.rank, i.start, i.end) for i in infos if i.plan == "train"]


# ---------------------------------------------------------------- prediction
def task_seconds(plan: Plan, costs: CostFile) -> dict[TaskKey, float]:
    """Predicted seconds of every task of ``plan``: its node's cost at its rows per rank (the line measured
    on its pool's worker count, when profiled there; else its line plus an update's gradient all-reduce
    across ranks), the calibrated task latency, and the weight syncs it loads first."""
    out: dict[TaskKey, float] = {}
    for key, task in plan.tasks.items():
        node = costs.nodes[task.node]
        measured = node.on(task.world, rank_rows(plan, task))  # on this many workers: collectives included
        s = node.seconds(rank_rows(plan, task)) if measured is None else measured
        if measured is None and task.updates is not None and task.gather > 1 and task.dispatch != "all":
            world = task.gather
            s += costs.transfer.seconds(2 * (world - 1) / world * _weight_bytes(costs, task.updates))
        s += costs.task_latency_s
        for gate in task.syncs:
            s += costs.transfer.seconds(_weight_bytes(costs, gate.sync_role))
        out[key] = s
    return out


def _weight_bytes(costs: CostFile, role: str | None) -> int:
    mem = costs.roles.get(role or "")
    return mem.weight_bytes if mem is not None else 0


def device_memory(plan: Plan, costs: CostFile) -> dict[str, int]:
    """Bytes one worker of each pool holds at its peak: every role object it builds (weights; gradients and
    optimizer state of a trainable role; all three sharded over a process group's ranks; a role sharing
    another's object adds nothing), plus the largest working set of the tasks it runs: activations per
    token of a training pass, or for generation the KV cache per token and a sharded role's gathered weights."""
    graph, out = plan.graph, {}
    for spec in plan.pools:
        shard = spec.workers if plan.traits.process_groups else 1
        held = 0
        for build in spec.roles:
            mem = costs.roles.get(build.name)
            if mem is None or build.shares is not None:
                continue
            extra = mem.bytes_per_param + mem.optimizer_bytes_per_param if mem.trainable else 0
            held += mem.params * (mem.bytes_per_param + extra) // (shard if mem.trainable else 1)
        peak = 0
        for task in plan.tasks.values():
            node = graph.nodes[task.node]
            mem = costs.roles.get(_owner(spec, node.role))
            if task.pool != spec.name or mem is None:
                continue
            rows = rank_rows(plan, task)
            micro = node.config.params.get("micro_batch_size")
            if node.updates_role or not task.factor > 1:
                need = mem.activation_bytes_per_token * costs.tokens_per_row * (min(rows, micro) if micro else rows)
            else:  # generation: a KV cache per token, on weights gathered from the shards
                gathered = mem.weight_bytes - mem.weight_bytes // shard if mem.trainable else 0
                need = mem.kv_bytes_per_token * costs.tokens_per_row * rows + gathered
            peak = max(peak, int(need))
        out[spec.name] = held + peak
    return out


def _owner(spec: Any, role: str | None) -> str:
    """The role whose object a role of this pool is (itself, or the role it shares)."""
    for build in spec.roles:
        if build.name == role:
            return build.shares or build.name
    return role or ""


__all__ = ["COST_FILE", "COST_VERSION", "WARMUP", "CostFile", "CostFileError", "GIB", "NodeCost", "Record",
           "RoleMemory", "Transfer", "device_memory", "graph_key", "load_costs", "records_of", "rank_rows",
           "save_costs", "task_records", "task_seconds"]
