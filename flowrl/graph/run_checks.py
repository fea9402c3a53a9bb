"""The checks of a graph's run settings: the keys whose meaning depends on the graph (staleness per
role, a failure policy per node, restarts against checkpoints, the nodes trainer keys name, validation).
:func:`flowrl.graph.checks.check` runs them with the structural checks."""

from __future__ import annotations

import difflib
from typing import TYPE_CHECKING, Callable

from flowrl.graph.config import FAULT_WINDOWS, parse_fault
from flowrl.graph.problems import GraphProblem, SchemaError

if TYPE_CHECKING:
    from flowrl.graph.ir import Graph


def check_run_settings(graph: Graph, add: Callable[[GraphProblem], None]) -> None:
    """Keys whose meaning depends on the graph: staleness per role, validation."""
    staleness = graph.config.schedule.staleness
    if isinstance(staleness, dict):
        updated = sorted({node.role for node in graph.nodes.values() if node.updates_role and node.role})
        for role in staleness:
            if role not in updated:
                near = difflib.get_close_matches(role, updated, n=1, cutoff=0.5)
                what = "is not a role" if role not in graph.config.roles else "is never updated by a node"
                add(SchemaError(
                    f"schedule.staleness names {role!r}, which {what}: its bound would be ignored",
                    location=graph.locate("schedule", "staleness", role),
                    fix=(f"did you mean {near[0]!r}? " if near else "")
                    + f"staleness is keyed by updated roles: {', '.join(updated) or '(none in this graph)'}",
                ))
    for name, node in graph.nodes.items():
        policy = node.config.on_error
        if policy is not None and policy.then != "fail" and (node.updates_role or node.scope == "batch"):
            what = "updates its role" if node.updates_role else "is batch-scoped"
            add(SchemaError(
                f"on_error.then: {policy.then}, but the node {what}: its rows cannot be left out one group at a time "
                "(an update that failed half-way may already have changed the weights)",
                node=name, field="on_error", location=graph.locate("nodes", name, "on_error", "then"),
                fix="use drop_group on the row- or group-scoped node that fails (a reward, a tool, an environment); "
                    "here use on_error: {retries: N} or fail",
            ))
    updated = {node.role for node in graph.nodes.values() if node.updates_role}
    for pool, cfg in graph.config.pools.items():
        trained = sorted(set(cfg.roles) & updated)
        if cfg.max_restarts and (trained or cfg.workers > 1) and not graph.config.trainer.checkpoint_every:
            why = (f"its role {trained[0]!r} is updated" if trained
                   else f"its {cfg.workers} workers form one process group")
            add(SchemaError(
                f"pools.{pool}.max_restarts: {cfg.max_restarts}, but {why}, so a dead worker rolls the run back "
                f"to its last checkpoint, and trainer.checkpoint_every is 0 (no checkpoint before the end)",
                location=graph.locate("pools", pool, "max_restarts"), field="max_restarts",
                fix="set trainer.checkpoint_every (a dead worker costs the steps since the last checkpoint), "
                    "or max_restarts: 0",
            ))
    record, fault = graph.config.trainer.record, graph.config.trainer.fault
    named = [(("trainer", "record", "nodes", i), name) for i, name in enumerate(record.nodes if record else [])]
    named += [(("trainer", "fault"), parse_fault(fault).node)] if fault is not None else []
    for path, name in named:  # trainer keys that name a node
        if name not in graph.nodes and not (path[1] == "fault" and name in FAULT_WINDOWS):
            near = difflib.get_close_matches(name, list(graph.nodes), n=1, cutoff=0.5)
            add(SchemaError(f"{'.'.join(map(str, path[:3]))} names {name!r}, which is not a node of this graph",
                            location=graph.locate(*path), field=path[1],
                            fix=(f"did you mean {near[0]!r}? " if near else "")
                            + f"the nodes are: {', '.join(graph.nodes)}"))
    if graph.config.trainer.val_every and graph.scorer() is None:
        add(SchemaError(
            "trainer.val_every asks for validation, but no node scores responses (no node's operator "
            "declares a score output)",
            location=graph.locate("trainer", "val_every"),
            fix="add a reward node (its operator declares @operator(..., score='<output>')), or set "
                "trainer.val_every: 0",
        ))
