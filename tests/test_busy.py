"""A run on a machine made busy on purpose (issue 36): eight CPU burners on the machine's cores while
``flowrl run`` starts its own Ray and runs; the run starts, finishes and saves, or (had Ray's own start
timed out every try) says so in one line. The burners are bounded: they stop on their own after a
deadline, and the test stops them first."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BURN = "import time\nend = time.time() + {seconds}\nwhile time.time() < end:\n    pass\n"


@pytest.mark.timeout(600)
def test_a_run_starts_and_finishes_on_ray_with_eight_burners_per_two_cores(tmp_path):
    burners = [subprocess.Popen([sys.executable, "-c", BURN.format(seconds=480)]) for _ in range(8)]
    try:
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", COLUMNS="200")
        env.pop("RAY_ADDRESS", None)
        res = subprocess.run(
            [sys.executable, "-m", "flowrl.cli", "run", "grpo", "--steps", "2", "--out", str(tmp_path / "run"),
             "--set", "data.batch_size=4", "--set", "nodes.generate.n=2", "--set", "trainer.val_every=0"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=560)
    finally:
        for b in burners:
            b.kill()
        for b in burners:
            b.wait()
    both = res.stdout + res.stderr
    assert "Traceback" not in both
    assert res.returncode == 0, both
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert (tmp_path / "run" / "checkpoints").is_dir()
