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

import threading
import time
from typing import Any, Callable

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
#: steps the closing summary averages the headline metric over (the README's "last-25" reward)
RECENT = 25


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


class Waits:
    """A line for every wait longer than ``first_s``: what the run is waiting on and for how long, again every
    ``every_s`` while it lasts, from a thread of its own (the waiting thread is busy or blocked).

    Example::

        waits = Waits(print)
        waits.begin("starting the workers")   # after 5 s: "… starting the workers: 5 s", then every 10 s
        waits.begin("waiting for step 1/300")  # a new wait ends the one before
        waits.close()
    """

    def __init__(self, say: Callable[[str], None], first_s: float = 5.0, every_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.say, self.first_s, self.every_s, self.clock = say, first_s, every_s, clock
        self.label: str | None = None
        self.since = self.next = 0.0
        self.said = False  # whether the current wait has had a line
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="flowrl-waits", daemon=True)
        self._thread.start()

    def begin(self, label: str) -> None:
        """A new wait, ending the one before. When that one was already said, the new one keeps its rhythm
        (the terminal has been silent: a line at least every ``every_s``); otherwise its first line comes after
        ``first_s`` (steps that each come sooner never print one)."""
        with self._lock:
            now = self.clock()
            first = now + self.first_s
            self.next = min(self.next, first) if self.label is not None and self.said else first
            self.label, self.since, self.said = label, now, False

    def end(self) -> None:
        """Nothing is being waited on."""
        with self._lock:
            self.label = None

    def tick(self) -> str | None:
        """The line due now, if any (the thread calls it twice a second)."""
        with self._lock:
            now = self.clock()
            if self.label is None or now < self.next:
                return None
            while self.next <= now:  # on the schedule, however late this tick came (a loaded machine)
                self.next += self.every_s
            self.said = True
            return f"… {self.label}: {now - self.since:.0f} s"

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            line = self.tick()
            if line is not None:
                self.say(line)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)


class LiveView:
    """Shows a run; feed it ``progress(step, states)`` and ``step(step, row)``, and ``wait(label)`` for what
    it waits on between them (start-up, the next step)."""

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
        self.waits: Waits | None = None
        #: the highest held-out score (``Graph``'s scorer declares it: ``score_max``), when known
        self.score_max: float | None = None
        scorer = graph.scorer()
        scored = graph.nodes[scorer[0]].op.headline[:1] if scorer is not None else ()
        #: the metric the summary averages over the last steps (the scoring node's first headline: the reward),
        #: and the held-out one validation reports
        self.headline = scored[0] if scored else None
        self.val_metric = f"val/{scored[0]}" if scored else None
        self.recent: list[float] = []  # the headline of the last RECENT steps
        self.val_scores: list[tuple[int, float]] = []  # (step, held-out score) as validation ran
        self.steps_done = 0

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> "LiveView":
        self.waits = Waits(self.say)
        if self.interactive:
            self._live = Live(self.render(), console=self.console, refresh_per_second=4, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.waits is not None:
            self.waits.close()
            self.waits = None
        if self._live is not None:
            self._live.update(self.render())
            self._live.__exit__(*exc)
            self._live = None

    # ------------------------------------------------------------------ feeding
    def wait(self, label: str) -> None:
        """What the run waits on now (``starting Ray``, ``step 3/300``): a line if it lasts past 5 s."""
        if self.waits is not None:
            self.waits.begin(label)

    def progress(self, step: int, states: dict[str, str]) -> None:
        """Node states of the step in progress (from the scheduler)."""
        self.current = step
        self.states = dict(states)
        if self._live is not None:
            self._live.update(self.render())

    def step(self, step: int, row: dict[str, float]) -> None:
        """A finished step's metrics."""
        self.last_row = row
        self._note(step + 1, row)
        for k, v in row.items():
            values = self.history.setdefault(k, [])
            values.append(v)
            if len(values) > 4 * SPARK_POINTS:  # only the sparkline's points are shown: memory stays flat
                del values[:-SPARK_POINTS]
        for node in self.graph.nodes:
            if f"timing/{node}" in row:
                self.durations[node] = row[f"timing/{node}"]
        done = step + 1
        if done < self.total:
            self.wait(f"step {done + 1}/{self.total}")
        elif self.waits is not None:
            self.waits.end()
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

    def _note(self, done: int, row: dict[str, float]) -> None:
        """What the closing summary needs, and a validation's scores said as they come."""
        self.steps_done = max(self.steps_done, done)
        if self.headline in row:
            self.recent = [*self.recent[-(RECENT - 1):], row[self.headline]]
        val = {k: v for k, v in row.items() if k.startswith("val/") and isinstance(v, (int, float))}
        if not val:
            return
        if self.val_metric in val:
            self.val_scores.append((done, val[self.val_metric]))
        of = f" (of {self.score_max:.4g})" if self.score_max is not None else ""
        shown = [k for k in self.shown if k in val] or sorted(val)
        self.say(f"validation after step {done}: " + "  ".join(
            f"{k} {val[k]:.4g}{of if k == self.val_metric else ''}" for k in shown))

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
