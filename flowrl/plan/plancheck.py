"""Every run checks its plan's prediction against what it measures: ``plan/predicted_step_s``, ``plan/error``.

The prediction is the search's (:func:`~flowrl.plan.costfit.predict_step`) from the cost file in the run
directory (``costs.json``, written by ``flowrl profile``) when it was profiled
for this graph; otherwise from the node times this run measured so far (each
node's median ``timing/<node>`` over the steps before), so the number checks the
schedule's prediction even where nobody profiled. ``plan/error`` is
``measured / predicted - 1`` with the measured seconds per step the interval
between finished steps. When it passes 25% (after the first step, which warms
up), a warning names the node whose measured time drifted most from its
predicted time, once per node.

Example::

    check = PlanCheck(plan, Path("runs/grpo"), say=print)
    row.update(check.observe(row))        # in the trainer, per step
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

from flowrl.data.metrics import step_seconds
from flowrl.plan.costfit import cores_for, node_seconds, predict_step
from flowrl.plan.costs import COST_FILE, CostFile, CostFileError, load_costs, task_seconds
from flowrl.plan.planner import Plan, TaskKey
from flowrl.plan.simulate import bounds_of, seconds_per_step, spread

#: relative error past which the node that drifted most is named
DRIFT = 0.25
STEPS = 8


class PlanCheck:
    """Predicted against measured seconds per step, for a run of ``plan`` writing into ``out``."""

    def __init__(self, plan: Plan, out: Path, say: Callable[[str], None]) -> None:
        self.plan, self.say = plan, say
        self.costs: CostFile | None = None
        path = Path(out) / COST_FILE
        if path.is_file():
            try:
                self.costs = load_costs(path, plan.graph)
            except CostFileError as e:
                say(f"plan check: not using {path}: {e}")
        self.seen: list[dict[str, float]] = []  # the timing/<node> of the steps so far (the first left out)
        self.warned: set[str] = set()
        self.steps = 0
        self._tasks: dict[TaskKey, float] | None = None  # task_seconds() until the next step is observed

    @staticmethod
    def per_node(seconds: dict[TaskKey, float]) -> dict[str, float]:
        """Task seconds summed by node (what ``timing/<node>`` measures)."""
        out: dict[str, float] = {}
        for (node, _), s in seconds.items():
            out[node] = out.get(node, 0.0) + s
        return out

    def task_seconds(self) -> dict[TaskKey, float] | None:
        """Each task's predicted seconds now: from the cost file, else from the node times measured so far
        (None before anything to predict from). The hang report calibrates itself on them; they change only
        when a step is observed, so they are kept until then (the watchdog asks on every poll)."""
        if self._tasks is None:
            if self.costs is not None:
                self._tasks = task_seconds(self.plan, self.costs)
            elif self.seen:  # measured as they ran, sharing the cores already
                self._tasks = spread(self.plan, node_seconds(self.seen, self.plan.graph.nodes), missing=0.0)
        return self._tasks

    def predicted(self) -> tuple[float, dict[str, float], float] | None:
        """Seconds per step, per node and of the critical path as predicted now (None before anything
        to predict from)."""
        seconds = self.task_seconds()
        if seconds is None:
            return None
        if self.costs is not None:  # the search's prediction: its tasks share this machine's cores
            step_s = predict_step(self.plan, self.costs, cores_for(self.plan, float(os.cpu_count() or 1)), STEPS)[0]
        else:  # measured tasks, simulated with a device each
            step_s = seconds_per_step(self.plan, seconds, STEPS)[0]
        return step_s, self.per_node(seconds), bounds_of(self.plan, seconds)[0]

    def observe(self, row: dict[str, Any]) -> dict[str, float]:
        """The step's ``plan/*`` metrics from its metrics row (``timing/*``); warns on drift."""
        self.steps += 1
        prediction = self.predicted()
        measured = step_seconds(row)
        nodes = {n: row[f"timing/{n}"] for n in self.plan.graph.nodes if f"timing/{n}" in row}
        if self.steps > 1 and nodes:  # the first step warms up: it predicts nothing for later ones
            self.seen.append({f"timing/{n}": s for n, s in nodes.items()})
            self._tasks = None
        if prediction is None or not measured:
            return {}
        step_s, per_node, critical = prediction
        error = measured / step_s - 1.0 if step_s > 0 else 0.0
        if self.steps > 1 and abs(error) > DRIFT and nodes:
            node = max(nodes, key=lambda n: abs(nodes[n] - per_node.get(n, 0.0)))
            if node not in self.warned:
                self.warned.add(node)
                where = "the cost file" if self.costs is not None else "the steps before"
                self.say(f"plan check: step {row.get('step', self.steps)} took {measured:.3g}s, {error:+.0%} off "
                         f"the predicted {step_s:.3g}s; node {node!r} drifted most ({nodes[node]:.3g}s measured, "
                         f"{per_node.get(node, 0.0):.3g}s predicted from {where}); profile again with "
                         f"`flowrl profile` if this persists")
        return {"plan/predicted_step_s": step_s, "plan/error": error, "plan/predicted_critical_path_s": critical}


__all__ = ["DRIFT", "PlanCheck"]
