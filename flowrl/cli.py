"""The ``flowrl`` command: validate, viz, plan, run, ops.

Every command takes a graph: a YAML file, a Python file defining one graph, a
``module:graph`` import path, or the name of a built-in graph (``grpo``).
Bad input never prints a Python traceback: it prints what is wrong and where,
and exits 1 (2 for command-line usage errors). Off a terminal (a pipe, a log
file) nothing is wrapped and no colour codes are written.

Only what a command needs is imported, when it needs it (hence the imports inside
the commands): ``--help`` imports typer and rich alone, no graph code, and
``validate``/``viz``/``plan``/``ops`` no Ray (``benchmarks/cli.py``).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from enum import Enum
from typing import TYPE_CHECKING, Any, NoReturn, Optional

import typer
from rich.console import Console

from flowrl import cli_debug
from flowrl.runtime.ray_start import exit_now, prestart

if TYPE_CHECKING:
    from flowrl.graph.checks import GraphProblem

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="flowrl: RL for language models as a declarative dataflow graph.",
    pretty_exceptions_enable=False,
)


def _make_console(stderr: bool = False) -> Console:
    """A console that wraps and colours only on a terminal: piped text stays one line per message."""
    c = Console(stderr=stderr)
    return c if c.is_terminal else Console(stderr=stderr, soft_wrap=True, no_color=True, highlight=False)


console = _make_console()
err_console = _make_console(stderr=True)


class VizFormat(str, Enum):
    text = "text"
    mermaid = "mermaid"
    dot = "dot"
    json = "json"


parse_overrides = cli_debug.parse_overrides  # flowrl replay takes --set too

#: the fault switch's environment variable: an alias of ``flowrl run --fault``, read by that command
#: alone, once (the runtime reads no environment; the switch is the graph's ``trainer.fault``)
FAULT_ENV = "FLOWRL_FAULT"


def _count(n: int, noun: str) -> str:
    """``1 pool``, ``2 pools``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _print_problems(problems: list[GraphProblem], warnings: list[GraphProblem]) -> None:
    for p in problems:
        err_console.print(f"[bold red]error[/] [red]\\[{p.title}][/] {_escape(str(p))}")
    for w in warnings:
        err_console.print(f"[yellow]warning[/] [yellow]\\[{w.title}][/] {_escape(str(w))}")


_escape = cli_debug.plain


def fail(message: str, code: int = 1, label: str = "") -> NoReturn:
    """One error line on the command's stderr console, then exit ``code`` (:func:`flowrl.cli_debug.fail`)."""
    cli_debug.fail(message, code, err_console, label)


def _load(ref: str, overrides: dict[str, Any] | None = None):
    from flowrl.graph import GraphError, load_graph

    try:
        return load_graph(ref, overrides=overrides)
    except GraphError as e:
        _print_problems(e.problems, e.warnings)
        raise typer.Exit(1) from None


def _load_checked(ref: str, set_: list[str] | None, more: dict[str, Any] | None = None):
    """A graph that passed every check (else its problems are printed and the command exits 1);
    ``more``: overrides set by other options than ``--set``."""
    g = _load(ref, {**parse_overrides(set_), **(more or {})})
    report = g.check()
    if not report.ok:
        _print_problems(report.errors, report.warnings)
        raise typer.Exit(1)
    return g


@app.command()
def validate(
    graph: str = typer.Argument(..., help="graph: file.yaml, file.py, module:graph, or a built-in name"),
    set_: Optional[list[str]] = typer.Option(None, "--set", help="override a key: path.to.key=value"),
    backend: str = typer.Option("ray", "--backend", help="plan for this backend: ray (default) or local"),
) -> None:
    """Check a graph as the run would, without running a step; exit 1 on any error.

    It imports the Python modules the graph names (imports:, op: mod:fn, a reward fn:),
    opens its dataset file and reads its model's config: a graph file is code.
    """
    g = _load(graph, parse_overrides(set_))
    report = g.check()
    _print_problems(report.errors, report.warnings)
    if report.ok:
        # what only placement can tell: row spaces that do not match, more micro-batches than prompts,
        # a data-parallel node with fewer rows than ranks: the plan the run would make
        _plan(g, backend, "[red]\\[plan][/] ")
    if not report.ok:
        n = len(report.errors)
        err_console.print(f"[bold red]{g.name}: {n} error{'s' if n != 1 else ''}[/]")
        raise typer.Exit(1)
    console.print(
        f"[bold green]ok[/] {g.name}: {_count(len(g.nodes), 'node')}, {_count(g.dag.number_of_edges(), 'edge')}, "
        f"{_count(len(g.config.pools), 'pool')}, {_count(len(report.warnings), 'warning')}"
    )


@app.command()
def viz(
    graph: str = typer.Argument(..., help="graph: file.yaml, file.py, module:graph, or a built-in name"),
    format: VizFormat = typer.Option(VizFormat.text, "--format", "-f", help="text, mermaid, dot or json"),
    compact: bool = typer.Option(False, "--compact", help="one line per node"),
    width: Optional[int] = typer.Option(None, "--width", help="terminal width to lay out for"),
) -> None:
    """Draw the graph: in the terminal, or as Mermaid / Graphviz / JSON (imports the modules it names)."""
    from visualizer import export
    from visualizer.dag import print_dag

    g = _load(graph)
    if format is VizFormat.text:
        print_dag(g, console=Console(width=width) if width else console, compact=compact)
    elif format is VizFormat.mermaid:
        sys.stdout.write(export.to_mermaid(g) + "\n")
    elif format is VizFormat.dot:
        sys.stdout.write(export.to_dot(g) + "\n")
    else:
        sys.stdout.write(json.dumps(export.to_json(g), indent=2) + "\n")


@app.command()
def plan(
    graph: str = typer.Argument(..., help="graph: file.yaml, file.py, module:graph, or a built-in name"),
    set_: Optional[list[str]] = typer.Option(None, "--set", help="override a key: path.to.key=value"),
    measured: Optional[str] = typer.Option(None, "--measured",
                                           help="a run directory: predict with its measured node times"),
    backend: str = typer.Option("ray", "--backend", help="plan for this backend: ray (default) or local"),
    search: bool = typer.Option(False, "--search", help="rank the configurations that fit a budget (needs "
                                "--costs and --cpus): pools, workers, micro-batches, staleness"),
    costs: Optional[str] = typer.Option(None, "--costs", help="a cost file written by `flowrl profile`"),
    cpus: Optional[float] = typer.Option(None, "--cpus", help="CPU cores per node the search may use"),
    gpus: int = typer.Option(0, "--gpus", min=0, help="GPUs per node the search may use"),
    nodes: int = typer.Option(1, "--nodes", min=1, help="nodes of that size"),
    memory_per_device: Optional[float] = typer.Option(None, "--memory-per-device", min=0,
                                                      help="GiB a worker's device may hold"),
    max_staleness: Optional[int] = typer.Option(
        None, "--max-staleness", min=0,
        help="let the search try schedule.staleness 0..S (changes the algorithm; default: the graph's own)"),
    write: Optional[str] = typer.Option(None, "--write", help="write the graph with the best configuration here"),
) -> None:
    """Show placement, per-pool order, micro-batching, staleness and a predicted timeline."""
    from visualizer.plan import print_plan

    g = _load_checked(graph, set_)
    if search:
        from flowrl.cli_plan import search_command

        search_command(graph, g, parse_overrides(set_), costs_path=costs, cpus=cpus, gpus=gpus, nodes=nodes,
                       memory_gib=memory_per_device, max_staleness=max_staleness, write=write, backend=backend,
                       console=console, err=err_console)
        return
    p = _plan(g, backend)
    costs = None
    if measured is not None:
        costs = measured_costs(measured, list(g.nodes))
    print_plan(p, console=console, costs=costs)


def _plan(g, backend: str, label: str = ""):
    """The plan the run on ``backend`` would make (what ``run`` calls too), or exit 1 naming why not."""
    from flowrl.plan.planner import PlanError, make_plan
    from flowrl.plan.traits import traits_of

    try:
        traits = traits_of(backend)
    except ValueError as e:
        fail(f"--backend: {e}", 2)
    try:
        return make_plan(g, traits)
    except PlanError as e:
        fail(str(e), 1, label)


def measured_costs(run_dir: str, nodes: list[str]) -> dict[str, float]:
    """Each node's measured seconds per step over a run's metrics.jsonl (:func:`~flowrl.plan.costfit.node_seconds`)."""
    from flowrl.plan.costfit import node_seconds

    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        fail(f"--measured: no metrics at {path}")
    from flowrl.store.sinks import MetricsFileError, read_metrics

    def warn(msg: str) -> None:
        err_console.print(f"[yellow]warning[/] {_escape(msg)}")

    try:
        rows = [row for _, row in read_metrics(path, warn=warn)]
    except MetricsFileError as e:
        fail(f"--measured: {e}")
    costs = node_seconds(rows, nodes)
    missing = [n for n in nodes if n not in costs]
    if missing:
        err_console.print(f"[yellow]warning[/] no measured time for {', '.join(missing)}; using declared costs")
    return costs


@app.command()
def profile(
    graph: str = typer.Argument(..., help="a graph to run briefly, or a run directory to fit from"),
    steps: int = typer.Option(6, "--steps", min=3, help="steps per profiling run (the first two warm up)"),
    out: Optional[str] = typer.Option(None, "--out", help="run directory (default: trainer.out)"),
    set_: Optional[list[str]] = typer.Option(None, "--set", help="override a key: path.to.key=value"),
    backend: str = typer.Option("ray", "--backend", help="a registered backend: ray (default) or local"),
) -> None:
    """Measure a graph's costs (seconds per node by rows, weight transfer, memory per role) into costs.json."""
    from flowrl.cli_plan import profile_command

    path = profile_command(graph, steps, out, parse_overrides(set_), backend, say=console.print, err=err_console)
    console.print(f"[green]costs[/] in {path}: search with `flowrl plan GRAPH --search --costs {path} --cpus N`")


@app.command()
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
    g = _load_checked(graph, set_, {"trainer.fault": fault} if fault else None)
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
        err_console.print(f"[bold red]run failed[/] {_escape(str(e))}")
        exit_now(1)
        raise typer.Exit(1) from None
    total = steps if steps is not None else g.config.trainer.steps
    trainer = None
    try:
        with LiveView(g, total_steps=total, console=console) as view:
            trainer = Trainer(g, backend=backend, steps=steps, out=out, address=address, trace=trace,
                              on_step=view.step, on_progress=view.progress, resume=resume, say=view.say,
                              overwrite=overwrite, history_limit=0, show_startup=verbose,
                              allow_data_change=allow_data_change)
            view.placement = dict(trainer.runtime.plan.moved)
            view.say(f"{g.name}: {total} steps on the {backend} backend → {trainer.out}")
            trainer.run()
    except RuntimeFailure as e:
        err_console.print(f"[bold red]run failed[/] {_escape(str(e))}")
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


@app.command()
def export(
    run_dir: str = typer.Argument(..., help="a run directory (trainer.out) holding checkpoints/"),
    out_dir: str = typer.Argument(..., help="where to write the Hugging Face model directory"),
    step: Optional[int] = typer.Option(None, "--step", help="the checkpoint after K steps (default: the newest)"),
    role: str = typer.Option("actor", "--role", help="which role's weights to export"),
) -> None:
    """Write a Hugging Face model directory (config, safetensors, tokenizer) from a run's checkpoint."""
    from flowrl.store.checkpoint import CheckpointError, CheckpointStore
    from operators.models.export import ExportError, export_hf, role_head
    from operators.models.hf import hf

    hf("utils").logging.disable_progress_bar()  # transformers' "Writing model shards" bars: one line says it
    try:
        state, meta, where = CheckpointStore.of_run(run_dir).read_role(role, step)
        path = export_hf(state["model"], meta["graph"], out_dir, role=role, where=where)
    except (CheckpointError, ExportError, OSError, ValueError) as e:
        fail(str(e))
    head = role_head(meta["graph"].get("roles") or {}, role)
    how = ("AutoModelForCausalLM.from_pretrained" if head == "causal_lm"
           else f"operators.models.load_model(path, head={head!r})")
    console.print(f"[green]exported[/] {role} to {path} (load it with {how})")


@app.callback(invoke_without_command=True)
def main_options(
    ctx: typer.Context,
    version: bool = typer.Option(False, "--version", help="print flowrl's version and exit"),
) -> None:
    """flowrl: RL for language models as a declarative dataflow graph."""
    if version:
        from flowrl import __version__

        console.print(f"flowrl {__version__}")
        raise typer.Exit(0)
    if ctx.invoked_subcommand is None:
        console.print(ctx.get_help())
        raise typer.Exit(0)


@app.command()
def ops(
    name: Optional[str] = typer.Argument(None, help="one operator to describe (e.g. advantage.grpo)"),
) -> None:
    """List the registered operators, or describe one: its fields, role, scope and parameters."""
    from rich.table import Table

    from flowrl.graph import REGISTRY

    REGISTRY.load_plugins()
    if name is not None:
        _describe_op(name)
        return
    rows = []
    for name in sorted(REGISTRY.operators):
        op = REGISTRY.operators[name]
        params = [f"{n}={d}," for n, _, d, _ in op.param_table()]
        rows.append([[name], [op.role or "-"], [op.scope], [f"{x}," for x in op.input_names],
                     [f"{x}," for x in op.output_names], params])
    header = ("operator", "role", "scope", "reads", "writes", "parameters")
    # every column at least as wide as its longest word, so wrapping never splits one
    widths = [max([len(header[i])] + [len(w) for r in rows for w in r[i]]) for i in range(len(header))]
    if sum(widths) + 3 * len(widths) + 1 <= console.width:
        table = Table(title="operators", show_lines=False)
        for col, w in zip(header, widths):
            table.add_column(col, min_width=w, style="bold" if col == "operator" else None)
        for r in rows:
            table.add_row(*(" ".join(words).rstrip(",") for words in r))
        console.print(table)
        return
    for r in rows:  # too narrow for the table: one block per operator, wrapped at spaces
        console.print(f"[bold]{r[0][0]}[/]  role {r[1][0]}, scope {r[2][0]}")
        for label, words in (("reads", r[3]), ("writes", r[4]), ("parameters", r[5])):
            if words:
                console.print(f"  {label}: " + _escape(" ".join(words).rstrip(",")))


def _describe_op(name: str) -> None:
    from rich.table import Table

    from flowrl.graph.registry import REGISTRY, ImportPathError, UnknownNameError

    try:
        op = REGISTRY.operator(name)
    except (UnknownNameError, ImportPathError) as e:
        fail(str(e))
    console.print(f"[bold]{op.name}[/]  (node name {op.default_node_name()!r}, defined in {op.module})")
    if op.doc:
        console.print(_escape(op.doc))
    role = f"role {op.role!r} (kinds: {', '.join(op.role_kinds)})" if op.role else "no role (runs on the driver)"
    extras = [f"scope {op.scope}", f"dispatch {op.dispatch}", role]
    if op.updates_role:
        extras.append("updates its role")
    if op.expands:
        extras.append(f"each input row becomes {op.expands!r} rows")
    if op.balance_by:
        extras.append(f"data parallel: rows balanced by the real tokens of {op.balance_by}")
    if op.group_key:
        extras.append(f"a group is the rows of one {op.group_key}")
    console.print("  ".join(extras))
    fields = Table(box=None, show_header=True, header_style="bold")
    for col in ("", "field", "spec", "note"):
        fields.add_column(col)
    for f in op.inputs:
        fields.add_row("reads", f.name, f.spec, "optional" if f.name in op.optional_inputs else "")
    for f in op.outputs:
        fields.add_row("writes", f.name, f.spec, "auxiliary" if f.name in op.aux_outputs else "")
    console.print(fields)
    params = Table(box=None, show_header=True, header_style="bold")
    for col in ("parameter", "type", "default", "description"):
        params.add_column(col, overflow="fold")
    for row in op.param_table():
        params.add_row(*(_escape(x) for x in row))
    console.print(params if op.params.model_fields else "no parameters")


app.command("diff")(cli_debug.diff)
app.command("replay")(cli_debug.replay)


def main() -> None:  # pragma: no cover - console entry point
    app()


if __name__ == "__main__":  # pragma: no cover
    main()


__all__ = ["app", "main", "parse_overrides"]
