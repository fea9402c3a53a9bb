"""Searching a graph's configurations for the fastest step on a budget, from measured costs.

What may vary without changing the algorithm: which roles share a pool (and
so a process), workers per pool, ``schedule.micro_batches``, the updates'
``micro_batch_size`` (gradient accumulation: the same loss, less memory), and
``schedule.staleness`` from 0 up to a bound the user gives (without one the
graph's own staleness is kept: the algorithm is never changed unless asked). Each candidate is a set of ``--set``
overrides, built into a graph the way ``--set`` builds one, checked by the
graph checker, planned by :func:`~flowrl.plan.planner.make_plan` and predicted
by :func:`~flowrl.plan.costfit.predict_step` (tasks sharing the budget's cores) with the tasks' seconds from
the cost file (:func:`~flowrl.plan.costs.task_seconds`): the plan and the
order the run itself would use. Candidates over the memory budget are rejected.

Example::

    result = search(graph, lambda o: load_graph("grpo", overrides=o), costs, Budget(cpus=2))
    best = result.ranked[0]
    print(best.overrides, best.step_s)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import product
from typing import Any, Callable, Iterator

from flowrl.errors import ConfigError
from flowrl.graph import Graph, GraphError
from flowrl.plan.costfit import cores_for, predict_step
from flowrl.plan.costs import GIB, CostFile, device_memory, task_seconds
from flowrl.plan.critical import critical_path
from flowrl.plan.planner import Plan, PlanError, TaskKey, make_plan
from flowrl.plan.pools import DRIVER
from flowrl.plan.simulate import pool_work
from flowrl.plan.traits import RAY, BackendTraits

MICRO_BATCHES = (1, 2, 4, 8)
#: worker counts tried per pool (powers of two keep the space small on a large budget)
WORKERS = (1, 2, 4, 8, 16, 32, 64)
ASSUMPTIONS = (
    "a data-parallel pass on a worker count never profiled takes fixed + per-row × its rows / ranks (rows "
    "split evenly, the measured per-row cost); a profiled worker count uses the line measured there (from "
    "two row counts; from one, the line scaled by the slowdown measured there)",
    "an update on N ranks adds a gradient all-reduce of 2(N-1)/N × its weights at the measured bytes/s",
    "a weight sync to another pool costs the measured fixed + bytes/s; nodes add no network cost beyond it",
    "workers share the budget's CPU cores: while more processes run than there are cores, each runs "
    "cores / running as fast (the driver's tasks are threads of one process); on GPUs each worker has its own",
    "a task's latency and the driver's work per step are the profiled ones, whatever the task count",
)


class SearchError(ConfigError, ValueError):
    """The search cannot run (a budget nothing fits, a staleness bound the graph cannot use)."""


@dataclass(frozen=True)
class Budget:
    cpus: float
    gpus: int = 0
    nodes: int = 1
    memory_per_device: float | None = None  # bytes
    max_staleness: int | None = None  # None: keep the graph's own staleness (the algorithm as written)

    @property
    def devices(self) -> float:
        """Workers the budget can host: one per GPU when GPUs are given, else one per CPU."""
        return (self.gpus if self.gpus else self.cpus) * self.nodes


@dataclass
class Outcome:
    """One candidate configuration and its prediction (or why it was rejected)."""

    overrides: dict[str, Any]
    step_s: float = 0.0  # predicted seconds per step, steps back to back
    makespan_s: float = 0.0  # one step alone
    utilisation: dict[str, float] = field(default_factory=dict)  # pool → busy share of a step
    memory: dict[str, int] = field(default_factory=dict)  # pool → bytes per device
    critical: list[TaskKey] = field(default_factory=list)
    bound: str = ""  # what limits it: the critical path or the busiest pool
    rejected: str = ""
    plan: Plan | None = None

    @property
    def ok(self) -> bool:
        return not self.rejected


@dataclass
class SearchResult:
    ranked: list[Outcome]  # fitting candidates, fastest first
    rejected: list[Outcome]
    shipped: Outcome  # the graph as given
    extrapolated: bool = False

    @property
    def best(self) -> Outcome:
        return self.ranked[0]


def set_partitions(items: list[str]) -> Iterator[list[list[str]]]:
    """Every way to cut ``items`` into groups (which roles share a pool)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in set_partitions(rest):
        yield [[first], *part]
        for i in range(len(part)):
            yield [*part[:i], [first, *part[i]], *part[i + 1:]]


def pool_layouts(graph: Graph, budget: Budget) -> Iterator[dict[str, dict[str, Any]]]:
    """``pools:`` sections: every grouping of the placed roles, every worker count per pool that fits."""
    pools = graph.config.pools
    roles = [r for p in pools.values() for r in p.roles]
    home = {r: name for name, p in pools.items() for r in p.roles}
    for groups in set_partitions(roles):
        names: list[str] = []
        for group in groups:
            # a group keeps the name of the pool its first role came from, when no other group took it
            name = home[group[0]]
            names.append(name if name not in names else "_".join(group))
        counts = [w for w in WORKERS if w <= budget.devices]
        for workers in product(counts, repeat=len(groups)):
            if sum(workers) > budget.devices:
                continue
            section = {}
            for name, group, w in zip(names, groups, workers):
                base = pools[home[group[0]]].model_dump()
                base.update(workers=w, roles=group, cpus=1.0, gpus=1.0 if budget.gpus else 0.0)
                section[name] = base
            yield section


def candidates(graph: Graph, budget: Budget) -> Iterator[dict[str, Any]]:
    """Override sets for every configuration the budget allows (the checker may still refuse some)."""
    prompts = graph.config.data.batch_size
    updates = [n for n, node in graph.nodes.items() if node.updates_role and "micro_batch_size" in
               type(node.params).model_fields] if budget.memory_per_device else []
    micro_sizes: list[int | None] = [None]
    if updates:
        rows = prompts * max(graph.nodes[n].op.expansion(graph.nodes[n].params) for n in graph.nodes)
        micro_sizes += [rows // d for d in (2, 4, 8, 16) if rows // d >= 1]
    own = graph.config.schedule.staleness
    stalenesses = [own] if budget.max_staleness is None else list(range(budget.max_staleness + 1))
    for pools in pool_layouts(graph, budget):
        most = max(p["workers"] for p in pools.values())
        # generation keeps a prompt's samples on one rank: fewer prompts in a micro-batch than ranks leaves
        # a rank nothing to generate (the run then fails on the empty shard)
        for k in (m for m in MICRO_BATCHES if m * most <= prompts):
            for s in stalenesses:
                for micro in micro_sizes:
                    out: dict[str, Any] = {"pools": pools, "schedule.micro_batches": k, "schedule.staleness": s}
                    out.update({f"nodes.{n}.micro_batch_size": micro for n in updates})
                    yield out


def check_budget(graph: Graph, budget: Budget) -> None:
    """What no candidate could fix, said once."""
    if budget.devices < 1:
        raise SearchError(f"the budget ({budget.cpus:g} CPU(s), {budget.gpus} GPU(s) × {budget.nodes} node(s)) "
                          f"cannot host one worker: every pool needs at least one CPU (or one GPU with --gpus)")
    if budget.max_staleness is None:
        return
    if budget.max_staleness > 0 and not graph.state_edges:
        raise SearchError(f"--max-staleness {budget.max_staleness}: graph {graph.name!r} has no state edge (no "
                          f"node reads the weights of a role another node updates), so there is nothing a "
                          f"staleness bound could let run ahead; leave --max-staleness at 0")
    if budget.max_staleness < 0:
        raise SearchError("--max-staleness must be >= 0 (0: the synchronous step)")
    same = [e for e in graph.state_edges if graph.nodes[e.dst].role == e.role]
    if budget.max_staleness > 0 and len(same) == len(graph.state_edges):
        edges = ", ".join(f"{e.src} → {e.dst}" for e in same)
        raise SearchError(f"--max-staleness {budget.max_staleness}: every state edge of graph {graph.name!r} "
                          f"({edges}) reads the role it updates, and a role lives in one process: no placement "
                          f"lets its readers run on older weights, so staleness changes nothing here. Give the "
                          f"reader a role of its own ({{from: {same[0].role}}}, as grpo_async does), or leave "
                          f"--max-staleness at 0")


def evaluate(graph: Graph, costs: CostFile, budget: Budget, overrides: dict[str, Any],
             traits: BackendTraits = RAY) -> Outcome:
    """Plan and predict one built, checked candidate graph; reject it when it does not fit."""
    out = Outcome(overrides)
    report = graph.check(resources={"CPU": budget.cpus * budget.nodes, "GPU": float(budget.gpus * budget.nodes)})
    if not report.ok:
        out.rejected = "graph check: " + str(report.errors[0])
        return out
    try:
        plan = make_plan(graph, traits)
    except PlanError as e:
        out.rejected = f"plan: {e}"
        return out
    out.plan = plan
    for task in plan.tasks.values():
        lo, hi = plan.rows(plan.spaces[task.node], task.mb)
        inputs = (hi - lo) // max(1, task.factor)  # a node that expands rows splits its input rows
        if task.dispatch != "all" and len(task.ranks) > 1 and inputs < len(task.ranks):
            out.rejected = (f"plan: a task of node {task.node!r} has {inputs} input rows for the "
                            f"{len(task.ranks)} ranks of pool {task.pool!r}: a rank would run on none")
            return out
    out.memory = device_memory(plan, costs)
    over = {p: b for p, b in out.memory.items() if budget.memory_per_device and b > budget.memory_per_device}
    if over:
        pool, need = max(over.items(), key=lambda kv: kv[1])
        out.rejected = (f"memory: pool {pool!r} needs {need / GIB:.2f} GiB per device, over the "
                        f"{budget.memory_per_device / GIB:.2f} GiB budget")
    seconds = task_seconds(plan, costs)
    out.step_s, out.makespan_s = predict_step(plan, costs, cores_for(plan, budget.cpus * budget.nodes))
    work = pool_work(plan, seconds)
    out.utilisation = {p: min(1.0, w / out.step_s) if out.step_s > 0 else 0.0 for p, w in work.items()}
    cp = critical_path(plan.tasks, seconds, plan.order)
    out.critical, length = cp.path, cp.length
    busiest = max(work.items(), key=lambda kv: kv[1], default=("", 0.0))
    out.bound = (f"pool {busiest[0]!r} busy {busiest[1]:.3g}s of each step" if busiest[1] >= length
                 else f"critical path {length:.3g}s")
    return out


def search(graph: Graph, build: Callable[[dict[str, Any]], Graph], costs: CostFile, budget: Budget,
           traits: BackendTraits = RAY, machine: tuple[float, int] | None = None) -> SearchResult:
    """Every candidate built with ``build`` (the ``--set`` path), checked, planned and predicted.

    ``machine``: ``(cpus, gpus)`` here; a budget beyond it, or worker counts beyond the profiled
    ones, make the predictions extrapolations (:data:`ASSUMPTIONS`)."""
    check_budget(graph, budget)
    shipped = evaluate(graph, costs, budget, {}, traits)
    ranked, rejected = [], []
    for overrides in candidates(graph, budget):
        try:
            g = build(overrides)
        except GraphError as e:
            rejected.append(Outcome(overrides, rejected="graph: " + str(e.problems[0] if e.problems else e)))
            continue
        o = evaluate(g, costs, budget, overrides, traits)
        (ranked if o.ok else rejected).append(o)
    if not ranked:
        raise SearchError(no_fit_message(budget, rejected))
    ranked.sort(key=lambda o: (round(o.step_s, 6), _workers(o), o.overrides["schedule.micro_batches"],
                               str(o.overrides["schedule.staleness"])))
    measured = {1} | {int(w) for w in costs.measured_with.get("workers", {}).values()}
    measured |= {w for n in costs.nodes.values() for w in n.world_factor}
    beyond = machine is not None and (budget.cpus * budget.nodes > machine[0] or budget.gpus * budget.nodes >
                                      machine[1] or budget.nodes > 1)
    wider = any(p["workers"] not in measured for p in ranked[0].overrides["pools"].values())
    return SearchResult(ranked, rejected, shipped, extrapolated=beyond or wider)


def no_fit_message(budget: Budget, rejected: list[Outcome]) -> str:
    memory = [o for o in rejected if o.rejected.startswith("memory") and o.memory]
    if memory:
        least = min(memory, key=lambda o: max(o.memory.values()))
        need = max(least.memory.values())
        return (f"no configuration fits {budget.memory_per_device / GIB:.2f} GiB per device: the smallest needs "
                f"{need / GIB:.2f} GiB ({least.rejected}); raise --memory-per-device or add devices")
    reason = rejected[0].rejected if rejected else "no candidate"
    return f"no configuration fits the budget of {budget.cpus:g} CPU(s), {budget.gpus} GPU(s): {reason}"


def _workers(o: Outcome) -> int:
    return sum(p["workers"] for p in o.overrides["pools"].values())


def describe(o: Outcome) -> str:
    """A candidate in words: pools with their roles and workers, micro-batches, staleness."""
    pools = "; ".join(f"{n}: {'+'.join(p['roles'])} ×{p['workers']}" for n, p in o.overrides.get("pools", {}).items())
    rest = [f"{k.split('.')[-1] if k.startswith('schedule') else k}={v}" for k, v in o.overrides.items()
            if k != "pools" and v is not None]
    return ", ".join(filter(None, [pools, *rest])) or "as shipped"


def why(result: SearchResult) -> str:
    """Why the best candidate wins, against the shipped configuration and the runner-up."""
    best, shipped = result.best, result.shipped
    parts = [f"{best.step_s:.3g} s/step, bound by the {best.bound}"]
    if shipped.ok and shipped.step_s > 0:
        ratio = shipped.step_s / best.step_s if best.step_s > 0 else float("inf")
        parts.append(f"{ratio:.2f}× the shipped configuration's predicted speed ({shipped.step_s:.3g} s/step, "
                     f"bound by the {shipped.bound})" if ratio > 1.0005 else "the shipped configuration is as fast")
    if len(result.ranked) > 1:
        second = result.ranked[1]
        parts.append(f"runner-up {describe(second)} at {second.step_s:.3g} s/step"
                     + (" (a tie: fewer workers, micro-batches and staleness win)" if
                        round(second.step_s, 6) == round(best.step_s, 6) else ""))
    busy = {p: u for p, u in best.utilisation.items() if p != DRIVER}
    if busy:
        parts.append("utilisation " + ", ".join(f"{p} {u:.0%}" for p, u in sorted(busy.items())))
    return "; ".join(parts)


__all__ = ["ASSUMPTIONS", "Budget", "Outcome", "SearchError", "SearchResult", "candidates", "check_budget",
           "describe", "evaluate", "pool_layouts", "search", "set_partitions", "why"]
