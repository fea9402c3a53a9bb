"""The plan: a checked graph made concrete — everything a step will run, decided once.

For every task of a step the plan says: what it reads (which upstream tasks,
which columns, which rows, the repeat factor to the task's row space), the
rows it returns (its node's declared expansion), how it is dispatched over the
ranks of its pool (a registered :mod:`~flowrl.data.dispatch` mode: which ranks
run, which ranks' outputs are collected), its gates (state edges as step
offsets, :mod:`~flowrl.runtime.staleness`), the weight syncs they need, and
whether its update's weights must be published to another pool. ``flowrl
plan`` prints exactly this; the runtime only submits it.

A node becomes one *task* per micro-batch when its scope allows streaming
(``row``, and ``group`` since micro-batches are cut at prompt boundaries, so
every group of ``n`` samples stays whole) and one task when it is ``batch``
scoped (a barrier). Every task knows which upstream tasks it reads, and which
rows of them (a row-scoped consumer of a batch-scoped output reads its slice).

Row spaces: the data source yields prompt rows; an operator that ``expands``
(``rollout.generate`` with ``n`` samples) yields ``n`` rows per input row.
A consumer reading fields of both spaces gets the prompt-level columns repeated
to match (verl's ``repeat(n, interleave=True)``), so ``ground_truth`` and
``uid`` reach the reward and the GRPO grouping without any user code.

Nodes on one pool run one at a time, in an order chosen here by list
scheduling the step with the declared costs: repeatedly, the task that can
start earliest (its inputs done, its pool free) goes next; among equals, the
one with the longest path to the end of the step (its *upward rank*) —
critical path first. So a pool fills the time it would spend waiting for one
upstream micro-batch with work that is already ready. Nodes on different pools
run concurrently; driver nodes run as soon as their inputs are.

Example::

    plan = make_plan(graph)
    print(plan.pool_order["train"])      # [("generate", 0), ("generate", 1), ...]
    sim = plan.simulate()                # predicted timeline from declared costs
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import networkx as nx

from flowrl.data.dispatch import DATA_PARALLEL, TOKEN_MASK, get_mode
from flowrl.graph import SOURCE, Graph
from flowrl.runtime.staleness import Gate

DRIVER = "driver"


class PlanError(ValueError):
    """The graph cannot be planned (e.g. it mixes two unrelated row spaces)."""


@dataclass(frozen=True)
class Space:
    """A row space: the expanding nodes since the source and their factors."""

    path: tuple[tuple[str, int], ...] = ()

    @property
    def factor(self) -> int:
        return math.prod(f for _, f in self.path)

    def extends(self, other: "Space") -> bool:
        return self.path[: len(other.path)] == other.path

    def then(self, node: str, factor: int) -> "Space":
        return self if factor == 1 else Space(self.path + ((node, factor),))


@dataclass(frozen=True)
class Read:
    """What a task reads from one upstream node.

    ``srcs`` are the producer's tasks ``(node, mb)`` whose outputs are
    concatenated in order (``mb`` is ``None`` for a batch-scoped producer and
    for the source's whole batch); ``rows`` slices the result;
    ``repeat`` repeats each row to reach the consumer's space; ``fields`` names
    the columns taken.
    """

    srcs: tuple[tuple[str, int | None], ...]
    fields: tuple[str, ...]
    rows: tuple[int, int] | None = None
    repeat: int = 1


@dataclass
class Task:
    """One node's work on one micro-batch (or the whole batch) of a step."""

    node: str
    mb: int | None  # None: one task for the whole batch
    pool: str  # a pool name, or DRIVER
    reads: list[Read] = field(default_factory=list)
    deps: set[tuple[str, int | None]] = field(default_factory=set)  # tasks that must finish first
    rank: float = 0.0  # upward rank (critical path to the end of the step)
    cost: float = 1.0
    dispatch: str = "driver"  # a registered dispatch mode
    ranks: tuple[int, ...] = (0,)  # the ranks of its pool that run it
    collected: tuple[int, ...] = (0,)  # the ranks whose outputs (and metrics) form its result
    world: int = 1  # workers of its pool
    factor: int = 1  # output rows per input row (its node's declared expansion)
    gates: tuple[Gate, ...] = ()  # state edges it waits on, as step offsets
    updates: str | None = None  # the role whose update completes with this task (its last micro-batch)
    publishes: bool = False  # another pool loads that role's weights: fetched right behind the update

    @property
    def key(self) -> tuple[str, int | None]:
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
    tasks: dict[tuple[str, int | None], Task]
    pool_order: dict[str, list[tuple[str, int | None]]]  # pool → its tasks in run order
    order: list[tuple[str, int | None]]  # all tasks, a topological order by priority
    moved: dict[str, str] = field(default_factory=dict)  # stateless node → the pool that runs it
    dispatch_rules: dict[str, str] = field(default_factory=dict)  # node → why its tasks run their dispatch mode

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

    def simulate(self, costs: dict[str, float] | None = None) -> "Simulation":
        """Predict the step's timeline: pools run their order one task at a time."""
        return simulate(self, costs)


def dispatch_rule(node: Any, on_rank0: bool, world: int, data_parallel: bool, rows: int) -> tuple[str, str]:
    """The dispatch mode a node's tasks run under, and the rule that picked it, in words.

    On a pool whose ranks form a process group (``data_parallel``, more than
    one worker) rows are assigned to ranks by real tokens
    (:data:`~flowrl.data.dispatch.DATA_PARALLEL` by the node's scope: groups
    kept whole where the scope is ``group``) for an update (declared ``all``)
    and for a forward pass (declared ``split``) that reads
    :data:`~flowrl.data.dispatch.TOKEN_MASK`. A node that expands rows
    (generation with ``n`` samples) keeps ``split``: each rank its prompts, all
    samples of a prompt on that rank. ``rows`` is the fewest rows one of the
    node's tasks gets: a forward pass balances only when every rank can get one.
    """
    declared = node.op.dispatch
    if on_rank0:
        return "driver", "one run with the whole batch"
    if world == 1:
        return declared, "one worker"
    if not data_parallel:
        return declared, "as declared: the ranks form no process group (threads of one process)"
    balanced = DATA_PARALLEL[node.scope]
    tokens = f"rows to ranks by real tokens ({TOKEN_MASK})" + (", uid groups whole" if node.scope == "group" else "")
    if declared == "all":
        return balanced, f"an update, data parallel: {tokens}"
    if declared != "split":
        return declared, "as declared"
    factor = node.op.expansion(node.params)
    if factor > 1:
        return declared, (f"expands each row ×{factor}: each rank its share of the rows, "
                          f"all {factor} samples of a row on that rank")
    if TOKEN_MASK not in node.input_names():
        return declared, f"reads no {TOKEN_MASK} to count real tokens: contiguous rows by count"
    if rows < world:
        return declared, f"fewer rows in a task ({rows}) than ranks ({world}): nothing to balance"
    return balanced, f"a forward pass, data parallel: {tokens}"


def make_plan(graph: Graph, micro_batches: int | None = None, batch_size: int | None = None,
              data_parallel: bool = True) -> Plan:
    """Expand a checked graph into tasks and per-pool orders.

    ``data_parallel``: the ranks of a pool form one process group (the ray
    backend), so a node declared ``dispatch="all"`` (an update) runs data
    parallel instead, and so does a forward pass declared ``split`` that does
    not expand rows: each rank its share of the rows, balanced by real tokens
    (:func:`dispatch_rule`). Without one (threads in one process) every node
    runs as declared: an update on every rank with the whole batch. The rule
    that picked each node's mode is in :attr:`Plan.dispatch_rules`.
    """
    k = micro_batches or graph.config.schedule.micro_batches
    prompts = batch_size or graph.config.data.batch_size
    if k > prompts:
        raise PlanError(f"schedule.micro_batches={k} is more than data.batch_size={prompts} prompts")
    bounds = [round(i * prompts / k) for i in range(k + 1)]
    spaces = _row_spaces(graph)
    producers = {f: ps[0] for f, ps in graph.producers().items()}
    placement = place_light_nodes(graph) if graph.config.schedule.colocate_light_nodes else {}
    tasks: dict[tuple[str, int | None], Task] = {}
    rules: dict[str, str] = {}
    gates = _gates(graph)
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
        mode_name, rules[name] = dispatch_rule(node, pool == DRIVER or name in placement, world, data_parallel, rows)
        if mode_name in ("balanced", "balanced_groups") and rows < world:
            raise PlanError(f"node {name!r} runs data parallel on the {world} workers of pool {pool!r}, but a "
                            f"task of it gets only {rows} rows: every rank needs at least one; lower "
                            f"pools.{pool}.workers or raise data.batch_size")
        if mode_name == "balanced_groups" and "uid" not in node.input_names():
            raise PlanError(f"node {name!r} is group-scoped and runs data parallel on pool {pool!r}, but reads "
                            f"no 'uid' to keep each group on one rank; add uid to its inputs")
        mode = get_mode(mode_name)
        for mb in mbs:
            task = Task(name, mb, pool, cost=node.cost / (k if mb is not None else 1),
                        dispatch=mode.name, ranks=tuple(mode.ranks(world)), collected=tuple(mode.collected(world)),
                        world=world, factor=node.op.expansion(node.params), gates=gates.get(name, ()),
                        updates=node.role if node.updates_role and (mb is None or mb == k - 1) else None,
                        publishes=node.updates_role and node.role in publishes)
            by_src: dict[str, list[str]] = {}
            for f in node.inputs:
                if f.name in producers:
                    by_src.setdefault(producers[f.name], []).append(f.name)
            for src, fields in by_src.items():
                task.reads.extend(_reads(graph, tasks, spaces, name, mb, src, tuple(fields), bounds))
            for r in task.reads:
                task.deps.update(src for src in r.srcs if src[0] != SOURCE)
            for pred in graph.dag.predecessors(name):
                if pred == SOURCE or graph.dag.edges[pred, name]["kind"] == "data":
                    continue
                task.deps.update(t.key for t in tasks.values() if t.node == pred)
            tasks[task.key] = task
    _upward_ranks(tasks)
    if graph.config.schedule.order == "declared":
        order = _declared_order(tasks, list(graph.nodes))
    else:
        order = _priority_order(tasks)
    pool_order: dict[str, list[tuple[str, int | None]]] = {}
    for key in order:
        pool_order.setdefault(tasks[key].pool, []).append(key)
    return Plan(graph, k, bounds, spaces, tasks, pool_order, order, placement, rules)


def _gates(graph: Graph) -> dict[str, tuple[Gate, ...]]:
    """Node → the state edges it waits on; a sync where the update happens on another pool."""
    out: dict[str, list[Gate]] = {}
    for e in graph.state_edges:
        crosses = graph.pool_of(e.src) != graph.pool_of(e.dst)
        out.setdefault(e.dst, []).append(
            Gate(e.role, e.src, e.dst, e.staleness, graph.nodes[e.dst].role if crosses else None))
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


def _row_spaces(graph: Graph) -> dict[str, Space]:
    spaces: dict[str, Space] = {SOURCE: Space()}
    producers = {f: ps[0] for f, ps in graph.producers().items()}
    for name in graph.topological_order():
        node = graph.nodes[name]
        ins = [spaces[producers[f.name]] for f in node.inputs if f.name in producers]
        space = Space()
        for s in ins:
            if s.extends(space):
                space = s
            elif not space.extends(s):
                raise PlanError(
                    f"node {name!r} reads rows of two unrelated expansions "
                    f"({_space_name(space)} and {_space_name(s)}); rows cannot be matched"
                )
        factor = node.op.expansion(node.params) if node.op is not None and node.params is not None else 1
        spaces[name] = space.then(name, factor)
    return spaces


def _space_name(s: Space) -> str:
    return " × ".join(f"{n}(n={f})" for n, f in s.path) or "the prompts"


def _reads(graph: Graph, tasks, spaces, name, mb, src, fields, bounds) -> list[Read]:
    mine = _input_space(graph, spaces, name)
    theirs = spaces[src]
    repeat = mine.factor // theirs.factor
    if src == SOURCE:
        return [Read(((SOURCE, None),), fields, _prompt_rows(bounds, mb, theirs), repeat)]
    src_tasks = sorted((t for t in tasks.values() if t.node == src), key=lambda t: t.mb or 0)
    if mb is None:  # a barrier reads every micro-batch of its producer, in order
        return [Read(tuple(t.key for t in src_tasks), fields, None, repeat)]
    if (src, mb) in tasks:  # streaming to streaming: micro-batch m feeds micro-batch m
        return [Read(((src, mb),), fields, None, repeat)]
    return [Read(((src, None),), fields, _prompt_rows(bounds, mb, theirs), repeat)]


def _prompt_rows(bounds: list[int], mb: int | None, space: Space) -> tuple[int, int] | None:
    if mb is None:
        return None
    return (bounds[mb] * space.factor, bounds[mb + 1] * space.factor)


def _input_space(graph: Graph, spaces: dict[str, Space], name: str) -> Space:
    producers = {f: ps[0] for f, ps in graph.producers().items()}
    space = Space()
    for f in graph.nodes[name].inputs:
        if f.name in producers and spaces[producers[f.name]].extends(space):
            space = spaces[producers[f.name]]
    return space


def _upward_ranks(tasks: dict[tuple[str, int | None], Task]) -> None:
    g = nx.DiGraph()
    for key, t in tasks.items():
        g.add_node(key)
        for d in t.deps:
            g.add_edge(d, key)
    for key in reversed(list(nx.topological_sort(g))):
        succ = [tasks[s].rank for s in g.successors(key)]
        tasks[key].rank = tasks[key].cost + (max(succ) if succ else 0.0)


def _declared_order(tasks: dict[tuple[str, int | None], Task], nodes: list[str]) -> list[tuple[str, int | None]]:
    """Nodes in the order they are written, micro-batches in order (a hand-written loop's order)."""
    g = nx.DiGraph()
    for key, t in tasks.items():
        g.add_node(key)
        g.add_edges_from((d, key) for d in t.deps)
    rank = {n: i for i, n in enumerate(nodes)}
    return list(nx.lexicographical_topological_sort(g, key=lambda k: (rank[k[0]], k[1] or 0)))


def _priority_order(tasks: dict[tuple[str, int | None], Task]) -> list[tuple[str, int | None]]:
    """List-schedule the tasks by declared cost; the order they start in (a topological order)."""
    seq = {key: i for i, key in enumerate(tasks)}
    end: dict[tuple[str, int | None], float] = {}
    pool_free: dict[str, float] = {}
    order: list[tuple[str, int | None]] = []
    left = set(tasks)
    while left:
        best, best_key = None, None
        for key in left:
            t = tasks[key]
            if not all(d in end for d in t.deps):
                continue
            start = max((end[d] for d in t.deps), default=0.0)
            if t.pool != DRIVER:
                start = max(start, pool_free.get(t.pool, 0.0))
            rank_key = (round(start, 9), -t.rank, seq[key])
            if best is None or rank_key < best:
                best, best_key = rank_key, key
        assert best_key is not None, "the task graph has a cycle"
        t = tasks[best_key]
        end[best_key] = best[0] + t.cost
        if t.pool != DRIVER:
            pool_free[t.pool] = end[best_key]
        order.append(best_key)
        left.remove(best_key)
    return order


# ---------------------------------------------------------------- prediction
@dataclass
class Simulation:
    """A predicted (or replayed) timeline: start/end per task, makespan and bounds."""

    start: dict[tuple[str, int | None], float]
    end: dict[tuple[str, int | None], float]
    makespan: float
    critical_path: float
    pool_bound: tuple[str, float]
    measured: bool = False  # costs were measured seconds rather than declared relative costs

    @property
    def lower_bound(self) -> float:
        return max(self.critical_path, self.pool_bound[1])

    @property
    def efficiency(self) -> float:
        return self.lower_bound / self.makespan if self.makespan > 0 else 1.0


def simulate(plan: Plan, costs: dict[str, float] | None = None) -> Simulation:
    """List-schedule the plan: each pool runs its order sequentially; the driver in parallel.

    ``costs`` maps node → seconds for the whole batch (default: declared costs).
    """
    def cost(t: Task) -> float:
        if costs is None or t.node not in costs:
            return t.cost
        n = plan.micro_batches if t.mb is not None else 1
        return costs[t.node] / n

    start: dict[Any, float] = {}
    end: dict[Any, float] = {}
    pool_free: dict[str, float] = {}
    for key in plan.order:  # a topological order consistent with every pool's order
        t = plan.tasks[key]
        ready = max((end[d] for d in t.deps), default=0.0)
        s = ready if t.pool == DRIVER else max(ready, pool_free.get(t.pool, 0.0))
        start[key], end[key] = s, s + cost(t)
        if t.pool != DRIVER:
            pool_free[t.pool] = end[key]
    makespan = max(end.values(), default=0.0)
    return Simulation(start, end, makespan, *bounds_of(plan, {k: end[k] - start[k] for k in end}),
                      measured=costs is not None)


def bounds_of(plan: Plan, durations: dict[tuple[str, int | None], float]) -> tuple[float, tuple[str, float]]:
    """Two lower bounds of a step's makespan given task durations: the critical path
    through the task graph, and the tightest pool bound — a pool runs its tasks one at a
    time, cannot start before the earliest of them can, and after its last one ends at
    least the shortest remaining path is left: ``min head + Σ work + min tail``."""
    dur = {k: durations.get(k, 0.0) for k in plan.tasks}
    head: dict[Any, float] = {}
    for key in plan.order:
        head[key] = max((head[d] + dur[d] for d in plan.tasks[key].deps), default=0.0)
    succ: dict[Any, list[Any]] = {k: [] for k in plan.tasks}
    for key, t in plan.tasks.items():
        for d in t.deps:
            succ[d].append(key)
    tail: dict[Any, float] = {}
    for key in reversed(plan.order):
        tail[key] = max((dur[s] + tail[s] for s in succ[key]), default=0.0)
    critical = max((head[k] + dur[k] + tail[k] for k in plan.tasks), default=0.0)
    per_pool: dict[str, list[Any]] = {}
    for key, t in plan.tasks.items():
        if t.pool != DRIVER:
            per_pool.setdefault(t.pool, []).append(key)
    pools = {
        pool: min(head[k] for k in keys) + sum(dur[k] for k in keys) + min(tail[k] for k in keys)
        for pool, keys in per_pool.items()
    }
    tightest = max(pools.items(), key=lambda kv: kv[1], default=("", 0.0))
    return critical, tightest


def pool_work(plan: Plan, durations: dict[tuple[str, int | None], float]) -> dict[str, float]:
    """Seconds of work each pool did (driver tasks excluded)."""
    work: dict[str, float] = {}
    for key, d in durations.items():
        pool = plan.tasks[key].pool
        if pool != DRIVER:
            work[pool] = work.get(pool, 0.0) + d
    return work
