"""Fitting a cost file from runs, and predicting a plan's seconds per step from one.

The primitives :mod:`flowrl.cli_plan` (``flowrl profile``) fits a cost file with:
each node's line through the median seconds of each row count
(:func:`fit_line`), the task records' seconds as if each task had had a core
to itself (:func:`solo_seconds`: the run's own tasks shared the machine's
cores, which the prediction then shares again the same way), how far each line
is from its samples (:func:`residuals`), and the per-task latency and per-step
driver work that the task durations do not hold (:func:`calibrate_overheads`,
:func:`calibrated`). :func:`predict_step` is the one prediction the profile
calibrates, the search ranks and every run checks itself against. What a run's
metrics say each node took is read here once (:func:`node_seconds`, :func:`metric_samples`), for
``flowrl plan --measured``, the profile of a run without a trace and the plan check.

Example::

    samples = node_samples(plan, records, cpus=2)      # node → [(rows per rank, solo seconds)]
    line = fit_line(samples["generate"])
    step_s = predict_step(plan, costs, cpus=2)
"""

from __future__ import annotations

import statistics
from typing import Any, Iterable

import numpy as np

from flowrl.plan.costs import WARMUP, CostFile, NodeCost, Record, rank_rows, task_seconds
from flowrl.plan.planner import Plan
from flowrl.plan.pools import DRIVER
from flowrl.plan.simulate import seconds_per_step, spread

#: steps simulated back to back: enough for the pipeline of the largest staleness tried to fill
SIM_STEPS = 8


def cores_for(plan: Plan, cpus: float | None) -> float | None:
    """The cores ``plan``'s tasks share: None (a device each) when its pools run on GPUs; one when its
    backend runs every worker as a thread of one process (no process groups: the local backend)."""
    if any(spec.gpus for spec in plan.pools):
        return None
    return cpus if plan.traits.process_groups else 1.0


def predict_step(plan: Plan, costs: CostFile, cpus: float | None, steps: int = SIM_STEPS) -> tuple[float, float]:
    """``(seconds per step with steps back to back, one step alone)`` of ``plan`` from ``costs``, its
    tasks sharing ``cpus`` cores (None: a device each, as GPUs are)."""
    return seconds_per_step(plan, task_seconds(plan, costs), steps, cpus, costs.step_overhead_s)


def with_overheads(costs: CostFile, latency: float, overhead: float) -> CostFile:
    """``costs`` with a task latency and a per-step driver overhead of these seconds."""
    return costs.model_copy(update={"task_latency_s": latency, "step_overhead_s": overhead})


def calibrated(costs: CostFile, runs: list[tuple[Plan, float]], cpus: float | None) -> CostFile:
    """``costs`` with the task latency and per-step overhead :func:`calibrate_overheads` finds in ``runs``."""
    return with_overheads(costs, *calibrate_overheads(runs, costs, cpus))


def calibrate_overheads(runs: list[tuple[Plan, float]], costs: CostFile, cpus: float | None) -> tuple[float, float]:
    """``(task latency, per-step overhead)``: what the runs' measured seconds per step (``(plan,
    measured)``) hold beyond their tasks' durations, by least squares of the relative error over the
    runs. A task's latency (dispatch, moving its inputs) adds to every task; the per-step overhead is
    the driver's work after each step (results, metrics, fingerprints): it holds back the submission of
    the step a window later and takes a core while it runs. Runs with different task counts (the
    profile's twice-the-micro-batches run) tell the two apart; one run gives all to the latency."""
    runs = [(p, m) for p, m in runs if m > 0]
    if not runs:
        return 0.0, 0.0

    def at(latency: float, overhead: float) -> list[float]:
        c = with_overheads(costs, latency, overhead)
        return [predict_step(p, c, cpus)[0] for p, _ in runs]

    measured = np.array([m for _, m in runs])
    w = 1 / measured ** 2  # relative error: each run counts alike

    def fit(overhead: float) -> tuple[float, float, float]:
        """The best latency for this overhead (the prediction is close to linear in it), and the error."""
        base = np.array(at(0.0, overhead))
        slope = (np.array(at(1e-3, overhead)) - base) / 1e-3
        denom = float((w * slope * slope).sum())
        latency = max(0.0, float((w * slope * (measured - base)).sum()) / denom) if denom > 0 else 0.0
        return float((w * (base + slope * latency - measured) ** 2).sum()), latency, overhead

    # the overhead hides behind work that overlaps it, so the error is not smooth in it: a grid, refined twice
    lo, hi = 0.0, float(max(0.0, (measured - np.array(at(0.0, 0.0))).max()))
    best = fit(0.0)
    for _ in range(3):
        for overhead in np.linspace(lo, hi, 9):
            cand = fit(float(overhead))
            if cand[0] < best[0] - 1e-12:
                best = cand
        step = (hi - lo) / 8
        lo, hi = max(0.0, best[2] - step), best[2] + step
    return best[1], best[2]


def fit_line(samples: list[tuple[float, float]]) -> NodeCost:
    """``seconds = fixed + per_row × rows``, both non-negative, through the median seconds of each row
    count seen (a shared machine's stalls make a few tasks several times slower: a median ignores
    them, a mean follows them), weighted by how often each count was seen; through the origin when
    one row count was seen (nothing tells fixed from per-row cost then)."""
    if not samples:
        return NodeCost(fit="fixed")
    by_rows: dict[float, list[float]] = {}
    for r, sec in samples:
        by_rows.setdefault(float(r), []).append(sec)
    seen = sorted(by_rows)
    rows = np.array(seen, dtype=float)
    secs = np.array([statistics.median(by_rows[r]) for r in seen], dtype=float)
    weight = np.sqrt(np.array([len(by_rows[r]) for r in seen], dtype=float))
    n = len(samples)
    if len(seen) >= 2:
        a = np.stack([np.ones_like(rows), rows], axis=1) * weight[:, None]
        (fixed, per_row), *_ = np.linalg.lstsq(a, secs * weight, rcond=None)
        if fixed >= 0 and per_row >= 0:
            return NodeCost(fixed_s=float(fixed), per_row_s=float(per_row), fit="affine", rows_seen=seen, samples=n)
        if per_row < 0:  # time does not grow with rows: a constant
            return NodeCost(fixed_s=float(statistics.median(s for _, s in samples)), fit="fixed", rows_seen=seen,
                            samples=n)
    if rows.sum() <= 0:
        return NodeCost(fixed_s=float(statistics.median(s for _, s in samples)), fit="fixed", rows_seen=seen,
                        samples=n)
    w = weight ** 2
    return NodeCost(per_row_s=float((w * rows) @ secs / ((w * rows) @ rows)), fit="proportional",
                    rows_seen=seen, samples=n)


def residuals(node: NodeCost, samples: list[tuple[float, float]]) -> float:
    """How far the fitted line is from what was measured: the median of ``|predicted / measured - 1|``."""
    errs = [abs(node.seconds(r) / sec - 1) for r, sec in samples if sec > 0]
    return statistics.median(errs) if errs else 0.0


def solo_seconds(plan: Plan, records: list[Record], cpus: float | None) -> list[float]:
    """Each record's seconds as if it had had a core to itself: the run's own tasks shared ``cpus``
    cores (:func:`~flowrl.plan.simulate.simulate_steps` shares them the same way: a pool's task is a
    process per rank, the driver's tasks are threads of one process), so the seconds a task did work
    are its duration times the share of a core it had, integrated over its span."""
    if not cpus:
        return [r.end - r.start for r in records]
    driver = [plan.tasks.get((r.node, r.mb)) is None or plan.tasks[(r.node, r.mb)].pool == DRIVER for r in records]
    times = sorted({t for r in records for t in (r.start, r.end)})
    procs = np.zeros(len(times))  # worker processes running in each interval [times[i], times[i+1])
    threads = np.zeros(len(times))
    index = {t: i for i, t in enumerate(times)}
    for r, d in zip(records, driver):
        (threads if d else procs)[index[r.start]:index[r.end]] += 1
    demand = procs + (threads > 0)
    share = np.where(demand > cpus, cpus / np.maximum(demand, 1), 1.0)
    gaps = np.diff(np.array(times + [times[-1]]))
    worker_cum = np.concatenate([[0.0], np.cumsum(share * gaps)])
    driver_cum = np.concatenate([[0.0], np.cumsum(share / np.maximum(threads, 1) * gaps)])
    return [float((driver_cum if d else worker_cum)[index[r.end]] - (driver_cum if d else worker_cum)[index[r.start]])
            for r, d in zip(records, driver)]


def node_samples(plan: Plan, records: list[Record], skip_steps: int = WARMUP,
                 cpus: float | None = None) -> dict[str, list[tuple[float, float]]]:
    """``(rows on the rank, seconds)`` per node from a run of ``plan`` (its first ``skip_steps`` warm up);
    with ``cpus``, the seconds each task would have taken with a core of its own (:func:`solo_seconds`)."""
    out: dict[str, list[tuple[float, float]]] = {}
    first = min((r.step for r in records), default=0)
    for r, sec in zip(records, solo_seconds(plan, records, cpus)):
        task = plan.tasks.get((r.node, r.mb))
        if task is None or r.step < first + skip_steps:
            continue
        out.setdefault(r.node, []).append((rank_rows(plan, task), sec))
    return out


def metric_samples(plan: Plan, rows: list[dict[str, Any]], skip_steps: int = WARMUP) -> dict[str, list[tuple[float, float]]]:
    """The same from ``metrics.jsonl``: ``timing/<node>`` is the sum of its tasks' (slowest-rank) seconds."""
    out: dict[str, list[tuple[float, float]]] = {}
    for row in rows[skip_steps:]:
        measured = {n: row[f"timing/{n}"] for n in plan.graph.nodes if f"timing/{n}" in row}
        for key, sec in spread(plan, measured).items():
            out.setdefault(key[0], []).append((rank_rows(plan, plan.tasks[key]), sec))
    return out


def node_seconds(rows: list[dict[str, Any]], nodes: Iterable[str]) -> dict[str, float]:
    """Each node's measured seconds per step: the median of its ``timing/<node>`` over ``rows`` (metrics
    rows); nodes never timed are left out."""
    out: dict[str, float] = {}
    for n in nodes:
        xs = [r[f"timing/{n}"] for r in rows if f"timing/{n}" in r]
        if xs:
            out[n] = statistics.median(xs)
    return out


def world_factors(nodes: dict[str, NodeCost], plan: Plan, samples: dict[str, list[tuple[float, float]]],
                  base: dict[str, int]) -> None:
    """Record on ``nodes`` how their tasks ran in ``plan`` (``samples``: from one or more runs of its worker
    counts), for the nodes whose pool has another worker count than in the profiled ``base`` (node →
    workers): the factor against their line at the rows profiled there, and, where two or more row
    counts were profiled there, the line there (:meth:`~flowrl.plan.costs.NodeCost.on`).

    From one row count, the factor scales the whole line; profiling here, what more ranks add was in
    some nodes paid per task (a pool of two ranks took about as long on 8 rows as on 32) and in others per
    row, so only a second row count tells the two apart."""
    for node, xs in samples.items():
        world = plan.node_tasks(node)[0].world
        if world == base.get(node, world) or node not in nodes or not xs:
            continue
        line = nodes[node]
        ratios = [s / line.seconds(r) for r, s in xs if line.seconds(r) > 0]
        if ratios:
            line.world_factor[world] = statistics.median(ratios)
        if len({r for r, _ in xs}) > 1:
            there = fit_line(xs)
            line.world_line[world] = (there.fixed_s, there.per_row_s)


def step_intervals(records: list[Record], skip_steps: int = WARMUP) -> list[float]:
    """Seconds between the ends of consecutive steps (a step's wall time, overlap included)."""
    ends: dict[int, float] = {}
    for r in records:
        ends[r.step] = max(ends.get(r.step, r.end), r.end)
    steps = sorted(ends)[skip_steps:]
    return [ends[b] - ends[a] for a, b in zip(steps, steps[1:])]


def median_or_zero(xs: list[float]) -> float:
    return statistics.median(xs) if xs else 0.0




__all__ = ["SIM_STEPS", "calibrate_overheads", "calibrated", "cores_for", "fit_line", "median_or_zero", "metric_samples",
           "node_samples", "node_seconds", "predict_step", "residuals", "solo_seconds", "step_intervals",
           "with_overheads", "world_factors"]
