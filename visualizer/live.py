"""The live view of ``flowrl run``: what every node is doing, how far along the run
is, and how the metrics move.

In a terminal it redraws in place (rich ``Live``): a progress bar with rate and
ETA, the DAG with each node's state (waiting / running / stuck / done / failed) and last
duration, the latest metrics with sparklines of their recent trend, and how busy
each pool was during the last step. When output is not a terminal (CI, a pipe,
a log file) it prints plain lines instead — at most one every ``min_interval_s``
seconds (plus the first and last step), so a long run never floods a log.

Example::

    with LiveView(graph, total_steps=300) as view:
        trainer = Trainer(graph, on_step=view.step, on_progress=view.progress, say=view.say)
        trainer.run()
"""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

from flowrl.data.metrics import step_seconds
from flowrl.graph import Graph
from visualizer.dag import pool_colors, render_dag

#: the run's own metrics shown after the graph's headline (``Graph.headline_metrics``: what its operators
#: declare), when present
RUN_METRICS = ("throughput/tokens_per_s", "timing/step", "scheduler/efficiency", "scheduler/pipeline_efficiency")
SPARKS = "▁▂▃▄▅▆▇█"


#: values a sparkline shows
SPARK_POINTS = 24


def sparkline(values: list[float], width: int = SPARK_POINTS) -> str:
    """``▁▃▅█``-style trend of the last ``width`` values (flat when constant)."""
    vals = [v for v in values[-width:] if v == v]  # drop NaN
    if not vals:
        return ""
    lo, hi = min(vals), max(vals)
    if hi - lo < 1e-12:
        return SPARKS[0] * len(vals)
    return "".join(SPARKS[min(len(SPARKS) - 1, int((v - lo) / (hi - lo) * len(SPARKS)))] for v in vals)


def pool_busy(graph: Graph, row: dict[str, float], placement: dict[str, str] | None = None) -> dict[str, float]:
    """Each pool's busy fraction of the last step: its nodes' time / the step's makespan.

    ``placement`` adds stateless nodes the plan runs in a pool's process."""
    step = row.get("timing/step", 0.0)
    busy: dict[str, float] = {pool: 0.0 for pool in graph.config.pools}
    for node in graph.nodes:
        pool = (placement or {}).get(node) or graph.pool_of(node)
        if pool is not None:
            busy[pool] += row.get(f"timing/{node}", 0.0)
    return {p: (b / step if step > 0 else 0.0) for p, b in busy.items()}


def plan_line(row: dict[str, float]) -> str | None:
    """Predicted against measured step time and critical path, when the run checks its plan
    (``plan/predicted_step_s``, :mod:`flowrl.plan.plancheck`); None otherwise."""
    predicted = row.get("plan/predicted_step_s")
    measured = step_seconds(row)
    if predicted is None or measured is None:
        return None
    out = f"plan: {measured:.3g} s/step measured, {predicted:.3g} predicted ({measured / predicted - 1:+.0%})"
    path, want = row.get("scheduler/critical_path"), row.get("plan/predicted_critical_path_s")
    if path is not None and want:
        out += f"; critical path {path:.3g} s measured, {want:.3g} predicted ({path / want - 1:+.0%})"
    return out


class LiveView:
    """Shows a run; feed it ``progress(step, states)`` and ``step(step, row)``."""

    def __init__(self, graph: Graph, total_steps: int, console: Console | None = None, start_step: int = 0,
                 min_interval_s: float = 2.0) -> None:
        self.graph, self.total = graph, total_steps
        #: the metrics shown, in order, when present
        self.shown = (*graph.headline_metrics(), *RUN_METRICS)
        self.console = console or Console()
        self.interactive = self.console.is_terminal and not self.console.is_dumb_terminal
        self.history: dict[str, list[float]] = {}
        self.states: dict[str, str] = {}
        self.durations: dict[str, float] = {}
        self.last_row: dict[str, float] = {}
        self.current = start_step
        self.min_interval_s = min_interval_s
        self._last_print = 0.0
        self._progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                  TextColumn("{task.fields[rate]}"), TimeRemainingColumn(), console=self.console)
        self._task = self._progress.add_task(graph.name, total=total_steps, completed=start_step, rate="")
        self._first_done: tuple[int, float] | None = None  # (steps done, when): rates exclude start-up
        self._start_step = start_step
        self.placement: dict[str, str] = {}  # stateless nodes the plan runs in a pool (set by the caller)
        self._live: Live | None = None
        self.fired: dict[str, str] = {}  # node → the invariant that fired there (kept marked for the run)

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> "LiveView":
        if self.interactive:
            self._live = Live(self.render(), console=self.console, refresh_per_second=4, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._live is not None:
            self._live.update(self.render())
            self._live.__exit__(*exc)
            self._live = None

    # ------------------------------------------------------------------ feeding
    def progress(self, step: int, states: dict[str, str]) -> None:
        """Node states of the step in progress (from the scheduler)."""
        self.current = step
        self.states = dict(states)
        if self._live is not None:
            self._live.update(self.render())

    def step(self, step: int, row: dict[str, float]) -> None:
        """A finished step's metrics."""
        self.last_row = row
        for k, v in row.items():
            values = self.history.setdefault(k, [])
            values.append(v)
            if len(values) > 4 * SPARK_POINTS:  # only the sparkline's points are shown: memory stays flat
                del values[:-SPARK_POINTS]
        for node in self.graph.nodes:
            if f"timing/{node}" in row:
                self.durations[node] = row[f"timing/{node}"]
        done = step + 1
        now_wall = time.time()
        if self._first_done is None:
            self._first_done = (done, now_wall)
            self._progress.update(self._task, completed=done)
        else:
            first, t0 = self._first_done
            per_step = (now_wall - t0) / max(1, done - first)
            self._progress.update(self._task, completed=done, rate=f"{per_step:.2f} s/step")
        if self._live is not None:
            self.states = {n: "done" for n in self.graph.nodes}
            self._live.update(self.render())
            return
        now = time.monotonic()
        first, last = done == self._start_step + 1, done == self.total
        if first or last or now - self._last_print >= self.min_interval_s:
            self._last_print = now
            self.console.print(self.line(done, row), highlight=False, soft_wrap=True)

    def say(self, message: str) -> None:
        """A message above the live view (or a plain line); an invariant's marks its node."""
        if getattr(message, "node", None) in self.graph.nodes:
            self.fired[message.node] = message.name  # type: ignore[attr-defined]
        self.console.print(Text(message), highlight=False)

    # ------------------------------------------------------------------ drawing
    def line(self, done: int, row: dict[str, float]) -> str:
        """The plain-text form of a step: ``step 12/300  reward/mean 0.41  ...``."""
        parts = [f"step {done}/{self.total}"] + [f"{k} {row[k]:.4g}" for k in self.shown if k in row]
        if "plan/error" in row:
            parts.append(f"plan/error {row['plan/error']:+.0%}")
        return "  ".join(parts)

    def render(self) -> RenderableType:
        width = self.console.width
        parts: list[RenderableType] = [self._progress]
        states = {**self.states, **{n: "invariant" for n in self.fired}}
        parts.append(render_dag(self.graph, compact=True, width=width, states=states or None,
                                durations=self.durations or None, placement=self.placement or None))
        parts.append(self._metrics_table())
        parts.append(self._pools_line())
        plan = plan_line(self.last_row)
        if plan is not None:
            parts.append(Text(plan))
        return Group(*parts)

    def _metrics_table(self) -> Table:
        table = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
        table.add_column("metric")
        table.add_column("last", justify="right")
        table.add_column("trend")
        for key in self.shown:
            if key in self.last_row:
                table.add_row(key, f"{self.last_row[key]:.4g}", sparkline(self.history.get(key, [])))
        return table

    def _pools_line(self) -> Text:
        out = Text("pools busy: ", style="bold")
        if not self.last_row:
            return out.append("—")
        colors = pool_colors(self.graph)
        for pool, frac in pool_busy(self.graph, self.last_row, self.placement).items():
            out.append(f"{pool} ", style=colors.get(pool, ""))
            out.append(f"{frac * 100:.0f}%  ")
        return out
