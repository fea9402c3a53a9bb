"""How long each ``flowrl`` command takes to answer, as a ratio to ``python -c pass``.

Run from the repository root::

    python benchmarks/cli.py            # 5 rounds
    python benchmarks/cli.py --rounds 3
    python benchmarks/cli.py --smoke    # 1 round of `python -c pass` and `flowrl --help`: a few seconds

Every command runs as a fresh process (``python -m flowrl.cli ...``), the
commands in alternation round after round, so a load spike on a shared machine
hits them all alike; the median wall time of each is printed with its ratio to
the median of ``python -c pass`` measured in the same rounds, and the heavy
modules each command imported (``-X importtime``).

Targets (issue 14.4): ``--help`` under 1 s and ``validate`` of a built-in graph
under 3 s on a 2-core machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks._common import print_table  # noqa: E402

HEAVY = ("torch", "tensordict", "transformers", "ray")

COMMANDS = {
    "python -c pass": ["-c", "pass"],
    "flowrl --help": ["-m", "flowrl.cli", "--help"],
    "flowrl ops": ["-m", "flowrl.cli", "ops"],
    "flowrl validate grpo": ["-m", "flowrl.cli", "validate", "grpo"],
    "flowrl viz grpo": ["-m", "flowrl.cli", "viz", "grpo"],
    "flowrl plan grpo": ["-m", "flowrl.cli", "plan", "grpo"],
}


def _env() -> dict[str, str]:
    env = dict(os.environ, COLUMNS="200")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH", "")) if p)
    return env


def time_once(args: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, *args], cwd=ROOT, env=_env(), check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def heavy_imports(args: list[str]) -> list[str]:
    """Which of :data:`HEAVY` the command imports (top-level modules named in ``-X importtime``)."""
    res = subprocess.run([sys.executable, "-X", "importtime", *args], cwd=ROOT, env=_env(),
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    names = {line.rsplit("|", 1)[-1].strip() for line in res.stderr.splitlines() if line.startswith("import time:")}
    return [m for m in HEAVY if m in names]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="1 round of `python -c pass` and `flowrl --help`")
    args = ap.parse_args()
    commands = dict(COMMANDS)
    if args.smoke:
        args.rounds = 1
        commands = {k: v for k, v in COMMANDS.items() if k in ("python -c pass", "flowrl --help")}
    times: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(args.rounds):
        for name, argv in commands.items():
            times[name].append(time_once(argv))
    base = statistics.median(times["python -c pass"])
    rows = []
    for name, argv in commands.items():
        med = statistics.median(times[name])
        heavy = ", ".join(heavy_imports(argv)) if name != "python -c pass" else ""
        rows.append([name, f"{med:.2f}", f"{med / base:.1f}x", heavy or "-"])
    print_table(f"flowrl CLI start-up: median of {args.rounds} rounds, ratio to `python -c pass`",
                ["command", "median s", "ratio", "heavy modules imported"], rows,
                notes=[f"os.cpu_count()={os.cpu_count()}; load average {os.getloadavg()[0]:.1f}"])


if __name__ == "__main__":
    main()
