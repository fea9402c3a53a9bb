"""``flowrl profile`` and ``flowrl plan --search``: costs measured from a run, configurations searched.

``flowrl profile GRAPH --steps K`` runs the graph briefly (then once more with
the micro-batch count the search tries that is farthest from the graph's, so a
node's fixed cost per task is told from its cost per row over every row count
the search predicts, both again on twice the workers where the machine has the
cores, so data parallelism is measured rather than assumed, and the first run
once more, for the machine's drift) and writes ``costs.json`` into the run directory; ``flowrl profile
RUN_DIR`` fits one from a run that already happened (its ``trace.json`` when
written with ``--trace``, else the ``timing/<node>`` of its ``metrics.jsonl``).
``flowrl plan GRAPH --search --costs FILE --cpus N`` ranks the configurations
:mod:`flowrl.plan.search` finds and ``--write`` saves the best as a graph file.

The ``flowrl`` command (:mod:`flowrl.cli`) imports this module only when one of
these runs: profiling imports the models (to read their configs) and Ray.
"""

from __future__ import annotations

import io
import json
import math
import os
import time
from pathlib import Path
from typing import Any, Callable

import torch
import yaml
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from flowrl.cli_io import fail, show
from flowrl.data.metrics import step_seconds
from flowrl.graph import Graph, GraphError, load_graph
from flowrl.plan.costfit import (calibrated, cores_for, fit_line, median_or_zero, metric_samples, node_samples,
                                    residuals, step_intervals, world_factors)
from flowrl.plan.costs import (COST_FILE, GIB, WARMUP, CostFile, CostFileError, NodeCost, Record, RoleMemory,
                                  Transfer, graph_key, load_costs, records_of, save_costs, task_records)
from flowrl.errors import ConfigError, RuntimeFailure
from flowrl.plan.planner import Plan, PlanError, make_plan
from flowrl.plan.search import ASSUMPTIONS, MICRO_BATCHES, Budget, SearchError, SearchResult, describe, search, why
from flowrl.store.sinks import MetricsFileError, read_metrics
from flowrl.run.trainer import Trainer
from flowrl.plan.traits import traits_of
from operators.models import load_model

#: bytes a training pass keeps per token per layer per hidden unit (fp32 activations saved for backward:
#: attention and MLP inputs/outputs; a coarse estimate, said in the cost file's roles)
ACTIVATION_FACTOR = 16


class CommandError(ConfigError):
    """What the command prints as one error line before exiting 1."""


# ---------------------------------------------------------------- profile
def role_memory(graph: Graph) -> dict[str, RoleMemory]:
    """Each role's memory from its model's config: weights, optimizer, activations and KV per token."""
    cfg, out = graph.config, {}
    updated = {n.role for n in graph.nodes.values() if n.updates_role}
    for name, role in cfg.roles.items():
        src = role
        while "model" not in src.settings and src.from_ in cfg.roles:
            src = cfg.roles[src.from_]
        spec = src.settings.get("model")
        if not isinstance(spec, str):
            continue
        model, _ = load_model(spec)  # the causal LM: a value head differs by one layer's parameters
        c = model.config.get_text_config()  # a vision-language model's decoder holds the layers and the KV
        layers, hidden = c.num_hidden_layers, c.hidden_size
        heads = c.num_attention_heads
        kv = getattr(c, "num_key_value_heads", None) or heads
        params = sum(p.numel() for p in model.parameters())
        out[name] = RoleMemory(params=params, bytes_per_param=4, trainable=name in updated,
                               activation_bytes_per_token=ACTIVATION_FACTOR * 4 * layers * hidden,
                               kv_bytes_per_token=2 * layers * kv * (hidden // heads) * 4)
    return out


def measure_transfer(sizes: tuple[int, ...] = (1 << 18, 1 << 21, 1 << 23)) -> Transfer:
    """Seconds to move a tensor of each size through a serialise/deserialise copy (the object store's
    path, without Ray), fitted as fixed + per byte."""
    samples = []
    for n in sizes:
        t = torch.zeros(n // 4)
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            buf = io.BytesIO()
            torch.save(t, buf)
            buf.seek(0)
            torch.load(buf, weights_only=True)
            best = min(best, time.perf_counter() - t0)
        samples.append((float(n), best))
    line = fit_line(samples)
    return Transfer(fixed_s=line.fixed_s, per_byte_s=line.per_row_s, how="torch.save/load round trip in one process")


def fit_runs(runs: list[tuple[Plan, list[Record], list[dict[str, Any]]]], graph: Graph, source: str,
             transfer: Transfer, cpus: float | None = None, drift: bool = False) -> CostFile:
    """A cost file from one or more runs of ``graph`` (each: its plan, task records, metric rows) on a
    machine of ``cpus`` cores (default: this one's). The runs with the first run's worker counts fit
    each node's line on the seconds its tasks would have taken with a core each; the runs on other worker
    counts (pooled where they have the same ones) give each node's factor against its line there, and its
    line there from two row counts (:func:`~flowrl.plan.costfit.world_factors`); then the per-task
    latency and per-step overhead the runs' step intervals hold beyond their tasks.

    ``drift``: the last run repeats the first, so how much slower (or faster) the machine got while
    profiling is measured; each run's seconds are divided by that drift, taken as growing evenly from
    the first run to the last (on a shared machine the neighbours' load moves between runs, and the
    runs' differences would otherwise be read as the costs of what they vary)."""
    cpus = float(cpus or os.cpu_count() or 1)

    def interval(records: list[Record], rows: list[dict[str, Any]]) -> float:
        return median_or_zero(step_intervals(records)) if records else median_or_zero(
            [step_seconds(r) or 0.0 for r in rows[WARMUP:]])

    first, last = interval(*runs[0][1:]), interval(*runs[-1][1:])
    ratio = last / first if drift and len(runs) > 1 and first > 0 and last > 0 else 1.0
    slow = [1 + (ratio - 1) * i / max(1, len(runs) - 1) for i in range(len(runs))]

    def workers(plan: Plan) -> dict[str, int]:
        return {n: plan.node_tasks(n)[0].world for n in plan.graph.nodes}

    def samples_of(i: int) -> dict[str, list]:
        plan, records, rows = runs[i]
        xs = node_samples(plan, records, cpus=cores_for(plan, cpus)) if records else metric_samples(plan, rows)
        return {node: [(r, sec / slow[i]) for r, sec in v] for node, v in xs.items()}

    base = workers(runs[0][0])
    samples: dict[str, list[tuple]] = {}
    for i, (plan, _, _) in enumerate(runs):
        if workers(plan) == base:
            for node, xs in samples_of(i).items():
                samples.setdefault(node, []).extend(xs)
    nodes = {n: fit_line(samples[n]) if n in samples else NodeCost(fit="fixed") for n in graph.nodes}
    for n, line in nodes.items():
        line.residual = residuals(line, samples.get(n, []))
    wider: dict[str, tuple[Plan, dict[str, list]]] = {}  # runs on the same other worker counts: pooled
    for i, (plan, _, _) in enumerate(runs):
        if workers(plan) != base:
            _, pooled = wider.setdefault(json.dumps(workers(plan), sort_keys=True), (plan, {}))
            for node, xs in samples_of(i).items():
                pooled.setdefault(node, []).extend(xs)
    for plan, pooled in wider.values():
        world_factors(nodes, plan, pooled, base)
    longest = tokens.max if (tokens := graph.token_metrics()) is not None else None  # as the generator declares
    lengths = [r[longest] for _, _, rows in runs for r in rows if longest in r]
    pools = [{p: c.workers for p, c in plan.graph.config.pools.items()} for plan, _, _ in runs]
    costs = CostFile(graph=graph.name, key=graph_key(graph), source=source, nodes=nodes, transfer=transfer,
                     roles=role_memory(graph), tokens_per_row=max(lengths, default=0.0),
                     measured_with={"workers": pools[0], "runs": [{"workers": w, "micro_batches": plan.micro_batches}
                                                                  for w, (plan, _, _) in zip(pools, runs)],
                                    "cpus": cpus, "steps": max((len(rows) for *_, rows in runs), default=0),
                                    "drift": ratio})
    measured = [(plan, interval(records, rows) / slow[i]) for i, (plan, records, rows) in enumerate(runs)]
    return calibrated(costs, measured, cores_for(runs[0][0], cpus))


def fit_report(costs: CostFile) -> list[str]:
    """What a profile fitted, a line per node (its line, how far from its samples) and the overheads."""
    out = [f"{n}: {c.fixed_s * 1e3:.1f} ms + {c.per_row_s * 1e3:.3f} ms/row ({c.fit}, {c.samples} tasks, median "
           f"residual {c.residual:.0%})" + "".join(
               f", ×{f:.2f} on {w} workers" + (f" ({c.world_line[w][0] * 1e3:.1f} ms + {c.world_line[w][1] * 1e3:.3f} "
                                               f"ms/row)" if w in c.world_line else "")
               for w, f in c.world_factor.items())
           for n, c in costs.nodes.items()]
    drift = costs.measured_with.get("drift", 1.0)
    return out + [f"task latency {costs.task_latency_s * 1e3:.1f} ms, driver work per step "
                  f"{costs.step_overhead_s * 1e3:.1f} ms; the machine ran {drift:.2f}x as slow at the end of "
                  f"profiling as at its start (each run's seconds divided by its share of that)"]


def read_run(run_dir: Path, traits: Any, warn: Callable[[str], None]) -> tuple[Graph, Plan, list[Record], list[dict]]:
    """A finished run's graph (its ``config.yaml``), plan, task records (``trace.json``) and metric rows."""
    config, metrics = run_dir / "config.yaml", run_dir / "metrics.jsonl"
    if not config.is_file() or not metrics.is_file():
        raise CommandError(f"{run_dir} is not a run directory: it has no config.yaml and metrics.jsonl "
                           f"(give a graph to profile, or the directory a run wrote)")
    graph = load_graph(config)
    rows = [row for _, row in read_metrics(metrics, warn=warn)]
    trace = run_dir / "trace.json"
    records = task_records(json.loads(trace.read_text())) if trace.is_file() else []
    return graph, make_plan(graph, traits), records, rows


def farthest_micro_batches(k: int, prompts: int, workers: int = 1) -> int | None:
    """The micro-batch count the search tries that is farthest (by ratio) from the graph's ``k`` and gives
    each of a pool's ``workers`` ranks a prompt of each of its ``prompts``' micro-batches: profiled too,
    the fitted lines span every row count the search predicts (a line from ``k`` and ``2k`` predicted
    grpo_tools' generate of 8 micro-batches 37% short)."""
    others = [m for m in MICRO_BATCHES if m * workers <= prompts and m != k]
    return max(others, key=lambda m: (abs(math.log(m / k)), m)) if others else None


def wider_variant(graph: Graph, ref: str, base: dict[str, Any]) -> dict[str, Any] | None:
    """Overrides that run every node on more workers than the graph has, within this machine's cores, so
    data parallelism is measured rather than assumed: twice every pool's workers where the cores allow;
    else every role in one pool of as many workers as the cores allow (where the checker takes it)."""
    pools, cores = graph.config.pools, os.cpu_count() or 1
    if sum(2 * p.workers * p.cpus for p in pools.values()) <= cores:
        return {f"pools.{n}.workers": 2 * p.workers for n, p in pools.items()}
    first, spec = next(iter(pools.items()))
    workers = int(cores // max(spec.cpus, 1e-9))
    if workers <= max(p.workers for p in pools.values()):
        return None
    section = {first: {**spec.model_dump(), "roles": [r for p in pools.values() for r in p.roles], "workers": workers}}
    try:
        ok = load_graph(ref, overrides={**base, "pools": section}).check().ok
    except GraphError:
        ok = False
    return {"pools": section} if ok else None


def profile_command(ref: str, steps: int, out: str | None, overrides: dict[str, Any], backend: str,
                    say: Callable[[str], None], err: Console) -> Path:
    """``flowrl profile``: fit (and, for a graph, first measure) a cost file; returns its path."""
    traits = traits_of(backend)
    try:
        if Path(ref).is_dir():
            graph, plan, records, rows = read_run(Path(ref), traits, say)
            costs = fit_runs([(plan, records, rows)], graph, str(ref), measure_transfer())
            for line in fit_report(costs):
                say(line)
            return save_costs(costs, Path(ref) / COST_FILE)
        base = {"trainer.val_every": 0, "trainer.checkpoint_every": 0, **overrides}
        graph = load_graph(ref, overrides=base)
        if not graph.check().ok:
            raise CommandError(f"{ref}: the graph has errors; run `flowrl validate {ref}` to see them")
        k = graph.config.schedule.micro_batches
        far = farthest_micro_batches(k, graph.config.data.batch_size,
                                     max(p.workers for p in graph.config.pools.values()))
        counts = [k] if far is None else [k, far]
        variants: list[dict[str, Any]] = [{"schedule.micro_batches": m} for m in counts]
        wider = wider_variant(graph, ref, base)
        if wider is not None:
            most = max(p.workers for p in load_graph(ref, overrides={**base, **wider}).config.pools.values())
            far = farthest_micro_batches(k, graph.config.data.batch_size, most)
            variants += [{"schedule.micro_batches": m, **wider} for m in ([k] if far is None else [k, far])]
        if len(variants) > 1:  # the first again: how far the machine's speed drifted while profiling
            variants.append(dict(variants[0]))
        home = Path(out or graph.config.trainer.out or f"runs/{graph.name}")
        target = home / "profile"
        runs = []
        for i, variant in enumerate(variants):
            g = load_graph(ref, overrides={**base, **variant})
            where = target / f"run_{i}"
            say(f"profiling {graph.name}: {steps} steps with {', '.join(f'{a}={b}' for a, b in variant.items())} "
                f"→ {where}")
            trainer = Trainer(g, backend=backend, steps=steps, out=where, trace=where / "trace.json",
                              overwrite=True, say=say, history_limit=steps)
            history = trainer.run()
            runs.append((trainer.runtime.plan, records_of(trainer.runtime.timeline.records), history))
        costs = fit_runs(runs, graph, str(target), measure_transfer(), drift=len(variants) > 1)
        for line in fit_report(costs):
            say(line)
        return save_costs(costs, home / COST_FILE)
    except (GraphError, PlanError, CommandError, MetricsFileError, RuntimeFailure, OSError) as e:
        msg = str(e.problems[0]) if isinstance(e, GraphError) and e.problems else str(e)
        fail(msg, 1, err)


# ---------------------------------------------------------------- search
def search_command(ref: str, graph: Graph, overrides: dict[str, Any], *, costs_path: str | None, cpus: float | None,
                   gpus: int, nodes: int, memory_gib: float | None, max_staleness: int | None, write: str | None,
                   backend: str, console: Console, err: Console, top: int = 10) -> SearchResult:
    """``flowrl plan --search``: rank the configurations, print them, write the best when asked."""
    if costs_path is None:
        fail(f"--search needs --costs FILE: measure one with `flowrl profile {ref}`", 1, err)
    if cpus is None:
        fail("--search needs --cpus N: the CPU cores the run may use", 1, err)
    try:
        costs = load_costs(Path(costs_path), graph)
        budget = Budget(cpus=cpus, gpus=gpus, nodes=nodes, max_staleness=max_staleness,
                        memory_per_device=memory_gib * GIB if memory_gib is not None else None)

        def build(extra: dict[str, Any]) -> Graph:
            return load_graph(ref, overrides={**overrides, **extra})

        machine = (float(os.cpu_count() or 1), torch.cuda.device_count())
        result = search(graph, build, costs, budget, traits_of(backend), machine=machine)
    except (CostFileError, SearchError) as e:
        fail(str(e), 1, err)
    print_search(result, console, top)
    if write is not None:
        tuned = build(result.best.overrides)
        Path(write).write_text(yaml.safe_dump(tuned.config.dump(), sort_keys=False))
        console.print(f"[green]wrote[/] {escape(write)}: run it with `flowrl run {escape(write)}`")
    return result


def _path_text(o: Any) -> str:
    names: list[str] = []
    for node, _ in o.critical:
        if not names or names[-1] != node:
            names.append(node)
    return " → ".join(names)


def print_search(result: SearchResult, console: Console, top: int) -> None:
    label = "predicted from extrapolated costs" if result.extrapolated else "predicted from measured costs"
    table = Table(title=f"plan search: {len(result.ranked)} configurations fit, {len(result.rejected)} rejected "
                        f"({label})", title_justify="left")
    for col in ("#", "configuration", "s/step", "vs shipped", "utilisation", "critical path", "memory/device"):
        table.add_column(col, justify="right" if col in ("#", "s/step", "vs shipped") else "left")
    base = result.shipped.step_s if result.shipped.ok else 0.0
    shown = result.ranked[:top]
    for i, o in enumerate(shown, 1):
        util = ", ".join(f"{p} {u:.0%}" for p, u in sorted(o.utilisation.items()))
        mem = ", ".join(f"{p} {b / GIB:.2f} GiB" for p, b in sorted(o.memory.items()))
        speed = f"{base / o.step_s:.2f}×" if base and o.step_s else "-"
        table.add_row(str(i), escape(describe(o)), f"{o.step_s:.3f}", speed, util, escape(_path_text(o)), mem)
    if result.shipped.ok:
        o = result.shipped
        table.add_row("shipped", "as given", f"{o.step_s:.3f}", "1.00×",
                      ", ".join(f"{p} {u:.0%}" for p, u in sorted(o.utilisation.items())), escape(_path_text(o)),
                      ", ".join(f"{p} {b / GIB:.2f} GiB" for p, b in sorted(o.memory.items())))
    show(console, table)  # piped: every configuration's full text, whatever the window
    console.print(f"[bold]best[/]: {escape(describe(result.best))}: {escape(why(result))}")
    if result.extrapolated:
        console.print("[yellow]these are predictions from extrapolated costs[/] (a budget beyond this machine or "
                      "worker counts beyond the profiled ones), assuming:")
        for a in ASSUMPTIONS:
            console.print(f"  - {escape(a)}")


__all__ = ["CommandError", "fit_report", "fit_runs", "wider_variant", "profile_command", "read_run", "role_memory",
           "search_command"]
