"""What fingerprints cost: the default job's step time with and without them.

Every node output of every step is digested row by row where it is produced,
with a few statistics, and every role's weights are digested before each task
that uses them and after each update (:mod:`flowrl.provenance.fingerprints`). This
runs the default job (``grpo``, local backend) with ``trainer.fingerprints`` on
and off, alternating runs so that a busy machine slows both alike, and prints
the median step time of each and their ratio (the target: at most 1.02). The order
alternates (off-on, on-off, ...), so that neither variant always runs warmer. On a
shared machine that ratio is noisy, so it also times the fingerprint work itself
(the CPU time of the worker's digests and the driver's record, in process on the
local backend) and prints it as a share of the step.

Example::

    PYTHONPATH=$PWD python benchmarks/fingerprints.py            # 4 runs each of 12 steps
    PYTHONPATH=$PWD python benchmarks/fingerprints.py --smoke    # 1 run each of 3 small steps
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any, Callable

import _common  # noqa: F401  (repository on sys.path, one torch thread)
from _common import print_table

import flowrl.provenance.fingerprints as fingerprints
from flowrl.graph import load_graph
from flowrl.provenance.fingerprints import FingerprintLog
from flowrl.run.trainer import Trainer

SMALL = {"data.batch_size": 4, "nodes.generate.n": 2, "nodes.generate.max_new_tokens": 4}


SPENT = [0.0]  # CPU seconds of the fingerprint work (its thread's: waiting on a busy machine is not its cost)


def timed(fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            SPENT[0] += time.thread_time() - t
    return wrapper


def instrument() -> None:
    """Time every fingerprint call: the worker's (same process on the local backend) and the driver's."""
    for name in ("task_prints", "source_prints"):  # called by the worker's FingerprintHook, by module name
        setattr(fingerprints, name, timed(getattr(fingerprints, name)))
    fingerprints.role_weights = timed(fingerprints.role_weights)  # looked up by WeightDigests at each call
    FingerprintLog.step = timed(FingerprintLog.step)


def step_times(on: bool, steps: int, overrides: dict) -> list[float]:
    """Seconds between finished steps, the first (warm-up) left out."""
    graph = load_graph("grpo", overrides={**overrides, "trainer.fingerprints": on, "trainer.val_every": 0,
                                          "trainer.checkpoint_every": 0})
    with tempfile.TemporaryDirectory() as out:
        rows = Trainer(graph, backend="local", steps=steps, out=out, say=lambda _: None).run()
    elapsed = [r["timing/elapsed"] for r in rows]
    return [b - a for a, b in zip(elapsed, elapsed[1:])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: check that it runs")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--runs", type=int, default=4)
    args = parser.parse_args()
    steps, runs, overrides = (3, 1, SMALL) if args.smoke else (args.steps, args.runs, {})
    instrument()
    times: dict[bool, list[float]] = {True: [], False: []}
    pairs = []  # each run's with / without ratio of median steps
    for run in range(runs):  # off-on, then on-off: neither variant always runs second (warmer)
        medians = {}
        for on in ((False, True) if run % 2 == 0 else (True, False)):
            medians[on] = step_times(on, steps, overrides)
            times[on] += medians[on]
        pairs.append(statistics.median(medians[True]) / statistics.median(medians[False]))
    off, on = statistics.median(times[False]), statistics.median(times[True])
    per_step = SPENT[0] / (runs * steps)
    size = "small batch (smoke)" if args.smoke else "default sizes"
    print_table(f"fingerprints: grpo, local backend, {size}, {runs} run(s) x {steps - 1} timed steps each",
                ["variant", "steps", "median step s", "ratio"],
                [["without fingerprints", str(len(times[False])), f"{off:.3f}", "1.000"],
                 ["with fingerprints", str(len(times[True])), f"{on:.3f}", f"{on / off:.3f}"]],
                ["ratio: with / without (target <= 1.02); runs alternate (off-on, on-off, ...), so load on the machine "
                 "hits both",
                 f"each run's ratio: {' '.join(f'{r:.3f}' for r in pairs)} (median {statistics.median(pairs):.3f}; "
                 f"their spread is the machine's noise)",
                 f"fingerprint work, timed: {per_step * 1000:.1f} ms CPU per step = {per_step / on:.2%} of the "
                 f"median step with them"])


if __name__ == "__main__":
    main()
