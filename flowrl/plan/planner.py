"""The plan: a checked graph made concrete — everything a step will run, decided once.

For every task of a step the plan says: what it reads (which upstream tasks,
which columns, which rows, the repeat factor to the task's row space), the
rows it returns (its node's declared expansion), how it is dispatched over the
ranks of its pool (a registered :mod:`~flowrl.data.dispatch` mode: which ranks
run, which ranks' outputs are collected), its gates (state edges as step
offsets, :mod:`~flowrl.plan.staleness`), the weight syncs they need, and
whether its update's weights must be published to another pool. ``flowrl
plan`` prints exactly this; the runtime only submits it. The plan depends on
the backend's traits (:mod:`~flowrl.plan.traits`: whether a pool's ranks form
a process group), and ``flowrl plan --backend``, ``flowrl validate`` and the run
all call :func:`make_plan` the same way. It also says which roles each pool
builds (:mod:`~flowrl.plan.pools`), which tasks keep operator state, how many
ranks gather an update's weights, and the validation run: a second plan, run by
the same loop.

A node becomes one *task* per micro-batch when its scope allows streaming
(``row``, and ``group`` since micro-batches are cut at prompt boundaries, so
every group of ``n`` samples stays whole) and one task when it is ``batch``
scoped (a barrier). Every task knows which upstream tasks it reads, and which
rows of them (a row-scoped consumer of a batch-scoped output reads its slice).

Row spaces and reads live in :mod:`~flowrl.plan.rowspace`; the order nodes
that share a pool run in (list scheduling, critical path first) in
:mod:`~flowrl.plan.ordering`; the predicted timeline in
:mod:`~flowrl.plan.simulate`.

Example::

    plan = make_plan(graph, traits_of("ray"))
    print(plan.pool_order["train"])      # [("generate", 0), ("generate", 1), ...]
    sim = plan.simulate()                # predicted timeline from declared costs
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import networkx as nx

from flowrl.data.dispatch import RowKeys, data_parallel, get_mode
from flowrl.graph import SOURCE, Graph
from flowrl.plan.ordering import declared_order, priority_order, upward_ranks
from flowrl.plan.pools import DRIVER, PoolSpec, pool_specs
from flowrl.plan.rowspace import PlanError, Read, Space, reads_of, row_spaces
from flowrl.plan.simulate import Simulation, bounds_of, pool_work, simulate
from flowrl.plan.staleness import Gate
from flowrl.plan.traits import RAY, BackendTraits
from flowrl.plan.validation import validation_graph

TaskKey = tuple[str, int | None]


@dataclass
class Task:
    """One node's work on one micro-batch (or the whole batch) of a step."""

    node: str
    mb: int | None  # None: one task for the whole batch
    pool: str  # a pool name, or DRIVER
    reads: list[Read] = field(default_factory=list)
    deps: set[TaskKey] = field(default_factory=set)  # tasks that must finish first
    rank: float = 0.0  # upward rank (critical path to the end of the step)
    cost: float = 1.0
    dispatch: str = "driver"  # a registered dispatch mode: its split on the ranks, its collect for consumers
    keys: RowKeys = RowKeys()  # the columns the mode may read (from the node's declared inputs)
    ranks: tuple[int, ...] = (0,)  # the ranks of its pool that run it
    collected: tuple[int, ...] = (0,)  # the ranks whose outputs (and metrics) form its result
    world: int = 1  # workers of its pool
    factor: int = 1  # output rows per input row (its node's declared expansion)
    gates: tuple[Gate, ...] = ()  # state edges it waits on, as step offsets
    updates: str | None = None  # the role whose update completes with this task (its last micro-batch)
    publishes: bool = False  # another pool loads that role's weights: fetched right behind the update
    gather: int = 1  # ranks that take part in gathering the updated weights (a process group's all)
    stateful: bool = False  # its operator keeps state across steps: handed the last task's, reports its own

    @property
    def key(self) -> TaskKey:
        return (self.node, self.mb)

    @property
    def syncs(self) -> tuple[Gate, ...]:
        """The gates that load weights onto this task's pool before it runs."""
        return tuple(g for g in self.gates if g.sync_role is not None)


@dataclass
class Plan:
    graph: Graph
    micro_batches: int
    prompt_bounds: list[int]  # micro-batch boundaries over the prompt rows
    spaces: dict[str, Space]  # node → the row space of its outputs
    tasks: dict[TaskKey, Task]
    pool_order: dict[str, list[TaskKey]]  # pool → its tasks in run order
    order: list[TaskKey]  # all tasks, a topological order by priority
    moved: dict[str, str] = field(default_factory=dict)  # stateless node → the pool that runs it
    dispatch_rules: dict[str, str] = field(default_factory=dict)  # node → why its tasks run their dispatch mode
    traits: BackendTraits = RAY  # the backend it was planned for
    pools: list[PoolSpec] = field(default_factory=list)  # every pool's workers and the roles they build
    kind: str = "train"  # "train", or "val" for the validation run
    validation: "Plan | None" = None  # the validation run (greedy, on held-out prompts), when the trainer asks

    def pool_of(self, node: str) -> str:
        """Where a node runs: its role's pool, the pool a light node moved to, or the driver."""
        return self.moved.get(node) or self.graph.pool_of(node) or DRIVER

    def rows(self, space: Space, mb: int | None) -> tuple[int, int]:
        """The row range of micro-batch ``mb`` (or the whole batch) in ``space``."""
        f = space.factor
        if mb is None:
            return (0, self.prompt_bounds[-1] * f)
        return (self.prompt_bounds[mb] * f, self.prompt_bounds[mb + 1] * f)

    def node_tasks(self, node: str) -> list[Task]:
        return [t for t in self.tasks.values() if t.node == node]

    def runs(self) -> list["Plan"]:
        """This plan and the ones run beside it (validation)."""
        return [self] + ([self.validation] if self.validation is not None else [])

    @property
    def staleness_bound(self) -> int:
        """The largest staleness bound its tasks' gates allow (0: steps in lockstep)."""
        return max((g.staleness for t in self.tasks.values() for g in t.gates), default=0)

    @property
    def driver(self) -> bool:
        """Whether any task (of this plan or validation) runs on the driver: it needs a driver worker."""
        return any(t.pool == DRIVER for p in self.runs() for t in p.tasks.values())

    def simulate(self, costs: dict[str, float] | None = None) -> Simulation:
        """Predict the step's timeline: pools run their order one task at a time."""
        return simulate(self, costs)


def row_keys(node: Any) -> RowKeys:
    """The columns a dispatch mode may read for ``node``: the inputs its operator declares
    (``balance_by``, ``group_key``), by their names in the graph."""
    op = node.op
    rename = node.config.inputs
    return RowKeys(tokens=rename.get(op.balance_by, op.balance_by) if op.balance_by else None,
                   groups=rename.get(op.group_key, op.group_key) if op.group_key else None)


def dispatch_rule(node: Any, on_rank0: bool, world: int, traits: BackendTraits, rows: int) -> tuple[str, str]:
    """The dispatch mode a node's tasks run under, and the rule that picked it, in words.

    On a pool whose ranks form a process group (``traits.process_groups``, more
    than one worker) rows are assigned to ranks by real tokens
    (:func:`~flowrl.data.dispatch.data_parallel`: groups kept whole where the
    scope is ``group``) for an update (declared ``all``) and for a forward pass
    (declared ``split``) whose operator declares the column that counts real
    tokens (``balance_by``). A node that expands rows (generation with ``n``
    samples) keeps ``split``: each rank its prompts, all samples of a prompt on
    that rank. ``rows`` is the fewest rows one of the node's tasks gets: a
    forward pass balances only when every rank can get one.
    """
    declared = node.op.dispatch
    if on_rank0:
        return "driver", "one run with the whole batch"
    if world == 1:
        return declared, "one worker"
    if not traits.process_groups:
        return declared, f"as declared: the {traits.name} backend's ranks form no process group"
    keys = row_keys(node)
    mode = data_parallel(keep_groups=node.scope == "group")
    by = f"rows to ranks by real tokens ({keys.tokens})" if keys.tokens else "rows to ranks by count"
    if node.scope == "group":
        by += f", {keys.groups} groups whole" if keys.groups else ", groups whole"
    if declared == "all":
        return mode.name, f"an update, data parallel: {by}"
    if declared != "split":
        return declared, "as declared"
    factor = node.op.expansion(node.params)
    if factor > 1:
        return declared, (f"expands each row ×{factor}: each rank its share of the rows, "
                          f"all {factor} samples of a row on that rank")
    if keys.tokens is None:
        return declared, "declares no balance_by column to count real tokens: contiguous rows by count"
    if rows < world:
        return declared, f"fewer rows in a task ({rows}) than ranks ({world}): nothing to balance"
    return mode.name, f"a forward pass, data parallel: {by}"


def make_plan(graph: Graph, traits: BackendTraits = RAY, *, micro_batches: int | None = None,
              batch_size: int | None = None, kind: str = "train") -> Plan:
    """Expand a checked graph into tasks and per-pool orders, for a backend with ``traits``.

    Where the backend's pool ranks form one process group (``ray``), a node
    declared ``dispatch="all"`` (an update) runs data parallel instead, and so
    does a forward pass declared ``split`` that does not expand rows: each rank
    its share of the rows, balanced by real tokens (:func:`dispatch_rule`).
    Without one (``local``: threads in one process) every node runs as
    declared: an update on every rank with the whole batch. The rule that
    picked each node's mode is in :attr:`Plan.dispatch_rules`. A training plan
    of a graph with ``trainer.val_every`` carries its validation plan
    (``kind="val"``: one micro-batch, no gates).
    """
    k = micro_batches or graph.config.schedule.micro_batches
    prompts = batch_size or graph.config.data.batch_size
    if k > prompts:
        raise PlanError(f"schedule.micro_batches={k} is more than data.batch_size={prompts} prompts")
    bounds = [round(i * prompts / k) for i in range(k + 1)]
    spaces = row_spaces(graph)
    producers = {f: ps[0] for f, ps in graph.producers().items()}
    placement = place_light_nodes(graph) if graph.config.schedule.colocate_light_nodes else {}
    tasks: dict[TaskKey, Task] = {}
    rules: dict[str, str] = {}
    gates = _gates(graph) if kind == "train" else {}
    publishes = _publishers(graph)
    for name in graph.topological_order():
        node = graph.nodes[name]
        pool = placement.get(name) or graph.pool_of(name) or DRIVER
        streams = node.scope in ("row", "group") and k > 1
        mbs: list[int | None] = list(range(k)) if streams else [None]
        # a light node moved onto a pool runs once, on its rank 0, like on the driver
        world = 1 if pool == DRIVER else graph.config.pools[pool].workers
        # the fewest rows one of the node's tasks gets, in its own row space
        rows = (min(b - a for a, b in pairwise(bounds)) if streams else prompts) * spaces[name].factor
        mode_name, rules[name] = dispatch_rule(node, pool == DRIVER or name in placement, world, traits, rows)
        mode, keys = get_mode(mode_name), row_keys(node)
        _check_mode(name, pool, mode, keys, world, rows // max(1, node.op.expansion(node.params)),
                    node.op.expands is not None)
        for mb in mbs:
            task = Task(name, mb, pool, cost=node.cost / (k if mb is not None else 1),
                        dispatch=mode.name, keys=keys, ranks=tuple(mode.ranks(world)),
                        collected=tuple(mode.collected(world)), world=world,
                        factor=node.op.expansion(node.params), gates=gates.get(name, ()),
                        updates=node.role if node.updates_role and (mb is None or mb == k - 1) else None,
                        publishes=node.updates_role and node.role in publishes,
                        gather=world if traits.process_groups else 1, stateful=node.op.state is not None)
            by_src: dict[str, list[str]] = {}
            for f in node.inputs:
                if f.name in producers:
                    by_src.setdefault(producers[f.name], []).append(f.name)
            for src, fields in by_src.items():
                task.reads.extend(reads_of(graph, tasks, spaces, name, mb, src, tuple(fields), bounds))
            for r in task.reads:
                task.deps.update(src for src in r.srcs if src[0] != SOURCE)
            for pred in graph.dag.predecessors(name):
                if pred == SOURCE or graph.dag.edges[pred, name]["kind"] == "data":
                    continue
                task.deps.update(t.key for t in tasks.values() if t.node == pred)
            tasks[task.key] = task
    upward_ranks(tasks)
    if graph.config.schedule.order == "declared":
        order = declared_order(tasks, list(graph.nodes))
    else:
        order = priority_order(tasks)
    pool_order: dict[str, list[TaskKey]] = {}
    for key in order:
        pool_order.setdefault(tasks[key].pool, []).append(key)
    plan = Plan(graph, k, bounds, spaces, tasks, pool_order, order, placement, rules, traits, pool_specs(graph), kind)
    if kind == "train" and graph.config.trainer.val_every:
        val = validation_graph(graph)
        plan.validation = make_plan(val, traits, micro_batches=1, kind="val") if val is not None else None
    return plan


def _check_mode(name: str, pool: str, mode: Any, keys: RowKeys, world: int, rows: int, expands: bool) -> None:
    """What a mode needs of a node that only the plan can tell: rows (``rows``: the fewest a task reads)
    for every rank where its ranks run collectives together or the node samples (``expands``: a
    rollout; none samples from an empty batch), its columns."""
    if (mode.every_rank_rows or expands) and rows < world:
        raise PlanError(f"node {name!r} runs data parallel on the {world} workers of pool {pool!r}, but a "
                        f"task of it gets only {rows} row{'s' if rows != 1 else ''}: every rank needs at least one; lower "
                        f"pools.{pool}.workers or schedule.micro_batches, or raise data.batch_size")
    if "groups" in mode.needs and keys.groups is None:
        raise PlanError(f"node {name!r} is group-scoped and runs data parallel on pool {pool!r}, but its "
                        f"operator declares no group_key to keep each group on one rank; declare the input "
                        f"that keys a group (@operator(..., group_key='uid'))")


def _gates(graph: Graph) -> dict[str, tuple[Gate, ...]]:
    """Node → the state edges it waits on; a sync where the update happens on another pool."""
    out: dict[str, list[Gate]] = {}
    for e in graph.state_edges:
        crosses = graph.pool_of(e.src) != graph.pool_of(e.dst)
        out.setdefault(e.dst, []).append(
            Gate(e.role, e.src, e.dst, e.staleness, graph.nodes[e.dst].role if crosses else None,
                 after_update=nx.has_path(graph.dag, e.src, e.dst)))
    return {n: tuple(gs) for n, gs in out.items()}


def _publishers(graph: Graph) -> set[str]:
    """Roles whose weights another pool reads after each update."""
    return {e.role for e in graph.state_edges if graph.pool_of(e.src) != graph.pool_of(e.dst)}


def place_light_nodes(graph: Graph) -> dict[str, str]:
    """Stateless nodes that would only bounce data off the driver, moved next to it.

    A connected group of driver nodes whose producers and consumers all run on
    one pool runs in that pool's process (rank 0, the whole batch): the batch
    stays where it is instead of crossing to the driver and back (two trips
    through the object store per node). Groups that join pools stay on the
    driver, where they overlap with both.
    """
    driver = [n for n in graph.nodes if graph.pool_of(n) is None]
    islands = nx.weakly_connected_components(graph.dag.subgraph(driver))
    out: dict[str, str] = {}
    for island in islands:
        edges = [(u, v) for u, v in graph.dag.edges if (u in island) != (v in island)]
        outside = {u if v in island else v for u, v in edges} - {SOURCE}
        pools = {graph.pool_of(n) for n in outside}
        if len(pools) == 1 and None not in pools:
            out.update({n: next(iter(pools)) for n in island})
    return out


__all__ = ["DRIVER", "Plan", "PlanError", "Read", "Simulation", "Space", "Task", "bounds_of", "dispatch_rule",
           "make_plan", "place_light_nodes", "pool_work", "row_keys", "simulate"]
