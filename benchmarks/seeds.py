"""Run several seeds of a graph and print the distribution of what it learned.

One seed is a sample, not a result. This script runs a graph once per seed, one
after another in one process (``--backend local`` by default: a one-worker
run's numbers equal Ray's, and it starts nothing), and prints per seed the
final greedy held-out reward (``val/reward/mean`` at the last step), the mean
reward of the last 25 steps and the wall time relative to the first seed's,
then the mean, min and max over seeds.

Example::

    PYTHONPATH=$PWD python benchmarks/seeds.py                          # grpo, seeds 0-9
    PYTHONPATH=$PWD python benchmarks/seeds.py grpo_tools --seeds 0,1,2
    PYTHONPATH=$PWD python benchmarks/seeds.py --seeds 8,9 --set nodes.update_actor.entropy_coeff=0
    PYTHONPATH=$PWD python benchmarks/seeds.py --smoke                  # 2 seeds, 3 small steps
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time

import _common  # noqa: F401  (repository on sys.path, one torch thread)

from flowrl.graph import load_graph
from flowrl.cli import parse_overrides
from flowrl.run.trainer import Trainer

#: how many final steps the reward figure averages (the README's "steps 276-300")
TAIL = 25
#: the metrics of the engine's log-probs against the update's (flowrl's rollout correction)
GAP = "actor/rollout_corr/"


def parse_seeds(text: str) -> list[int]:
    """``"0-9"``, ``"3,8,9"`` or ``"0-4,8"`` as a list of seeds."""
    seeds: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        seeds.extend(range(int(lo), int(hi or lo) + 1))
    return seeds


def run_seed(graph_name: str, seed: int, overrides: dict, steps: int | None, backend: str,
             verbose: bool = False, keep: str | None = None) -> dict:
    """One run: its final greedy held-out reward, last-``TAIL``-step mean reward and wall seconds; its run
    directory (metrics, checkpoints) kept in ``keep``/seed_<seed> when given, else a temporary one."""
    graph = load_graph(graph_name, overrides={**overrides, "trainer.seed": seed})

    def say_held_out(step: int, row: dict) -> None:
        if verbose and "val/reward/mean" in row:
            print(f"  seed {seed} step {row.get('step', step + 1)}: held-out {row['val/reward/mean']:.3f}, "
                  f"reward {row['reward/mean']:.3f}", flush=True)

    start = time.perf_counter()
    with (contextlib.nullcontext(f"{keep}/seed_{seed}") if keep else tempfile.TemporaryDirectory()) as out:
        history = Trainer(graph, backend=backend, steps=steps, out=out, say=lambda _: None,
                          on_step=say_held_out).run()
    wall = time.perf_counter() - start
    held_out = [row["val/reward/mean"] for row in history if "val/reward/mean" in row]
    rewards = [row["reward/mean"] for row in history]
    return {"seed": seed, "held_out": held_out[-1] if held_out else float("nan"),
            "held_out_all": held_out, "rewards": rewards, "reward_tail": statistics.fmean(rewards[-TAIL:]),
            "steps": len(history), "wall_s": wall, **engine_gap(history)}


def engine_gap(history: list[dict]) -> dict:
    """What a run's ``actor/rollout_corr/*`` metrics say of the engine's log-probs against the update's,
    over its steps: mean |Δ log p|, the largest |Δ|, the largest share of tokens past TIS/MIS's threshold,
    the largest TIS weight and MIS-rejected share (when they ran) and the largest weight-check gap."""
    rows = [r for r in history if GAP + "log_prob_abs_diff" in r]
    if not rows:
        return {}

    def most(key: str) -> float | None:
        values = [abs(r[key]) for r in rows if key in r]
        return max(values) if values else None

    return {"gap_mean": statistics.fmean(r[GAP + "log_prob_abs_diff"] for r in rows),
            "gap_max": most(GAP + "log_prob_diff_max"), "outside_max": most(GAP + "frac_outside_threshold"),
            "is_weight_max": most(GAP + "is_weight_max"), "rejected_max": most(GAP + "rs_masked_fraction"),
            "check_max": most("rollout/weight_check_max_diff"), "gap_steps": len(rows)}


def summary(values: list[float]) -> str:
    return f"{statistics.fmean(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("graph", nargs="?", default="grpo", help="a built-in name or a graph file")
    parser.add_argument("--seeds", default="0-9", help="e.g. 0-9, 3,8,9 (default 0-9)")
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default: trainer.steps)")
    parser.add_argument("--backend", default="local")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a key")
    parser.add_argument("--json", default=None, help="also write every seed's figures here")
    parser.add_argument("--out", default=None, help="keep each seed's run directory here (DIR/seed_<k>)")
    parser.add_argument("--verbose", action="store_true", help="print each validation as it comes")
    parser.add_argument("--smoke", action="store_true", help="2 seeds, 3 small steps: the script still runs")
    args = parser.parse_args(argv)
    overrides = parse_overrides(args.set)
    seeds = parse_seeds(args.seeds)
    if args.smoke:
        seeds, args.steps = [0, 1], 3
        overrides = {"data.batch_size": 4, "nodes.generate.n": 2, "nodes.generate.max_new_tokens": 4,
                     "trainer.val_every": 3, **overrides}

    print(f"seeds of {args.graph} ({args.backend} backend, {args.steps or 'trainer.steps'} steps)"
          + "".join(f" --set {s}" for s in args.set), flush=True)
    print(f"{'seed':>4}  {'held-out':>8}  {'reward last ' + str(TAIL):>14}  {'wall s':>7}  {'wall / seed ' + str(seeds[0]):>16}")
    runs = []
    for seed in seeds:
        run = run_seed(args.graph, seed, overrides, args.steps, args.backend, args.verbose, args.out)
        runs.append(run)
        print(f"{seed:>4}  {run['held_out']:>8.3f}  {run['reward_tail']:>14.3f}  "
              f"{run['wall_s']:>7.1f}  {run['wall_s'] / runs[0]['wall_s']:>16.2f}", flush=True)
        if "gap_mean" in run:
            extra = "".join(f", {label} {run[key]:.3g}" for key, label in
                            (("is_weight_max", "largest TIS weight"), ("rejected_max", "largest MIS-rejected share"),
                             ("check_max", "largest weight-check gap")) if run.get(key) is not None)
            print(f"      engine vs update log-probs over {run['gap_steps']} steps: mean |diff| {run['gap_mean']:.2g}, "
                  f"largest {run['gap_max']:.2g}, largest share past the TIS/MIS threshold "
                  f"{run['outside_max']:.2g}{extra}", flush=True)
    held = [r["held_out"] for r in runs]
    print(f"greedy held-out, final: mean (min-max) over {len(runs)} seeds {summary(held)}; "
          f"{sum(h >= 0.9 for h in held)} of {len(runs)} >= 0.9")
    print(f"reward, last {TAIL} steps: mean (min-max) over {len(runs)} seeds "
          f"{summary([r['reward_tail'] for r in runs])}")
    print("wall: the first seed's includes imports and the machine's load scales all: compare ratios")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
