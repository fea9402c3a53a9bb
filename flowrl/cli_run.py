"""``flowrl run``: train a graph, showing what happens, and say where the run left its results.

Registered on the ``flowrl`` app by :mod:`flowrl.cli`. Ray starts on a thread
before the graph loads; a wrong graph or a taken run directory is said before
anything waits on Ray. A first Ctrl-C or SIGTERM finishes the steps in flight
and saves (exit 130 or 143); a second aborts.

Example::

    flowrl run grpo --steps 5 --out runs/try
    flowrl run grpo --steps 8 --out runs/try --resume
"""

from __future__ import annotations

import os
import shlex
import signal
import time
from typing import Any, Optional

import typer

from flowrl.cli_io import console, err_console, escape, fail, load_checked
from flowrl.plan.traits import RAY
from flowrl.runtime.ray_start import exit_now, prestart

#: the fault switch's environment variable: an alias of ``flowrl run --fault``, read by that command
#: alone, once (the runtime reads no environment; the switch is the graph's ``trainer.fault``)
FAULT_ENV = "FLOWRL_FAULT"


def run(
    graph: str = typer.Argument("grpo", help="graph: file.yaml, file.py, module:graph, or a built-in name"),
    steps: Optional[int] = typer.Option(None, "--steps", min=1, help="steps to run (default: trainer.steps)"),
    out: Optional[str] = typer.Option(None, "--out", help="run directory (default: trainer.out)"),
    backend: str = typer.Option("ray", "--backend", help="a registered backend: ray (default) or local"),
    address: Optional[str] = typer.Option(
        None, "--address", help="a Ray cluster to join (default: RAY_ADDRESS when set, else a local Ray on 127.0.0.1)"),
    trace: Optional[str] = typer.Option(None, "--trace", help="write a Chrome/Perfetto trace here"),
    set_: Optional[list[str]] = typer.Option(None, "--set", help="override a key: path.to.key=value"),
    resume: bool = typer.Option(False, "--resume", help="continue from the newest checkpoint in the run directory"),
    overwrite: bool = typer.Option(False, "--overwrite",
                                   help="replace the run already in the run directory (its metrics and checkpoints)"),
    allow_data_change: bool = typer.Option(False, "--allow-data-change",
                                           help="with --resume: go on although the data changed since the checkpoint"),
    ray_listen_all: bool = typer.Option(
        False, "--ray-listen-all",
        help="let the local Ray listen on every network interface (default: 127.0.0.1 only; "
             "anyone who can reach an open Ray can run code as you)"),
    verbose: bool = typer.Option(
        False, "-v", "--verbose",
        help="after the first step, print the start-up timeline (which process did what, when)"),
    fault: Optional[str] = typer.Option(
        None, "--fault", help="inject a failure, for tests and rehearsals: node=reward,step=3,rank=0,"
        f"kind=raise|hang|kill,mb=0,times=1 (sets trainer.fault; default: {FAULT_ENV} when set)"),
) -> None:
    """Train: run the graph for trainer.steps steps, printing and recording metrics."""
    if resume and overwrite:
        fail("--resume continues the run in the directory and --overwrite replaces it: give one of them", 2)
    if ray_listen_all:
        os.environ["FLOWRL_RAY_LISTEN_ALL"] = "1"
    prestart(backend, address)  # Ray starts on a thread: its seconds overlap loading the graph
    fault = fault if fault is not None else os.environ.get(FAULT_ENV, "").strip() or None
    # before the runtime's imports: a wrong graph is said at once
    g = load_checked(graph, set_, {"trainer.fault": fault} if fault else None)
    from flowrl.errors import RuntimeFailure
    from flowrl.store.rundir import RunDirectory, run_dir_of
    from flowrl.store.runlog import RUN_LOG

    try:  # what needs no Ray is refused before the run waits on Ray's start
        RunDirectory(run_dir_of(g.config, out)).check(resume=resume, overwrite=overwrite)
    except RuntimeFailure as e:
        err_console.print(f"[bold red]run failed[/] {escape(str(e))}")
        exit_now(1)
        raise typer.Exit(1) from None
    workers: Any = backend
    if backend == RAY.name:  # the workers are asked for the moment Ray is up, while the rest below imports
        from flowrl.runtime.ray_backend import RayBackend

        workers = RayBackend.asked_early(g, address, run_dir_of(g.config, out) / RUN_LOG)
    from flowrl.runtime.backends import BACKENDS
    from flowrl.run.trainer import Trainer
    from visualizer.live import LiveView

    if backend not in BACKENDS:
        fail(f"--backend {backend}: not a backend; use one of {', '.join(sorted(BACKENDS))}", 2)
    total = steps if steps is not None else g.config.trainer.steps
    trainer = None
    start = time.monotonic()
    try:
        with LiveView(g, total_steps=total, console=console) as view:
            view.score_max = declared_score_max(g)
            view.say(f"{g.name}: {total} steps on the {backend} backend → {run_dir_of(g.config, out)}")
            view.wait("starting Ray and asking for the workers" if backend == "ray"
                      else "making the plan and opening the data")
            trainer = Trainer(g, backend=workers, steps=steps, out=out, address=address, trace=trace,
                              on_step=view.step, on_progress=view.progress, resume=resume, say=view.say,
                              overwrite=overwrite, history_limit=0, show_startup=verbose, on_wait=view.wait,
                              allow_data_change=allow_data_change)
            view.placement = dict(trainer.runtime.plan.moved)
            trainer.run()
    except RuntimeFailure as e:
        err_console.print(f"[bold red]run failed[/] {escape(str(e))}")
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        err_console.print("[bold red]aborted[/] by a second signal: the steps since the last checkpoint are lost")
        signum = trainer.stop_signal if trainer is not None else None
        raise typer.Exit(143 if signum == signal.SIGTERM else 130) from None
    except (OSError, ValueError) as e:
        fail(f"{type(e).__name__}: {e}")
    if trainer.stopped:
        # the shell's convention for "ended by a signal": 128 + its number
        raise typer.Exit(143 if trainer.stop_signal == signal.SIGTERM else 130)
    for line in summary(view, trainer, graph, time.monotonic() - start):
        console.print(escape(line), highlight=False)


def declared_score_max(g: Any) -> float | None:
    """The highest held-out score of graph ``g``, as its scoring node's operator declares it for its
    parameters (``score_max``: grpo_tools' 1.2 is 1 for the answer + its tool's 0.2); None when unknown."""
    scorer = g.scorer()
    node = g.nodes[scorer[0]] if scorer is not None else None
    if node is None or node.op.score_max is None:
        return None
    return node.op.score_max(node.params, g.config.dump())


def summary(view: Any, trainer: Any, graph: str, wall_s: float) -> list[str]:
    """The closing lines of a run: steps and wall time, the held-out score (final, best, of its maximum),
    the headline metric over the last steps, the checkpoint, and the commands that go on from here."""
    out = trainer.out
    minutes, seconds = divmod(round(wall_s), 60)
    lines = [f"done: {view.steps_done} steps in {f'{minutes}m ' if minutes else ''}{seconds}s → {out}"]
    if view.val_scores:
        final_step, final = view.val_scores[-1]
        best_step, best = max(view.val_scores, key=lambda s: s[1])
        of = f", of a maximum of {view.score_max:.4g}" if view.score_max is not None else ""
        lines.append(f"  held-out {view.val_metric}: {final:.4g} at step {final_step}, best {best:.4g} at step "
                     f"{best_step}{of}")
    if view.recent:
        lines.append(f"  {view.headline}, mean of the last {len(view.recent)} steps: "
                     f"{sum(view.recent) / len(view.recent):.4g}")
    lines.append(f"  metrics: {out / 'metrics.jsonl'}")
    q = shlex.quote
    if trainer.last_checkpoint is not None:
        lines.append(f"  checkpoint: {trainer.last_checkpoint}")
        lines.append(f"  resume:  flowrl run {q(graph)} --out {q(str(out))} --resume --steps {2 * trainer.steps}")
        lines.append(f"  export:  flowrl export {q(str(out))} {q(str(out / 'hf'))}")
    lines.append(f"  compare: flowrl diff {q(str(out))} OTHER_RUN_DIR")
    return lines


__all__ = ["FAULT_ENV", "declared_score_max", "run", "summary"]
