"""The graph IR: nodes, the fields they read and write, and the edges between them.

Both front ends (YAML and ``@graph`` tracing) produce a :class:`GraphConfig`;
:meth:`Graph.from_config` resolves every node against the registry and builds
the IR. Building never runs an operator and never raises for a semantic
problem: problems found while resolving (an unknown operator, a bad parameter)
are kept and reported by :func:`flowrl.graph.checks.check` together with the
structural ones, so a user sees everything wrong at once.

Edges are inferred from fields — the producer of ``responses`` feeds every
consumer of ``responses`` — plus explicit ``after`` edges and *order* edges that
make every reader of a role run before the node that updates it. The update of
a role at step t feeds that role's users at step t+1: a :class:`StateEdge`
carrying the schedule's staleness bound.

Example::

    graph = load_graph("graphs/ppo.yaml")
    for name in graph.topological_order():
        print(name, graph.nodes[name].op_name, graph.nodes[name].role)
"""

from __future__ import annotations

from typing import Any

import networkx as nx
from pydantic import ValidationError

from flowrl.data.fields import Field
from flowrl.graph.checks import Report, check
from flowrl.graph.config import GraphConfig, NodeConfig, RoleConfig
from flowrl.graph.nodes import Node, StateEdge
from flowrl.graph.problems import BuildProblem, Location, parameter_fix, pydantic_message
from flowrl.graph.registry import REGISTRY, ImportPathError, UnknownNameError, load_module, source_kind
from flowrl.graph.spec import SOURCE, TokenMetrics


class Graph:
    """An inert, checked-on-demand RL step: what ``validate``, ``viz``, ``plan`` and ``run`` consume."""

    def __init__(
        self,
        config: GraphConfig,
        *,
        source_file: str | None = None,
        lines: dict[tuple[Any, ...], int] | None = None,
    ) -> None:
        self.config = config
        self.source_file = source_file
        self._lines = lines or {}
        self.problems: list[BuildProblem] = []
        self.nodes: dict[str, Node] = {}
        self.source_fields: tuple[Field, ...] = ()
        self.role_kinds: dict[str, str | None] = {}
        self.dag = nx.DiGraph()
        self.state_edges: list[StateEdge] = []

    # ------------------------------------------------------------------ build
    @classmethod
    def from_config(
        cls,
        config: GraphConfig,
        *,
        source_file: str | None = None,
        lines: dict[tuple[Any, ...], int] | None = None,
    ) -> "Graph":
        g = cls(config, source_file=source_file, lines=lines)
        g._import_modules()
        g._resolve_source()
        g._resolve_roles()
        for name, node_cfg in config.nodes.items():
            g.nodes[name] = g._resolve_node(name, node_cfg)
        g._build_dag()
        return g

    def locate(self, *path: Any) -> Location:
        """The file and line of a config key, e.g. ``locate("nodes", "generate", "n")``."""
        path = tuple(path)
        while path:
            if path in self._lines:
                return Location(self.source_file, self._lines[path])
            path = path[:-1]
        return Location(self.source_file, self._lines.get((), None))

    def _import_modules(self) -> None:
        for i, mod in enumerate(self.config.imports):
            try:
                load_module(mod)
            except ImportPathError as e:
                self.problems.append(BuildProblem("import", str(e), path=("imports", i),
                                                  fix="check the module name and that it is on PYTHONPATH"))

    def _resolve_source(self) -> None:
        data = self.config.data
        try:
            spec = REGISTRY.source(source_kind(data.source))
        except UnknownNameError as e:
            self.problems.append(BuildProblem("source", f"unknown data source kind {e.name!r}",
                                              path=("data", "source"),
                                              fix=f"{e.did_you_mean()}known kinds: {', '.join(sorted(REGISTRY.sources))}; "
                                                  f"write builtin:<task> or a .parquet/.jsonl path"))
            return
        try:
            cfg = spec.config.model_validate(data.dump())
        except ValidationError as e:
            for err in e.errors():
                self.problems.append(BuildProblem(
                    "parameter", f"data: {pydantic_message(err)}", path=("data", *err["loc"]),
                    fix=parameter_fix(spec.config, err),
                ))
            return
        self.source_fields = spec.fields(cfg)

    def _resolve_roles(self) -> None:
        roles = self.config.roles
        for name in roles:
            self.role_kinds[name] = self._role_kind(name, roles, set())
        known = sorted(REGISTRY.roles) or ["(none registered)"]
        for name, role in roles.items():
            kind = self.role_kinds[name]
            if kind is None and role.from_ is None:
                self.problems.append(BuildProblem(
                    "role_kind", f"role {name!r} has no kind: its name is not a role kind and it sets no 'kind:'",
                    path=("roles", name), fix=f"add kind: <one of {', '.join(known)}>, or name the role after one",
                ))
                continue
            if kind is None or kind not in REGISTRY.roles:
                if kind is not None:
                    self.problems.append(BuildProblem(
                        "role_kind", f"role {name!r}: unknown kind {kind!r}", path=("roles", name),
                        fix=f"set 'kind:' to one of {', '.join(known)}",
                    ))
                continue
            if role.from_ is not None:
                continue  # a derived role takes its settings from its source
            try:
                REGISTRY.roles[kind].config.model_validate(role.settings)
            except ValidationError as e:
                for err in e.errors():
                    self.problems.append(BuildProblem(
                        "role_settings", f"role {name!r}: {pydantic_message(err)}",
                        path=("roles", name, *err["loc"]), fix=parameter_fix(REGISTRY.roles[kind].config, err),
                    ))

    def _role_kind(self, name: str, roles: dict[str, RoleConfig], seen: set[str]) -> str | None:
        role = roles[name]
        if role.kind:
            return role.kind
        if role.from_ is not None:
            if role.from_ not in roles:
                self.problems.append(BuildProblem(
                    "role_kind", f"role {name!r} is derived from {role.from_!r}, which is not a role",
                    path=("roles", name, "from"), fix=f"declare {role.from_!r} under roles:",
                ))
                return None
            if role.from_ in seen or role.from_ == name:
                self.problems.append(BuildProblem(
                    "role_kind", f"role {name!r}: 'from' chain loops back to itself",
                    path=("roles", name, "from"),
                ))
                return None
            return self._role_kind(role.from_, roles, seen | {name})
        REGISTRY.load_plugins()
        return name if name in REGISTRY.roles else None

    def _resolve_node(self, name: str, cfg: NodeConfig) -> Node:
        node = Node(name=name, config=cfg, location=self.locate("nodes", name))
        try:
            node.op = REGISTRY.operator(cfg.op)
        except UnknownNameError as e:
            self.problems.append(BuildProblem(
                "unknown_operator", f"unknown operator {e.name!r}", node=name, path=("nodes", name, "op"),
                fix=e.did_you_mean() + e.hint,
            ))
            return node
        except ImportPathError as e:
            self.problems.append(BuildProblem("unknown_operator", str(e), node=name,
                                              path=("nodes", name, "op")))
            return node
        op = node.op
        try:
            node.params = op.params.model_validate(cfg.params)
        except ValidationError as e:
            for err in e.errors():
                self.problems.append(BuildProblem(
                    "parameter", f"operator {op.name!r}: {pydantic_message(err)}", node=name,
                    field=str(err["loc"][0]) if err["loc"] else None,
                    path=("nodes", name, *err["loc"]), fix=parameter_fix(op.params, err),
                ))
        node.role = cfg.role if cfg.role is not None else op.role
        for what, declared, renames in (("input", op.inputs, cfg.inputs), ("output", op.outputs, cfg.outputs)):
            known = {f.name for f in declared}
            for key in renames:
                if key not in known:
                    self.problems.append(BuildProblem(
                        "parameter", f"operator {op.name!r} has no {what} field {key!r} to rename",
                        node=name, field=key, path=("nodes", name, f"{what}s", key),
                        fix=f"its {what}s are: {', '.join(sorted(known)) or '(none)'}",
                    ))
        node.inputs = tuple(f.renamed(cfg.inputs.get(f.name, f.name)) for f in op.inputs)
        node.outputs = tuple(f.renamed(cfg.outputs.get(f.name, f.name)) for f in op.outputs)
        return node

    def _build_dag(self) -> None:
        dag = self.dag
        dag.add_node(SOURCE, kind="source")
        for name, node in self.nodes.items():
            dag.add_node(name, kind="node")
        producers = self.producers()
        for name, node in self.nodes.items():
            for f in node.inputs:
                prods = producers.get(f.name, [])
                if len(prods) == 1:
                    self._add_edge(prods[0], name, f.name, "data")
            for dep in node.config.after:
                if dep in self.nodes:
                    self._add_edge(dep, name, None, "after")
        self._add_role_edges()

    def _add_edge(self, src: str, dst: str, field_name: str | None, kind: str) -> None:
        if self.dag.has_edge(src, dst):
            data = self.dag.edges[src, dst]
            if field_name and field_name not in data["fields"]:  # read under two names, carried once
                data["fields"].append(field_name)
            if kind == "data":
                data["kind"] = "data"
        else:
            self.dag.add_edge(src, dst, fields=[field_name] if field_name else [], kind=kind)

    def _add_role_edges(self) -> None:
        """Order every reader of a role before its updater; record the cross-step state edges."""
        for upd_name, upd in self.nodes.items():
            if not upd.updates_role or upd.role is None:
                continue
            sharers = self.roles_sharing_weights(upd.role)
            staleness = self.config.schedule.staleness_of(upd.role)
            for name, node in self.nodes.items():
                if name == upd_name or node.role not in sharers:
                    continue
                self.state_edges.append(StateEdge(upd.role, upd_name, name, staleness))
                acyclic = nx.is_directed_acyclic_graph(self.dag)
                if acyclic and (nx.has_path(self.dag, upd_name, name) or nx.has_path(self.dag, name, upd_name)):
                    continue
                self._add_edge(name, upd_name, None, "order")

    # ------------------------------------------------------------------ queries
    def roles_sharing_weights(self, role: str) -> set[str]:
        """``role`` and every non-frozen role derived from it (they see its updates)."""
        out = {role}
        changed = True
        while changed:
            changed = False
            for name, cfg in self.config.roles.items():
                if name not in out and cfg.from_ in out and not cfg.frozen:
                    out.add(name)
                    changed = True
        return out

    def producers(self) -> dict[str, list[str]]:
        """Field name → the nodes (and ``data``) that write it."""
        out: dict[str, list[str]] = {}
        for f in self.source_fields:
            out.setdefault(f.name, []).append(SOURCE)
        for name, node in self.nodes.items():
            for f in node.outputs:
                out.setdefault(f.name, []).append(name)
        return out

    def consumers(self) -> dict[str, list[str]]:
        """Field name → the nodes that read it."""
        out: dict[str, list[str]] = {}
        for name, node in self.nodes.items():
            for f in node.inputs:
                out.setdefault(f.name, []).append(name)
        return out

    def dumped_fields(self) -> list[str]:
        """Fields the graph's operators declare worth a rollout dump (``dumped=``), graph names."""
        out: list[str] = []
        for node in self.nodes.values():
            if node.op is None:
                continue
            renames = {**node.config.inputs, **node.config.outputs}
            out.extend(g for g in (renames.get(f, f) for f in node.op.dumped) if g not in out)
        return out

    def scorer(self) -> tuple[str, str] | None:
        """``(node, field)``: the first node, in the file's order, whose operator declares a
        ``score`` output (a reward), with that output's graph name; None when nothing scores."""
        for name, node in self.nodes.items():
            if node.op is not None and node.op.score is not None:
                return name, node.config.outputs.get(node.op.score, node.op.score)
        return None

    def headline_metrics(self) -> list[str]:
        """The metrics a person watches (the live view's headline): each node's declared ``headline``
        in the step's order, then the scoring node's again under ``val/`` (what validation reports)."""
        ops = [self.nodes[n].op for n in self.topological_order() if self.nodes[n].op is not None]
        scorer = self.scorer()
        val = [f"val/{m}" for m in self.nodes[scorer[0]].op.headline] if scorer else []
        return list(dict.fromkeys([m for op in ops for m in op.headline] + val))

    def token_metrics(self) -> TokenMetrics | None:
        """Where the run reads the tokens generated per row: the first node's declared ``tokens``."""
        return next((n.op.tokens for n in self.nodes.values() if n.op is not None and n.op.tokens), None)

    def topological_order(self) -> list[str]:
        """Nodes in a dependency order (declaration order breaks ties)."""
        rank = {n: i for i, n in enumerate(self.nodes)}
        order = nx.lexicographical_topological_sort(self.dag, key=lambda n: rank.get(n, -1))
        return [n for n in order if n != SOURCE]

    def layers(self) -> list[list[str]]:
        """Nodes grouped in topological generations (for drawing)."""
        rank = {n: i for i, n in enumerate(self.nodes)}
        return [
            sorted((n for n in gen if n != SOURCE), key=rank.get)
            for gen in nx.topological_generations(self.dag)
            if any(n != SOURCE for n in gen)
        ]

    def pool_of_role(self, role: str | None) -> str | None:
        if role is None:
            return None
        for pool, cfg in self.config.pools.items():
            if role in cfg.roles:
                return pool
        return None

    def pool_of(self, node: str) -> str | None:
        """The pool a node runs on; ``None`` for driver nodes."""
        return self.pool_of_role(self.nodes[node].role)

    def check(self, resources: dict[str, float] | None = None) -> Report:
        """Run every check; see :func:`flowrl.graph.checks.check`."""
        return check(self, resources=resources)

    @property
    def name(self) -> str:
        return self.config.name

    def to_dict(self) -> dict[str, Any]:
        """A canonical description of the IR, equal for equal graphs whatever the front end."""
        cfg = self.config.dump()
        for name, node in self.nodes.items():
            cfg["nodes"][name]["op"] = node.op_name
            if node.params is not None:
                cfg["nodes"][name]["params"] = node.params.model_dump()
                for key in list(node.config.params):
                    cfg["nodes"][name].pop(key, None)
            cfg["nodes"][name]["role"] = node.role
        return {
            "config": cfg,
            "edges": sorted(
                (u, v, d["kind"], tuple(sorted(d["fields"]))) for u, v, d in self.dag.edges(data=True)
            ),
            "state_edges": sorted((e.role, e.src, e.dst, e.staleness) for e in self.state_edges),
            "fields": {
                n: ([str(f) for f in node.inputs], [str(f) for f in node.outputs])
                for n, node in self.nodes.items()
            },
        }

    def __repr__(self) -> str:
        return f"Graph({self.name!r}, nodes={list(self.nodes)})"
