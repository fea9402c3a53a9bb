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
import signal
from typing import Optional

import typer

from flowrl.cli_io import console, err_console, escape, fail, load_checked
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
    from flowrl.runtime.backends import BACKENDS
    from flowrl.errors import RuntimeFailure
    from flowrl.run.trainer import Trainer
    from flowrl.store.rundir import RunDirectory, run_dir_of
    from visualizer.live import LiveView

    if backend not in BACKENDS:
        fail(f"--backend {backend}: not a backend; use one of {', '.join(sorted(BACKENDS))}", 2)
    try:  # what needs no Ray is refused before the run waits on Ray's start
        RunDirectory(run_dir_of(g.config, out)).check(resume=resume, overwrite=overwrite)
    except RuntimeFailure as e:
        err_console.print(f"[bold red]run failed[/] {escape(str(e))}")
        exit_now(1)
        raise typer.Exit(1) from None
    total = steps if steps is not None else g.config.trainer.steps
    trainer = None
    try:
        with LiveView(g, total_steps=total, console=console) as view:
            trainer = Trainer(g, backend=backend, steps=steps, out=out, address=address, trace=trace,
                              on_step=view.step, on_progress=view.progress, resume=resume, say=view.say,
                              overwrite=overwrite, history_limit=0, show_startup=verbose)
            view.placement = dict(trainer.runtime.plan.moved)
            view.say(f"{g.name}: {total} steps on the {backend} backend → {trainer.out}")
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
    console.print(f"[green]done[/]: metrics in {trainer.out / 'metrics.jsonl'}")


__all__ = ["FAULT_ENV", "run"]
