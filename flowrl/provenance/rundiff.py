"""``flowrl diff``: the first node where two runs part, from their ``fingerprints.jsonl``.

Both runs' records are walked in step order and, within a step, in the graph's
topological order (the data source first). A (step, node, field) whose digest
differs while every input of the node is equal — the fields it reads, as their
producers printed them that step, and the digest of the weights it ran on — is
where the difference was *introduced*; every later difference whose inputs
differed *inherited* it. An update's ``weights`` (what it left) count as its
output, so a difference that only changes weights is found at the update.

The finding names the step, node and field, the rows that differ (from the
per-row digests) and how far apart the statistics are, then how it spread:
every later node and field that differs, by first step. Graphs that differ in
their nodes, fields or parameters are said first; the walk then compares what
both have.

Example::

    report = diff_runs(Path("runs/a"), Path("runs/b"))
    report["same"], report["finding"]["node"]
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from flowrl.errors import ConfigError
from flowrl.store.sinks import read_metrics

FILE = "fingerprints.jsonl"
#: the pseudo-node whose outputs are the data source's fields
SOURCE = "<data>"
#: the pseudo-field of an update's output: the weights it left
WEIGHTS = "weights"
#: rows listed in a finding
SHOWN_ROWS = 8
#: hex characters of one row's digest (48 bits: enough to point at the rows that differ)
ROW_HEX = 12
#: how the digests are computed, in the header (``format``; none: 1). 2: rows read as 64-bit words
#: rather than 32-bit ones (half the products). Digests of different formats are not comparable.
FORMAT = 2


def format_of(header: dict[str, Any]) -> int:
    """The digest format a fingerprints header was written with."""
    return int(header.get("format", 1))


def row_digests(fp: dict[str, Any]) -> list[str]:
    """The per-row digests of a field's fingerprint: stored as one string of :data:`ROW_HEX` characters
    per row (a list of strings in files written before that; both read)."""
    rows = fp.get("rows")
    if rows is None or isinstance(rows, list):
        return rows
    return [rows[i:i + ROW_HEX] for i in range(0, len(rows), ROW_HEX)]


class FingerprintFileError(ConfigError, ValueError):
    """A fingerprints file that is missing or cannot be read."""


def read_prints(run: Path, warn: Callable[[str], None] = lambda m: None) -> tuple[dict[str, Any], list[dict]]:
    """``(header, step records)`` of a run directory (or its ``fingerprints.jsonl``); an error
    naming the file when it is missing or damaged."""
    path = Path(run)
    path = path if path.suffix == ".jsonl" else path / FILE
    if not path.is_file():
        raise FingerprintFileError(f"{path}: no fingerprints file (a run writes one unless "
                                   f"trainer.fingerprints is false); check the run directory")
    try:
        rows = [row for _, row in read_metrics(path, warn=warn)]
    except (ValueError, UnicodeDecodeError) as e:
        raise FingerprintFileError(str(e).replace("not a metrics row", "not a fingerprint record")) from None
    if not rows or "header" not in rows[0]:
        raise FingerprintFileError(f"{path}: the first line is not a fingerprint header; the file is damaged "
                                   f"or not a flowrl fingerprints file")
    records = [r for r in rows[1:] if isinstance(r.get("step"), int) and isinstance(r.get("nodes"), dict)]
    if len(records) != len(rows) - 1:
        raise FingerprintFileError(f"{path}: a line after the header is not a step record; the file is damaged")
    return rows[0]["header"], records


def graph_differences(a: dict[str, Any], b: dict[str, Any]) -> tuple[list[str], list[str]]:
    """``(structure, parameters)``: how two runs' graphs differ, in words."""
    structure, params = [], []
    na, nb = a.get("nodes", {}), b.get("nodes", {})
    for n in na.keys() - nb.keys():
        structure.append(f"node {n!r} only in run A")
    for n in nb.keys() - na.keys():
        structure.append(f"node {n!r} only in run B")
    for n in [n for n in a.get("order", []) if n in nb]:
        for key in ("op", "reads", "writes", "role"):
            if na[n].get(key) != nb[n].get(key):
                structure.append(f"node {n!r}: {key} {na[n].get(key)} in A, {nb[n].get(key)} in B")
        pa, pb = na[n].get("params", {}), nb[n].get("params", {})
        for k in sorted(pa.keys() | pb.keys()):
            if pa.get(k) != pb.get(k):
                params.append(f"node {n!r}: {k} = {pa.get(k)!r} in A, {pb.get(k)!r} in B")
    return structure, params


def _outputs(node: dict[str, Any]) -> dict[str, Any]:
    """A node's printed outputs, an update's weights among them."""
    out = dict(node.get("fields", {}))
    w = node.get("weights") or {}
    if "after" in w:
        out[WEIGHTS] = {"hash": w["after"]}
    return out


def _inputs_equal(header: dict[str, Any], node: str, ra: dict, rb: dict) -> tuple[bool, list[str]]:
    """Whether every input of ``node`` was equal in both records, and which differed."""
    producer = {f: n for n in header["order"] for f in header["nodes"][n].get("writes", [])}
    differed = []
    for f in header["nodes"].get(node, {}).get("reads", []):
        src = producer.get(f)
        pa = ra["nodes"].get(src, {}).get("fields", {}).get(f)
        pb = rb["nodes"].get(src, {}).get("fields", {}).get(f)
        if (pa or {}).get("hash") != (pb or {}).get("hash"):
            differed.append(f)
    wa, wb = ra["nodes"].get(node, {}).get("weights") or {}, rb["nodes"].get(node, {}).get("weights") or {}
    if wa.get("used") != wb.get("used"):
        differed.append(f"weights of {wa.get('role') or wb.get('role')!r}")
    return not differed, differed


def _detail(pa: dict[str, Any] | None, pb: dict[str, Any] | None) -> dict[str, Any]:
    """Rows that differ and how far apart the statistics are."""
    pa, pb = pa or {}, pb or {}
    out: dict[str, Any] = {"shape_a": pa.get("shape"), "shape_b": pb.get("shape")}
    rows_a, rows_b = row_digests(pa), row_digests(pb)
    if rows_a is not None and rows_b is not None:
        differ = [i for i, (x, y) in enumerate(zip(rows_a, rows_b)) if x != y]
        differ += list(range(min(len(rows_a), len(rows_b)), max(len(rows_a), len(rows_b))))
        out.update(rows=differ[:SHOWN_ROWS], rows_differing=len(differ), rows_total=max(len(rows_a), len(rows_b)))
    for k in ("mean", "min", "max", "nan", "inf"):
        if pa.get(k) is not None or pb.get(k) is not None:
            out[f"{k}_a"], out[f"{k}_b"] = pa.get(k), pb.get(k)
    if isinstance(pa.get("mean"), (int, float)) and isinstance(pb.get("mean"), (int, float)):
        out["size"] = abs(pa["mean"] - pb["mean"])  # how far apart: the means' distance
    return out


def _metric_differences(a: dict[str, float], b: dict[str, float]) -> list[dict[str, Any]]:
    """The step's metrics that differ, the largest relative difference first (at most ``SHOWN_ROWS``)."""
    out = []
    for k in sorted(a.keys() & b.keys()):
        x, y = a[k], b[k]
        if x != y and not (x != x and y != y):  # NaN in both: the same
            out.append({"metric": k, "a": x, "b": y, "relative": abs(x - y) / max(abs(x), abs(y), 1e-12)})
    out.sort(key=lambda d: -d["relative"] if d["relative"] == d["relative"] else 0.0)
    return out[:SHOWN_ROWS]


def diff_runs(run_a: Path, run_b: Path, warn: Callable[[str], None] = lambda m: None) -> dict[str, Any]:
    """Compare two runs' fingerprints (see the module docstring); reads, never writes."""
    ha, recs_a = read_prints(run_a, warn)
    hb, recs_b = read_prints(run_b, warn)
    if format_of(ha) != format_of(hb):
        raise FingerprintFileError(
            f"{run_a} has fingerprints of format {format_of(ha)} and {run_b} of format {format_of(hb)}: the "
            f"digests are computed differently (format 2, since flowrl computes them over 64-bit words), so "
            f"they cannot be compared; run the older one again with this flowrl")
    structure, params = graph_differences(ha, hb)
    by_step_b = {r["step"]: r for r in recs_b}
    common = [r for r in recs_a if r["step"] in by_step_b]
    order = [n for n in ha.get("order", []) if n in hb.get("nodes", {})]
    differing: list[dict[str, Any]] = []
    for ra in common:
        rb = by_step_b[ra["step"]]
        for node in order:
            oa, ob = _outputs(ra["nodes"].get(node, {})), _outputs(rb["nodes"].get(node, {}))
            for field in sorted(oa.keys() | ob.keys()):
                if (oa.get(field) or {}).get("hash") == (ob.get(field) or {}).get("hash"):
                    continue
                equal, differed = _inputs_equal(ha, node, ra, rb)
                differing.append({"step": ra["step"], "node": node, "field": field, "inputs_equal": equal,
                                  "inputs_differing": differed, **_detail(oa.get(field), ob.get(field))})
    finding = next((d for d in differing if d["inputs_equal"]), differing[0] if differing else None)
    if finding is not None:
        ra, rb = next(r for r in common if r["step"] == finding["step"]), by_step_b[finding["step"]]
        finding["metrics"] = _metric_differences(ra.get("metrics", {}), rb.get("metrics", {}))
    spread: dict[str, dict[str, Any]] = {}
    for d in differing:
        if d is finding:
            continue
        s = spread.setdefault(d["node"], {"node": d["node"], "first_step": d["step"], "steps": set(), "fields": set()})
        s["steps"].add(d["step"])
        s["fields"].add(d["field"])
    steps_a, steps_b = [r["step"] for r in recs_a], [r["step"] for r in recs_b]
    return {
        "same": not differing and not structure and steps_a == steps_b,
        "graph_differences": structure, "parameter_differences": params,
        "steps_compared": len(common), "steps_a": len(steps_a), "steps_b": len(steps_b),
        "finding": finding,
        "spread": [{**s, "steps": len(s["steps"]), "fields": sorted(s["fields"])}
                   for s in sorted(spread.values(), key=lambda s: (s["first_step"], order.index(s["node"])))],
        "differences": len(differing),
    }


__all__ = ["FILE", "FORMAT", "SOURCE", "WEIGHTS", "format_of", "FingerprintFileError", "diff_runs", "graph_differences", "read_prints"]
