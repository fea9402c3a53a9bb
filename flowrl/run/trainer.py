"""The outer loop of ``flowrl run``: a data source, ``trainer.steps`` steps, metrics out.

Each step's metrics go to ``<out>/metrics.jsonl`` (one JSON object per line,
``step`` included) and to a callback (the CLI prints them). The resolved graph
config is written to ``<out>/config.yaml`` before the first step. What the worker
processes print, and the full traceback of a failure, go to ``<out>/run.log``
(:mod:`flowrl.store.runlog`).

Every ``trainer.checkpoint_every`` steps, at the end of every run, and on a
graceful stop (Ctrl-C or SIGTERM: the steps in flight finish, then it saves
and the CLI exits 130 or 143; a second signal aborts), a checkpoint goes to
``<out>/checkpoints``. ``resume=True`` continues from the newest loadable one:
N uninterrupted steps and k steps + resume + N−k steps give the same metrics.
A run may resume with other worker counts (``pools.<p>.workers``): sharded roles
reshard onto the new ranks and every role continues from the same weights and
optimizer state. A prompt's samples are keyed by its uid, not by the rank that
draws them, so the run goes on as the uninterrupted one would, until a
floating-point difference of the other sharding flips a sample.

With ``trainer.record``, the chosen nodes' outputs of the recorded steps go to
``<out>/records`` (:mod:`flowrl.provenance.record`; a resume removes those of the
steps it runs again), what ``flowrl replay`` rebuilds a step from.

The run directory has one owner (:mod:`flowrl.store.rundir`): a second run
on it is refused, and a fresh run refuses another run's state unless
``resume`` or ``overwrite``.

Example::

    trainer = Trainer(load_graph("grpo"), backend="local", steps=5, out="runs/try")
    history = trainer.run()
    print(history[-1]["reward/mean"])
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable

import yaml

from flowrl.graph import Graph
from flowrl.graph.registry import make_source
from flowrl.store.checkpoint import (CheckpointError, CheckpointStore, UnreadableCheckpoint, differences,
                                       fingerprint, worker_counts)
from flowrl.runtime.backends import make_backend, start_early, stop_early
from flowrl.store.dumps import graph_fields, write_rollouts
from flowrl.plan.plancheck import PlanCheck
from flowrl.recovery import rollback
from flowrl.recovery.restarts import RollbackNeeded
from flowrl.provenance.fingerprints import FingerprintLog
from flowrl.errors import RuntimeFailure
from flowrl.provenance.record import Recorder
from flowrl.store.rundir import RunDirectory, run_dir_of
from flowrl.store.runlog import RUN_LOG, record_failure
from flowrl.runtime.scheduler import Runtime, StepResult
from flowrl.store.sinks import open_sinks, read_metrics
from flowrl.runtime.startup import describe

#: task records kept in the driver when no trace is written (a few steps' worth: memory stays flat)
TIMELINE_RECORDS = 1_000


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
        overwrite: bool = False,
        history_limit: int | None = None,
        show_startup: bool = False,
    ) -> None:
        """``show_startup``: after the first step, ``say`` the start-up timeline (``flowrl run -v``)."""
        self.graph = graph
        cfg = graph.config
        self.steps = steps if steps is not None else cfg.trainer.steps
        self.out = run_dir_of(cfg, out)
        self.trace = Path(trace) if trace else None
        self.on_step = on_step
        # the fields the graph's operators declare worth dumping (dumped=...)
        producers = graph.producers()
        fetch = [f for f in graph.dumped_fields() if f in producers] if cfg.trainer.dump_rollouts else []
        self.store = CheckpointStore.of_run(self.out, keep=cfg.trainer.keep_checkpoints)
        # the plan carries the validation run when trainer.val_every asks (the check refused a graph
        # that scores nothing)
        #: what worker processes print, and the traceback of a failure (:mod:`flowrl.store.runlog`)
        self.log_path = self.out / RUN_LOG
        self.recorder: Recorder | None = None  # made when the run starts (a resume cuts the records back)
        self.runtime = Runtime(graph, backend=make_backend(backend, address, self.log_path), address=address,
                               on_progress=on_progress, fetch=fetch, stage=self.store.stage, record=self._recorded)
        start_early(self.runtime.backend, self.runtime.plan.pools)  # their imports overlap the rest of this
        self.show_startup = show_startup
        try:
            self.source = make_source(cfg)
            self.val_source = make_source(cfg, split="val") if self.runtime.plan.validation is not None else None
        except BaseException:
            stop_early(self.runtime.backend)  # no run will use the workers asked for above
            raise
        self.history: list[dict[str, float]] = []
        self.history_limit = history_limit
        if self.trace is None:
            self.runtime.timeline.keep_last(TIMELINE_RECORDS)
        self.resume, self.say, self.overwrite = resume, say, overwrite
        #: the signal that stopped the run gracefully (``signal.SIGINT`` or ``signal.SIGTERM``), if any
        self.stop_signal: int | None = None
        self.stopped = False
        self._last_end: float | None = None
        # rows a step generates: prompts × the largest expansion (n samples per prompt)
        self.samples_per_step = cfg.data.batch_size * max(sp.factor for sp in self.runtime.plan.spaces.values())
        self.plan_check = PlanCheck(self.runtime.plan, self.out, say)  # plan/predicted_step_s, plan/error

    def run(self) -> list[dict[str, float]]:
        """Run the steps (resuming first when asked) and return the metrics rows of this run."""
        try:
            with RunDirectory(self.out, say=self.say) as rundir:
                rundir.claim(resume=self.resume, overwrite=self.overwrite)
                try:
                    return self._run()
                except RuntimeFailure as e:
                    record_failure(self.log_path, e)  # the traceback goes to the log, the message names it
                    raise
                finally:
                    if self.trace is not None:
                        self.runtime.timeline.to_chrome_trace(self.trace, self.runtime.backend.startup_spans())
                    self.runtime.close()
                    for line in self.runtime.backend.notes():
                        self.say(line)
                    self.store.discard_staged()  # shards written for a checkpoint that was never saved
        finally:
            stop_early(self.runtime.backend)  # workers asked for early that no step came to use

    def _run(self) -> list[dict[str, float]]:
        cfg = self.graph.config
        start_step = self._resume() if self.resume else 0
        (self.out / "config.yaml").write_text(yaml.safe_dump(cfg.dump(), sort_keys=False))
        every, val_every = cfg.trainer.checkpoint_every, cfg.trainer.val_every
        last = self.steps - 1
        self.runtime.start()  # ray.init installs a SIGTERM handler of its own: ours go in after it
        start = time.time()
        restore_signals = self._install_signals()
        done = start_step - 1
        saved = start_step - 1

        def roll_back(e: RollbackNeeded) -> int:  # a dead worker of a sharded pool (flowrl.recovery.rollback)
            nonlocal prints
            if prints is not None:
                prints.close()
            step = rollback.roll_back(self, e, sinks)
            prints = self._fingerprints(step)
            if self.recorder is not None:  # the steps run again are recorded again
                self.recorder = Recorder(self.out, self.graph, self.say, keep_through=step)
            return step

        try:
            sinks = open_sinks(self.out, cfg.trainer.wandb_project, run_name=cfg.name, config=cfg.dump())
            prints = self._fingerprints(start_step)
            if cfg.trainer.record is not None:
                self.recorder = Recorder(self.out, self.graph, self.say, keep_through=start_step)
            try:
                results = rollback.rolling(lambda s: self.runtime.run(
                    self.source, steps=self.steps - s, start_step=s,
                    # a run always ends with a checkpoint, so it always leaves a model
                    checkpoint=lambda t: (bool(every) and (t + 1) % every == 0) or t == last,
                    validate=lambda t: bool(val_every) and ((t + 1) % val_every == 0 or t == last),
                    val_batches=self.val_source), start_step, roll_back)
                for result in results:
                    row = self._row(result, start)
                    sinks.write(row["step"], row)
                    if prints is not None:
                        prints.step(result)
                    if result.data is not None:
                        self._dump(result)
                    if result.records is not None and self.recorder is not None:
                        self.recorder.write(result.step, result.records)
                    self._remember(row)
                    done = result.step
                    if result.checkpoint is not None:
                        sinks.sync()  # metrics on disk before the checkpoint that continues after them
                        if prints is not None:
                            prints.sync()
                        self._save(result.step, result.checkpoint)
                        saved = result.step
                    if self.on_step is not None:
                        self.on_step(result.step, row)
                    if self.show_startup and result.step == start_step:
                        for line in describe(self.runtime.backend.startup_spans(), self.runtime.timeline.records):
                            self.say(line)
                if self.stopped and done > saved:
                    sinks.sync()
                    self._save(done, self.runtime.snapshot_now(done, self.source))
            except CheckpointError as e:  # e.g. a full disk while the ranks wrote their shards
                raise CheckpointError(str(getattr(e, "cause", None) or e)) from None  # a worker's: its message
            finally:
                sinks.close()
                if prints is not None:
                    prints.close()
            if self.stopped:
                self.say(f"stopped after step {done + 1}; checkpoint saved, continue with --resume")
        finally:
            restore_signals()
        return self.history

    def _fingerprints(self, start_step: int) -> FingerprintLog | None:
        """``fingerprints.jsonl`` and the invariants (``trainer.fingerprints``, ``trainer.invariants``)."""
        cfg = self.graph.config.trainer
        if not cfg.fingerprints:
            return None
        return FingerprintLog(self.out, self.graph, self.runtime.plan, self.say, keep_through=start_step,
                              fatal=cfg.invariants == "fatal", check=cfg.invariants != "off")

    def _recorded(self, step: int) -> dict[str, list[str]] | None:
        """The fields ``trainer.record`` saves of 0-based step ``step`` (None: not this step)."""
        return self.recorder.fields if self.recorder is not None and self.recorder.wants(step) else None

    def _remember(self, row: dict[str, Any]) -> None:
        """Keep the run's rows for the caller, up to ``history_limit`` (the driver's memory stays flat)."""
        self.history.append(row)
        if self.history_limit is not None and len(self.history) > self.history_limit:
            del self.history[: len(self.history) - self.history_limit]

    # ------------------------------------------------------------------ checkpoints
    def _save(self, step: int, payload: dict[str, Any]) -> None:
        dump = self.graph.config.dump()
        meta = {"graph": fingerprint(dump), "workers": worker_counts(dump), "name": self.graph.name,
                "saved_at": time.time()}
        path = self.store.save(step, payload, meta)
        self.say(f"checkpoint: {path}")

    def _resume(self) -> int:
        dump = self.graph.config.dump()
        mine, counts = fingerprint(dump), worker_counts(dump)

        def accept(payload: dict[str, Any], meta: dict[str, Any], path: Path) -> None:
            diff = differences(fingerprint(meta["graph"]), mine)
            if diff:
                raise CheckpointError(
                    f"checkpoint {path} belongs to a different graph or config; it differs in: "
                    + "; ".join(diff[:10]) + ("; ..." if len(diff) > 10 else "")
                    + ". Resume with the graph it was written by, or start a new run directory (--out)."
                )
            step = payload["step"]
            if step + 1 >= self.steps:
                raise CheckpointError(f"checkpoint {path} is at step {step + 1} of {self.steps}: nothing left "
                                      f"to run (raise --steps)")
            try:
                self.runtime.restore(payload)
                if payload["source"] is not None:
                    self.source.load_state_dict(payload["source"])
            except Exception as e:  # noqa: BLE001 - a tensor of the wrong shape, a missing key: try the previous one
                text = str(e).strip().splitlines()
                raise UnreadableCheckpoint(f"it does not fit the graph's roles: {type(e).__name__}: "
                                           f"{text[0] if text else ''}") from None

        payload, meta, path = self.store.load_latest(warn=self.say, accept=accept)
        step = payload["step"]
        saved = meta.get("workers") if isinstance(meta.get("workers"), dict) else worker_counts(meta["graph"])
        changed = [f"{p}: {n} → {counts[p]}" for p, n in saved.items() if p in counts and n != counts[p]]
        if changed:
            self.say(f"workers changed since the checkpoint ({', '.join(changed)}): weights and optimizer "
                     f"state carry over (resharded); the metrics follow an uninterrupted run's up to "
                     f"floating-point differences in the sharded update")
        self._truncate_metrics(step + 1)
        self.say(f"resuming from {path} at step {step + 2}")
        return step + 1

    def _dump(self, result: StepResult) -> None:
        """Write the step's samples as JSONL: the columns the graph's operators declare ``dumped``."""
        path = self.out / "rollouts" / f"step_{result.step + 1:06d}.jsonl"
        fields = graph_fields(self.graph)
        dumped = {n: fields[n] for n in self.runtime.fetch}
        write_rollouts(path, result.data, dumped, getattr(self.source, "decode", None))

    def _truncate_metrics(self, keep_through: int) -> None:
        """Drop metric rows written after the checkpoint (those steps run again, identically), and nothing else."""
        path = self.out / "metrics.jsonl"
        if not path.is_file():
            return
        kept = [line for line, row in read_metrics(path, warn=self.say) if row.get("step", 0) <= keep_through]
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        tmp.replace(path)

    def _install_signals(self) -> Callable[[], None]:
        """First Ctrl-C or SIGTERM: finish the steps in flight, save, stop. A second one aborts."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

        def handler(signum: int, frame: Any) -> None:
            if self.stopped:
                for sig in previous:
                    signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
                raise KeyboardInterrupt
            self.stopped = True
            self.stop_signal = signum
            self.runtime.request_stop()
            name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
            self.say(f"{name}: finishing the steps in flight, then saving a checkpoint (again to abort)")

        for sig in previous:
            signal.signal(sig, handler)

        def restore() -> None:
            for sig, h in previous.items():
                signal.signal(sig, h)

        return restore

    def _row(self, result: StepResult, start: float) -> dict[str, Any]:
        now = time.time()
        row = {"step": result.step + 1, **result.metrics, **(result.val_metrics or {}),
               "timing/elapsed": now - start}
        # throughput over wall time between finished steps (it includes any overlap across steps)
        wall = now - self._last_end if self._last_end is not None else result.makespan
        self._last_end = now
        if wall > 0:
            row["throughput/samples_per_s"] = self.samples_per_step / wall
            tokens = self.graph.token_metrics()  # the operator that generates says which metric counts
            if tokens is not None and tokens.mean in row:
                row["throughput/tokens_per_s"] = self.samples_per_step * row[tokens.mean] / wall
        row.update(self.plan_check.observe(row))
        return row
