"""Every run checks its plan's prediction against what it measures: ``plan/predicted_step_s``, ``plan/error``.

The prediction is the search's (:func:`~flowrl.plan.costfit.predict_step`) from the cost file in the run
directory (``costs.json``, written by ``flowrl profile``) when it was profiled
for this graph; otherwise from the node times this run measured so far (each
node's median ``timing/<node>`` over the steps before), so the number checks the
schedule's prediction even where nobody profiled. ``plan/error`` is
``measured / predicted - 1`` with the measured seconds per step the interval
between finished steps.

A warning is for a drift that lasts, not for one slow step on a busy machine: a
step drifts when its error passes 25% and also passes what the run's own steps
spread (:data:`SPREAD` times the median absolute deviation of the calm steps'
seconds over their median); once :data:`PERSIST` steps in a row have drifted, over
at least :data:`LASTING_S` seconds (a burst of another program's work on a shared
machine is over in seconds, while a run of half-second steps makes three of them), the
run is warned once, naming the node whose measured time drifted most from its
predicted time. On a loaded machine (a load average over its cores) the warning
names the load and goes to the run's log instead of the terminal: the machine,
not the plan, is the likely cause.

Example::

    check = PlanCheck(plan, Path("runs/grpo"), say=print)
    row.update(check.observe(row))        # in the trainer, per step
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path
from typing import Any, Callable

from flowrl.data.metrics import step_seconds
from flowrl.plan.costfit import cores_for, node_seconds, predict_step
from flowrl.plan.costs import COST_FILE, CostFile, CostFileError, load_costs, task_seconds
from flowrl.plan.planner import Plan, TaskKey
from flowrl.plan.simulate import bounds_of, seconds_per_step, spread

#: relative error past which a step drifts (when the run's own steps spread less)
DRIFT = 0.25
#: drifting steps in a row before the run is warned (once)
PERSIST = 3
#: and those steps took at least this many seconds together
LASTING_S = 10.0
#: a step drifts past this many median absolute deviations of the calm steps' seconds (relative to their median)
SPREAD = 4.0
STEPS = 8


def load_average() -> float | None:
    """The machine's load average over the last minute (None where the system does not say)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def relative_spread(seconds: list[float]) -> float:
    """The median absolute deviation of ``seconds`` over their median (0 for fewer than three)."""
    if len(seconds) < 3:
        return 0.0
    mid = statistics.median(seconds)
    return statistics.median(abs(s - mid) for s in seconds) / mid if mid > 0 else 0.0


class PlanCheck:
    """Predicted against measured seconds per step, for a run of ``plan`` writing into ``out``."""

    def __init__(self, plan: Plan, out: Path, say: Callable[[str], None],
                 log: Callable[[str], None] | None = None,
                 load: Callable[[], float | None] = load_average, cores: int | None = None) -> None:
        """``say``: the terminal; ``log``: the run's log, where a warning goes when the machine is loaded
        (``load()`` past ``cores``, default this machine's)."""
        self.plan, self.say, self.log = plan, say, log
        self.load, self.cores = load, cores or os.cpu_count() or 1
        self.costs: CostFile | None = None
        path = Path(out) / COST_FILE
        if path.is_file():
            try:
                self.costs = load_costs(path, plan.graph)
            except CostFileError as e:
                say(f"plan check: not using {path}: {e}")
        self.seen: list[dict[str, float]] = []  # the timing/<node> of the steps so far (the first left out)
        self.calm: list[float] = []  # the seconds of the steps that did not drift (the first left out)
        self.streak: list[tuple[float, str, float]] = []  # the drifting steps in a row: error, node, seconds
        self.warned = False
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
        # the first step warms up: it predicts nothing for later ones and is not judged; a drifting step
        # stays out of the prediction, so a lasting slowdown is warned rather than learned
        judged = self.steps > 1 and bool(nodes)
        if prediction is None or not measured:
            if judged:
                self._learn(nodes)
            return {}
        step_s, per_node, critical = prediction
        error = measured / step_s - 1.0 if step_s > 0 else 0.0
        if judged and not self._drifts(row.get("step", self.steps), measured, step_s, error, nodes, per_node):
            self._learn(nodes)
        return {"plan/predicted_step_s": step_s, "plan/error": error, "plan/predicted_critical_path_s": critical}

    def _learn(self, nodes: dict[str, float]) -> None:
        """A step's node seconds join what the prediction is made from (and :meth:`task_seconds` anew)."""
        self.seen.append({f"timing/{n}": s for n, s in nodes.items()})
        self._tasks = None

    def _drifts(self, step: int, measured: float, step_s: float, error: float, nodes: dict[str, float],
                per_node: dict[str, float]) -> bool:
        """Whether the step drifts: off the prediction by more than DRIFT and than the calm steps spread, once
        there are enough calm steps to know their spread. The run is warned once, when PERSIST steps in a row
        drifted, for LASTING_S seconds together, with the same node drifting most (a slow step then a burst of
        the machine's load is not one drift)."""
        if len(self.calm) < PERSIST or abs(error) <= max(DRIFT, SPREAD * relative_spread(self.calm)):
            self.calm.append(measured)
            self.streak.clear()
            return False
        node = max(nodes, key=lambda n: abs(nodes[n] - per_node.get(n, 0.0)))
        if self.streak and self.streak[-1][1] != node:
            self.streak.clear()
        self.streak.append((error, node, measured))
        lasted = sum(s for _, _, s in self.streak)
        if self.warned or len(self.streak) < PERSIST or lasted < LASTING_S:
            return True
        self.warned = True
        where = "the cost file" if self.costs is not None else "the steps before"
        errors = [f"{e:+.0%}" for e, _, _ in self.streak]
        shown = ", ".join(errors if len(errors) <= 6 else [*errors[:3], "…", *errors[-2:]])
        message = (f"plan check: {len(self.streak)} steps in a row ({lasted:.3g}s) off the predicted "
                   f"{step_s:.3g}s/step ({shown}; step {step} took {measured:.3g}s); node {node!r} drifted most ({nodes[node]:.3g}s measured, "
                   f"{per_node.get(node, 0.0):.3g}s predicted from {where}); profile again with `flowrl profile` "
                   f"if this persists")
        load = self.load()
        if load is not None and load > self.cores and self.log is not None:
            self.log(f"{message} (the machine's load average was {load:.1f} on {self.cores} cores: "
                     f"the load may be the cause)")
        else:
            self.say(message)
        return True


__all__ = ["DRIFT", "LASTING_S", "PERSIST", "SPREAD", "PlanCheck", "load_average", "relative_spread"]
