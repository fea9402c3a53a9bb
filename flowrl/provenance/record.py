"""Records: the exact outputs of chosen nodes at chosen steps, what ``flowrl replay`` rebuilds a step from.

``trainer.record: {nodes: [generate, reward], every: K, max_gb: G}`` saves, for
every K-th step (1-based step numbers divisible by K), each listed node's output
fields at the node's own row space, in row order, and the step's data batch
with them. A step is one directory written atomically (staged under a hidden
name, then renamed)::

    <out>/records/step_00000003/
        tensors.safetensors   every tensor column, keyed "<node>/<field>"
        record.json           the step; per node its rows, tensor names, non-tensor columns
                              as JSON lists (exactly, or named under "skipped" with why),
                              and the data batch's meta fields

Never pickle: a record loads as tensors and JSON, nothing else. Past ``max_gb``
the oldest recorded steps are removed (one warning says so). A resumed run
removes the records of the steps it runs again. ``record: {nodes: [generate]}``
is a rollout dump in exact form (``trainer.dump_rollouts`` writes the readable
one: :mod:`flowrl.store.dumps`).

Example::

    rec = Recorder(Path("runs/grpo"), graph, say=print)
    rec.write(step, collect_records(rec.fields, finished_step.read))
    read_record(Path("runs/grpo"), 3).data       # {"data": DataProto, "generate": DataProto, ...}
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from flowrl.data import DataProto
from flowrl.graph import SOURCE, Graph
from flowrl.errors import RuntimeFailure

RECORDS = "records"
TENSORS, INDEX = "tensors.safetensors", "record.json"
FORMAT = 1


class RecordError(RuntimeFailure):
    """A record that is missing, unreadable, or does not hold what was asked; the message names the file."""


def step_dir(out: Path, step: int) -> Path:
    """The directory of 1-based step ``step``'s record."""
    return Path(out) / RECORDS / f"step_{step:08d}"


def recorded_steps(out: Path) -> list[int]:
    """The 1-based steps with a complete record in run directory ``out``, oldest first."""
    root = Path(out) / RECORDS
    if not root.is_dir():
        return []
    return sorted(int(p.name[5:]) for p in root.glob("step_*") if p.name[5:].isdigit() and (p / INDEX).is_file())


def record_fields(graph: Graph, nodes: list[str]) -> dict[str, list[str]]:
    """Node → the graph names of its output fields (the data source's under ``data``)."""
    out = {SOURCE: [f.name for f in graph.source_fields]}
    out.update({n: list(graph.nodes[n].output_names()) for n in nodes if n in graph.nodes})
    return out


def collect_records(fields: dict[str, list[str]], read: Callable[[list[str]], DataProto]) -> dict[str, DataProto]:
    """Each node's ``fields`` of a finished step, at the node's own row space: ``read(names)`` reads them
    as a consumer does (:attr:`~flowrl.runtime.steps.FinishedStep.read`)."""
    return {node: read(names) for node, names in fields.items() if names}


def _jsonable(values: Any) -> list[Any] | None:
    """A non-tensor column as a JSON list, or None when JSON cannot hold it exactly."""
    rows = [v.item() if isinstance(v, np.generic) else v for v in values]
    try:
        return rows if json.loads(json.dumps(rows)) == rows else None
    except (TypeError, ValueError):
        return None


class Recorder:
    """Writes a run's records (see the module docstring) and keeps them within the budget."""

    def __init__(self, out: Path, graph: Graph, say: Callable[[str], None], keep_through: int = 0) -> None:
        """``keep_through``: a resume after that many steps; the records of later steps go."""
        cfg = graph.config.trainer.record
        assert cfg is not None, "Recorder needs trainer.record"
        self.root, self.say = Path(out) / RECORDS, say
        self.every, self.budget = cfg.every, int(cfg.max_gb * 1e9)
        self.fields = record_fields(graph, cfg.nodes)
        self.meta = {f.name for f in graph.source_fields if f.kind == "meta"}
        self._warned: set[str] = set()
        if self.root.is_dir():
            for stale in self.root.glob(".tmp_*"):  # a run killed while writing one
                shutil.rmtree(stale, ignore_errors=True)
            for step in recorded_steps(out):
                if step > keep_through:
                    shutil.rmtree(step_dir(out, step), ignore_errors=True)
        self.sizes = {s: _size(step_dir(out, s)) for s in recorded_steps(out)}

    def wants(self, step: int) -> bool:
        """Whether 0-based step ``step`` is recorded."""
        return (step + 1) % self.every == 0

    def write(self, step: int, data: dict[str, DataProto]) -> Path:
        """Write 0-based step ``step``'s record atomically, then keep the records within the budget."""
        final = self.root / f"step_{step + 1:08d}"
        tmp = self.root / f".tmp_step_{step + 1:08d}_{os.getpid()}"
        tensors: dict[str, torch.Tensor] = {}
        index: dict[str, Any] = {"format": FORMAT, "step": step + 1, "nodes": {}}
        for node, part in data.items():
            entry: dict[str, Any] = {"rows": len(part), "tensors": [], "objects": {}, "meta": {}, "skipped": {}}
            for name, t in (part.batch.items() if part.batch is not None else []):
                tensors[f"{node}/{name}"] = t.detach().cpu().contiguous().clone()
                entry["tensors"].append(name)
            for name, values in part.non_tensor_batch.items():
                rows = _jsonable(values)
                if rows is None:
                    entry["skipped"][name] = f"values of type {type(values[0]).__name__} that JSON cannot hold"
                    self._warn(f"{node}.{name}", f"record: {node}.{name} is not recorded: "
                               f"{entry['skipped'][name]} (a replay that needs it is refused)")
                else:
                    entry["objects"][name] = rows
            for name in self.meta & set(part.meta_info) if node == SOURCE else ():
                entry["meta"][name] = part.meta_info[name]
            index["nodes"][node] = entry
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            save_file(tensors, str(tmp / TENSORS))
            (tmp / INDEX).write_text(json.dumps(index, default=str))
            for f in (tmp / TENSORS, tmp / INDEX):
                with f.open("rb") as fh:
                    os.fsync(fh.fileno())
            if final.exists():
                shutil.rmtree(final)
            os.rename(tmp, final)  # the step's record appears whole or not at all
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise RecordError(f"cannot write the record of step {step + 1} to {final}: {e.strerror or e}") from None
        self.sizes[step + 1] = _size(final)
        self._keep_budget()
        return final

    def _keep_budget(self) -> None:
        """Oldest steps out while the records exceed ``max_gb`` (the newest always stays)."""
        while sum(self.sizes.values()) > self.budget and len(self.sizes) > 1:
            oldest = min(self.sizes)
            self._warn("budget", f"record: the records exceed trainer.record.max_gb ({self.budget / 1e9:g} GB); "
                       f"removing the oldest recorded steps to stay within it (first: step {oldest})")
            shutil.rmtree(self.root / f"step_{oldest:08d}", ignore_errors=True)
            del self.sizes[oldest]

    def _warn(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            self.say(f"warning: {message}")


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file()) if path.is_dir() else 0


@dataclass
class Record:
    """One step's record: node (``data``: the data batch) → its outputs; the fields it could not hold."""

    path: Path
    data: dict[str, DataProto]
    skipped: dict[str, dict[str, str]]


def read_record(out: Path, step: int) -> Record:
    """1-based step ``step``'s record in run directory ``out``; :class:`RecordError` naming the file
    when it is missing or does not read."""
    where = step_dir(out, step)
    index_path, tensor_path = where / INDEX, where / TENSORS
    if not index_path.is_file():
        have = recorded_steps(out)
        raise RecordError(f"no record of step {step}: {index_path} does not exist (recorded steps: "
                          f"{_ranges(have) or 'none'}; trainer.record in the run's graph says what is recorded)")
    try:
        nodes = json.loads(index_path.read_text())["nodes"]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise RecordError(f"{index_path} is not a readable record index ({type(e).__name__}: {e})") from None
    try:
        tensors = load_file(str(tensor_path))
    except Exception as e:  # noqa: BLE001 - safetensors raises its own types for a truncated or altered file
        raise RecordError(f"{tensor_path} does not read as safetensors ({type(e).__name__}: {e})") from None
    data: dict[str, DataProto] = {}
    for node, entry in nodes.items():
        try:
            cols = {name: tensors[f"{node}/{name}"] for name in entry["tensors"]}
            objects = {name: _objects(rows) for name, rows in entry["objects"].items()}
            data[node] = DataProto.from_dict(cols or None, objects or None, dict(entry["meta"]))
        except Exception as e:  # noqa: BLE001 - an index that does not match its tensors
            raise RecordError(f"{index_path}: node {node!r} does not read ({type(e).__name__}: {e})") from None
    return Record(where, data, {n: e.get("skipped", {}) for n, e in nodes.items()})


def _objects(rows: list[Any]) -> np.ndarray:
    arr = np.empty(len(rows), dtype=object)
    for i, v in enumerate(rows):  # one by one: equal-length lists stay objects, not a 2-D array
        arr[i] = v
    return arr


def _ranges(steps: list[int]) -> str:
    """``[1, 2, 3, 7]`` → ``"1-3, 7"``."""
    out, i = [], 0
    while i < len(steps):
        j = i
        while j + 1 < len(steps) and steps[j + 1] == steps[j] + 1:
            j += 1
        out.append(str(steps[i]) if i == j else f"{steps[i]}-{steps[j]}")
        i = j + 1
    return ", ".join(out)


__all__ = ["RECORDS", "Record", "RecordError", "Recorder", "collect_records", "read_record", "record_fields",
           "recorded_steps", "step_dir"]
