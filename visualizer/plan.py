"""``flowrl plan``: placement, every task of a step (the rows it reads and their
repeat factor, its dispatch over the pool's ranks, its gates and weight syncs),
per-pool order, staleness, and a predicted timeline drawn as a Gantt chart — all
before any model starts. What it prints is the plan the runtime submits.

Example::

    from flowrl.plan.planner import make_plan
    print_plan(make_plan(graph))
"""

from __future__ import annotations

from typing import Any

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from flowrl.data.dispatch import get_mode
from flowrl.graph import SOURCE
from flowrl.plan.planner import DRIVER, Plan, Read, Simulation, Task
from visualizer.dag import pool_colors


def render_plan(plan: Plan, costs: dict[str, float] | None = None, width: int = 80) -> Group:
    g = plan.graph
    colors = pool_colors(g)  # the same colour per pool as flowrl viz and the live view
    colors[DRIVER] = "white"
    parts: list[Any] = []

    place = Table(title=f"placement — {g.name} on the {plan.traits.name} backend", title_justify="left",
                  expand=False)
    for col in ("pool", "workers", "per worker", "roles (one process)", "nodes"):
        place.add_column(col, overflow="fold")
    for spec in plan.pools:
        per = f"{spec.cpus:g} CPU" + (f", {spec.gpus:g} GPU" if spec.gpus else "")
        nodes = [n for n in g.nodes if plan.pool_of(n) == spec.name]
        roles = ", ".join(b.name + (f" (shares {b.shares})" if b.shares else " (frozen copy)" if b.frozen else "")
                          for b in spec.roles)
        place.add_row(Text(spec.name, style=colors[spec.name]), str(spec.workers), per, roles, ", ".join(nodes))
    driver_nodes = [n for n in g.nodes if plan.pool_of(n) == DRIVER]
    if driver_nodes:
        place.add_row(Text(DRIVER, style="white"), "-", "0 CPU", "-", ", ".join(driver_nodes))
    parts.append(place)

    sched = Table(title="schedule", title_justify="left")
    for col in ("node", "scope", "tasks", "rows", "dispatch", "why (rows → ranks)"):
        sched.add_column(col, overflow="fold")
    for name in g.topological_order():
        node = g.nodes[name]
        tasks = plan.node_tasks(name)
        streamed = tasks[0].mb is not None
        space = plan.spaces[name]
        rows = f"× {space.factor}" if space.factor > 1 else "prompts"
        sched.add_row(name, node.scope, f"{len(tasks)} micro-batches" if streamed else "1 (whole batch)",
                      rows, tasks[0].dispatch, plan.dispatch_rules.get(name, ""))
    parts.append(sched)
    modes = sorted({t.dispatch for t in plan.tasks.values()})
    parts.append(Text("dispatch: " + "; ".join(f"{m}: {get_mode(m).doc}" for m in modes), style="dim"))

    parts.append(render_tasks(plan, colors))

    order = Text("per-pool order (critical path first):\n", style="bold")
    for pool, keys in plan.pool_order.items():
        order.append(f"  {pool}: ", style=colors.get(pool, "white"))
        order.append(" → ".join(k[0] + (f"[{k[1]}]" if k[1] is not None else "") for k in keys) + "\n")
    parts.append(order)

    stale = Text("state edges (update at step t → use at step t+1):\n", style="bold")
    if not g.state_edges:
        stale.append("  none\n")
    for e in g.state_edges:
        move = "moves weights across pools" if g.pool_of(e.src) != g.pool_of(e.dst) else "same process, no copy"
        stale.append(f"  {e.src} ⇢ {e.dst} (role {e.role}, staleness {e.staleness}: {move})\n")
    parts.append(stale)

    if plan.validation is not None:
        val = plan.validation
        parts.append(Text(f"validation (a second plan, queued behind a step): {', '.join(val.graph.nodes)} on "
                          f"held-out prompts, one micro-batch, " + "; ".join(
                              f"{n} {t.dispatch}" for n, t in ((t.node, t) for t in val.tasks.values())), style="dim"))

    sim = plan.simulate(costs)
    parts.append(render_gantt(plan, sim, colors, width=width))
    return Group(*parts)


def _tag(key: tuple[str, int | None]) -> str:
    return key[0] + (f"[{key[1]}]" if key[1] is not None else "")


def _read_text(r: Read) -> str:
    srcs = r.srcs
    if len(srcs) > 1 and all(k[0] == srcs[0][0] for k in srcs):
        src = f"{srcs[0][0]}[{srcs[0][1]}..{srcs[-1][1]}]"  # every micro-batch of one producer
    else:
        src = ", ".join("data" if k[0] == SOURCE else _tag(k) for k in srcs)
    rows = f" rows {r.rows[0]}:{r.rows[1]}" if r.rows is not None else ""
    rep = f" ×{r.repeat}" if r.repeat > 1 else ""
    return f"{src}{rows}{rep} ({len(r.fields)} field{'s' if len(r.fields) != 1 else ''})"


def _rows_in(plan: Plan, task: Task) -> int:
    """The rows a task's operator receives (before its dispatch splits them over ranks)."""
    for r in task.reads:
        if r.rows is not None:
            return (r.rows[1] - r.rows[0]) * r.repeat
        n = sum(plan.rows(plan.spaces[k[0]], k[1])[1] - plan.rows(plan.spaces[k[0]], k[1])[0] for k in r.srcs)
        return n * r.repeat
    return 0


def render_tasks(plan: Plan, colors: dict[str, str]) -> Table:
    """Every task of one step: what it reads, its rows, its dispatch over ranks, its gates and syncs."""
    table = Table(title="tasks of step t (what the runtime submits)", title_justify="left")
    for col in ("task", "pool", "reads", "rows in → out", "ranks (dispatch)", "gates / syncs"):
        table.add_column(col, overflow="fold")
    for key in plan.order:
        t = plan.tasks[key]
        n_in = _rows_in(plan, t)
        mode = get_mode(t.dispatch)
        ranks = ",".join(map(str, t.ranks))
        collect = "all ranks" if list(t.collected) == list(t.ranks) and len(t.ranks) > 1 else \
            f"rank {','.join(map(str, t.collected))}"
        dispatch = f"{t.dispatch}: {ranks} → {collect}" + (" (whole batch each)" if
                                                            mode.name == "all" and len(t.ranks) > 1 else "")
        gates = [f"after {g.src}@t-{g.offset} (weights ≥ version t" + (f"-{g.staleness})" if g.staleness else ")")
                 for g in t.gates]
        gates += [f"load {g.sync_role} ← {g.role}@t-{g.offset}" for g in t.syncs]
        if t.updates:
            gates.append(f"updates {t.updates}" + (", publishes its weights" if t.publishes else ""))
        table.add_row(Text(_tag(key), style=colors.get(t.pool, "white")), t.pool,
                      "; ".join(_read_text(r) for r in t.reads) or "-", f"{n_in} → {n_in * t.factor}",
                      dispatch, "; ".join(gates) or "-")
    return table


def render_gantt(plan: Plan, sim: Simulation, colors: dict[str, str], width: int = 80) -> Text:
    """One lane per pool (and the driver); each task a bar labelled with its node."""
    label_w = max(len(p) for p in list(plan.pool_order) + ["driver"]) + 2
    bar_w = max(20, width - label_w - 2)
    scale = bar_w / sim.makespan if sim.makespan > 0 else 1.0
    basis = "measured seconds" if sim.measured else "declared costs"
    # declared costs are relative (a node of cost 1 takes one unit); measured ones are seconds
    unit = " s" if sim.measured else " cost units"
    out = Text(f"predicted timeline ({basis}): makespan {sim.makespan:.2f}{unit}, lower bound "
               f"{sim.lower_bound:.2f}{unit}, efficiency {sim.efficiency:.2f} (lower bound / makespan)\n",
               style="bold")
    for pool, keys in plan.pool_order.items():
        lane = [" "] * bar_w
        for k in keys:
            a = int(sim.start[k] * scale)
            b = max(a + 1, int(sim.end[k] * scale))
            tag = k[0] + (str(k[1]) if k[1] is not None else "")
            # "▕label━━━": a bar per task, its name as far as it fits
            cells = ("▕" + tag + "━" * bar_w)[: max(1, b - a)]
            for i, ch in enumerate(cells):
                if a + i < bar_w:
                    lane[a + i] = ch
        out.append(pool.ljust(label_w), style=colors.get(pool, "white"))
        out.append("".join(lane) + "\n", style=colors.get(pool, "white"))
    return out


def print_plan(plan: Plan, console: Console | None = None, costs: dict[str, float] | None = None) -> None:
    console = console or Console()
    console.print(render_plan(plan, costs, width=console.width))
