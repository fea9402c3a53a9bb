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

Everything written per step — the metrics row and its sinks, fingerprints, dumps,
records, timing — is a driver-step hook (:mod:`flowrl.run.hooks`), so the loop
below only runs steps and saves checkpoints. Faults go through one
:class:`~flowrl.recovery.recovery.Recovery`; when a worker of a sharded or trained
pool dies, it rolls the run back through :meth:`Trainer.resume`, the path
``--resume`` takes.

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

from flowrl.errors import RuntimeFailure
from flowrl.graph import Graph
from flowrl.graph.registry import make_source
from flowrl.plan.plancheck import PlanCheck
from flowrl.recovery.recovery import Recovery
from flowrl.recovery.watchdog import StuckReport
from flowrl.run.hooks import Dumps, Fingerprints, MetricsSinks, Records, StartupLines, Timing
from flowrl.runtime.backend import Backend, describe_death
from flowrl.runtime.backends import make_backend, start_early, stop_early
from flowrl.runtime.scheduler import Runtime
from flowrl.runtime.steps import StepHook
from flowrl.store.checkpoint import (CheckpointError, CheckpointStore, DataChanged, UnreadableCheckpoint,
                                     data_changes, differences, fingerprint, worker_counts)
from flowrl.store.verify import read_meta
from flowrl.store.rundir import RunDirectory, run_dir_of
from flowrl.store.runlog import RUN_LOG, log_note, record_failure

#: task records kept in the driver when no trace is written (a few steps' worth: memory stays flat)
TIMELINE_RECORDS = 1_000


class Trainer:
    """Runs a graph for a number of steps and records what happened."""

    def __init__(
        self,
        graph: Graph,
        *,
        backend: str | Backend = "ray",
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
        on_wait: Callable[[str], None] | None = None,
        allow_data_change: bool = False,
    ) -> None:
        """``backend``: a registered backend's name, or a backend already made (``flowrl run`` makes the Ray
        one as soon as the graph is checked, so that it asks for the workers the moment Ray is up);
        ``show_startup``: after the first step, ``say`` the start-up timeline (``flowrl run -v``);
        ``on_wait``: told what the run waits on before its first step (the workers starting, the first step),
        so a long wait is said as it lasts (:class:`visualizer.live.Waits`); ``allow_data_change``: resume
        although the data source changed since the checkpoint (``flowrl run --allow-data-change``; refused
        otherwise, before the workers are waited on)."""
        self.graph = graph
        cfg = graph.config
        self.steps = steps if steps is not None else cfg.trainer.steps
        self.out = run_dir_of(cfg, out)
        self.trace = Path(trace) if trace else None
        self.on_step = on_step
        self.store = CheckpointStore.of_run(self.out, keep=cfg.trainer.keep_checkpoints)
        #: what worker processes print, and the traceback of a failure (:mod:`flowrl.store.runlog`)
        self.log_path = self.out / RUN_LOG
        #: one recovery path; a rollback resumes through :meth:`resume`
        self.recovery = Recovery(run=self)
        # the plan carries the validation run when trainer.val_every asks
        if isinstance(backend, str):
            backend = make_backend(backend, address, self.log_path)
        self.runtime = Runtime(graph, backend=backend, address=address,
                               on_progress=on_progress, stage=self.store.stage, recovery=self.recovery)
        # their imports overlap the rest of this
        start_early(self.runtime.backend, self.runtime.plan.pools, self.runtime.plan.driver)
        try:
            self.source = make_source(cfg)
            self.val_source = make_source(cfg, split="val") if self.runtime.plan.validation is not None else None
            #: what the prompts come from (a file's digest, a generator's settings), kept in every checkpoint
            self.data: dict[str, Any] | None = self.source.identity() if hasattr(self.source, "identity") else None
            self.resuming, self.say, self.overwrite, self.allow_data_change = resume, say, overwrite, allow_data_change
            if resume:
                self._check_newest_data()
        except BaseException:
            stop_early(self.runtime.backend)  # no run will use the workers asked for above
            raise
        self._source_start: dict[str, Any] | None = None  # the data's position before the first step (start_over)
        if self.trace is None:
            self.runtime.timeline.keep_last(TIMELINE_RECORDS)
        self.on_wait = on_wait or (lambda label: None)
        #: the signal that stopped the run gracefully (``signal.SIGINT`` or ``signal.SIGTERM``), if any
        self.stop_signal: int | None = None
        self.stopped = False
        #: the checkpoint this run saved last (None before its first)
        self.last_checkpoint: Path | None = None
        #: the metrics rows of this run (the last ``history_limit``)
        self.history: list[dict[str, float]] = []
        self.sinks = MetricsSinks(self.out, cfg, say, self.history, history_limit)
        #: the driver-step hooks, attached to the runtime while :meth:`run` runs
        self.hooks = self._hooks(show_startup)

    def _hooks(self, show_startup: bool) -> list[StepHook]:
        """The driver-step hooks of the run, in order (:mod:`flowrl.run.hooks`)."""
        cfg, plan = self.graph.config, self.runtime.plan
        # rows a step generates: prompts × the largest expansion (n samples per prompt)
        samples = cfg.data.batch_size * max(sp.factor for sp in plan.spaces.values())
        tokens = self.graph.token_metrics()  # the operator that generates says which metric counts tokens
        check = PlanCheck(plan, self.out, self.say, log=lambda message: log_note(self.log_path, message))
        timing = Timing(samples, check, tokens.mean if tokens is not None else None)
        # a hang is reported once the run can predict its tasks: 10x past the plan check's prediction
        self.recovery.stuck = StuckReport(self.say, check.task_seconds)
        hooks: list[StepHook] = [timing, self.sinks]
        if cfg.trainer.fingerprints:
            hooks.append(Fingerprints(self.out, self.graph, plan, self.say))
        if cfg.trainer.dump_rollouts:
            hooks.append(Dumps(self.out, self.graph, getattr(self.source, "decode", None)))
        if cfg.trainer.record is not None:
            hooks.append(Records(self.out, self.graph, self.say))
        if show_startup:
            hooks.append(StartupLines(self.runtime, self.say))
        return hooks

    def run(self) -> list[dict[str, float]]:
        """Run the steps (resuming first when asked) and return the metrics rows of this run."""
        try:
            with RunDirectory(self.out, say=self.say) as rundir:
                rundir.claim(resume=self.resuming, overwrite=self.overwrite)
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
        self.runtime.hooks[:] = self.hooks
        self.on_wait(self._starting())
        self.runtime.start()  # ray.init installs a SIGTERM handler of its own: ours go in after it
        if self.resuming:
            self.on_wait("loading the newest checkpoint")
        # where a rollback before any checkpoint takes the data back to (start_over)
        self._source_start = self.source.state_dict() if hasattr(self.source, "state_dict") else None
        start = self.resume() if self.resuming else self._rewind(0)
        self.on_wait(f"step {start + 1}/{self.steps}: the first of this run")
        (self.out / "config.yaml").write_text(yaml.safe_dump(self.graph.config.dump(), sort_keys=False))
        restore_signals = self._install_signals()
        done = saved = start - 1
        try:
            for result in self.runtime.run(self.source, steps=self.steps - start, start_step=start,
                                           checkpoint=self._checkpointed, validate=self._validated,
                                           val_batches=self.val_source):
                done = result.step
                if result.checkpoint is not None:
                    self._save(result.step, result.checkpoint)
                    saved = result.step
                if self.on_step is not None:
                    self.on_step(result.step, self.sinks.last)
            if self.stopped and done > saved:
                self._save(done, self.runtime.snapshot_now(done, self.source))
        except CheckpointError as e:  # e.g. a full disk while the ranks wrote their shards
            raise CheckpointError(str(getattr(e, "cause", None) or e)) from None  # a worker's: its message
        finally:
            for hook in self.hooks:
                hook.close()
            self.runtime.hooks.clear()
            restore_signals()
        if self.stopped:
            self.say(f"stopped after step {done + 1}; checkpoint saved, continue with --resume")
        return self.history

    def _starting(self) -> str:
        """What starting the workers waits on: their processes and the roles they build (loading models,
        a model's warm-up, a rollout engine)."""
        roles = self.graph.config.dump().get("roles") or {}
        pools = self.graph.config.pools
        workers = sum(p.workers for p in pools.values())
        built = ", ".join(f"{name} ({spec['model']})" if isinstance(spec, dict) and spec.get("model") else name
                          for name, spec in roles.items())
        return (f"starting {workers} worker process{'es' if workers != 1 else ''} and building the roles "
                f"{built}: loading models, warm-ups, engines")

    def _checkpointed(self, step: int) -> bool:
        """Whether 0-based ``step`` ends with a checkpoint: every ``trainer.checkpoint_every`` steps, and the
        last (a run always leaves a model)."""
        every = self.graph.config.trainer.checkpoint_every
        return (bool(every) and (step + 1) % every == 0) or step == self.steps - 1

    def _validated(self, step: int) -> bool:
        """Whether validation runs after 0-based ``step``: every ``trainer.val_every`` steps, and after the last."""
        every = self.graph.config.trainer.val_every
        return bool(every) and ((step + 1) % every == 0 or step == self.steps - 1)

    def _rewind(self, step: int) -> int:
        """Open every hook at 0-based ``step``, cutting back what they wrote for later steps; ``step``."""
        for hook in self.hooks:
            hook.rewind(step)
        return step

    # ------------------------------------------------------------------ checkpoints
    def _save(self, step: int, payload: dict[str, Any]) -> None:
        for hook in self.hooks:  # what they wrote is on disk before the checkpoint that continues it
            hook.sync()
        dump = self.graph.config.dump()
        meta = {"graph": fingerprint(dump), "workers": worker_counts(dump), "name": self.graph.name,
                "saved_at": time.time(), "data": self.data}
        path = self.store.save(step, payload, meta)
        self.last_checkpoint = path
        self.say(f"checkpoint: {path}")

    def has_checkpoint(self) -> bool:
        """Whether a complete checkpoint has been saved in the run directory."""
        return self.store.complete()

    def resume(self) -> int:
        """Load the newest loadable checkpoint into the run — every worker's state, the data position —
        and cut every sink back to it (``metrics.jsonl``, ``fingerprints.jsonl``, records); the 0-based
        step to go on from. ``--resume`` and a rollback (:mod:`flowrl.recovery.rollback`) take this path."""
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
            self._check_data(meta, path)
            step = payload["step"]
            if step + 1 >= self.steps:
                raise CheckpointError(f"checkpoint {path} is at step {step + 1} of {self.steps}: nothing left "
                                      f"to run (raise --steps)")
            try:
                self.runtime.restore(payload)
                if payload["source"] is not None:
                    self.source.load_state_dict(payload["source"])
            except Exception as e:  # noqa: BLE001 - a tensor of the wrong shape, a missing key: try the previous one
                death = describe_death(e) or describe_death(getattr(e, "cause", None) or e)
                if death is not None:  # the workers failed, not the checkpoint: never call it unreadable
                    raise CheckpointError(f"a worker died while checkpoint {path} was loaded into it ({death}); the "
                                          f"checkpoint was not found wrong and is untouched: run again with --resume"
                                          ) from None
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
        self._rewind(step + 1)
        self.say(f"resuming from {path} at step {step + 2}")
        return step + 1

    def _check_newest_data(self) -> None:
        """Refuse a changed data source against the newest checkpoint's record before the run waits on its
        workers; a checkpoint that does not read is left to :meth:`resume`, which names it and falls back."""
        found = self.store.complete()
        try:
            meta = read_meta(found[0]) if found else None
        except UnreadableCheckpoint:
            return
        if isinstance(meta, dict):
            self._check_data(meta, found[0], quiet=True)

    def _check_data(self, meta: dict[str, Any], path: Path, quiet: bool = False) -> None:
        """:class:`DataChanged` when the data source no longer holds what the checkpoint at ``path`` was trained
        on, unless ``--allow-data-change`` (then said, unless ``quiet``). A checkpoint written before
        flowrl recorded its data has nothing to compare."""
        saved = meta.get("data")
        if not isinstance(saved, dict) or self.data is None:
            return
        changed = data_changes(saved, self.data)
        if not changed:
            return
        what = "; ".join(changed[:6]) + ("; ..." if len(changed) > 6 else "")
        name = self.data.get("path") or self.data.get("source")
        if self.allow_data_change:
            if not quiet:
                self.say(f"the data source {name} changed since checkpoint {path} ({what}); going on with the "
                         f"new data (--allow-data-change)")
            return
        raise DataChanged(f"the data source {name} changed since checkpoint {path} was saved ({what}): resuming on "
                          f"it would be a different run. Restore the data the run was trained on, pass "
                          f"--allow-data-change to go on with the new data, or start a new run directory (--out)")

    def start_over(self) -> int:
        """Take the run back to before its first step: no step in flight, the data at its start, every sink
        emptied (a rollback before any checkpoint, its pools started anew: :mod:`flowrl.recovery.rollback`); 0."""
        self.runtime.restore(None)
        if self._source_start is not None:
            self.source.load_state_dict(self._source_start)
        self.say("no checkpoint yet: going back to the start of the run")
        return self._rewind(0)

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
