"""``flowrl plan --search`` against reality: predicted vs measured seconds per step, every built-in graph.

Run from the repository root (one line; every built-in graph, about half an hour on 2 idle cores)::

    python benchmarks/plan_search.py                       # every graph in graphs/, ray backend
    python benchmarks/plan_search.py --graphs grpo ppo     # some of them
    python benchmarks/plan_search.py --refit DIR           # predictions of this code from a past run's measurements
    python benchmarks/plan_search.py --smoke               # grpo, 8 prompts, local backend, 2 configurations

For each graph: profile it once (``flowrl profile``: the graph as written, at
the micro-batch count the search tries farthest from its own, both on twice its
workers where the cores allow), search the configurations that fit this
machine (``flowrl plan --search --cpus <cores>``), then run up to ``--configs``
of them — all when there are no more, else spread over the ranking from the
picked one to the slowest — each for ``--steps`` steps, and the picked, the
shipped and the fastest measured one once more at the end (``--again``).
Measured seconds per step: the median interval between the ends of consecutive
steps after the warm-up steps (:data:`~flowrl.plan.costs.WARMUP`, the
measure the profile calibrates on), over both runs of a configuration measured
twice. One Ray serves every run; each run starts its own workers.

Printed per graph: each configuration's predicted and measured s/step and
relative error, the median and worst absolute error, the measured rank of the
configuration the search picked (1 = the fastest run) and its time against the
fastest measured; then one summary line per graph. Everything measured is kept
in ``--out`` (``results.json``, the cost files, every run's trace), so
``--refit`` can predict the same measurements again with other code. On a
shared, loaded machine the measured times carry the neighbours' noise: the load
average is printed with each table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import _common  # noqa: F401  (repository on sys.path, one torch thread)
import torch
from _common import ROOT, print_table
from rich.console import Console

from flowrl.cli_plan import fit_runs, profile_command, read_run
from flowrl.graph import load_graph
from flowrl.runtime import ray_start
from flowrl.plan.costfit import step_intervals
from flowrl.plan.costs import COST_FILE, WARMUP, Transfer, load_costs, records_of, save_costs
from flowrl.plan.search import Budget, Outcome, describe, search
from flowrl.plan.traits import traits_of
from flowrl.run.trainer import Trainer

QUIET = {"trainer.val_every": 0, "trainer.checkpoint_every": 0}
#: the graphs whose search space is widest first: they tell the most
FIRST = ["grpo", "grpo_async", "ppo", "reinforce_pp"]


def builtin_graphs() -> list[str]:
    names = sorted(p.stem for p in (Path(ROOT) / "graphs").glob("*.yaml"))
    return [n for n in FIRST if n in names] + [n for n in names if n not in FIRST]


def spread(n: int, k: int) -> list[int]:
    """``k`` indices out of ``n``, the first and last included, evenly apart."""
    if n <= k:
        return list(range(n))
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})


def measure(graph: str, overrides: dict, steps: int, backend: str, out: Path) -> list[float]:
    """The step intervals after the warm-up of one run of ``graph`` with ``overrides``."""
    g = load_graph(graph, overrides={**QUIET, **overrides})
    trainer = Trainer(g, backend=backend, steps=steps, out=out, trace=out / "trace.json", overwrite=True,
                      say=lambda m: None, history_limit=steps)
    trainer.run()
    return step_intervals(records_of(trainer.runtime.timeline.records))


def searched(graph: str, base: dict, costs_path: Path, backend: str) -> tuple[list[Outcome], int]:
    """The search's ranking on this machine's cores, and where the shipped configuration is in it."""
    g = load_graph(graph, overrides={**QUIET, **base})
    costs = load_costs(costs_path, g)
    cpus = float(os.cpu_count() or 1)
    result = search(g, lambda o: load_graph(graph, overrides={**QUIET, **base, **o}), costs, Budget(cpus=cpus),
                    traits_of(backend), machine=(cpus, 0))
    return result.ranked, shipped_index(g, result.ranked)


def key_of(overrides: dict) -> str:
    return json.dumps(overrides, sort_keys=True, default=str)


def shipped_index(graph: Any, ranked: list[Outcome]) -> int:
    """Where the graph as written sits in the ranking: same pools (roles, workers), micro-batches, staleness."""
    cfg = graph.config
    pools = sorted((sorted(p.roles), p.workers) for p in cfg.pools.values())
    for i, o in enumerate(ranked):
        if (sorted((sorted(p["roles"]), p["workers"]) for p in o.overrides["pools"].values()) == pools
                and o.overrides["schedule.micro_batches"] == cfg.schedule.micro_batches
                and o.overrides["schedule.staleness"] == cfg.schedule.staleness):
            return i
    return -1


def chosen(n: int, k: int, shipped: int) -> list[int]:
    """The configurations to run: ``k`` spread over the ranking, the shipped one always among them."""
    picks = spread(n, k)
    if shipped < 0 or shipped in picks:
        return picks
    inner = [i for i in picks if 0 < i < n - 1] or picks  # the picked one and the slowest stay
    picks[picks.index(min(inner, key=lambda i: abs(i - shipped)))] = shipped
    return sorted(picks)


def contenders(ranked: list[Outcome], runs: dict[str, list[list[float]]], shipped: int) -> list[int]:
    """The configurations measured once more at the end: the one the search picked, the shipped one and
    the fastest measured. The pick's rank and its time against the fastest and the shipped one are what
    the table reports; two runs of a few steps each on a shared machine can differ by a quarter (here
    grpo_async's shipped configuration: 0.21 s/step in both profiling runs of it, 0.28 when measured), so
    these three get the median of both runs' steps."""
    at = {i: statistics.median(runs[key_of(o.overrides)][0]) for i, o in enumerate(ranked)
          if key_of(o.overrides) in runs}
    fastest = min(at, key=at.__getitem__)
    return sorted({i for i in (0, shipped, fastest) if i in at})


def twice_of(runs: dict[str, list[list[float]]]) -> frozenset[str]:
    return frozenset(k for k, v in runs.items() if len(v) > 1)


def probe() -> float:
    """Seconds of a fixed one-thread matrix workload (the median of five): how fast this shared machine
    runs one of our processes right now. Timed before and after the profile and every measured run, it
    shows how the neighbours' load moved between them."""
    x = torch.randn(160, 160)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(40):
            x = torch.tanh(x @ x)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def report(graph: str, backend: str, steps: int, ranked: list[Outcome], measured: dict[str, float],
           shipped: int, load: tuple[float, float], slower: dict[str, float],
           twice: frozenset[str] = frozenset()) -> dict[str, Any]:
    """One graph's table; returns its summary. ``slower``: per configuration, how much slower the
    probe ran around its run than around the profile (the load-adjusted error divides by it)."""
    rows = [(i, o, measured[key_of(o.overrides)]) for i, o in enumerate(ranked) if key_of(o.overrides) in measured]
    by_measured = [r[0] for r in sorted(rows, key=lambda r: r[2])]
    errors = [abs(s / o.step_s - 1) for _, o, s in rows]
    factor = {i: slower.get(key_of(o.overrides), 1.0) for i, o, _ in rows}
    adjusted = [abs(s / factor[i] / o.step_s - 1) for i, o, s in rows]
    table = []
    for i, o, s in rows:
        table.append([str(i + 1), describe(o) + (" (shipped)" if i == shipped else "")
                      + (" ×2" if key_of(o.overrides) in twice else ""), f"{o.step_s:.3f}",
                      f"{s:.3f}", f"{s / o.step_s - 1:+.0%}", str(1 + by_measured.index(i)), f"{factor[i]:.2f}",
                      f"{s / factor[i] / o.step_s - 1:+.0%}"])
    fastest = min(s for *_, s in rows)
    at = {i: s for i, _, s in rows}
    nan = float("nan")
    summary = {"graph": graph, "configs": len(rows), "searched": len(ranked),
               "median_error": statistics.median(errors), "worst_error": max(errors),
               "median_adjusted": statistics.median(adjusted),
               # a refit may pick a configuration the run did not measure: rank 0 then
               "pick_rank": 1 + by_measured.index(0) if 0 in at else 0,
               "pick_vs_fastest": at[0] / fastest - 1 if 0 in at else nan,
               "shipped_rank": 1 + by_measured.index(shipped) if shipped in at else 0,
               "pick_vs_shipped": at[0] / at[shipped] - 1 if shipped in at and 0 in at else nan, "load": list(load)}
    print_table(f"plan search on {graph} ({backend} backend, {steps} steps per configuration, the first {WARMUP} "
                f"warm up)", ["search rank", "configuration", "predicted s/step", "measured s/step", "error",
                              "measured rank", "probe vs profile", "error, load-adjusted"], table,
                notes=[f"median |error| {summary['median_error']:.0%}, worst {summary['worst_error']:.0%} over "
                       f"{len(rows)} of {len(ranked)} configurations (load-adjusted: median "
                       f"{summary['median_adjusted']:.0%}); the picked one measured rank {summary['pick_rank']} of "
                       f"{len(rows)}, {summary['pick_vs_fastest']:+.0%} vs the fastest measured",
                       "×2: measured twice, the median of both runs' steps",
                       f"load average {load[0]:.1f} before, {load[1]:.1f} after, on {os.cpu_count()} cores; "
                       f"probe vs profile: how much slower a fixed one-thread workload ran around that run than "
                       f"around the profile (the load-adjusted error divides the measured time by it)"])
    return summary


def refit(graph: str, base: dict, where: Path, backend: str) -> Path:
    """The cost file fitted again, with this code, from the profiling runs kept in ``where``."""
    runs = []
    for run in sorted((where / "profile").glob("run_*")):
        _, plan, records, rows = read_run(run, traits_of(backend), lambda m: None)
        runs.append((plan, records, rows))
    old = json.loads((where / COST_FILE).read_text())
    g = load_graph(graph, overrides={**QUIET, **base})
    def shape(plan: Any) -> tuple:
        return plan.micro_batches, sorted((p.name, p.workers) for p in plan.pools)

    repeated = len(runs) > 2 and shape(runs[-1][0]) == shape(runs[0][0])  # profiled with the drift run
    costs = fit_runs(runs, g, str(where / "profile"), Transfer.model_validate(old["transfer"]), drift=repeated)
    return save_costs(costs, where / f"refit_{COST_FILE}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--graphs", nargs="*", default=None, help="built-in graphs (default: every one in graphs/)")
    ap.add_argument("--graph", default=None, help="one graph (same as --graphs NAME)")
    ap.add_argument("--steps", type=int, default=8, help="steps per measured configuration")
    ap.add_argument("--profile-steps", type=int, default=8, help="steps per profiling run")
    ap.add_argument("--again", type=int, default=1, choices=(0, 1),
                    help="measure the picked, the shipped and the fastest measured configuration once more at "
                         "the end and keep the median of both runs' steps (1, the default) or not (0)")
    ap.add_argument("--configs", type=int, default=10)
    ap.add_argument("--backend", default="ray")
    ap.add_argument("--out", default=None, help="keep everything measured here (default: a temporary directory)")
    ap.add_argument("--refit", default=None, help="predict the measurements kept in this --out again; run nothing")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    graphs = [args.graph] if args.graph else (args.graphs or builtin_graphs())
    base: dict = {}
    if args.smoke:
        graphs, args.steps, args.profile_steps, args.configs, args.backend = ["grpo"], 4, 4, 2, "local"
        args.again = 0
        base = {"data.batch_size": 8}
    if args.refit:
        return refit_all(Path(args.refit), graphs, base, args.backend)
    work = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="flowrl-plan-search-"))
    console = Console(width=250)
    say = (lambda m: None) if args.smoke else console.print
    boot = ray_start.take(None) if args.backend == "ray" else None
    if boot is not None:
        boot.ready()  # one Ray for every run: each run's workers still start afresh
    saved: dict[str, Any] = {"steps": args.steps, "backend": args.backend, "base": base, "graphs": {}}
    summaries = []
    try:
        for graph in graphs:
            home = work / graph
            load0 = os.getloadavg()[0]
            t0, before = time.time(), probe()
            path = profile_command(graph, args.profile_steps, str(home), base, args.backend, say=say, err=console)
            reference = (before + probe()) / 2
            ranked, shipped = searched(graph, base, path, args.backend)
            runs: dict[str, list[list[float]]] = {}  # configuration → each run's step intervals
            probes: dict[str, list[float]] = {}

            def run(i: int, where: str) -> None:
                o = ranked[i]
                say(f"{graph}: configuration {i + 1} of {len(ranked)}: {describe(o)}")
                before = probe()
                runs.setdefault(key_of(o.overrides), []).append(
                    measure(graph, {**base, **o.overrides}, args.steps, args.backend, home / where))
                probes.setdefault(key_of(o.overrides), []).append((before + probe()) / 2 / reference)

            for i in chosen(len(ranked), args.configs, shipped):
                run(i, f"config_{i}")
            for i in contenders(ranked, runs, shipped) if args.again else []:
                run(i, f"config_{i}_again")
            measured = {k: statistics.median([x for r in v for x in r]) for k, v in runs.items()}
            slower = {k: statistics.mean(v) for k, v in probes.items()}
            saved["graphs"][graph] = {"measured": measured, "slower": slower, "intervals": runs,
                                      "seconds": time.time() - t0, "load": [load0, os.getloadavg()[0]]}
            (work / "results.json").write_text(json.dumps(saved, indent=1))
            summaries.append(report(graph, args.backend, args.steps, ranked, measured, shipped,
                                    (load0, os.getloadavg()[0]), slower, twice_of(runs)))
    finally:
        if boot is not None:
            import ray  # noqa: PLC0415 - the benchmark's own Ray, started above

            ray.shutdown()
            boot.release()
    summarise(summaries, work)
    if args.smoke:
        shutil.rmtree(work, ignore_errors=True)


def refit_all(work: Path, graphs: list[str], base: dict, backend: str) -> None:
    saved = json.loads((work / "results.json").read_text())
    summaries = []
    for graph in graphs:
        if graph not in saved["graphs"]:
            continue
        path = refit(graph, saved.get("base", base), work / graph, backend)
        ranked, shipped = searched(graph, saved.get("base", base), path, backend)
        kept = saved["graphs"][graph]
        summaries.append(report(graph, backend, saved["steps"], ranked, kept["measured"], shipped,
                                kept.get("load", os.getloadavg()[:2]), kept.get("slower", {}),
                                twice_of(kept.get("intervals", {}))))
    summarise(summaries, work)


def summarise(summaries: list[dict[str, Any]], work: Path) -> None:
    print_table("plan search, every graph", ["graph", "configurations", "median |error|", "worst |error|",
                                             "median, load-adjusted", "pick's measured rank", "pick vs fastest",
                                             "shipped's measured rank", "pick vs shipped", "load average"],
                [[s["graph"], f"{s['configs']} of {s['searched']}", f"{s['median_error']:.0%}",
                  f"{s['worst_error']:.0%}", f"{s['median_adjusted']:.0%}", f"{s['pick_rank']} of {s['configs']}", f"{s['pick_vs_fastest']:+.0%}",
                  f"{s['shipped_rank']} of {s['configs']}", f"{s['pick_vs_shipped']:+.0%}",
                  "-".join(f"{x:.1f}" for x in s["load"])] for s in summaries],
                notes=[f"measurements kept in {work}"])


if __name__ == "__main__":
    main()
