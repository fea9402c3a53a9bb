"""The outer loop of ``flowrl run``: a data source, ``trainer.steps`` steps, metrics out.

Each step's metrics go to ``<out>/metrics.jsonl`` (one JSON object per line,
``step`` included) and to a callback (the CLI prints them). The resolved graph
config is written to ``<out>/config.yaml`` before the first step.

Every ``trainer.checkpoint_every`` steps, at the end, and on a graceful stop
(Ctrl-C: the steps in flight finish, then it saves), a checkpoint goes to
``<out>/checkpoints``. ``resume=True`` continues from the newest loadable one:
N uninterrupted steps and k steps + resume + N−k steps give the same metrics.

Example::

    trainer = Trainer(load_graph("grpo"), backend="local", steps=5, out="runs/try")
    history = trainer.run()
    print(history[-1]["reward/mean"])
"""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable

import yaml

from flowrl.graph import REGISTRY, Graph
from flowrl.runtime.checkpoint import CheckpointError, CheckpointStore, differences, fingerprint
from flowrl.runtime.scheduler import Runtime, StepResult
from flowrl.runtime.sinks import open_sinks
from flowrl.runtime.validation import validation_graph

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
        resume: bool = False,
        say: Callable[[str], None] = print,
        on_progress: Callable[[int, dict[str, str]], None] | None = None,
    ) -> None:
        self.graph = graph
        cfg = graph.config
        self.steps = steps if steps is not None else cfg.trainer.steps
        self.out = Path(out or cfg.trainer.out or f"runs/{cfg.name}")
        self.trace = Path(trace) if trace else None
        self.on_step = on_step
        self.val_graph = validation_graph(graph) if cfg.trainer.val_every else None
        if cfg.trainer.val_every and self.val_graph is None:
            raise ValueError("trainer.val_every needs a node whose operator declares a score (a reward): declare "
                             "it with @operator(..., score='<output>'), or set trainer.val_every: 0")
        # the fields the graph's operators declare worth dumping (dumped=...)
        producers = graph.producers()
        fetch = [f for f in graph.dumped_fields() if f in producers] if cfg.trainer.dump_rollouts else []
        self.runtime = Runtime(graph, backend=backend, address=address, on_progress=on_progress,
                               validation=self.val_graph, fetch=fetch)
        kind = cfg.data.source.split(":", 1)[0] if ":" in cfg.data.source else "file"
        spec = REGISTRY.source(kind)
        data_cfg = spec.config.model_validate(cfg.data.dump())
        self.source = spec.factory(data_cfg, seed=cfg.trainer.seed, roles=cfg.roles)
        self.val_source = (spec.factory(data_cfg, seed=cfg.trainer.seed, roles=cfg.roles, split="val")
                           if self.val_graph is not None else None)
        self.history: list[dict[str, float]] = []
        self.resume, self.say = resume, say
        self.store = CheckpointStore(self.out / "checkpoints", keep=cfg.trainer.keep_checkpoints)
        self.stopped = False
        self._last_end: float | None = None
        # rows a step generates: prompts × the largest expansion (n samples per prompt)
        self.samples_per_step = cfg.data.batch_size * max(sp.factor for sp in self.runtime.plan.spaces.values())

    def run(self) -> list[dict[str, float]]:
        cfg = self.graph.config
        start_step = self._resume() if self.resume else 0
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "config.yaml").write_text(yaml.safe_dump(cfg.dump(), sort_keys=False))
        every, val_every = cfg.trainer.checkpoint_every, cfg.trainer.val_every
        last = self.steps - 1
        start = time.time()
        restore_sigint = self._install_sigint()
        done = start_step - 1
        try:
            sinks = open_sinks(self.out, cfg.trainer.wandb_project, run_name=cfg.name, config=cfg.dump())
            try:
                results = self.runtime.run(
                    self.source, steps=self.steps - start_step, start_step=start_step,
                    checkpoint=lambda t: bool(every) and ((t + 1) % every == 0 or t == last),
                    validate=lambda t: bool(val_every) and ((t + 1) % val_every == 0 or t == last),
                    val_batches=self.val_source)
                for result in results:
                    row = self._row(result, start)
                    sinks.write(row["step"], row)
                    if result.data is not None:
                        self._dump(result)
                    self.history.append(row)
                    done = result.step
                    if result.checkpoint is not None:
                        self._save(result.step, result.checkpoint)
                    if self.on_step is not None:
                        self.on_step(result.step, row)
            finally:
                sinks.close()
            if self.stopped and done >= start_step:
                self._save(done, self.runtime.snapshot_now(done, self.source))
                self.say(f"stopped after step {done + 1}; checkpoint saved, continue with --resume")
        finally:
            restore_sigint()
            if self.trace is not None:
                self.runtime.timeline.to_chrome_trace(self.trace)
            self.runtime.close()
        return self.history

    # ------------------------------------------------------------------ checkpoints
    def _save(self, step: int, payload: dict[str, Any]) -> None:
        meta = {"graph": fingerprint(self.graph.config.dump()), "name": self.graph.name,
                "saved_at": time.time()}
        path = self.store.save(step, payload, meta)
        self.say(f"checkpoint: {path}")

    def _resume(self) -> int:
        payload, meta, path = self.store.load_latest(warn=self.say)
        diff = differences(meta["graph"], fingerprint(self.graph.config.dump()))
        if diff:
            raise CheckpointError(
                f"checkpoint {path} belongs to a different graph or config; it differs in: "
                + "; ".join(diff[:10]) + ("; ..." if len(diff) > 10 else "")
                + ". Resume with the graph it was written by, or start a new run directory (--out)."
            )
        step = int(payload["step"])
        if step + 1 >= self.steps:
            raise CheckpointError(f"checkpoint {path} is at step {step + 1} of {self.steps}: nothing left to run "
                                  f"(raise --steps)")
        self.runtime.restore(payload)
        if payload["source"] is not None:
            self.source.load_state_dict(payload["source"])
        self._truncate_metrics(step + 1)
        self.say(f"resuming from {path} at step {step + 2}")
        return step + 1

    def _dump(self, result: StepResult) -> None:
        """Write the step's samples as JSONL: prompt and response text, score, advantage."""
        data = result.data
        decode = getattr(self.source, "decode", None)
        cols = set(data.batch.keys()) if data.batch is not None else set()
        path = self.out / "rollouts" / f"step_{result.step + 1:06d}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w") as f:
            for i in range(len(data)):
                row: dict[str, Any] = {}
                if "uid" in data.non_tensor_batch:
                    row["uid"] = str(data.non_tensor_batch["uid"][i])
                for name in ("prompts", "responses"):
                    if name in cols:
                        ids = data.batch[name][i]
                        if name == "responses" and "response_mask" in cols:
                            ids = ids[data.batch["response_mask"][i].bool()]
                        ids = ids.tolist()
                        row[name[:-1]] = decode(ids) if decode else ids
                if "token_level_scores" in cols:
                    row["score"] = float(data.batch["token_level_scores"][i].sum())
                if "advantages" in cols:
                    row["advantage"] = float(data.batch["advantages"][i][0])
                if "weight_version" in cols:
                    row["weight_version"] = int(data.batch["weight_version"][i])
                f.write(json.dumps(row) + "\n")

    def _truncate_metrics(self, keep_through: int) -> None:
        """Drop metric rows written after the checkpoint: those steps run again, identically."""
        path = self.out / "metrics.jsonl"
        if not path.is_file():
            return
        kept = [line for line in path.read_text().splitlines()
                if line.strip() and json.loads(line).get("step", 0) <= keep_through]
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        tmp.replace(path)

    def _install_sigint(self) -> Callable[[], None]:
        """First Ctrl-C: finish the steps in flight, save, stop. A second one interrupts."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        previous = signal.getsignal(signal.SIGINT)

        def handler(signum: int, frame: Any) -> None:
            if self.stopped:
                signal.signal(signal.SIGINT, signal.default_int_handler)
                raise KeyboardInterrupt
            self.stopped = True
            self.runtime.request_stop()
            self.say("stopping: finishing the steps in flight, then saving a checkpoint (Ctrl-C again to abort)")

        signal.signal(signal.SIGINT, handler)
        return lambda: signal.signal(signal.SIGINT, previous)

    def _row(self, result: StepResult, start: float) -> dict[str, Any]:
        now = time.time()
        row = {"step": result.step + 1, **result.metrics, **(result.val_metrics or {}),
               "timing/elapsed": now - start}
        # throughput over wall time between finished steps (it includes any overlap across steps)
        wall = now - self._last_end if self._last_end is not None else result.makespan
        self._last_end = now
        if wall > 0:
            row["throughput/samples_per_s"] = self.samples_per_step / wall
            if "response_length/mean" in row:
                row["throughput/tokens_per_s"] = self.samples_per_step * row["response_length/mean"] / wall
        return row
