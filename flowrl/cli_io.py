"""What every ``flowrl`` command shares: its consoles, its one error line, ``--set``, loading a graph.

Off a terminal (a pipe, a log file) nothing is wrapped or cut and no colour codes
are written: a message stays one line, and a table (:func:`show`) is laid out
as wide as its rows need rather than rich's default of 80 columns.

Example::

    g = load_checked("grpo", ["trainer.steps=2"])   # exits 1 printing the graph's problems
    show(console, table)                            # whole rows, in a terminal or a pipe
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, NoReturn

import typer
from rich.console import Console, RenderableType
from rich.markup import escape as _markup_escape
from rich.measure import Measurement

if TYPE_CHECKING:
    from flowrl.graph.checks import GraphProblem

#: colour codes inside messages (a Ray error carries them); never written off a terminal
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
#: the widest a table written to a pipe is laid out (past it, a cell folds)
PIPE_WIDTH = 1_000


def make_console(stderr: bool = False) -> Console:
    """A console that wraps and colours only on a terminal: piped text stays one line per message."""
    c = Console(stderr=stderr)
    return c if c.is_terminal else Console(stderr=stderr, soft_wrap=True, no_color=True, highlight=False)


console = make_console()
err_console = make_console(stderr=True)


def show(out: Console, renderable: RenderableType) -> None:
    """Print a table (or a group of them): in a terminal at its width; off one at the width its rows need, so
    a pipe or a log file gets every cell whole (a metric name on one row, a configuration's full text)."""
    if out.is_terminal:
        out.print(renderable)
        return
    need = Measurement.get(out, out.options.update_width(PIPE_WIDTH), renderable).maximum
    width = out.width
    out.width = max(width, min(need, PIPE_WIDTH))  # print(width=) cannot go past the console's own width
    try:
        out.print(renderable, crop=False)
    finally:
        out.width = width


def plain(text: str) -> str:
    """``text`` as printed inside a rich message: colour codes dropped, markup characters escaped."""
    return _markup_escape(ANSI.sub("", text))


escape = plain


def parse_overrides(items: list[str] | None) -> dict[str, Any]:
    """``["trainer.steps=5", "data.batch_size=8"]`` → typed values (parsed as YAML scalars)."""
    import yaml  # not for `flowrl --help`

    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise typer.BadParameter(f"--set {item!r}: write it as path.to.key=value", param_hint="--set")
        out[key.strip()] = yaml.safe_load(raw) if raw.strip() else ""
    return out


def fail(message: str, code: int = 1, err: Console | None = None, label: str = "") -> NoReturn:
    """What every command does with a bad input: one line ``error <label><message>`` on stderr (``label``
    is rich markup, ``message`` plain text), then exit ``code``, no traceback.

    Example::

        fail(f"--backend: {e}", code=2)
    """
    (err or err_console).print(f"[bold red]error[/] {label}{plain(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def count(n: int, noun: str) -> str:
    """``1 pool``, ``2 pools``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def print_problems(problems: list[GraphProblem], warnings: list[GraphProblem]) -> None:
    """A graph's errors and warnings, one line each, on stderr."""
    for p in problems:
        err_console.print(f"[bold red]error[/] [red]\\[{p.title}][/] {plain(str(p))}")
    for w in warnings:
        err_console.print(f"[yellow]warning[/] [yellow]\\[{w.title}][/] {plain(str(w))}")


def load(ref: str, overrides: dict[str, Any] | None = None):
    """The graph ``ref`` names, or its problems printed and exit 1."""
    from flowrl.graph import GraphError, load_graph

    try:
        return load_graph(ref, overrides=overrides)
    except GraphError as e:
        print_problems(e.problems, e.warnings)
        raise typer.Exit(1) from None


def load_checked(ref: str, set_: list[str] | None, more: dict[str, Any] | None = None):
    """A graph that passed every check (else its problems are printed and the command exits 1);
    ``more``: overrides set by other options than ``--set``."""
    g = load(ref, {**parse_overrides(set_), **(more or {})})
    report = g.check()
    if not report.ok:
        print_problems(report.errors, report.warnings)
        raise typer.Exit(1)
    return g


__all__ = ["ANSI", "console", "count", "err_console", "escape", "fail", "load", "load_checked", "make_console",
           "parse_overrides", "plain", "print_problems", "show"]
