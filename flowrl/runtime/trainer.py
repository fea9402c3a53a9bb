"""The outer loop of ``flowrl run``: a data source, ``trainer.steps`` steps, metrics out.

Each step's metrics go to ``<out>/metrics.jsonl`` (one JSON object per line,
``step`` included) and to a callback (the CLI prints them). The resolved graph
config is written to ``<out>/config.yaml`` before the first step.

Example::

    trainer = Trainer(load_graph("grpo"), backend="local", steps=5, out="runs/try")
    history = trainer.run()
    print(history[-1]["reward/mean"])
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Callable

import yaml

from flowrl.graph import REGISTRY, Graph
from flowrl.runtime.errors import RuntimeFailure
from flowrl.runtime.scheduler import Runtime, StepResult


class NonFiniteError(RuntimeFailure):
    """A loss, reward or gradient became NaN or infinite."""


class Trainer:
    """Runs a graph for a number of steps and records what happened."""

    def __init__(
        self,
        graph: Graph,
        *,
        backend: str = "ray",
        steps: int | None = None,
        out: str | Path | None = None,
        address: str | None = None,
        trace: str | Path | None = None,
        on_step: Callable[[int, dict[str, float]], None] | None = None,
    ) -> None:
        self.graph = graph
        cfg = graph.config
        self.steps = steps if steps is not None else cfg.trainer.steps
        self.out = Path(out or cfg.trainer.out or f"runs/{cfg.name}")
        self.trace = Path(trace) if trace else None
        self.on_step = on_step
        self.runtime = Runtime(graph, backend=backend, address=address)
        kind = cfg.data.source.split(":", 1)[0] if ":" in cfg.data.source else "file"
        spec = REGISTRY.source(kind)
        self.source = spec.factory(spec.config.model_validate(cfg.data.dump()), seed=cfg.trainer.seed,
                                   roles=cfg.roles)
        self.history: list[dict[str, float]] = []

    def run(self) -> list[dict[str, float]]:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "config.yaml").write_text(yaml.safe_dump(self.graph.config.dump(), sort_keys=False))
        metrics_path = self.out / "metrics.jsonl"
        start = time.time()
        try:
            with metrics_path.open("a") as sink:
                for result in self.runtime.run(self.source, steps=self.steps):
                    row = self._row(result, start)
                    sink.write(json.dumps(row) + "\n")
                    sink.flush()
                    self.history.append(row)
                    if self.on_step is not None:
                        self.on_step(result.step, row)
        finally:
            if self.trace is not None:
                self.runtime.timeline.to_chrome_trace(self.trace)
            self.runtime.close()
        return self.history

    def _row(self, result: StepResult, start: float) -> dict[str, Any]:
        bad = [k for k, v in result.metrics.items() if not math.isfinite(v)]
        if bad:
            raise NonFiniteError(f"step {result.step}: {', '.join(sorted(bad))} is not finite "
                                 f"({', '.join(f'{k}={result.metrics[k]}' for k in sorted(bad))})")
        return {"step": result.step + 1, **result.metrics, "timing/elapsed": time.time() - start}
