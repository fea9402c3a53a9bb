"""Draw a graph's DAG in the terminal: layers of boxes, coloured by pool.

The drawing reads top to bottom in the graph's topological generations, with
the data source as the first layer. Each node is a box holding its operator,
``role@pool`` and scope; under each layer, one line per outgoing edge names the
fields it carries (``generate → reward  responses, response_mask``). A legend
says what each pool is, and a footer lists the cross-step state edges (the
weights an update hands to the next step).

Colour carries meaning only: a node's *pool* colours its name and ``role@pool``
(driver nodes stay neutral), and, when ``states`` is given, a node's *state*
(waiting, running, stuck, done, failed) colours its border. Both are also written as
text, so nothing is lost on a terminal without colour.

Example::

    from flowrl.graph import load_graph
    from visualizer import print_dag

    print_dag(load_graph("graphs/ppo.yaml"))
    print_dag(graph, states={"generate": "done", "reward": "running"},
              durations={"generate": 1.8})
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from rich import box
from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.padding import Padding
from rich.panel import Panel
from rich.rule import Rule
from rich.style import Style
from rich.table import Table
from rich.text import Text

from flowrl.graph import SOURCE, Graph

__all__ = [
    "DagView", "POOL_PALETTE", "STATES", "pool_colors", "print_dag", "render_dag", "state_style",
]

#: node states a live view reports, in the order a node goes through them
STATES: tuple[str, ...] = ("waiting", "running", "stuck", "done", "failed", "invariant")

_STATE_STYLES: dict[str, Style] = {
    "waiting": Style(color="bright_black"),
    "running": Style(color="yellow", bold=True),
    "stuck": Style(color="red", bold=True, reverse=True),  # past its timeout: the hang the run fails with
    "done": Style(color="green"),
    "failed": Style(color="red", bold=True),
    "invariant": Style(color="dark_orange", bold=True),  # an invariant fired there (flowrl.provenance.invariants)
}

#: pool colours, assigned in the order pools are declared; none of them is a
#: state colour (yellow, green, red, grey), so pool and state never read alike
POOL_PALETTE: tuple[str, ...] = (
    "cyan", "magenta", "blue", "bright_cyan", "bright_magenta", "bright_blue",
    "medium_purple1", "steel_blue1", "orchid", "deep_sky_blue4",
)

_DRIVER = "driver"  # what a node without a pool shows instead of role@pool
_NEUTRAL = Style()  # driver nodes and the data source: no colour
_GAP = 1  # columns between two boxes of a row


# ---------------------------------------------------------------- public helpers
def state_style(state: str) -> Style:
    """The style a node in ``state`` is drawn with (its border in the boxed view).

    Example::

        >>> state_style("failed").color.name
        'red'
    """
    try:
        return _STATE_STYLES[state]
    except KeyError:
        raise ValueError(f"unknown node state {state!r}; use one of: {', '.join(STATES)}") from None


def pool_colors(graph: Graph) -> dict[str, str]:
    """A colour per pool, stable for a graph: the i-th declared pool gets the i-th palette colour."""
    return {pool: POOL_PALETTE[i % len(POOL_PALETTE)] for i, pool in enumerate(graph.config.pools)}


def describe_pool(graph: Graph, pool: str) -> str:
    """``2 workers × 1 cpu, 1 gpu`` for a pool of the graph."""
    cfg = graph.config.pools[pool]
    per_worker = [_count(cfg.cpus, "cpu")]
    if cfg.gpus:
        per_worker.append(_count(cfg.gpus, "gpu"))
    return f"{_count(cfg.workers, 'worker')} × {', '.join(per_worker)}"


def placement(graph: Graph, node: str, moved: Mapping[str, str] | None = None) -> str:
    """``role@pool`` for a node; ``driver`` when it has no role, ``role@?`` when the role has no pool.

    ``moved`` maps stateless nodes the plan runs in a pool's process to that pool
    (shown as ``@pool``)."""
    role = graph.nodes[node].role
    if role is None:
        return f"@{moved[node]}" if moved and node in moved else _DRIVER
    return f"{role}@{graph.pool_of(node) or '?'}"


def edge_groups(graph: Graph, src: str) -> list[tuple[str, tuple[str, ...], list[str]]]:
    """The edges out of ``src`` as ``(kind, fields, [dst, ...])``: destinations that
    receive the same fields over the same kind of edge share one entry."""
    rank = {n: i for i, n in enumerate(graph.nodes)}
    groups: dict[tuple[str, tuple[str, ...]], list[str]] = {}
    for dst in sorted(graph.dag.successors(src), key=lambda n: rank.get(n, -1)):
        data = graph.dag.edges[src, dst]
        groups.setdefault((data["kind"], tuple(data["fields"])), []).append(dst)
    return [(kind, fields, dsts) for (kind, fields), dsts in groups.items()]


def render_dag(
    graph: Graph,
    *,
    width: int | None = None,
    compact: bool = False,
    states: Mapping[str, str] | None = None,
    durations: Mapping[str, float] | None = None,
    placement: Mapping[str, str] | None = None,
) -> RenderableType:
    """A rich renderable drawing ``graph``'s DAG, laid out when it is printed.

    ``width`` caps the drawing (default: the width of the console it is printed
    on). ``states`` (node → one of :data:`STATES`) colours each node's border
    and writes the state in its box; ``durations`` (node → seconds) writes the
    time in its box. ``placement`` (node → pool) marks stateless nodes that a
    plan runs in a pool's process rather than the driver. Unknown nodes or
    states raise :class:`ValueError`.

    Layout rule: the boxed view (a row of boxes per layer, wrapped onto more
    rows when a layer is wider than ``width``) is used unless ``compact`` is
    true or it would not fit: it fits when every box fits the width and every
    two neighbouring boxes of a layer fit side by side, so that a layer always
    reads as a row. Otherwise the compact view prints one entry per node,
    ``layer  node  op  role@pool  ← inputs  → outputs``: in aligned columns
    when every entry fits on one line, else each entry wraps within the width,
    its continuation lines indented under the node's name.

    Example::

        console.print(render_dag(graph, width=80))
    """
    states = dict(states or {})
    durations = dict(durations or {})
    placement = dict(placement or {})
    for what, given in (("states", states), ("durations", durations), ("placement", placement)):
        unknown = sorted(set(given) - set(graph.nodes))
        if unknown:
            raise ValueError(f"{what} name nodes not in graph {graph.name!r}: {', '.join(unknown)}")
    for state in states.values():
        state_style(state)
    if width is not None and width < 1:
        raise ValueError(f"width must be a positive number of columns, got {width}")
    return DagView(graph, width=width, compact=compact, states=states, durations=durations, placement=placement)


def print_dag(
    graph: Graph,
    console: Console | None = None,
    *,
    width: int | None = None,
    compact: bool = False,
    states: Mapping[str, str] | None = None,
    durations: Mapping[str, float] | None = None,
) -> None:
    """Print :func:`render_dag` of ``graph`` on ``console`` (a new one by default).

    Example::

        print_dag(load_graph("graphs/ppo.yaml"), compact=True)
    """
    console = console or Console()
    console.print(render_dag(graph, width=width, compact=compact, states=states, durations=durations))


# ---------------------------------------------------------------- the renderable
@dataclass
class _Box:
    """One node's (or the data source's) box, measured before it is drawn."""

    name: str
    lines: list[Text]
    title_style: Style
    border_style: Style

    @property
    def width(self) -> int:
        # "╭─ name ─╮": the title needs its own length plus 6 columns of border
        inner = max([cell_len(self.name) + 2] + [t.cell_len for t in self.lines])
        return inner + 4  # two border columns and one column of padding on each side

    def panel(self) -> Panel:
        return Panel(
            Text("\n").join(self.lines), title=Text(self.name, style=self.title_style + Style(bold=True)),
            title_align="left", border_style=self.border_style, box=box.ROUNDED,
            width=self.width, padding=(0, 1),
        )


class DagView:
    """The renderable :func:`render_dag` returns; it picks its layout from the width it gets."""

    def __init__(
        self,
        graph: Graph,
        *,
        width: int | None,
        compact: bool,
        states: dict[str, str],
        durations: dict[str, float],
        placement: dict[str, str] | None = None,
    ) -> None:
        self.graph = graph
        self.moved = placement or {}
        self.width = width
        self.compact = compact
        self.states = states
        self.durations = durations
        self.colors = pool_colors(graph)
        self.layers = graph.layers()
        self.unwrapped = False

    # -- rich protocol
    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        # off a terminal (soft wrap: no wrapping, no cropping) a line of text is written whole
        self.unwrapped = bool(options.no_wrap)
        width = min(self.width or options.max_width, options.max_width)
        body = self.compact_view(width) if self.uses_compact(width) else self.boxed_view(width)
        yield from console.render(body, options.update(width=width, max_width=width))

    def uses_compact(self, width: int) -> bool:
        """Whether the drawing at ``width`` columns is the compact one (see :func:`render_dag`)."""
        if self.compact:
            return True
        for layer in [[SOURCE], *self.layers]:
            boxes = [self._box(n).width for n in layer]
            if max(boxes) > width:
                return True
            if any(a + _GAP + b > width for a, b in zip(boxes, boxes[1:])):
                return True
        return False

    # -- shared parts
    def _pool_style(self, node: str) -> Style:
        if node == SOURCE:
            return _NEUTRAL
        pool = self.moved.get(node) or self.graph.pool_of(node)
        return Style(color=self.colors[pool]) if pool in self.colors else _NEUTRAL

    def _name(self, node: str) -> Text:
        return Text(node, style=self._pool_style(node))

    def _status(self, node: str) -> Text | None:
        """``done · 1.24 s`` for a node with a state and/or a duration."""
        parts = []
        if node in self.states:
            parts.append(Text(self.states[node], style=state_style(self.states[node])))
        if node in self.durations:
            parts.append(Text(_seconds(self.durations[node])))
        return Text(" · ").join(parts) if parts else None

    def header(self) -> RenderableType:
        """The graph's name and size, and the legend of pools."""
        g = self.graph
        n = len(g.nodes)
        mb = g.config.schedule.micro_batches
        title = Text.assemble(
            (g.name, "bold"), f" · {n} node{'s' if n != 1 else ''} in {len(self.layers)} layers",
            f" · {mb} micro-batch{'es' if mb != 1 else ''}",
        )
        legend = Table.grid(padding=(0, 2))
        legend.add_column(no_wrap=True)
        legend.add_column(overflow="fold")
        for pool, cfg in g.config.pools.items():
            legend.add_row(
                Text.assemble(("■ ", self.colors[pool]), (pool, self.colors[pool])),
                Text(f"{describe_pool(g, pool)} · roles {', '.join(cfg.roles) or '(none)'}"),
            )
        if any(placement(g, n, self.moved) == _DRIVER for n in g.nodes):
            legend.add_row(Text("□ " + _DRIVER), Text("nodes without a role, run in the driver"))
        return Group(title, legend)

    def footer(self) -> RenderableType | None:
        """The state edges: the weights an update hands to the next step."""
        grouped: dict[tuple[str, str, int], list[str]] = {}
        for e in self.graph.state_edges:
            grouped.setdefault((e.src, e.role, e.staleness), []).append(e.dst)
        if not grouped:
            return None
        lines: list[RenderableType] = [Text("state edges: weights handed to step t+1", style="italic")]
        for (src, role, staleness), dsts in grouped.items():
            line = self._name(src)
            line.append(" ⇢ ")
            line.append_text(Text(", ").join(self._name(d) for d in dsts))
            line.append(f"  (next step, {role} weights, staleness {staleness})", style="italic")
            lines.append(self._indented(line))
        return Group(*lines)

    def _indented(self, text: Text, indent: int = 2) -> RenderableType:
        """``text`` indented, its wrapped lines hanging at the same indent; one whole line when unwrapped
        (a padded block is cropped to the width, and a pipe has no width)."""
        if self.unwrapped:
            return Text(" " * indent).append_text(text)
        return Padding(text, (0, 0, 0, indent), expand=False)

    # -- boxed view
    def _box(self, node: str) -> _Box:
        g = self.graph
        if node == SOURCE:
            data = g.config.data
            return _Box(SOURCE, [Text(data.source), Text(f"batch {data.batch_size}")], _NEUTRAL, _NEUTRAL)
        n = g.nodes[node]
        lines = [Text(n.op_name), Text(placement(g, node, self.moved), style=self._pool_style(node))]
        scope = Text(n.scope)
        status = self._status(node)
        if status is not None:
            scope = Text(" · ").join([scope, status])
        lines.append(scope)
        border = state_style(self.states[node]) if node in self.states else self._pool_style(node)
        return _Box(node, lines, self._pool_style(node), border)

    def _edge_lines(self, src: str) -> list[RenderableType]:
        """``src → dst, dst: fields`` per group of edges out of ``src``."""
        lines: list[RenderableType] = []
        for kind, fields, dsts in edge_groups(self.graph, src):
            line = self._name(src)
            line.append(" → " if kind == "data" else " ⋯ ")
            line.append_text(Text(", ").join(self._name(d) for d in dsts))
            if fields:
                line.append(": " + ", ".join(fields))
            if kind != "data":
                line.append(f" ({kind})", style="italic")
            lines.append(self._indented(line))
        return lines

    def _rows(self, layer: list[str], width: int) -> list[list[_Box]]:
        """Pack a layer's boxes greedily into rows no wider than ``width``."""
        rows: list[list[_Box]] = [[]]
        used = 0
        for node in layer:
            b = self._box(node)
            if rows[-1] and used + _GAP + b.width > width:
                rows.append([])
                used = 0
            used += b.width + (_GAP if rows[-1] else 0)
            rows[-1].append(b)
        return rows

    def boxed_view(self, width: int) -> RenderableType:
        parts: list[RenderableType] = [self.header()]
        for i, layer in enumerate([[SOURCE], *self.layers]):
            label = "data source" if i == 0 else f"layer {i}"
            parts.append(Rule(Text(label, style="dim"), align="left", style="dim", characters="─"))
            for row in self._rows(layer, width):
                grid = Table.grid(padding=(0, _GAP, 0, 0))
                for _ in row:
                    grid.add_column(no_wrap=True)
                grid.add_row(*(b.panel() for b in row))
                parts.append(grid)
            for node in layer:
                parts.extend(self._edge_lines(node))
        footer = self.footer()
        if footer is not None:
            parts.extend([Rule(style="dim"), footer])
        return Group(*parts)

    # -- compact view
    def _compact_rows(self) -> list[tuple[str, Text, Text, Text, Text, Text]]:
        """(layer, node, op, role@pool, status, fields) per line, the data source first."""
        g = self.graph
        data = g.config.data
        rows = [(
            "0", Text(SOURCE), Text(data.source), Text(f"batch {data.batch_size}"), Text(),
            Text("→ " + ", ".join(f.name for f in g.source_fields)),
        )]
        for i, layer in enumerate(self.layers, start=1):
            for j, node in enumerate(layer):
                n = g.nodes[node]
                parts = []
                if n.inputs:
                    parts.append(Text("← " + ", ".join(n.input_names())))
                if n.outputs:
                    parts.append(Text("→ " + ", ".join(n.output_names())))
                for kind in ("after", "order"):
                    preds = [p for p in g.dag.predecessors(node) if g.dag.edges[p, node]["kind"] == kind]
                    if preds:
                        parts.append(Text(f"{kind} " + ", ".join(preds), style="italic"))
                rows.append((
                    str(i) if j == 0 else "", self._name(node), Text(n.op_name),
                    Text(placement(g, node, self.moved), style=self._pool_style(node)),
                    self._status(node) or Text(), Text("  ").join(parts),
                ))
        return rows

    def compact_view(self, width: int) -> RenderableType:
        """One entry per node: in aligned columns when every entry fits on one line of
        ``width``, else as a paragraph per node whose wrapped lines hang under its name."""
        rows = self._compact_rows()
        with_status = any(r[4].cell_len for r in rows)
        fixed = [max(_cells(r[k]) for r in rows) for k in range(5)]
        if not with_status:
            fixed[4] = 0
        used = sum(fixed) + 2 * sum(1 for w in fixed if w)
        table = Table.grid(padding=(0, 2, 0, 0))
        table.add_column(justify="right", no_wrap=True)
        if width - used >= max(_cells(r[5]) for r in rows):
            keep = [k for k in range(1, 6) if k != 4 or with_status]
            for _ in keep[:-1]:
                table.add_column(no_wrap=True)
            table.add_column(overflow="fold")
            for r in rows:
                table.add_row(r[0], *(r[k] for k in keep))
        else:
            table.add_column(overflow="fold")
            for layer, *rest in rows:
                table.add_row(layer, Text("  ").join(t for t in rest if t.cell_len))
        parts: list[RenderableType] = [self.header(), table]
        footer = self.footer()
        if footer is not None:
            parts.append(footer)
        return Group(*parts)


def _count(x: float, unit: str) -> str:
    """``1 cpu``, ``2 cpus``, ``0.5 gpu``."""
    n = str(int(x)) if float(x).is_integer() else f"{x:g}"
    return f"{n} {unit}{'s' if x > 1 else ''}"


def _cells(x: str | Text) -> int:
    return x.cell_len if isinstance(x, Text) else cell_len(x)


def _seconds(s: float) -> str:
    if s < 10:
        return f"{s:.2f} s"
    if s < 600:
        return f"{s:.1f} s"
    return f"{int(s // 60)} min {int(s % 60)} s"



