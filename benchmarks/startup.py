"""Time to the first step of the default job: ``flowrl run`` on the Ray backend against the local one.

Run from the repository root::

    python benchmarks/startup.py               # 3 rounds of 3 steps each on both backends
    python benchmarks/startup.py --rounds 5
    python benchmarks/startup.py --smoke       # 1 round of 1 step, 8 prompts: the same path, shorter

Each run is what a user types: a fresh ``python -m flowrl.cli run graphs/grpo.yaml
--steps N --backend B -v`` into an empty run directory, its own Ray started by the
run (``RAY_ADDRESS`` unset). Time to first step is the wall time from starting the
command to its first ``step 1/N`` line, read as the run prints it. The backends
alternate round after round (local first), so a load spike on a shared machine
hits both; the medians and their ratio are printed, then the Ray run's start-up
timeline (``flowrl run -v``) of the last round: which process did what, when.

Target (issue 26): Ray's time to first step at most 2x the local backend's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks._common import print_table  # noqa: E402

BACKENDS = ("local", "ray")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # the run starts a Ray of its own
    env.update(COLUMNS="200", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p))
    return env


def run_once(backend: str, steps: int, extra: list[str]) -> tuple[float, float, list[str]]:
    """(seconds to the first step's line, seconds to exit, the run's output lines) of one fresh run."""
    with tempfile.TemporaryDirectory(prefix="flowrl-startup-") as out:
        argv = [sys.executable, "-m", "flowrl.cli", "run", "graphs/grpo.yaml", "--steps", str(steps),
                "--backend", backend, "--out", out, "-v", *extra]
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        first, lines = None, []
        assert proc.stdout is not None
        for line in proc.stdout:
            if first is None and line.startswith(f"step 1/{steps}"):
                first = time.perf_counter() - t0
            lines.append(line.rstrip("\n"))
        code = proc.wait()
        total = time.perf_counter() - t0
    if code != 0 or first is None:
        sys.exit(f"flowrl run --backend {backend} exited {code} before its first step:\n" + "\n".join(lines[-30:]))
    return first, total, lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="1 round of 1 step on 8 prompts")
    args = ap.parse_args()
    extra: list[str] = []
    if args.smoke:
        args.rounds, args.steps = 1, 1
        extra = ["--set", "data.batch_size=8"]
    first: dict[str, list[float]] = {b: [] for b in BACKENDS}
    total: dict[str, list[float]] = {b: [] for b in BACKENDS}
    timeline: list[str] = []
    for _ in range(args.rounds):
        for backend in BACKENDS:
            f, t, lines = run_once(backend, args.steps, extra)
            first[backend].append(f)
            total[backend].append(t)
            if backend == "ray":
                timeline = [line for line in lines if line.startswith(("start-up timeline", "  "))]
    med = {b: statistics.median(first[b]) for b in BACKENDS}
    rows = [[b, f"{med[b]:.1f}", " ".join(f"{x:.1f}" for x in first[b]), f"{statistics.median(total[b]):.1f}"]
            for b in BACKENDS]
    ratio = med["ray"] / med["local"]
    print_table("time to first step of graphs/grpo.yaml", ["backend", "first step s", "each round", "whole run s"],
                rows, notes=[f"median of {args.rounds} round(s) of {args.steps} step(s), backends alternating",
                             f"ratio ray/local: {ratio:.2f}x (target: at most 2x); round by round: "
                             + " ".join(f"{r / loc:.2f}x" for r, loc in zip(first["ray"], first["local"])),
                             f"os.cpu_count()={os.cpu_count()}; load average {os.getloadavg()[0]:.1f}"])
    if timeline:
        print("\nthe last Ray run's " + timeline[0])
        print("\n".join(timeline[1:]))


if __name__ == "__main__":
    main()
