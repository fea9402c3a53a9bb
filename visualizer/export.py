"""Export a graph's DAG for other tools: Mermaid, Graphviz DOT, and JSON.

All three carry the same facts as the terminal drawing: every node with its
operator, role and pool; one group per pool; every edge with the fields it
carries (``order``/``after`` edges marked as such); and the cross-step state
edges, drawn dashed and labelled "next step".

Names are quoted, never trusted: a node or pool called ``my "best" node`` or
``end`` still yields valid Mermaid and DOT.

Example::

    from flowrl.graph import load_graph
    from visualizer import to_dot, to_mermaid

    graph = load_graph("graphs/ppo.yaml")
    open("ppo.mmd", "w").write(to_mermaid(graph))
    open("ppo.dot", "w").write(to_dot(graph))   # dot -Tsvg ppo.dot > ppo.svg
"""

from __future__ import annotations

import re
from typing import Any

from flowrl.graph import SOURCE, Graph
from visualizer.dag import describe_pool, edge_groups, placement

__all__ = ["to_dot", "to_json", "to_mermaid"]


# ---------------------------------------------------------------- mermaid
def to_mermaid(graph: Graph) -> str:
    """A Mermaid ``flowchart TD``: a subgraph per pool, edges labelled with their fields.

    Example::

        >>> print(to_mermaid(graph))        # doctest: +SKIP
        flowchart TD
          n_data[("data<br/>testdata:prompts")]
          subgraph p0["train · 1 worker × 1 cpu"]
            n_generate["generate<br/>test.generate<br/>actor@train"]
          end
          n_data -->|"prompts, uid"| n_generate
    """
    ids = _ids(graph, "n")
    pool_ids = {pool: f"p{i}" for i, pool in enumerate(graph.config.pools)}
    lines = ["flowchart TD"]
    lines.append(f'  {ids[SOURCE]}[("{_mermaid_text(SOURCE)}<br/>{_mermaid_text(graph.config.data.source)}")]')

    def node_line(name: str, indent: str) -> str:
        label = "<br/>".join(_mermaid_text(s) for s in _node_label(graph, name))
        return f'{indent}{ids[name]}["{label}"]'

    for pool, members in _by_pool(graph).items():
        if pool is None:
            lines.extend(node_line(n, "  ") for n in members)
            continue
        title = _mermaid_text(f"{pool} · {describe_pool(graph, pool)}")
        lines.append(f'  subgraph {pool_ids[pool]}["{title}"]')
        lines.extend(node_line(n, "    ") for n in members)
        lines.append("  end")
    for src, dst, kind, fields in _edges(graph):
        label = ", ".join(fields) if fields else kind
        arrow = "-->" if kind == "data" else "-.->"
        lines.append(f'  {ids[src]} {arrow}|"{_mermaid_text(label)}"| {ids[dst]}')
    for e in graph.state_edges:
        label = _mermaid_text(f"next step: {e.role} weights, staleness {e.staleness}")
        lines.append(f'  {ids[e.src]} -.->|"{label}"| {ids[e.dst]}')
    return "\n".join(lines) + "\n"


def _mermaid_text(s: str) -> str:
    """Text safe inside a double-quoted Mermaid label: specials as numeric entity codes."""
    out = s.replace("#", "#35;")  # first: every later code starts with '#'
    for ch in '"&<>|`':
        out = out.replace(ch, f"#{ord(ch)};")
    return out.replace("\n", " ")


# ---------------------------------------------------------------- graphviz
def to_dot(graph: Graph) -> str:
    """A Graphviz digraph: a ``cluster_`` subgraph per pool, edges labelled with their fields;
    state edges dashed, outside the ranking (``constraint=false``).

    Example::

        >>> print(to_dot(graph))            # doctest: +SKIP
        digraph "test_ppo" {
          "data" -> "generate" [label="prompts, uid"];
    """
    q = _dot_quote
    lines = [
        f"digraph {q(graph.name)} {{",
        "  rankdir=TB;",
        '  node [shape=box, style=rounded, fontname="Helvetica"];',
        '  edge [fontname="Helvetica", fontsize=10];',
        f"  {q(SOURCE)} [shape=cylinder, label={q(SOURCE + chr(10) + graph.config.data.source)}];",
    ]
    for i, (pool, members) in enumerate(_by_pool(graph).items()):
        indent = "  "
        if pool is not None:
            lines.append(f"  subgraph {q(f'cluster_{i}')} {{")
            lines.append(f"    label={q(f'{pool} · {describe_pool(graph, pool)}')};")
            indent = "    "
        for n in members:
            lines.append(f"{indent}{q(n)} [label={q(chr(10).join(_node_label(graph, n)))}];")
        if pool is not None:
            lines.append("  }")
    for src, dst, kind, fields in _edges(graph):
        attrs = [f"label={q(', '.join(fields) if fields else kind)}"]
        if kind != "data":
            attrs.append("style=dotted")
        lines.append(f"  {q(src)} -> {q(dst)} [{', '.join(attrs)}];")
    for e in graph.state_edges:
        label = f"next step: {e.role} weights, staleness {e.staleness}"
        lines.append(f"  {q(e.src)} -> {q(e.dst)} [label={q(label)}, style=dashed, constraint=false];")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _dot_quote(s: str) -> str:
    r"""A DOT double-quoted string; a real newline becomes DOT's ``\n`` line break."""
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


# ---------------------------------------------------------------- json
def to_json(graph: Graph) -> dict[str, Any]:
    """The DAG as plain data (``json.dumps``-able): nodes, edges, state edges, pools, layers.

    Example::

        >>> d = to_json(graph)
        >>> d["edges"][0]                    # doctest: +SKIP
        {'src': 'data', 'dst': 'generate', 'fields': ['prompts', 'uid'], 'kind': 'data'}
    """
    layer_of = {n: i for i, layer in enumerate(graph.layers(), start=1) for n in layer}
    return {
        "name": graph.name,
        "data": {
            "source": graph.config.data.source,
            "batch_size": graph.config.data.batch_size,
            "fields": [{"name": f.name, "spec": f.spec} for f in graph.source_fields],
        },
        "pools": {
            pool: {"workers": cfg.workers, "cpus": cfg.cpus, "gpus": cfg.gpus, "roles": list(cfg.roles)}
            for pool, cfg in graph.config.pools.items()
        },
        "nodes": {
            name: {
                "op": n.op_name,
                "role": n.role,
                "pool": graph.pool_of(name),
                "scope": n.scope,
                "layer": layer_of.get(name),
                "inputs": [{"name": f.name, "spec": f.spec} for f in n.inputs],
                "outputs": [{"name": f.name, "spec": f.spec} for f in n.outputs],
            }
            for name, n in graph.nodes.items()
        },
        "edges": [
            {"src": src, "dst": dst, "fields": list(fields), "kind": kind}
            for src, dst, kind, fields in _edges(graph)
        ],
        "state_edges": [
            {"role": e.role, "src": e.src, "dst": e.dst, "staleness": e.staleness} for e in graph.state_edges
        ],
        "layers": [[SOURCE], *graph.layers()],
    }


# ---------------------------------------------------------------- shared
def _edges(graph: Graph) -> list[tuple[str, str, str, tuple[str, ...]]]:
    """Every DAG edge as ``(src, dst, kind, fields)``, sources in drawing order."""
    out = []
    for src in [SOURCE, *(n for layer in graph.layers() for n in layer)]:
        for kind, fields, dsts in edge_groups(graph, src):
            out.extend((src, dst, kind, fields) for dst in dsts)
    return out


def _by_pool(graph: Graph) -> dict[str | None, list[str]]:
    """Nodes grouped by pool in declaration order; ``None`` holds the driver nodes."""
    groups: dict[str | None, list[str]] = {pool: [] for pool in graph.config.pools}
    groups[None] = []
    for name in graph.nodes:
        pool = graph.pool_of(name)
        groups.setdefault(pool, []).append(name)
    return {pool: members for pool, members in groups.items() if members}


def _node_label(graph: Graph, name: str) -> list[str]:
    """A node's label lines: name, operator, ``role@pool`` (or ``driver``)."""
    return [name, graph.nodes[name].op_name, placement(graph, name)]


def _ids(graph: Graph, prefix: str) -> dict[str, str]:
    """Identifiers safe in any syntax, readable where the name allows: ``n_generate``;
    a name with other characters is reduced to word characters and made unique."""
    out: dict[str, str] = {}
    for name in [SOURCE, *graph.nodes]:
        base = f"{prefix}_{re.sub(r'[^A-Za-z0-9_]', '_', name)}"
        ident, i = base, 2
        while ident in out.values():
            ident, i = f"{base}_{i}", i + 1
        out[name] = ident
    return out

