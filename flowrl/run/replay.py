"""``flowrl replay``: one step of a finished run rebuilt and run again from one node, with overrides.

Step S from node N: the nodes replayed are N and everything downstream of it
(in the graph with the overrides applied); every field they read from a node
upstream comes from the run's records (:mod:`flowrl.provenance.record`), the data
batch included. Weights, optimizer and operator state come from the newest
checkpoint at or before S (the one after S-1 steps, or an earlier one: the steps
between are rolled forward without overrides, from their records, through the
nodes that change the state the replay reads). Then the replayed nodes run step
S on the recorded inputs, and their metrics are compared with those the run
logged for S in ``metrics.jsonl``.

The replay runs in workers of its own (the run's pools and roles) and writes
only to a temporary directory: nothing of the run changes. What the records or
checkpoints do not cover is refused by a :class:`ReplayError` (or a
:class:`~flowrl.provenance.record.RecordError`) that names the file or node.

Example::

    report = replay_step(Path("runs/grpo"), 3, "advantage",
                         {"nodes.advantage.norm_adv_by_std_in_grpo": False}, backend="local")
    for row in report["metrics"]:
        print(row["metric"], row["run"], row["replay"])
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Callable

import networkx as nx

from flowrl.data import DataProto
from flowrl.data.expand import take_rows
from flowrl.data.fields import Field
from flowrl.data.metrics import measured
from flowrl.graph import SOURCE, Graph, GraphError, load_graph
from flowrl.graph.config import GraphConfig
from flowrl.runtime.backends import make_backend
from flowrl.store.checkpoint import CheckpointStore, UnreadableCheckpoint, differences, steps_done
from flowrl.store.dumps import graph_fields
from flowrl.errors import RuntimeFailure
from flowrl.plan.planner import Plan, make_plan
from flowrl.plan.reads import union_columns
from flowrl.provenance.record import Record, RecordError, read_record
from flowrl.recovery.recovery import Recovery
from flowrl.plan.rowspace import input_space
from flowrl.runtime.scheduler import Runtime
from flowrl.store.sinks import read_metrics
from flowrl.plan.traits import traits_of


class ReplayError(RuntimeFailure):
    """A replay that cannot be done as asked; the message names what is missing and where."""


def replayed_nodes(graph: Graph, start: str) -> set[str]:
    """``start`` and every node downstream of it."""
    return ({start} | nx.descendants(graph.dag, start)) - {SOURCE}


def rolled_nodes(graph: Graph, keep: set[str]) -> set[str]:
    """What a step before the replayed one runs again: ``keep``, and every update of a role that
    ``keep`` uses (with what follows it), so that the state the replay reads moves as in the run."""
    roles = {graph.nodes[n].role for n in keep if graph.nodes[n].role}
    out = set(keep)
    for name, node in graph.nodes.items():
        if node.updates_role and node.role and graph.roles_sharing_weights(node.role) & roles:
            out |= replayed_nodes(graph, name)
    return out


def external_inputs(graph: Graph, keep: set[str]) -> dict[str, list[str]]:
    """Producer (``data``: the data source) → the fields the nodes of ``keep`` read from it."""
    producers = graph.producers()
    out: dict[str, list[str]] = {}
    for name in sorted(keep):
        for f in graph.nodes[name].inputs:
            src = producers.get(f.name, [None])[0]
            if src is not None and src not in keep and f.name not in out.get(src, []):
                out.setdefault(src, []).append(f.name)
    return out


def replay_graph(graph: Graph, keep: set[str], fields: list[Field], rows: int) -> Graph:
    """``graph`` cut to the nodes of ``keep``, whose source batch (``rows`` rows) holds ``fields``:
    the recorded outputs of the nodes upstream."""

    class Recorded(Graph):
        def _resolve_source(self) -> None:  # the source is the record, not the data source
            self.source_fields = tuple(fields)

    dump = graph.config.dump()
    dump["nodes"] = {n: c for n, c in dump["nodes"].items() if n in keep}
    dump["data"] = {**dump["data"], "batch_size": rows}
    dump["trainer"] = {**dump["trainer"], "val_every": 0, "checkpoint_every": 0, "fingerprints": False,
                       "record": None, "fault": None}
    return Recorded.from_config(GraphConfig.model_validate(dump), source_file=graph.source_file)


def step_batch(record: Record, needs: dict[str, list[str]], plan: Plan, kinds: dict[str, str]) -> DataProto:
    """The source batch of a replayed step: each producer's recorded fields, the coarser row
    spaces repeated to the finest (as a consumer in the run read them)."""
    target = max(plan.spaces[p].factor for p in needs)
    parts = []
    for producer, names in needs.items():
        data = record.data.get(producer)
        missing = [n for n in names if data is None or (n not in data and n not in data.meta_info)]
        if missing:
            why = "; ".join(f"{n}: {record.skipped[producer][n]}" for n in missing
                            if n in record.skipped.get(producer, {}))
            raise RecordError(f"{record.path} holds no {', '.join(missing)} of node {producer!r}"
                              + (f" ({why})" if why else "") + f"; the replayed nodes read them: add {producer!r} "
                              "to trainer.record.nodes, or replay from a node further upstream")
        part = data.select(batch_keys=[n for n in names if kinds[n] == "tensor"],
                           non_tensor_batch_keys=[n for n in names if kinds[n] == "non_tensor"],
                           meta_info_keys=[n for n in names if kinds[n] == "meta"])
        parts.append(take_rows(part, None, target // plan.spaces[producer].factor))
    return union_columns(parts)


def _same_cuts(run: Plan, sub: Plan) -> None:
    """Refuse a replay whose tasks would read other rows than the run's tasks read."""
    for (node, mb) in sub.tasks:
        theirs = run.rows(input_space(run.graph, run.spaces, node), mb) if (node, mb) in run.tasks else None
        mine = sub.rows(input_space(sub.graph, sub.spaces, node), mb)
        if theirs != mine:
            raise ReplayError(f"node {node!r} would read rows {mine} of the replayed step where the run's read "
                              f"{theirs}: replay from a node after the expansion, or with the run's schedule")


class Replay:
    """One replay (see the module docstring); :meth:`run` returns the report."""

    def __init__(self, run: str | Path, step: int, start: str, overrides: dict[str, Any] | None = None,
                 backend: str = "ray", address: str | None = None, say: Callable[[str], None] = print) -> None:
        self.run_dir, self.step, self.start = Path(run), step, start
        self.overrides, self.backend, self.address, self.say = dict(overrides or {}), backend, address, say
        config = self.run_dir / "config.yaml"
        if not config.is_file():
            raise ReplayError(f"{config} does not exist: give the directory of a run (its trainer.out)")
        self.graph = _load(config, None)
        self.changed = _load(config, self.overrides)
        if start not in self.changed.nodes:
            raise ReplayError(f"--from {start!r}: no such node in {config} (nodes: {', '.join(self.changed.nodes)})")
        self.keep = replayed_nodes(self.changed, start)
        for d in differences(self.graph.config.dump(), self.changed.config.dump()):
            parts = d.split(".")
            if parts[0] == "data" or (parts[0] == "nodes" and parts[1] not in self.keep):
                raise ReplayError(f"--set {d}: replay from {start!r} takes that from the record; override only "
                                  f"the replayed nodes ({', '.join(sorted(self.keep))}), roles or schedule")
        self.logged = self._logged()

    def _logged(self) -> dict[str, Any]:
        path = self.run_dir / "metrics.jsonl"
        if not path.is_file():
            raise ReplayError(f"{path} does not exist: the run logged no metrics to compare with")
        rows = [row for _, row in read_metrics(path, warn=self.say)]
        row = next((r for r in rows if r.get("step") == self.step), None)
        if row is None:
            raise ReplayError(f"{path} has no step {self.step} (it logged {len(rows)} steps)")
        return row

    def _checkpoint(self) -> tuple[dict[str, Any], Path]:
        store = CheckpointStore.of_run(self.run_dir)
        found = [p for p in store.complete() if steps_done(p) <= self.step - 1]
        if not found:
            have = ", ".join(str(steps_done(p)) for p in reversed(store.complete())) or "none"
            raise ReplayError(f"no checkpoint in {store.root} at or before step {self.step} (one saved after at "
                              f"most {self.step - 1} steps; checkpoints after steps: {have}); replay a later "
                              "step, or run with a smaller trainer.checkpoint_every")
        try:
            payload, _ = store.load(found[0])
        except UnreadableCheckpoint as e:
            raise ReplayError(f"checkpoint {found[0]} is unreadable: {e}") from None
        return payload, found[0]

    def _runtime(self, graph: Graph, keep: set[str], run_plan: Plan, stage: Path,
                 records: list[Record]) -> tuple[Runtime, list[DataProto]]:
        """A runtime for the nodes of ``keep`` of ``graph``, and its source batches from ``records``."""
        needs = external_inputs(graph, keep)
        fields = graph_fields(graph)
        kinds = {n: fields[n].kind for names in needs.values() for n in names}
        batches = [step_batch(r, needs, run_plan, kinds) for r in records]
        sub = replay_graph(graph, keep, [fields[n] for names in needs.values() for n in names], len(batches[0]))
        report = sub.check()
        if report.errors:
            raise ReplayError(f"the replayed part of the graph does not check: {report.errors[0]}")
        rt = Runtime(sub, backend=make_backend(self.backend, self.address),
                     stage=CheckpointStore(stage).path, recovery=Recovery())  # the watchdog on
        _same_cuts(run_plan, rt.plan)
        return rt, batches

    def run(self) -> dict[str, Any]:
        payload, checkpoint = self._checkpoint()
        done = steps_done(checkpoint)
        before = list(range(done + 1, self.step))  # 1-based steps rolled forward
        roll = rolled_nodes(self.graph, replayed_nodes(self.graph, self.start))
        records = {t: read_record(self.run_dir, t) for t in [*before, self.step]}
        with tempfile.TemporaryDirectory(prefix="flowrl-replay-") as tmp:
            if before:
                plan = make_plan(self.graph, traits_of(self.backend))
                rt, batches = self._runtime(self.graph, roll, plan, Path(tmp) / "roll", [records[t] for t in before])
                try:
                    rt.restore(payload)
                    for _ in rt.run(batches, steps=len(before), start_step=done):
                        pass
                    payload = rt.snapshot_now(self.step - 2)
                finally:
                    rt.close()
            plan = make_plan(self.changed, traits_of(self.backend))
            rt, batches = self._runtime(self.changed, self.keep, plan, Path(tmp) / "step", [records[self.step]])
            try:
                rt.restore(payload)
                result = rt.run_step(batches[0], step=self.step - 1)
            finally:
                rt.close()
        return self._report(result.metrics, checkpoint, before)

    def _report(self, metrics: dict[str, Any], checkpoint: Path, before: list[int]) -> dict[str, Any]:
        computed = {k: v for k, v in metrics.items() if not measured(k) and isinstance(v, (int, float))}
        rows = [{"metric": k, "run": self.logged[k], "replay": v, "diff": v - self.logged[k]}
                for k, v in sorted(computed.items()) if isinstance(self.logged.get(k), (int, float))]
        return {"run": str(self.run_dir), "step": self.step, "from": self.start, "nodes": sorted(self.keep),
                "overrides": self.overrides, "checkpoint": str(checkpoint), "rolled_forward": before,
                "metrics": rows, "only_in_replay": sorted(k for k in computed if k not in self.logged),
                "same": all(r["diff"] == 0 for r in rows)}


def _load(config: Path, overrides: dict[str, Any] | None) -> Graph:
    try:
        return load_graph(config, overrides=overrides)
    except GraphError as e:
        raise ReplayError("; ".join(str(p) for p in e.problems) or f"{config} does not load") from None


def replay_step(run: str | Path, step: int, start: str, overrides: dict[str, Any] | None = None,
                backend: str = "ray", address: str | None = None, say: Callable[[str], None] = print) -> dict[str, Any]:
    """Replay step ``step`` (1-based) of ``run`` from node ``start`` with ``overrides`` (dotted keys);
    the report: each metric the replay computed, as the run logged it and as replayed."""
    return Replay(run, step, start, overrides, backend, address, say).run()


__all__ = ["Replay", "ReplayError", "external_inputs", "replay_graph", "replay_step", "replayed_nodes",
           "rolled_nodes", "step_batch"]
