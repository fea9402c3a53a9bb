"""Every benchmark script still runs: each in ``--smoke`` mode (tiny sizes, its own code path).

A benchmark nothing runs rots silently (``benchmarks/scheduler.py`` once failed
for months of changes). Each script runs as the user runs it, a fresh
``python benchmarks/<name>.py --smoke`` from the repository root, and must exit
0 and print its table. Timings are never asserted: the numbers of a smoke run
mean nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: script -> strings its smoke run prints: a table's title or header, or its summary line
EXPECTED = {
    "cli.py": ["flowrl CLI start-up", "flowrl --help"],
    "dataproto.py": ["DataProto operations", "peak memory of one round trip"],
    "dispatch.py": ["dispatch: one no-op node", "flowrl 1 worker"],
    "distributed.py": ["one update step", "2 workers, rank 1"],
    "driver_memory.py": ["driver RSS of", "ratio last/warm-up"],
    "e2e.py": ["GRPO end to end", "flowrl grpo (local, sync)", "plain PyTorch stage by stage"],
    "engines.py": ["rollout engines", "hf tok/s", "the default job (grpo, local backend)"],
    "fingerprints.py": ["fingerprints: grpo", "with fingerprints", "fingerprint work, timed"],
    "lora.py": ["LoRA vs full fine-tuning: builtin:tiny", "ratio lora/full"],
    "logprob_memory.py": ["log-prob memory: builtin:tiny", "ratio chunked/whole"],
    "metrics_snapshot.py": ["grpo           local recorded 2 steps", "MATCH: identical"],
    "plain_grpo.py": ["done: 3 steps"],
    "plan_search.py": ["plan search on grpo", "median |error|"],
    "seeds.py": ["seeds of grpo", "greedy held-out, final: mean (min-max) over 2 seeds"],
    "scheduler.py": ["makespan vs lower bound", "flowrl mb=4 staleness=1", "fan-out: 1 producer"],
    "startup.py": ["time to first step of graphs/grpo.yaml", "ratio ray/local"],
    "tokens.py": ["padded vs trimmed", "trimmed"],
}


#: the slowest first, so that the short ones fill in around them
ORDER = ["dispatch.py", "scheduler.py", "startup.py", "distributed.py", "dataproto.py", "cli.py", "tokens.py"]
#: smoke runs at once: most of a run is process start-up and imports, which overlap well on 2 cores
PARALLEL = 4


def run_smoke(script: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # each script starts its own Ray
    env.update(PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", COLUMNS="250")
    return subprocess.run([sys.executable, f"benchmarks/{script}", "--smoke"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def smoke_runs(request: pytest.FixtureRequest) -> Iterator[dict[str, Future]]:
    """The selected scripts' smoke runs, started together (at most PARALLEL at a time)."""
    selected = {item.callspec.params["script"] for item in request.session.items
                if getattr(item, "originalname", None) == "test_smoke"}
    with ThreadPoolExecutor(max_workers=PARALLEL) as pool:
        order = sorted(selected, key=lambda s: ORDER.index(s) if s in ORDER else len(ORDER))
        yield {script: pool.submit(run_smoke, script) for script in order}


def test_every_script_is_covered():
    scripts = {p.name for p in (ROOT / "benchmarks").glob("*.py")} - {"_common.py", "ops.py", "__init__.py"}
    assert scripts == set(EXPECTED)


@pytest.mark.parametrize("script", sorted(EXPECTED))
def test_smoke(script: str, smoke_runs: dict[str, Future]):
    proc = smoke_runs[script].result()
    assert proc.returncode == 0, f"{script} --smoke exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    for text in EXPECTED[script]:
        assert text in proc.stdout, f"{script} --smoke did not print {text!r}:\n{proc.stdout[-3000:]}"
