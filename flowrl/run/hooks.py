"""What ``flowrl run`` attaches to every finished step: its driver-step hooks (:mod:`flowrl.runtime.steps`).

In the order the trainer registers them:

* :class:`Timing` — the row's ``timing/elapsed``, throughput over the wall time
  between steps, and the plan check (``plan/*``, :mod:`flowrl.plan.plancheck`);
* :class:`MetricsSinks` — the row to ``metrics.jsonl``, TensorBoard and W&B
  (:mod:`flowrl.store.sinks`), and to the run's history;
* :class:`Fingerprints` — ``fingerprints.jsonl`` and the invariants
  (``trainer.fingerprints``, ``trainer.invariants``; :mod:`flowrl.provenance.fingerprints`);
* :class:`Dumps` — the columns the operators declare ``dumped``, as JSONL
  (``trainer.dump_rollouts``; :mod:`flowrl.store.dumps`);
* :class:`Records` — the chosen nodes' exact outputs (``trainer.record``;
  :mod:`flowrl.provenance.record`);
* :class:`StartupLines` — the start-up timeline after the first step (``flowrl run -v``).

Each opens at the run's first step and is cut back by a resume or a rollback
(:meth:`~flowrl.runtime.steps.StepHook.rewind`): the steps after the checkpoint
are written again, once.

Example::

    hooks = [Timing(samples, plan_check), MetricsSinks(out, config, print)]
    Runtime(graph, backend="local", hooks=hooks)
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

from flowrl.graph import Graph
from flowrl.graph.config import GraphConfig
from flowrl.plan.plancheck import PlanCheck
from flowrl.plan.planner import Plan
from flowrl.provenance.fingerprints import FingerprintLog
from flowrl.provenance.record import Recorder, collect_records
from flowrl.runtime.timeline import describe
from flowrl.runtime.steps import FinishedStep, StepHook
from flowrl.store.dumps import graph_fields, write_rollouts
from flowrl.store.sinks import Sinks, cut_metrics, open_sinks

Say = Callable[[str], None]


class Timing(StepHook):
    """``timing/elapsed`` since the run started, throughput, and the plan check, added to each row."""

    def __init__(self, samples_per_step: int, plan_check: PlanCheck, tokens: str | None = None) -> None:
        """``samples_per_step``: rows a step generates (prompts × the largest expansion); ``tokens``: the metric
        of the mean tokens a row generated, as the generating operator declares it (``Graph.token_metrics``)."""
        self.samples_per_step, self.plan_check, self.tokens = samples_per_step, plan_check, tokens
        self.start: float | None = None
        self.last_end: float | None = None

    def rewind(self, step: int) -> None:
        if self.start is None:
            self.start = time.time()

    def step_done(self, done: FinishedStep) -> None:
        now, row = time.time(), done.row
        row["timing/elapsed"] = now - (self.start or now)
        # throughput over wall time between finished steps (it includes any overlap across steps)
        wall = now - self.last_end if self.last_end is not None else done.result.makespan
        self.last_end = now
        if wall > 0:
            row["throughput/samples_per_s"] = self.samples_per_step / wall
            if self.tokens is not None and self.tokens in row:
                row["throughput/tokens_per_s"] = self.samples_per_step * row[self.tokens] / wall
        row.update(self.plan_check.observe(row))


class MetricsSinks(StepHook):
    """Each step's row to every metrics sink, and to ``history`` (the last ``history_limit`` rows)."""

    def __init__(self, out: Path, config: GraphConfig, say: Say, history: list[dict[str, Any]],
                 history_limit: int | None = None) -> None:
        self.out, self.config, self.say = Path(out), config, say
        self.history, self.history_limit = history, history_limit
        self.sinks: Sinks | None = None
        self.last: dict[str, Any] | None = None  # the latest row written

    def rewind(self, step: int) -> None:
        if self.sinks is None:
            cut_metrics(self.out / "metrics.jsonl", step, self.say)
            cfg = self.config
            self.sinks = open_sinks(self.out, cfg.trainer.wandb_project, run_name=cfg.name, config=cfg.dump())
        else:
            self.sinks.cut_back(step, self.say)
        self.history[:] = [row for row in self.history if row["step"] <= step]

    def step_done(self, done: FinishedStep) -> None:
        self.last = done.row
        self.sinks.write(done.row["step"], done.row)
        self.history.append(done.row)  # the driver's memory stays flat: only the last history_limit rows
        if self.history_limit is not None and len(self.history) > self.history_limit:
            del self.history[: len(self.history) - self.history_limit]

    def sync(self) -> None:
        if self.sinks is not None:
            self.sinks.sync()  # metrics on disk before the checkpoint that continues after them

    def close(self) -> None:
        if self.sinks is not None:
            self.sinks.close()
            self.sinks = None


class Fingerprints(StepHook):
    """``<out>/fingerprints.jsonl``: each step's record, its invariants checked (fatal ones raise)."""

    def __init__(self, out: Path, graph: Graph, plan: Plan, say: Say) -> None:
        self.out, self.graph, self.plan, self.say = out, graph, plan, say
        self.log: FingerprintLog | None = None

    def rewind(self, step: int) -> None:
        self.close()
        cfg = self.graph.config.trainer
        self.log = FingerprintLog(self.out, self.graph, self.plan, self.say, keep_through=step,
                                  fatal=cfg.invariants == "fatal", check=cfg.invariants != "off")

    def step_done(self, done: FinishedStep) -> None:
        self.log.step(done.result)

    def sync(self) -> None:
        if self.log is not None:
            self.log.sync()

    def close(self) -> None:
        if self.log is not None:
            self.log.close()


class Dumps(StepHook):
    """``<out>/rollouts/step_<n>.jsonl``: each step's samples, the columns its operators declare ``dumped``."""

    def __init__(self, out: Path, graph: Graph, decode: Callable[..., Any] | None) -> None:
        fields, producers = graph_fields(graph), graph.producers()
        self.fields = {n: fields[n] for n in graph.dumped_fields() if n in producers}
        self.out, self.decode = out, decode

    def step_done(self, done: FinishedStep) -> None:
        if self.fields:
            path = self.out / "rollouts" / f"step_{done.result.step + 1:06d}.jsonl"
            write_rollouts(path, done.read(self.fields), self.fields, self.decode)


class Records(StepHook):
    """``<out>/records``: the chosen nodes' outputs of the recorded steps (``trainer.record``)."""

    def __init__(self, out: Path, graph: Graph, say: Say) -> None:
        self.out, self.graph, self.say = out, graph, say
        self.recorder: Recorder | None = None

    def rewind(self, step: int) -> None:
        self.recorder = Recorder(self.out, self.graph, self.say, keep_through=step)  # later steps' records go

    def step_done(self, done: FinishedStep) -> None:
        step = done.result.step
        if self.recorder.wants(step):
            self.recorder.write(step, collect_records(self.recorder.fields, done.read))


class StartupLines(StepHook):
    """After the run's first step, the start-up timeline of every process (``flowrl run -v``)."""

    def __init__(self, runtime: Any, say: Say) -> None:
        self.runtime, self.say, self.said = runtime, say, False

    def step_done(self, done: FinishedStep) -> None:
        if not self.said:
            self.said = True
            for line in describe(self.runtime.backend.startup_spans(), self.runtime.timeline.records):
                self.say(line)


__all__ = ["Dumps", "Fingerprints", "MetricsSinks", "Records", "StartupLines", "Timing"]
