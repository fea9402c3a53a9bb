"""Does the driver's memory stay flat over a long run? RSS of ``flowrl run`` over 2,000 steps.

Run from the repository root::

    python benchmarks/driver_memory.py                 # 2,000 steps of a shrunk default graph, local backend
    python benchmarks/driver_memory.py --steps 500
    python benchmarks/driver_memory.py --smoke      # 12 steps, baseline at step 4: start-up and a few steps

It starts ``flowrl run grpo --backend local`` as a child process (the real
command, live view included, output piped), samples the child's resident set
size from ``/proc/<pid>/status`` while it runs, and reads the step from the
lines of ``metrics.jsonl``. The graph is the default one with a small batch
(2 prompts × 2 samples, 2 new tokens, no validation) so that 2,000 steps take
minutes on a 2-core CPU; what a step leaves behind in the driver (task
records, metric rows, live-view values) does not depend on the batch size.

Printed: RSS at a few steps, and the ratio of the last sample to the one
taken after warm-up (step 200). Goal (issue 13.7): within 1.10.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHRINK = {"data.batch_size": 2, "nodes.generate.n": 2, "nodes.generate.max_new_tokens": 2,
          "trainer.val_every": 0, "trainer.checkpoint_every": 0}


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def steps_done(metrics: Path) -> int:
    try:
        with metrics.open("rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=200, help="the step whose RSS is the baseline")
    ap.add_argument("--smoke", action="store_true", help="12 steps, baseline at step 4")
    args = ap.parse_args()
    if args.smoke:
        args.steps, args.warmup = 12, 4
    out = Path(tempfile.mkdtemp(prefix="flowrl-mem-")) / "run"
    cmd = [sys.executable, "-m", "flowrl.cli", "run", "grpo", "--backend", "local", "--steps", str(args.steps),
           "--out", str(out)] + [x for k, v in SHRINK.items() for x in ("--set", f"{k}={v}")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
               OMP_NUM_THREADS="1")
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    samples: dict[int, float] = {}
    while proc.poll() is None:
        step, rss = steps_done(out / "metrics.jsonl"), rss_mib(proc.pid)
        if rss is not None and step:
            samples[step] = rss  # the latest sample per completed step
        time.sleep(0.2)
    if proc.returncode != 0:
        sys.exit(f"flowrl run failed ({proc.returncode}): {proc.stderr.read()[-2000:]}")
    wall = time.time() - t0
    marks = sorted({args.warmup, *(s for s in range(0, args.steps, max(1, args.steps // 8)) if s), args.steps - 1})
    print(f"driver RSS of `{' '.join(cmd[1:])}`")
    print(f"{'step':>6}  {'RSS MiB':>8}  {'vs step ' + str(args.warmup):>12}")
    # the final step's samples fall in the end-of-run checkpoint and teardown: compare running steps only
    seen = sorted(s for s in samples if s < args.steps)
    base_step = min(seen, key=lambda s: abs(s - args.warmup))
    base = samples[base_step]
    for m in marks:
        s = min(seen, key=lambda x: abs(x - m))
        print(f"{s:>6}  {samples[s]:>8.1f}  {samples[s] / base:>12.3f}")
    last = seen[-1]
    print(f"ratio last/warm-up: {samples[last] / base:.3f} (step {last} vs step {base_step}); "
          f"growth {(samples[last] - base) * 1024 / max(1, last - base_step):.1f} KiB/step; "
          f"{args.steps} steps in {wall:.0f} s")


if __name__ == "__main__":
    main()
