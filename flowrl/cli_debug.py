"""``flowrl diff`` and ``flowrl replay``: commands that look back at finished runs. Registered on
the ``flowrl`` app by :mod:`flowrl.cli`; they read run directories and never write to them.

Example::

    flowrl diff runs/a runs/b          # exit 0: the same, 1: they differ, 2: cannot compare
    flowrl diff runs/a runs/b --json
    flowrl replay runs/a --step 3 --from advantage --set nodes.advantage.norm_adv_by_std_in_grpo=false
"""

from __future__ import annotations

import json
from typing import Optional

import typer
from rich.markup import escape

# ANSI, fail, parse_overrides and plain live in flowrl.cli_io; still importable from here
from flowrl.cli_io import ANSI, console, err_console, fail, parse_overrides, plain, show
from flowrl.errors import RuntimeFailure
from flowrl.provenance.rundiff import FingerprintFileError, diff_runs


def diff(
    run_a: str = typer.Argument(..., help="a run directory (or its fingerprints.jsonl)"),
    run_b: str = typer.Argument(..., help="the run to compare it with"),
    as_json: bool = typer.Option(False, "--json", help="print the comparison as JSON"),
) -> None:
    """Compare two runs node by node: the first (step, node, field) that differs while its inputs were
    equal, then how the difference spread. Exit 0 when they agree, 1 when they differ."""
    warnings: list[str] = []
    try:
        report = diff_runs(run_a, run_b, warn=warnings.append)
    except FingerprintFileError as e:
        fail(str(e), 2)
    for w in warnings:
        err_console.print(f"[yellow]warning[/] {escape(w)}", highlight=False)
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        from visualizer.diff import render_diff  # rich tables, imported when drawn: `flowrl --help` stays light

        show(console, render_diff(report, run_a, run_b))
    raise typer.Exit(0 if report["same"] else 1)


def replay(
    run: str = typer.Argument(..., help="a run directory (its trainer.out) with records and checkpoints"),
    step: int = typer.Option(..., "--step", min=1, help="the step to rebuild (1-based, as the run printed it)"),
    start: str = typer.Option(..., "--from", help="the node to run again from (it and everything downstream)"),
    set_: Optional[list[str]] = typer.Option(None, "--set", help="override a key of the replayed nodes: "
                                             "nodes.<node>.<param>=value (also roles, schedule)"),
    backend: str = typer.Option("ray", "--backend", help="a registered backend: ray (default) or local"),
    as_json: bool = typer.Option(False, "--json", help="print the comparison as JSON"),
) -> None:
    """Rebuild step STEP of RUN from its checkpoint and records, run node FROM and everything downstream
    again with the overrides, and compare the metrics with those the run logged. Writes nothing to RUN;
    exit 2 when the records or checkpoints do not cover the request."""
    # the runtime (torch, the workers) only when a replay runs: `flowrl --help` stays light
    from flowrl.run.replay import replay_step
    from visualizer.replay import render_replay

    overrides = parse_overrides(set_)
    try:
        report = replay_step(run, step, start, overrides, backend=backend,
                             say=lambda m: err_console.print(escape(m), highlight=False))
    except RuntimeFailure as e:
        fail(str(e), 2)
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        show(console, render_replay(report))


__all__ = ["ANSI", "diff", "fail", "parse_overrides", "plain", "replay"]
