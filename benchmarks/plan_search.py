"""``flowrl plan --search`` against reality: predicted vs measured seconds per step over ten configurations.

Run from the repository root::

    python benchmarks/plan_search.py                 # grpo on the ray backend, 6 steps per configuration
    python benchmarks/plan_search.py --graph ppo     # another built-in graph
    python benchmarks/plan_search.py --smoke         # grpo, 8 prompts, local backend, 3 steps, 2 configurations

For one built-in graph: profile it once (``flowrl profile``: two short runs,
the graph's micro-batches and twice as many), search the configurations that
fit this machine (``flowrl plan --search --cpus <cores>``), then run up to ten
of them, spread over the ranking from the picked one to the slowest, each for
``--steps`` steps. Measured seconds per step: the median interval between the
ends of consecutive steps after the first (the same measure the profile
calibrates on). Printed: each configuration's predicted and measured s/step and
relative error, then the median and worst absolute relative error and the
measured rank of the configuration the search picked (1 = the fastest run).
On a shared, loaded machine the measured times carry the neighbours' noise: the
load average is printed with the table.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
from pathlib import Path

import _common  # noqa: F401  (repository on sys.path, one torch thread)
from _common import print_table
from rich.console import Console

from flowrl.cli_plan import profile_command
from flowrl.graph import load_graph
from flowrl.runtime.costs import load_costs, records_of, step_intervals
from flowrl.runtime.search import Budget, describe, search
from flowrl.runtime.traits import traits_of
from flowrl.runtime.trainer import Trainer

QUIET = {"trainer.val_every": 0, "trainer.checkpoint_every": 0}


def spread(n: int, k: int) -> list[int]:
    """``k`` indices out of ``n``, the first and last included, evenly apart."""
    if n <= k:
        return list(range(n))
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})


def measure(graph: str, overrides: dict, steps: int, backend: str, out: Path) -> float:
    g = load_graph(graph, overrides={**QUIET, **overrides})
    trainer = Trainer(g, backend=backend, steps=steps, out=out, trace=out / "trace.json", overwrite=True,
                      say=lambda m: None, history_limit=steps)
    trainer.run()
    return statistics.median(step_intervals(records_of(trainer.runtime.timeline.records)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--graph", default="grpo")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--configs", type=int, default=10)
    ap.add_argument("--backend", default="ray")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    base: dict = {}
    if args.smoke:
        args.steps, args.configs, args.backend = 3, 2, "local"
        base = {"data.batch_size": 8}
    work = Path(tempfile.mkdtemp(prefix="flowrl-plan-search-"))
    console = Console(width=250)
    say = (lambda m: None) if args.smoke else console.print
    path = profile_command(args.graph, args.steps, str(work), base, args.backend, say=say, err=console)
    graph = load_graph(args.graph, overrides={**QUIET, **base})
    costs = load_costs(path, graph)
    cpus = float(os.cpu_count() or 1)
    result = search(graph, lambda o: load_graph(args.graph, overrides={**QUIET, **base, **o}), costs,
                    Budget(cpus=cpus), traits_of(args.backend), machine=(cpus, 0))
    picked = spread(len(result.ranked), args.configs)
    rows = []
    for i in picked:
        o = result.ranked[i]
        s = measure(args.graph, {**base, **o.overrides}, args.steps, args.backend, work / f"config_{i}")
        rows.append((i, o, s))
    by_measured = sorted(rows, key=lambda r: r[2])
    errors = [abs(s / o.step_s - 1) for _, o, s in rows]
    table = []
    for i, o, s in rows:
        rank = 1 + by_measured.index((i, o, s))
        table.append([str(i + 1), describe(o), f"{o.step_s:.3f}", f"{s:.3f}", f"{s / o.step_s - 1:+.0%}", str(rank)])
    load = os.getloadavg()
    best_measured = by_measured[0][2]
    picked_s = next(s for i, _, s in rows if i == 0)
    print_table(f"plan search on {args.graph} ({args.backend} backend, {args.steps} steps per configuration)",
                ["search rank", "configuration", "predicted s/step", "measured s/step", "error", "measured rank"],
                table,
                notes=[f"median |error| {statistics.median(errors):.0%}, worst {max(errors):.0%} over {len(rows)} "
                       f"configurations; the picked one measured rank {1 + [r[0] for r in by_measured].index(0)} "
                       f"of {len(rows)}, {picked_s / best_measured - 1:+.0%} vs the fastest measured",
                       f"load average {load[0]:.1f} on {os.cpu_count()} cores while measuring; costs {path}"])
    if args.smoke:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
