"""Fingerprints: what every node produced at every step, as digests and a few statistics.

Worker side (:func:`task_prints`, where the output is made, so no data moves): per
output field a digest of each row's exact bytes, the row positions when a rank
holds rows of a balanced task, and statistics (rows, mean, min, max, NaN and inf
counts; over real tokens where ``response_mask`` of the same shape applies); per
role a digest of the weights the task ran on and, for an update, of the weights it
left. Fields read from the data source are printed by the first node reading them.

Driver side (:class:`FingerprintLog`): the reports of one step are put back in row
order (micro-batches in order, each task's ranks by their positions), so a digest
does not depend on worker counts or micro-batches; one JSON line per step goes to
``<out>/fingerprints.jsonl`` (a header line first: the graph's nodes, what they
read and write, in topological order), flushed per line and fsync'd with the
metrics at every checkpoint. The invariants (:mod:`flowrl.runtime.invariants`)
are checked on each step's record.

Example::

    log = FingerprintLog(Path("runs/grpo"), graph, plan, say=print)
    log.step(result)   # after each StepResult
    log.close()
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable

import numpy as np
import torch

from flowrl.data import DataProto
from flowrl.data.dispatch import ROW_INDEX, task_rows
from flowrl.graph import Graph
from flowrl.runtime.invariants import Invariants
from flowrl.runtime.rundiff import FILE, SOURCE
from flowrl.runtime.sinks import read_metrics

if TYPE_CHECKING:
    from flowrl.runtime.plan import Plan

#: hex characters of one row's digest (48 bits: enough to point at the rows that differ)
ROW_HEX = 12
MASK = "response_mask"


# ---------------------------------------------------------------------- worker side
def _as_bytes(t: torch.Tensor) -> np.ndarray:
    """``[rows, bytes]`` of a tensor's exact contents."""
    t = t.detach().cpu().contiguous()
    local = getattr(t, "to_local", None)  # a DTensor shard: this rank's part
    if local is not None:
        t = local().contiguous()
    rows = t.shape[0] if t.dim() else 1
    return t.reshape(rows, -1).view(torch.uint8).numpy() if t.numel() else np.zeros((rows, 0), np.uint8)


def _row_digests(value: Any) -> list[str]:
    if isinstance(value, torch.Tensor):
        return [hashlib.blake2b(r.tobytes(), digest_size=ROW_HEX // 2).hexdigest() for r in _as_bytes(value)]
    return [hashlib.blake2b(repr(v).encode(), digest_size=ROW_HEX // 2).hexdigest() for v in value]


def _stats(t: torch.Tensor, mask: torch.Tensor | None) -> dict[str, Any]:
    """Sum, count, min, max, NaN and inf of a float tensor (over ``mask`` where given); the
    first row holding a NaN or inf."""
    values = t.detach().double()
    real = values[mask.bool()] if mask is not None else values.reshape(-1)
    finite = real[torch.isfinite(real)]
    bad_rows = (~torch.isfinite(values.reshape(values.shape[0], -1))).any(dim=1).nonzero() if values.dim() else []
    return {"n": int(finite.numel()), "sum": float(finite.sum()) if finite.numel() else 0.0,
            "min": float(finite.min()) if finite.numel() else None,
            "max": float(finite.max()) if finite.numel() else None,
            "nan": int(torch.isnan(real).sum()), "inf": int(torch.isinf(real).sum()),
            "first_bad": int(bad_rows[0]) if len(bad_rows) else None}


def field_print(value: Any, mask: torch.Tensor | None = None) -> dict[str, Any]:
    """One field of one rank's output: row digests, shape, dtype, statistics."""
    if isinstance(value, torch.Tensor):
        shape, dtype = list(value.shape), str(value.dtype).replace("torch.", "")
        use = mask if mask is not None and tuple(mask.shape) == tuple(value.shape) else None
        stats = _stats(value, use) if value.is_floating_point() and value.dim() else {}
    else:
        shape, dtype, stats = [len(value)], "object", {}
    return {"rows": _row_digests(value), "shape": shape, "dtype": dtype, **stats}


def weights_digest(named: Iterable[tuple[str, torch.Tensor]] | None) -> str | None:
    """A digest of ``(name, tensor)`` pairs: names, dtypes, shapes and exact bytes."""
    if named is None:
        return None
    h = hashlib.blake2b(digest_size=16)
    for name, t in named:
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(_as_bytes(t).tobytes())
    return h.hexdigest()


def role_weights(role_obj: Any, used: bool = False) -> str | None:
    """The digest of a role's weights (``used``: the copy its rollout engine generates on), when
    the role can say (``weights_for_digest`` / ``rollout_weights_for_digest``); no collective."""
    name = "rollout_weights_for_digest" if used and hasattr(role_obj, "rollout_weights_for_digest") \
        else "weights_for_digest"
    fn = getattr(role_obj, name, None)
    return weights_digest(fn()) if fn is not None else None


def source_prints(batch: DataProto, names: Iterable[str]) -> dict[str, Any]:
    """The data-source fields ``names`` of a task's input, as :func:`field_print` (taken before
    the operator runs: it sees its own names for renamed fields)."""
    wanted = set(names)
    return {name: field_print(value) for name, value in _columns(batch) if name in wanted} if wanted else {}


def task_prints(out: DataProto, batch: DataProto, source: dict[str, Any]) -> dict[str, Any]:
    """Every field of one rank's output as :func:`field_print`, with ``source`` (:func:`source_prints`);
    float fields are summarised over ``response_mask`` (the output's, else the input's) where it fits."""
    mask = None
    for part in (out, batch):
        if part.batch is not None and MASK in part.batch.keys():
            mask = part.batch[MASK]
            break
    fields = {name: field_print(value, mask) for name, value in _columns(out)}
    at = task_rows(out)
    return {"fields": fields, "source": source, "at": at.tolist() if at is not None else None}


def _columns(data: DataProto) -> Iterable[tuple[str, Any]]:
    if data.batch is not None:
        yield from data.batch.items()
    for name, value in data.non_tensor_batch.items():
        if name != ROW_INDEX:
            yield name, value


# ---------------------------------------------------------------------- driver side
def _merge(parts: list[tuple[dict[str, Any], list[int] | None]]) -> dict[str, Any]:
    """One field over a node's tasks and ranks (in row order) → its step fingerprint."""
    rows: list[str] = []
    n = nan = inf = 0
    total, lo, hi, first_bad, width = 0.0, None, None, None, None
    for p, at in parts:
        offset = len(rows)
        rows.extend(p["rows"] if at is None else [p["rows"][at.index(i)] for i in sorted(at)])
        if p.get("first_bad") is not None and first_bad is None:
            first_bad = offset + (p["first_bad"] if at is None else sorted(at).index(at[p["first_bad"]]))
        n, total, nan, inf = n + p.get("n", 0), total + p.get("sum", 0.0), nan + p.get("nan", 0), inf + p.get("inf", 0)
        lo = p.get("min") if lo is None else (lo if p.get("min") is None else min(lo, p["min"]))
        hi = p.get("max") if hi is None else (hi if p.get("max") is None else max(hi, p["max"]))
        width = p["shape"][1:]
    first = parts[0][0]
    h = hashlib.blake2b(f"{first['dtype']}|".encode() + "".join(rows).encode(), digest_size=16).hexdigest()
    out = {"hash": h, "shape": [len(rows), *(width or [])], "dtype": first["dtype"], "rows": rows}
    if "n" in first:
        out.update(mean=total / n if n else None, min=lo, max=hi, nan=nan, inf=inf, first_bad=first_bad)
    return out


def step_record(step: int, plan: "Plan", infos: list[Any], syncs: list[Any] = ()) -> dict[str, Any]:
    """The fingerprint record of one finished step from its task reports (see the module docstring)."""
    per_node: dict[str, dict[str, list]] = {}
    weights: dict[str, dict[str, Any]] = {}
    ordered = sorted((i for i in infos if getattr(i, "prints", None) is not None),
                     key=lambda i: (i.node, -1 if i.mb is None else i.mb, i.rank))
    for info in ordered:
        p = info.prints
        w = p.get("weights")
        if w:
            weights.setdefault(info.node, {"role": w["role"], "version": info.version, **{
                k: v for k, v in w.items() if k != "role"}})
        if info.rank not in plan.tasks[(info.node, info.mb)].collected:
            continue
        for kind, node in (("fields", info.node), ("source", SOURCE)):
            for name, fp in p[kind].items():
                per_node.setdefault(node, {}).setdefault(name, []).append((info.node, info.mb, fp, p["at"]))
    nodes: dict[str, Any] = {}
    for node, fields in per_node.items():
        merged = {}
        for name, parts in fields.items():
            if node == SOURCE:  # the first reader's copy (in topological order) only
                reader = next(n for n in plan.graph.topological_order() if any(q[0] == n for q in parts))
                parts = [q for q in parts if q[0] == reader]
            merged[name] = _merge([(fp, at) for _, _, fp, at in parts])
        nodes[node] = {"fields": merged}
    for node, w in weights.items():
        nodes.setdefault(node, {"fields": {}})["weights"] = w
    sync_list = [{"role": s.prints["role"], "pool": s.pool, "rank": s.rank, "version": s.version,
                  "digest": s.prints["digest"]} for s in syncs if getattr(s, "prints", None)]
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
    return {"header": {"graph": graph.name, "order": order, "nodes": nodes, "lineage": roles}}


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
            kept = [line for line, row in read_metrics(self.path, warn=say)
                    if "header" in row or row.get("step", 0) <= keep_through]
        self.file = self.path.open("w")
        for line in kept or [json.dumps(graph_header(graph))]:
            self.file.write(line + "\n")
        self.file.flush()

    def step(self, result: Any) -> list[dict[str, Any]]:
        """Record one step; the invariants it broke (raised instead when fatal)."""
        record = step_record(result.step, self.plan, result.infos, getattr(result, "syncs", ()))
        found = self.checks.check(record, result) if self.checks is not None else []
        record["invariants"] = found
        self.file.write(json.dumps(record) + "\n")
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


__all__ = ["FingerprintLog", "field_print", "graph_header", "role_weights", "source_prints", "step_record",
           "task_prints", "weights_digest"]
