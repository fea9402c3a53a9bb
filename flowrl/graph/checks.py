"""Checks a graph before anything runs, and says exactly what is wrong.

Every problem is its own class (so tests and tools can tell them apart), names
where it was written (file and line when known), the node and the field, and
says how to fix it. :func:`check` collects them all at once into a
:class:`Report`; :meth:`Report.raise_if_errors` turns errors into one
:class:`GraphError`.

Example::

    report = graph.check()
    for problem in report.errors:
        print(problem)          # ppo.yaml:14: node 'advantage', field 'valuez': ...
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable

import networkx as nx

from flowrl.graph.problems import (
    BuildProblem,
    CycleError,
    DataSourceError,
    DuplicateProducerError,
    GraphImportError,
    FieldTypeError,
    GraphError,
    GraphProblem,
    MissingProducerError,
    ParameterError,
    ParameterWarning,
    PoolError,
    ResourceError,
    RoleError,
    RoleWithoutPoolError,
    SchemaError,
    UnknownOperatorError,
    UnresolvedInputWarning,
    UnusedOutputWarning,
)
from flowrl.graph.run_checks import check_run_settings
from flowrl.graph.spec import SOURCE

if TYPE_CHECKING:  # the IR calls these checks (Graph.check); they only read it
    from flowrl.graph.ir import Graph


@dataclass
class Report:
    """All problems of one graph, errors first."""

    graph: Graph | None
    problems: list[GraphProblem] = field(default_factory=list)

    @property
    def errors(self) -> list[GraphProblem]:
        return [p for p in self.problems if p.severity == "error"]

    @property
    def warnings(self) -> list[GraphProblem]:
        return [p for p in self.problems if p.severity == "warning"]

    @property
    def ok(self) -> bool:
        return not self.errors

    def of(self, cls: type[GraphProblem]) -> list[GraphProblem]:
        return [p for p in self.problems if isinstance(p, cls)]

    def raise_if_errors(self) -> None:
        if self.errors:
            raise GraphError(self.errors, self.warnings)


_BUILD_KINDS: dict[str, type[GraphProblem]] = {
    "unknown_operator": UnknownOperatorError,
    "parameter": ParameterError,
    "import": GraphImportError,
    "source": DataSourceError,
    "role_kind": RoleError,
    "role_settings": ParameterError,
}


def local_resources() -> dict[str, float]:
    """CPUs and GPUs of this machine (what a local Ray would get)."""
    gpus = 0
    try:
        import torch

        gpus = torch.cuda.device_count()
    except Exception:  # pragma: no cover - torch always imports in this stack
        pass
    return {"CPU": float(os.cpu_count() or 1), "GPU": float(gpus)}


def check(graph: Graph, resources: dict[str, float] | None = None) -> Report:
    """Every check at once: build problems, cycles, producers, types, roles, pools, resources."""
    report = Report(graph)
    add = report.problems.append
    for bp in graph.problems:
        add(_from_build(graph, bp))
    _check_cycles(graph, add)
    _check_fields(graph, add)
    _check_roles(graph, add)
    _check_pools(graph, add, resources if resources is not None else local_resources())
    _check_unused(graph, add)
    check_run_settings(graph, add)
    _run_declared_checks(graph, add)
    _collapse_cascades(report)
    report.problems.sort(key=lambda p: p.severity != "error")
    return report


def _from_build(graph: Graph, bp: BuildProblem) -> GraphProblem:
    return _BUILD_KINDS[bp.kind](bp.message, node=bp.node, field=bp.field,
                                 location=graph.locate(*bp.path), fix=bp.fix)


def _check_cycles(graph: Graph, add, limit: int = 5) -> None:
    for n_found, cycle in enumerate(nx.simple_cycles(graph.dag)):
        if n_found == limit:
            break
        loop = list(cycle) + [cycle[0]]
        hops = []
        for u, v in zip(loop, loop[1:]):
            fields = graph.dag.edges[u, v]["fields"]
            kind = graph.dag.edges[u, v]["kind"]
            label = ", ".join(fields) if fields else kind
            hops.append(f"{u} --[{label}]--> {v}")
        add(CycleError(
            "the step has a cycle: " + "  ".join(hops),
            node=cycle[0], location=graph.locate("nodes", cycle[0]),
            fix="a field must be produced before it is read within one step; values from the previous "
                "step flow through role state (an update), not through fields",
        ))


def _check_fields(graph: Graph, add) -> None:
    producers = graph.producers()
    unresolved = [n for n, node in graph.nodes.items() if node.op is None]
    known = sorted(producers)
    for pname, prods in producers.items():
        if len(prods) > 1:
            where = [p if p != SOURCE else "the data source" for p in prods]
            node = next((p for p in prods[1:] if p != SOURCE), prods[0])
            add(DuplicateProducerError(
                f"field {pname!r} is produced by {' and '.join(where)}; a field has exactly one producer "
                f"in a step",
                node=node, field=pname, location=graph.locate("nodes", node),
                fix=f"rename one output (outputs: {{{pname}: {pname}_2}}) or remove one producer",
            ))
    for name, node in graph.nodes.items():
        if node.op is None:
            continue
        for f in node.inputs:
            prods = producers.get(f.name, [])
            if not prods:
                if node.op_field(f.name) in node.op.optional_inputs:
                    continue
                near = difflib.get_close_matches(f.name, known, n=3, cutoff=0.6)
                fix = (f"did you mean {' or '.join(repr(n) for n in near)}? map it with "
                       f"inputs: {{{node.op_field(f.name)}: {near[0]}}}" if near else
                       "add a node that produces it, or declare it as a column of the data source")
                if unresolved and not near:  # likely an output of the unknown operator: a follow-on
                    add(UnresolvedInputWarning(
                        f"input {f.name!r} ({f.spec}) of operator {node.op_name!r} has no producer; it may "
                        f"be an output of {', '.join(repr(u) for u in unresolved)}, whose operator is unknown",
                        node=name, field=f.name, location=node.location, fix="fix the unknown operator first",
                    ))
                    continue
                add(MissingProducerError(
                    f"input {f.name!r} ({f.spec}) of operator {node.op_name!r} has no producer",
                    node=name, field=f.name, location=node.location, fix=fix,
                ))
                continue
            if len(prods) != 1:
                continue
            produced = (graph.source_fields if prods[0] == SOURCE else graph.nodes[prods[0]].outputs)
            pf = next(p for p in produced if p.name == f.name)
            why = pf.mismatch(f)
            if why:
                src = "the data source" if prods[0] == SOURCE else f"node {prods[0]!r}"
                add(FieldTypeError(
                    f"{src} produces {pf.spec} but operator {node.op_name!r} reads {f.spec}: {why}",
                    node=name, field=f.name, location=node.location,
                    fix="make the producer's declaration and the consumer's agree, or insert a node that "
                        "converts it",
                ))
    for name, node in graph.nodes.items():
        for dep in node.config.after:
            if dep not in graph.nodes:
                near = difflib.get_close_matches(dep, list(graph.nodes), n=3, cutoff=0.5)
                add(SchemaError(
                    f"'after' names {dep!r}, which is not a node", node=name,
                    location=graph.locate("nodes", name, "after"),
                    fix=f"did you mean {near[0]!r}?" if near else f"nodes are: {', '.join(graph.nodes)}",
                ))
    if SOURCE in graph.nodes:
        add(SchemaError(f"a node may not be named {SOURCE!r}: it names the data source", node=SOURCE,
                        location=graph.locate("nodes", SOURCE), fix="rename the node"))


def _check_roles(graph: Graph, add) -> None:
    roles = graph.config.roles
    for name, node in graph.nodes.items():
        if node.op is None:
            continue
        op = node.op
        if op.role is None:
            if node.config.role is not None:
                add(RoleError(
                    f"operator {op.name!r} runs on the driver and takes no role, but role "
                    f"{node.config.role!r} is given", node=name,
                    location=graph.locate("nodes", name, "role"), fix="remove 'role:' from the node",
                ))
            continue
        if node.role not in roles:
            near = difflib.get_close_matches(node.role or "", list(roles), n=2, cutoff=0.5)
            add(RoleError(
                f"operator {op.name!r} runs on role {node.role!r}, which is not declared under roles",
                node=name, location=graph.locate("nodes", name, "role"),
                fix=(f"did you mean role: {near[0]}?" if near else
                     f"declare it: roles: {{{node.role}: {{model: ...}}}}"),
            ))
            continue
        kind = graph.role_kinds.get(node.role)
        if kind is not None and op.role_kinds and kind not in op.role_kinds:
            add(RoleError(
                f"operator {op.name!r} needs a role of kind {' or '.join(op.role_kinds)}, but "
                f"{node.role!r} is a {kind}", node=name, location=graph.locate("nodes", name, "role"),
                fix="bind the node to another role with role: <name>",
            ))
        if op.updates_role and roles[node.role].frozen:
            add(RoleError(
                f"operator {op.name!r} updates its role, but {node.role!r} is frozen", node=name,
                location=graph.locate("nodes", name, "role"), fix="bind it to a trainable role",
            ))


def _check_pools(graph: Graph, add, resources: dict[str, float]) -> None:
    roles = graph.config.roles
    pools = graph.config.pools
    hosted: dict[str, list[str]] = {}
    for pool, cfg in pools.items():
        for role in cfg.roles:
            hosted.setdefault(role, []).append(pool)
            if role not in roles:
                add(PoolError(f"pool {pool!r} hosts {role!r}, which is not a role",
                              location=graph.locate("pools", pool, "roles"),
                              fix=f"roles are: {', '.join(roles) or '(none)'}"))
    for role, in_pools in hosted.items():
        if len(in_pools) > 1:
            add(PoolError(f"role {role!r} is in pools {' and '.join(in_pools)}; a role lives in one pool",
                          location=graph.locate("pools", in_pools[1], "roles"),
                          fix="remove it from all but one pool"))
    for role in roles:
        if role not in hosted:
            users = [n for n, node in graph.nodes.items() if node.role == role]
            add(RoleWithoutPoolError(
                f"role {role!r} is in no pool" + (f" (used by {', '.join(users)})" if users else ""),
                node=users[0] if users else None, location=graph.locate("roles", role),
                fix=f"add it to a pool: pools: {{<pool>: {{roles: [{role}]}}}}",
            ))
    for res, key in (("CPU", "cpus"), ("GPU", "gpus")):
        asked = {p: cfg.workers * getattr(cfg, key) for p, cfg in pools.items()}
        total = sum(asked.values())
        have = resources.get(res, 0.0)
        if total > have + 1e-9:
            detail = ", ".join(f"{p} {pools[p].workers}×{getattr(pools[p], key):g}" for p in asked if asked[p])
            add(ResourceError(
                f"the pools ask for {total:g} {res}s ({detail}) but the cluster has {have:g}",
                location=graph.locate("pools"),
                fix=f"lower workers or {key} per worker, or run on a cluster with more {res}s",
            ))


def _check_unused(graph: Graph, add) -> None:
    consumers = graph.consumers()
    for name, node in graph.nodes.items():
        for f in node.outputs:
            if f.name not in consumers and node.op_field(f.name) not in node.op.aux_outputs:
                add(UnusedOutputWarning(
                    f"output {f.name!r} is produced but no node reads it", node=name, field=f.name,
                    location=node.location, fix="ignore this if you read it from the run's outputs",
                ))


# ---------------------------------------------------------------- what the run would reject
#: validate-time checks declared by operator packages (:func:`graph_check`)
GRAPH_CHECKS: list[Callable[[Graph], Iterable[GraphProblem]]] = []


def graph_check(fn: Callable[[Graph], Iterable[GraphProblem]]) -> Callable[[Graph], Iterable[GraphProblem]]:
    """Declare a check that :func:`check` (so ``flowrl validate``) runs on every built graph.

    A package uses it for what only it knows and the run would otherwise reject
    late: a reward function that does not import, a dataset without a column its
    consumers need, a model directory without ``config.json``. The check gets the
    graph and yields problems; it must be cheap and start nothing.

    Example::

        @graph_check
        def _reward_fn_imports(graph):
            for name, node in graph.nodes.items():
                if node.op_name == "reward.rule" and not importable(node.params.fn):
                    yield ParameterError(..., node=name, field="fn",
                                         location=graph.locate("nodes", name, "fn"))
    """
    GRAPH_CHECKS.append(fn)
    return fn


def _run_declared_checks(graph: Graph, add) -> None:
    for fn in GRAPH_CHECKS:
        try:
            for problem in fn(graph):
                add(problem)
        except Exception as e:  # noqa: BLE001 - a broken check is reported, never a traceback
            add(SchemaError(f"the check {fn.__module__}.{fn.__name__} failed: {type(e).__name__}: {e}",
                            fix="report this as a bug of the package that declares the check"))


def _collapse_cascades(report: Report) -> None:
    """List errors caused by an earlier one under it, instead of as new errors with wrong fixes.

    A data source that does not resolve provides no fields, so every node reading a
    prompt column would report a missing producer: those become one line under the
    data-source error.
    """
    graph = report.graph
    if graph is None or graph.source_fields:
        return
    causes = [p for p in report.problems if isinstance(p, DataSourceError)
              or (isinstance(p, ParameterError) and p.message.startswith("data: "))]
    if not causes:
        return
    follow = [p for p in report.problems if isinstance(p, MissingProducerError)
              and "did you mean" not in p.fix]
    if not follow:
        return
    for p in follow:
        report.problems.remove(p)
    fields = sorted({p.field for p in follow if p.field})
    nodes = sorted({p.node for p in follow if p.node})
    cause = causes[0]
    cause.message += (f" (so the data source provides no fields: {len(follow)} inputs of "
                      f"{', '.join(nodes)} have no producer: {', '.join(fields)})")
    cause.args = (str(cause),)


__all__: list[Any] = [
    "GraphProblem", "SchemaError", "CycleError", "MissingProducerError",
    "DuplicateProducerError", "FieldTypeError", "UnknownOperatorError", "ParameterError", "ParameterWarning", "RoleError",
    "RoleWithoutPoolError", "PoolError", "ResourceError", "DataSourceError", "UnusedOutputWarning",
    "UnresolvedInputWarning",
    "Report", "GraphError", "check", "local_resources", "graph_check", "GRAPH_CHECKS",
]
