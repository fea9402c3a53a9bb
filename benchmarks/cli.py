"""How long each ``flowrl`` command takes to answer, as a ratio to ``python -c "import typer"``.

Run from the repository root::

    python benchmarks/cli.py            # 5 rounds
    python benchmarks/cli.py --rounds 3
    python benchmarks/cli.py --smoke    # 1 round of `import typer`, `flowrl --help` and `validate grpo`

Every command runs as a fresh process (``python -m flowrl.cli ...``), the
commands in alternation round after round, so a load spike on a shared machine
hits them all alike; the median wall time of each is printed with its ratio to
the median of ``python -c "import typer"`` (the floor of any typer command)
measured in the same rounds, and the heavy modules each command imported
(``-X importtime``).

Targets (issue 24): ``flowrl --help`` under 0.5 s and ``flowrl validate
graphs/grpo.yaml`` under 3 s on an idle 2-core machine. On a loaded machine
the seconds say little; the ratios hold better.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks._common import print_table  # noqa: E402

HEAVY = ("torch", "tensordict", "transformers", "ray")

BASE = "python -c 'import typer'"
COMMANDS = {
    BASE: ["-c", "import typer"],
    "flowrl --help": ["-m", "flowrl.cli", "--help"],
    "flowrl ops": ["-m", "flowrl.cli", "ops"],
    "flowrl validate graphs/grpo.yaml": ["-m", "flowrl.cli", "validate", "graphs/grpo.yaml"],
    "flowrl viz grpo": ["-m", "flowrl.cli", "viz", "grpo"],
    "flowrl plan grpo": ["-m", "flowrl.cli", "plan", "grpo"],
}
#: seconds on an idle 2-core machine (issue 24)
TARGETS = {"flowrl --help": 0.5, "flowrl validate graphs/grpo.yaml": 3.0}
SMOKE = (BASE, "flowrl --help", "flowrl validate graphs/grpo.yaml")


def _env() -> dict[str, str]:
    env = dict(os.environ, COLUMNS="200")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH", "")) if p)
    return env


def time_once(args: list[str]) -> tuple[float, float]:
    """``(wall seconds, CPU seconds)`` of one run: on a loaded machine the CPU time (user + system of
    the child) is near what the wall time would be on an idle one, the wall time is not."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, *args], cwd=ROOT, env=_env(), check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def heavy_imports(args: list[str]) -> list[str]:
    """Which of :data:`HEAVY` the command imports (top-level modules named in ``-X importtime``)."""
    res = subprocess.run([sys.executable, "-X", "importtime", *args], cwd=ROOT, env=_env(),
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    names = {line.rsplit("|", 1)[-1].strip() for line in res.stderr.splitlines() if line.startswith("import time:")}
    return [m for m in HEAVY if m in names]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="1 round of `import typer`, `--help` and `validate`")
    args = ap.parse_args()
    commands = dict(COMMANDS)
    if args.smoke:
        args.rounds = 1
        commands = {k: v for k, v in COMMANDS.items() if k in SMOKE}
    times: dict[str, list[float]] = {name: [] for name in commands}
    cpu: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(args.rounds):
        for name, argv in commands.items():
            wall, used = time_once(argv)
            times[name].append(wall)
            cpu[name].append(used)
    base, base_cpu = statistics.median(times[BASE]), statistics.median(cpu[BASE])
    rows = []
    for name, argv in commands.items():
        med, med_cpu = statistics.median(times[name]), statistics.median(cpu[name])
        heavy = ", ".join(heavy_imports(argv)) if name != BASE else ""
        target = f"< {TARGETS[name]:g} s" if name in TARGETS else "-"
        rows.append([name, f"{med:.2f}", f"{med / base:.1f}x", f"{med_cpu:.2f}", f"{med_cpu / base_cpu:.1f}x",
                     target, heavy or "-"])
    print_table(f"flowrl CLI start-up: median of {args.rounds} rounds, ratio to {BASE}",
                ["command", "wall s", "ratio", "CPU s", "CPU ratio", "target (idle, wall)",
                 "heavy modules imported"], rows,
                notes=[f"os.cpu_count()={os.cpu_count()}; load average {os.getloadavg()[0]:.1f}"])


if __name__ == "__main__":
    main()
