"""Record or compare the first steps' metrics of every built-in graph on both backends.

A refactor of the runtime must not change what a run computes. This script runs
each built-in graph for a few steps on the ``local`` and the ``ray`` backend,
keeps every metric except wall-clock ones (``timing/``, ``throughput/``, ...),
and either writes them as JSON (``record``) or compares them with a recording
(``compare``), printing which graph/backend pairs match exactly.

Example::

    PYTHONPATH=$PWD python benchmarks/metrics_snapshot.py record /tmp/runtime_baseline
    PYTHONPATH=$PWD python benchmarks/metrics_snapshot.py compare /tmp/runtime_baseline
    PYTHONPATH=$PWD python benchmarks/metrics_snapshot.py --smoke   # record then compare grpo, 2 small steps, local
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

import _common  # noqa: F401  (repository on sys.path, one torch thread)

from flowrl.data.metrics import measured
from flowrl.graph import builtin_graphs, load_graph
from flowrl.run.trainer import Trainer


def untimed(row: dict) -> dict:
    """What the step computed: the metrics that measure the machine left out."""
    return {k: v for k, v in row.items() if not measured(k)}


def snapshot(name: str, backend: str, steps: int, overrides: dict) -> list[dict[str, float]]:
    graph = load_graph(name, overrides=overrides)
    with tempfile.TemporaryDirectory() as out:
        history = Trainer(graph, backend=backend, steps=steps, out=out, say=lambda _: None).run()
    return [untimed(row) for row in history]


def same(a: list[dict], b: list[dict]) -> tuple[bool, str]:
    if len(a) != len(b):
        return False, f"{len(a)} vs {len(b)} steps"
    for ra, rb in zip(map(untimed, a), map(untimed, b)):
        if set(ra) != set(rb):
            return False, f"step {ra.get('step')}: keys differ: {sorted(set(ra) ^ set(rb))}"
        for k in ra:
            x, y = ra[k], rb[k]
            if x != y and not (isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y)):
                return False, f"step {ra['step']}: {k} {x!r} vs {y!r}"
    return True, "identical"


#: --smoke: the default graph, a small batch, nothing but training steps
SMOKE = {"data.batch_size": 2, "nodes.generate.n": 2, "nodes.generate.max_new_tokens": 2,
         "trainer.val_every": 0, "trainer.checkpoint_every": 0}


def record_or_compare(mode: str, out: Path, names: list[str], backends: list[str], steps: int,
                      overrides: dict) -> bool:
    """Run every graph on every backend and record its metrics, or compare them with a recording."""
    out.mkdir(parents=True, exist_ok=True)
    ok = True
    for backend in backends:
        for name in names:
            rows = snapshot(name, backend, steps, overrides)
            path = out / f"{name}.{backend}.json"
            if mode == "record":
                path.write_text(json.dumps(rows, indent=1))
                print(f"{name:14s} {backend:5s} recorded {len(rows)} steps -> {path}", flush=True)
            else:
                match, why = same(json.loads(path.read_text()), rows)
                ok &= match
                print(f"{name:14s} {backend:5s} {'MATCH' if match else 'DIFFER'}: {why}", flush=True)
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", nargs="?", choices=["record", "compare"])
    ap.add_argument("dir", nargs="?")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--graphs", nargs="*", default=None)
    ap.add_argument("--backends", nargs="*", default=["local", "ray"])
    ap.add_argument("--set", nargs="*", default=[], help="overrides path.key=value (same for record and compare)")
    ap.add_argument("--smoke", action="store_true",
                    help="record then compare grpo on the local backend, 2 steps of 2 prompts x 2, in a temp dir")
    args = ap.parse_args()
    import yaml

    overrides = {k: yaml.safe_load(v) for k, v in (s.split("=", 1) for s in args.set)}
    if args.smoke:
        with tempfile.TemporaryDirectory(prefix="flowrl-snapshot-") as out:
            return 0 if all([record_or_compare(mode, Path(out), ["grpo"], ["local"], 2, {**SMOKE, **overrides})
                             for mode in ("record", "compare")]) else 1
    if args.mode is None or args.dir is None:
        ap.error("give a mode (record or compare) and a directory, or --smoke")
    if "ray" in args.backends:
        _common.init_ray(2)
    names = args.graphs or sorted(builtin_graphs())
    return 0 if record_or_compare(args.mode, Path(args.dir), names, args.backends, args.steps, overrides) else 1


if __name__ == "__main__":
    sys.exit(main())
