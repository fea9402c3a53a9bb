"""Metrics that say how they reduce.

An operator returns its metrics as a dict of numbers. A plain number is a
mean, weighted by the rows it was computed on; a value that reduces another
way says so by its type: :func:`mean` (with a weight of its own, e.g. real
tokens), :func:`total` (a sum), :func:`maximum`, :func:`minimum`. One
reducer (:class:`Reduction`) serves every level a metric crosses: the
micro-batches of an update, the ranks of a pool, the tasks of a step.

:class:`Metric` is a ``float``, so a declared metric reads, prints, compares
and serialises like any other number; arithmetic on it gives a plain float.

Example::

    >>> scores = [0.5, 0.5, 0.0625, 0.5]         # four micro-batches' maxima
    >>> r = Reduction()
    >>> for s in scores:
    ...     r.add({"reward/max": maximum(s), "reward/mean": s}, weight=4)
    >>> out = r.values()
    >>> out["reward/max"], out["reward/mean"]
    (0.5, 0.390625)
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping

MEAN, SUM, MAX, MIN = "mean", "sum", "max", "min"
REDUCTIONS = (MEAN, SUM, MAX, MIN)
#: the value a max / min starts from: what a part that has no value of the metric adds
IDENTITY = {MAX: -math.inf, MIN: math.inf}


class Metric(float):
    """A number and how it reduces: ``reduce`` (mean, sum, max, min) and, for a mean, ``weight``
    (``None``: the rows of the task or micro-batch it came from)."""

    reduce: str
    weight: float | None

    def __new__(cls, value: Any, reduce: str = MEAN, weight: Any = None) -> "Metric":
        if reduce not in REDUCTIONS:
            raise ValueError(f"a metric reduces by one of {', '.join(REDUCTIONS)}, not {reduce!r}")
        if hasattr(value, "detach"):  # a tensor computed with gradients: the value only
            value = value.detach()
        obj = super().__new__(cls, float(value))
        obj.reduce = reduce
        obj.weight = None if weight is None else float(weight)
        return obj

    def __reduce__(self):  # pickled (Ray) with its reduction
        return (Metric, (float(self), self.reduce, self.weight))


def mean(value: Any, weight: Any = None) -> Metric:
    """A mean; ``weight`` is what it is a mean over (tokens, rows), default the rows it came from."""
    return Metric(value, MEAN, weight)


def total(value: Any) -> Metric:
    """A sum: counts, or shares of a whole that add up to it."""
    return Metric(value, SUM)


def maximum(value: Any) -> Metric:
    return Metric(value, MAX)


def minimum(value: Any) -> Metric:
    return Metric(value, MIN)


def metric_value(value: Any) -> float:
    """An operator's metric as a number: a declared :class:`Metric` as it is, anything else
    (a tensor, an int) as a float, which reduces as a mean over rows."""
    return value if isinstance(value, Metric) else float(value.detach() if hasattr(value, "detach") else value)


def reduction_of(value: Any) -> str:
    """How ``value`` reduces: its declared reduction, or a mean for a plain number."""
    return value.reduce if isinstance(value, Metric) else MEAN


class Reduction:
    """Named metrics reduced as they are added, each by its declared reduction.

    :meth:`add` one part's metrics (a micro-batch's, a rank's, a task's) with
    the part's weight (its rows); :meth:`values` gives the reduced metrics,
    each a :class:`Metric` of the same reduction, so the result reduces again
    at the next level. A metric declared two ways is an error naming it.
    """

    def __init__(self) -> None:
        self._acc: dict[str, list] = {}  # name -> [reduction, value (Σ w·v for a mean), Σ w]

    def add(self, metrics: Mapping[str, Any], weight: float = 1.0, real: bool = True) -> None:
        """Add one part. ``real=False``: a part that only keeps the ranks in step (a padding pass):
        its names are recorded, its values add nothing."""
        for name, value in metrics.items():
            how = reduction_of(value)
            acc = self._acc.setdefault(name, [how, IDENTITY.get(how, 0.0), 0.0])
            if acc[0] != how:
                raise ValueError(f"metric {name!r} is reduced as {acc[0]} in one part and as {how} in "
                                 f"another: declare it one way")
            if not real:
                continue
            v = float(value)
            if how == MEAN:
                w = value.weight if isinstance(value, Metric) and value.weight is not None else weight
                acc[1] += w * v
                acc[2] += w
            elif how == SUM:
                acc[1] += v
            else:
                acc[1] = max(acc[1], v) if how == MAX else min(acc[1], v)

    def merge(self, packed: Mapping[str, tuple[str, float, float]]) -> None:
        """Replace the running values by ``packed`` (:meth:`packed`'s shape, reduced elsewhere:
        over a pool's ranks)."""
        for name, (how, value, weight) in packed.items():
            self._acc[name] = [how, value, weight]

    def packed(self) -> dict[str, tuple[str, float, float]]:
        """The running state, ``name -> (reduction, value, weight)``: a mean's value is Σ w·v."""
        return {name: tuple(acc) for name, acc in self._acc.items()}

    def values(self) -> dict[str, Metric]:
        """The reduced metrics; a max or min no part gave a value for is left out."""
        out: dict[str, Metric] = {}
        for name, (how, value, weight) in self._acc.items():
            if how == MEAN:
                out[name] = Metric(value / weight if weight else 0.0, MEAN, weight)
            elif math.isfinite(value) or how == SUM:
                out[name] = Metric(value, how)
        return out


def reduce_metrics(parts: Iterable[Mapping[str, Any]], weights: Iterable[float] | None = None) -> dict[str, Metric]:
    """``parts`` reduced into one dict, each metric by its reduction; ``weights`` are the parts'
    rows (the weight of a plain number or an unweighted mean; default 1 each)."""
    reduction = Reduction()
    weights = iter(weights) if weights is not None else None
    for part in parts:
        reduction.add(part, next(weights) if weights is not None else 1.0)
    return reduction.values()


#: prefixes of metrics that measure the machine (wall time, rates, memory, the plan's prediction
#: error), not what a step computed: two runs that computed the same bits differ there
MEASURED_PREFIXES = ("timing/", "throughput/", "perf/", "time/", "memory/", "plan/")
#: the scheduler's metrics derived from measured durations (its min_weight_version is computed)
MEASURED_KEYS = frozenset({"scheduler/lower_bound", "scheduler/critical_path", "scheduler/efficiency",
                           "scheduler/pipeline_efficiency"})


def step_seconds(row: dict[str, Any]) -> float | None:
    """A step's measured seconds from its metrics row: the interval since the step before ended (steps
    overlap under staleness), else its own makespan; None when the row has neither."""
    return row.get("timing/interval", row.get("timing/step"))


def measured(name: str) -> bool:
    """Whether metric ``name`` (``val/`` or not) measures the machine rather than the computation:
    what comparisons of two runs (``flowrl diff``, reproducibility checks) leave out."""
    name = name.removeprefix("val/")
    return name.startswith(MEASURED_PREFIXES) or name in MEASURED_KEYS or name.endswith(("_s", "_mb"))


__all__ = ["IDENTITY", "MAX", "MEASURED_KEYS", "MEASURED_PREFIXES", "MEAN", "MIN", "Metric", "REDUCTIONS", "Reduction",
           "SUM", "maximum", "mean", "measured", "metric_value", "minimum", "reduce_metrics", "reduction_of", "step_seconds", "total"]
