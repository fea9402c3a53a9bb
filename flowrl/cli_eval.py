"""``flowrl eval``: a policy's greedy pass@1 and sampled pass@k on a graph's held-out prompts.
Registered on the ``flowrl`` app by :mod:`flowrl.cli`; the scoring is
:func:`operators.evaluate.evaluate` (docs/evaluation.md says what the numbers mean).

Example::

    flowrl eval runs/grpo_smollm2                      # the newest checkpoint's actor
    flowrl eval runs/grpo_smollm2 --checkpoint 20 -k 8 --temperature 1.0 --json
    flowrl eval graphs/grpo_smollm2.yaml --base        # the graph's model as it starts
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from flowrl.cli_io import console, err_console, fail, parse_overrides, plain, show


def eval_(
    target: str = typer.Argument(..., help="a run directory (trainer.out) with checkpoints, or with --base a "
                                 "graph: file.yaml, file.py, module:graph, or a built-in name"),
    base: bool = typer.Option(False, "--base", help="evaluate the graph's model as it starts (no checkpoint)"),
    checkpoint: Optional[int] = typer.Option(None, "--checkpoint", min=1,
                                             help="the checkpoint after K steps (default: the newest)"),
    k: int = typer.Option(0, "-k", "--k", min=0, help="samples per prompt for pass@k (0: greedy pass@1 only)"),
    temperature: float = typer.Option(1.0, "--temperature",
                                      help="the temperature of the k samples (> 0)"),
    max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens", min=1,
                                                 help="default: the graph's generate node's"),
    prompts: Optional[int] = typer.Option(None, "--prompts", min=1,
                                          help="held-out prompts to score (default: data.val_size)"),
    batch_size: int = typer.Option(32, "--batch-size", min=1, help="prompts generated at once"),
    role: str = typer.Option("actor", "--role", help="the role whose policy answers"),
    seed: int = typer.Option(0, "--seed", help="the sampling seed of pass@k"),
    set_: Optional[list[str]] = typer.Option(None, "--set", help="with --base: override a key of the graph"),
    as_json: bool = typer.Option(False, "--json", help="print the scores as JSON"),
) -> None:
    """Score a run's policy (or with --base a graph's base model) on the graph's held-out prompts: greedy
    pass@1 and, with -k, pass@k and mean@k of k samples. Exit 1 on what cannot be evaluated."""
    from flowrl.errors import FlowrlError

    err = err_console
    if set_ and not base:
        fail("--set changes the graph of --base; a run is evaluated on its own graph (use --prompts, -k, "
             "--max-new-tokens)", 2, err)
    try:
        graph, weights, origin = _base(target, set_, err) if base else _checkpoint(target, checkpoint, role)
        # torch and transformers: only once a policy is scored
        from flowrl.store.runlog import quiet_known_warnings
        from operators.evaluate import evaluate
        from operators.models.hf import hf

        quiet_known_warnings()  # transformers' deprecation notes, once per generated token
        hf("utils").logging.disable_progress_bar()  # "Loading weights" bars: the table says what was loaded
        result = evaluate(graph, weights, role=role, k=k, temperature=temperature, max_new_tokens=max_new_tokens,
                          batch_size=batch_size, seed=seed, size=prompts, where=origin)
    except (FlowrlError, OSError) as e:
        fail(str(e), 1, err)
    report = {"target": target, "policy": origin, "graph": graph.name, **result.as_dict()}
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        show(console, _table(report))  # off a terminal, every cell whole


def _base(target: str, set_: list[str] | None, err: Console) -> tuple[Any, None, str]:
    from flowrl.graph import GraphError, load_graph

    if Path(target).is_dir():
        fail(f"{target} is a directory; --base takes a graph (file.yaml, file.py, module:graph or a built-in "
             f"name); to evaluate a run's checkpoint leave --base out", 2, err)
    try:
        graph = load_graph(target, overrides=parse_overrides(set_))
    except GraphError as e:
        fail("; ".join(str(p) for p in e.problems) or str(e), 1, err)
    report = graph.check()
    if not report.ok:
        fail("; ".join(str(p) for p in report.errors), 1, err)
    return graph, None, "the base model"


def _checkpoint(target: str, step: int | None, role: str) -> tuple[Any, Any, str]:
    from flowrl.graph import Graph
    from flowrl.graph.config import GraphConfig
    from flowrl.store.checkpoint import CheckpointError, CheckpointStore

    if not Path(target).is_dir():
        raise CheckpointError(f"{target} is no run directory; pass a run's trainer.out, or a graph with --base "
                              f"to evaluate its base model")
    state, meta, path = CheckpointStore.of_run(target).read_role(role, step)
    graph = Graph.from_config(GraphConfig.model_validate(meta["graph"]))
    return graph, state["model"], str(path)


def _table(report: dict[str, Any]) -> Table:
    table = Table(title=f"{plain(report['graph'])}: {plain(report['policy'])}", show_header=True,
                  header_style="bold")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("held-out prompts", str(report["prompts"]))
    table.add_row(f"pass@1 (greedy, {report['max_new_tokens']} tokens)", f"{report['pass_at_1']:.3f}")
    table.add_row("mean reward (greedy)", f"{report['score']:.3f}")
    if report["k"]:
        table.add_row(f"pass@{report['k']} (T={report['temperature']:g})", f"{report['pass_at_k']:.3f}")
        table.add_row(f"mean@{report['k']} (sampled pass@1)", f"{report['mean_at_k']:.3f}")
    if report["formatted"] is not None:
        table.add_row("answer read (greedy)", f"{report['formatted']:.3f}")
    return table


__all__ = ["eval_"]
