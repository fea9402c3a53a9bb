"""``flowrl diff``: commands that look back at finished runs. Registered on the
``flowrl`` app by :mod:`flowrl.cli`; they read run directories and never write
to them.

Example::

    flowrl diff runs/a runs/b          # exit 0: the same, 1: they differ, 2: cannot compare
    flowrl diff runs/a runs/b --json
"""

from __future__ import annotations

import json

import typer
from rich.console import Console
from rich.markup import escape

from flowrl.runtime.rundiff import FingerprintFileError, diff_runs


def diff(
    run_a: str = typer.Argument(..., help="a run directory (or its fingerprints.jsonl)"),
    run_b: str = typer.Argument(..., help="the run to compare it with"),
    as_json: bool = typer.Option(False, "--json", help="print the comparison as JSON"),
) -> None:
    """Compare two runs node by node: the first (step, node, field) that differs while its inputs were
    equal, then how the difference spread. Exit 0 when they agree, 1 when they differ."""
    out, err = Console(), Console(stderr=True, soft_wrap=True)  # a message stays one line
    warnings: list[str] = []
    try:
        report = diff_runs(run_a, run_b, warn=warnings.append)
    except FingerprintFileError as e:
        err.print(f"[bold red]error[/] {escape(str(e))}", highlight=False)
        raise typer.Exit(2) from None
    for w in warnings:
        err.print(f"[yellow]warning[/] {escape(w)}", highlight=False)
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        from visualizer.diff import render_diff  # rich tables, imported when drawn: `flowrl --help` stays light

        out.print(render_diff(report, run_a, run_b))
    raise typer.Exit(0 if report["same"] else 1)


__all__ = ["diff"]
