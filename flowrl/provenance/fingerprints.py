"""Fingerprints: what every node produced at every step, as digests and a few statistics.

Worker side (:class:`FingerprintHook`, a hook on every task of a training step, so the
output is printed where it is made and no data moves; :func:`task_prints`): per output
field a digest of each row's exact bytes, the row positions when a rank holds rows of a
balanced task, and statistics (rows, mean, min, max, NaN and inf counts; over real
tokens where the operator declares a ``token_mask`` of the same shape, e.g. verl's
``response_mask``); per role a digest of the weights the task ran on and, for an update,
of the weights it left. Fields read from the data source are printed by the first node
reading them (:func:`source_readers`).

Driver side (:class:`FingerprintLog`): the reports of one step are put back in row
order (micro-batches in order, each task's ranks by their positions), so a digest
does not depend on worker counts or micro-batches; one JSON line per step goes to
``<out>/fingerprints.jsonl`` (a header line first: the graph's nodes, what they
read and write, in topological order), flushed per line and fsync'd with the
metrics at every checkpoint. The invariants (:mod:`flowrl.provenance.invariants`)
are checked on each step's record.

Example::

    log = FingerprintLog(Path("runs/grpo"), graph, plan, say=print)
    log.step(result)   # after each StepResult
    log.close()
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable

import numpy as np
import pydantic_core
import torch

from flowrl.data import DataProto
from flowrl.data.dispatch import ROW_INDEX, task_rows
from flowrl.data.metrics import measured
from flowrl.graph import Graph, Role
from flowrl.runtime.hooks import HookSpec, Run, TaskHook, TaskRun, task_hooks
from flowrl.provenance.digest import WeightsDigester, combine_digests, mixed_rows, mixed_rows_of, weights_digest
from flowrl.provenance.invariants import Invariants
from flowrl.provenance.rundiff import FILE, FORMAT, ROW_HEX, SOURCE, format_of, row_digests
from flowrl.store.sinks import read_metrics

if TYPE_CHECKING:
    from flowrl.plan.planner import Plan


# ---------------------------------------------------------------------- worker side
def _hex(mixed: np.ndarray) -> list[str]:
    """Row digests as one string per column of ``mixed`` (rows, columns), :data:`ROW_HEX` hex characters
    per row (the low 48 bits of each): one conversion for all columns, then cut."""
    cols = mixed.reshape(mixed.shape[0], -1)
    big_endian = np.ascontiguousarray(cols.view(np.uint64).T, dtype=">u8").view(np.uint8).reshape(cols.shape[1], -1, 8)
    text, size = big_endian[:, :, 8 - ROW_HEX // 2:].tobytes().hex(), cols.shape[0] * ROW_HEX
    return [text[k * size:(k + 1) * size] for k in range(cols.shape[1])]


def _key(t: torch.Tensor) -> str:
    return f"{t.dtype}|{tuple(t.shape[1:])}"


def _row_digests(value: Any) -> str:
    """One digest per row, :data:`ROW_HEX` hex characters each, as one string (cheaper to send and write
    than a list): of a tensor row's exact bits (:func:`~flowrl.provenance.digest.mixed_rows`, its low 48 bits),
    of an object's ``repr`` (each distinct object once, each distinct text once: rows repeated per sample
    share theirs)."""
    if isinstance(value, torch.Tensor):
        return _hex(mixed_rows(value.detach(), None, _key(value)))[0]
    objects = {id(v): v for v in value}
    texts = {k: repr(v) for k, v in objects.items()}
    hexes = {t: hashlib.blake2b(t.encode(), digest_size=ROW_HEX // 2).hexdigest() for t in set(texts.values())}
    return "".join(map(hexes.__getitem__, map(texts.__getitem__, map(id, value))))


def _stats(t: torch.Tensor, mask: torch.Tensor | None) -> dict[str, Any]:
    """Sum, count, min, max, NaN and inf of a float tensor (over the bool ``mask`` where given); the
    first row holding a NaN or inf."""
    values = t.detach()
    real = values[mask] if mask is not None else values.reshape(-1)
    total = float(real.double().sum()) if real.numel() else 0.0
    if math.isfinite(total):  # no NaN or inf among them (the common case: two operations)
        lo, hi = torch.aminmax(real) if real.numel() else (None, None)
        return {"n": int(real.numel()), "sum": total, "min": None if lo is None else float(lo),
                "max": None if hi is None else float(hi), "nan": 0, "inf": 0, "first_bad": None}
    ok = torch.isfinite(real)
    finite = real[ok]
    nan = int(torch.isnan(real).sum())
    inf = real.numel() - finite.numel() - nan
    bad_rows = (~torch.isfinite(values.reshape(values.shape[0], -1))).any(dim=1).nonzero() if nan or inf else []
    return {"n": int(finite.numel()), "sum": float(finite.double().sum()) if finite.numel() else 0.0,
            "min": float(finite.min()) if finite.numel() else None,
            "max": float(finite.max()) if finite.numel() else None,
            "nan": nan, "inf": inf, "first_bad": int(bad_rows[0]) if len(bad_rows) else None}


def field_print(value: Any, mask: torch.Tensor | None = None) -> dict[str, Any]:
    """One field of one rank's output: row digests, shape, dtype, statistics."""
    return fields_print([("field", value)], mask)["field"]


def fields_print(columns: Iterable[tuple[str, Any]], mask: torch.Tensor | None = None) -> dict[str, Any]:
    """:func:`field_print` of each ``(name, value)``; the row digests of CPU tensors with one row count
    computed together (:func:`~flowrl.provenance.digest.mixed_rows_of`), the same digests."""
    out: dict[str, dict[str, Any]] = {}
    together: dict[int, list[tuple[str, torch.Tensor]]] = {}  # row count → CPU tensors
    real = mask.bool() if mask is not None else None
    for name, value in columns:
        if not isinstance(value, torch.Tensor):
            out[name] = {"rows": _row_digests(value), "shape": [len(value)], "dtype": "object"}
            continue
        use = real if real is not None and real.shape == value.shape else None
        stats = _stats(value, use) if value.is_floating_point() and value.dim() else {}
        out[name] = {"rows": None, "shape": list(value.shape), "dtype": str(value.dtype).replace("torch.", ""),
                     **stats}
        if value.device.type == "cpu" and value.dim():
            together.setdefault(value.shape[0], []).append((name, value.detach()))
        else:
            out[name]["rows"] = _row_digests(value)
    for group in together.values():
        hexes = _hex(mixed_rows_of([t for _, t in group], [_key(t) for _, t in group]))
        for (name, _), rows in zip(group, hexes):
            out[name]["rows"] = rows
    return out


def role_weights(role_obj: Role, digest: Callable[[Any], str | None] = weights_digest) -> str | None:
    """The digest of a role's weights, when the role can say (``weights_for_digest``: this rank's
    tensors, no collective). A rollout engine's own copy (vLLM, sglang) is not digested: the
    actor checks it against the model after every push. ``digest``: :func:`weights_digest` or a
    :class:`~flowrl.provenance.digest.WeightsDigester` kept for the role."""
    tensors = role_obj.weights_for_digest()
    return digest(tensors) if tensors is not None else None


def source_prints(batch: DataProto, names: Iterable[str]) -> dict[str, Any]:
    """The data-source fields ``names`` of a task's input, as :func:`field_print` (taken before
    the operator runs: it sees its own names for renamed fields)."""
    wanted = set(names)
    return fields_print((name, value) for name, value in _columns(batch) if name in wanted) if wanted else {}


def source_readers(graph: Graph) -> dict[str, tuple[str, ...]]:
    """Node → the data-source fields it prints (:func:`source_prints`): those it is the first to read,
    in topological order (each field once per step: later readers see the same rows)."""
    sources, first = {f.name for f in graph.source_fields}, {}
    for node in graph.topological_order():
        for name in sorted(set(graph.nodes[node].input_names()) & (sources - first.keys())):
            first[name] = node
    out: dict[str, tuple[str, ...]] = {}
    for name, node in first.items():
        out[node] = out.get(node, ()) + (name,)
    return out


class WeightDigests:
    """A worker's digest of each role's weights, computed once per weight version (an update or a
    load moves the version; a load or a restore forgets the digest) by a digester kept per role."""

    def __init__(self) -> None:
        self._of: dict[str, tuple[int, str | None]] = {}  # owner → (version, digest)
        self._digesters: dict[str, WeightsDigester] = {}

    def of(self, owner: str, version: int, role_obj: Any) -> str | None:
        cached = self._of.get(owner)
        if cached is None or cached[0] != version:
            digester = self._digesters.setdefault(owner, WeightsDigester())
            cached = self._of[owner] = (version, role_weights(role_obj, digester))
        return cached[1]

    def forget(self, owner: str | None = None) -> None:
        for held in (self._of, self._digesters):
            held.pop(owner, None) if owner is not None else held.clear()


def task_prints(out: DataProto, source: dict[str, Any], role: str | None = None, used: str | None = None,
                after: str | None = None, mask: torch.Tensor | None = None) -> dict[str, Any]:
    """Every field of one rank's output as :func:`field_print`, with ``source`` (:func:`source_prints`)
    and the digests of the weights of ``role`` it ran on (``used``) and, an update, left (``after``);
    float fields are summarised over the token ``mask`` where it fits (:func:`token_mask`)."""
    fields = fields_print(_columns(out), mask)
    at = task_rows(out)
    prints: dict[str, Any] = {"fields": fields, "source": source, "at": at.tolist() if at is not None else None}
    if used is not None:
        prints["weights"] = {"role": role, "used": used, **({"after": after} if after is not None else {})}
    return prints


def token_mask(out: DataProto, batch: DataProto, name: str | None, renames: dict[str, str] | None = None,
               ) -> torch.Tensor | None:
    """The column ``name`` (an operator's declared ``token_mask``) of its output, else of its input
    ``batch``; ``renames``: the node's output renames (the output holds graph names)."""
    if name is None:
        return None
    for part, key in ((out, (renames or {}).get(name, name)), (batch, name)):
        if part.batch is not None and key in part.batch.keys():
            return part.batch[key]
    return None


@dataclass(frozen=True, eq=False)
class Fingerprints(HookSpec):
    """Fingerprints on the tasks of a training step; ``sources``: node → the data-source fields it
    prints (:func:`source_readers`). One :class:`FingerprintHook` per worker."""

    sources: dict[str, tuple[str, ...]]

    def build(self, worker: Any) -> TaskHook:
        return FingerprintHook(self.sources, worker)


class FingerprintHook(TaskHook):
    """A worker's fingerprints of its tasks' outputs and of the weights they ran on and left, and of
    weights that arrive (what the invariants compare with what the update left)."""

    def __init__(self, sources: dict[str, tuple[str, ...]], worker: Any) -> None:
        self.sources, self.worker = sources, worker
        self.digests = WeightDigests()

    def around(self, task: TaskRun, run: Run) -> Run:
        # the weights and the source fields as the operator receives them: taken before it runs
        role = task.entry.role
        task.notes[self] = (self._digest(role) if role else None,
                            source_prints(task.batch, self.sources.get(task.call.node, ())))
        return run

    def after(self, task: TaskRun, out: DataProto) -> dict[str, Any]:
        (used, source), entry = task.notes.pop(self), task.entry
        # after the update moved the version: "after" is the new weights' digest
        after = self._digest(entry.role) if entry.op.updates_role and used is not None else None
        mask = token_mask(out, task.batch, entry.op.token_mask, entry.outputs)
        return {"prints": task_prints(out, source, entry.role, used, after, mask)}

    def loaded(self, role: str | None) -> dict[str, Any]:
        if role is None:  # every role restored from a checkpoint
            self.digests.forget()
            return {}
        self.digests.forget(self.worker.owner[role])
        arrived = self._digest(role)
        return {"prints": {"role": role, "digest": arrived}} if arrived is not None else {}

    def _digest(self, role: str) -> str | None:
        owner = self.worker.owner[role]
        return self.digests.of(owner, self.worker.versions[owner], self.worker.roles[owner])


@task_hooks
def fingerprint_hooks(plan: "Plan") -> dict[str, HookSpec]:
    """Every node of a training step's plan, when ``trainer.fingerprints`` is on (validation: none)."""
    graph = plan.graph
    if plan.kind != "train" or not graph.config.trainer.fingerprints:
        return {}
    spec = Fingerprints(source_readers(graph))
    return {n: spec for n in graph.nodes}


def _columns(data: DataProto) -> Iterable[tuple[str, Any]]:
    if data.batch is not None:
        yield from data.batch.items()
    for name, value in data.non_tensor_batch.items():
        if name != ROW_INDEX:
            yield name, value


# ---------------------------------------------------------------------- driver side
def _merge(parts: list[tuple[dict[str, Any], list[int] | None]]) -> dict[str, Any]:
    """One field over a node's tasks and ranks (in row order) → its step fingerprint."""
    rows: list[str] = []  # each part's row digests, one string per part
    count = n = nan = inf = 0
    total, lo, hi, first_bad, width = 0.0, None, None, None, None
    for p, at in parts:
        offset = count
        if at is None:
            rows.append(p["rows"] if isinstance(p["rows"], str) else "".join(p["rows"]))
        else:  # a rank's rows of a balanced task: put back in the order of their positions
            mine = row_digests(p)
            rows.append("".join(mine[j] for j in sorted(range(len(at)), key=at.__getitem__)))
        count += len(rows[-1]) // ROW_HEX
        if p.get("first_bad") is not None and first_bad is None:
            first_bad = offset + (p["first_bad"] if at is None else sorted(at).index(at[p["first_bad"]]))
        n, total, nan, inf = n + p.get("n", 0), total + p.get("sum", 0.0), nan + p.get("nan", 0), inf + p.get("inf", 0)
        lo = p.get("min") if lo is None else (lo if p.get("min") is None else min(lo, p["min"]))
        hi = p.get("max") if hi is None else (hi if p.get("max") is None else max(hi, p["max"]))
        width = p["shape"][1:]
    first = parts[0][0]
    joined = "".join(rows)
    h = hashlib.blake2b(f"{first['dtype']}|".encode() + joined.encode(), digest_size=16).hexdigest()
    out = {"hash": h, "shape": [count, *(width or [])], "dtype": first["dtype"], "rows": joined}
    if "n" in first:
        out.update(mean=total / n if n else None, min=lo, max=hi, nan=nan, inf=inf, first_bad=first_bad)
    return out


def step_record(step: int, plan: "Plan", infos: list[Any], syncs: list[Any] = ()) -> dict[str, Any]:
    """The fingerprint record of one finished step from its task reports (see the module docstring)."""
    per_node: dict[str, dict[str, list]] = {}
    weights: dict[str, list[Any]] = {}  # node → its first task's ranks' reports
    ordered = sorted((i for i in infos if getattr(i, "prints", None) is not None),
                     key=lambda i: (i.node, -1 if i.mb is None else i.mb, i.rank))
    for info in ordered:
        p = info.prints
        if p.get("weights") and (info.node not in weights or weights[info.node][0].mb == info.mb):
            weights.setdefault(info.node, []).append(info)
        if info.rank not in plan.tasks[(info.node, info.mb)].collected:
            continue
        for kind, node in (("fields", info.node), ("source", SOURCE)):
            for name, fp in p[kind].items():
                # a data-source field comes from its first reader alone (source_readers)
                per_node.setdefault(node, {}).setdefault(name, []).append((fp, p["at"]))
    nodes = {node: {"fields": {name: _merge(parts) for name, parts in fields.items()}}
             for node, fields in per_node.items()}
    for node, ranks in weights.items():
        w = ranks[0].prints["weights"]
        nodes.setdefault(node, {"fields": {}})["weights"] = {
            "role": w["role"], "version": ranks[0].version,
            **{k: combine_digests([r.prints["weights"].get(k) for r in ranks]) for k in ("used", "after") if k in w}}
    loads: dict[tuple[str, str, int | None], list[str]] = {}  # (role, pool, version) → the ranks' digests
    for s in syncs:
        if getattr(s, "prints", None):
            loads.setdefault((s.prints["role"], s.pool, s.version), []).append(s.prints["digest"])
    sync_list = [{"role": role, "pool": pool, "version": version, "digest": combine_digests(ds)}
                 for (role, pool, version), ds in loads.items()]
    return {"step": step + 1, "nodes": nodes, "syncs": sync_list}


def graph_header(graph: Graph) -> dict[str, Any]:
    """What ``flowrl diff`` compares before any value: nodes in order, their fields and roles."""
    order = [SOURCE] + list(graph.topological_order())
    nodes = {SOURCE: {"op": "data", "reads": [], "writes": sorted(f.name for f in graph.source_fields),
                      "role": None}}
    for name in order[1:]:
        node = graph.nodes[name]
        nodes[name] = {"op": node.config.op, "reads": sorted(node.input_names()),
                       "writes": sorted(node.output_names()), "role": node.role,
                       "params": _plain(node.params.model_dump()) if node.params is not None else {}}
    roles = {r: (cfg.from_ or r) for r, cfg in graph.config.roles.items()}
    return {"header": {"graph": graph.name, "format": FORMAT, "order": order, "nodes": nodes, "lineage": roles}}


def _plain(value: Any) -> Any:
    """``value`` as JSON holds it (an object parameter as its text)."""
    return json.loads(json.dumps(value, default=str))


class FingerprintLog:
    """``<out>/fingerprints.jsonl``: a header, then one record per step, invariants checked on each."""

    def __init__(self, out: Path, graph: Graph, plan: "Plan", say: Callable[[str], None], keep_through: int = 0,
                 fatal: bool = False, check: bool = True) -> None:
        self.path = Path(out) / FILE
        self.plan = plan
        self.checks = Invariants(graph_header(graph)["header"], say, fatal) if check else None
        kept = []
        if keep_through > 0 and self.path.is_file():  # a resume: the steps after the checkpoint run again
            kept = [(line, row) for line, row in read_metrics(self.path, warn=say, tolerant=True)
                    if "header" in row or row.get("step", 0) <= keep_through]
        old = format_of(kept[0][1].get("header", {})) if kept else FORMAT
        if old != FORMAT:  # written by an older flowrl: its digests are not comparable with this one's
            os.replace(self.path, self.path.with_name(f"fingerprints.format{old}.jsonl"))
            say(f"{self.path}: fingerprint format {old}, this flowrl writes {FORMAT}; the old file is kept as "
                f"fingerprints.format{old}.jsonl and a new one starts here")
            kept = []
        self.file = self.path.open("w")
        for line in [line for line, _ in kept] or [json.dumps(graph_header(graph))]:
            self.file.write(line + "\n")
        self.file.flush()

    def step(self, result: Any) -> list[dict[str, Any]]:
        """Record one step; the invariants it broke (raised instead when fatal)."""
        record = step_record(result.step, self.plan, result.infos, getattr(result, "syncs", ()))
        # what the step computed (not how long it took): flowrl diff sizes a difference with them
        record["metrics"] = {k: v for k, v in result.metrics.items()
                             if not measured(k) and isinstance(v, (int, float))}
        found = self.checks.check(record, result) if self.checks is not None else []
        record["invariants"] = found
        # pydantic's serializer: the same JSON (NaN as NaN) in a third of json.dumps's time on these long strings
        self.file.write(pydantic_core.to_json(record, inf_nan_mode="constants").decode() + "\n")
        self.file.flush()
        if self.checks is not None:
            self.checks.raise_if_fatal(found)
        return found

    def sync(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())

    def close(self) -> None:
        if not self.file.closed:
            self.sync()
            self.file.close()


__all__ = ["FingerprintHook", "FingerprintLog", "Fingerprints", "WeightDigests", "fingerprint_hooks", "token_mask", "field_print", "fields_print", "graph_header", "role_weights", "source_prints",
           "source_readers", "step_record", "task_prints"]
