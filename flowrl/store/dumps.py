"""Rollout dumps: a step's samples as JSON lines, one object per row.

What goes in is what the graph's operators declare worth dumping (``dumped=``
on ``@operator``: the prompts and responses of generation, a reward's scores, the
advantages); the core names none of them. Each column is written under its
graph name, by its declared type: a non-tensor column as text, a ``[B]`` tensor
as a number, an integer ``[B, X]`` column as the text its token ids decode to
(when the data source can decode; else the ids), any other ``[B, X]`` column as
the row's values.

Example::

    write_rollouts(out / "rollouts" / "step_000001.jsonl", data, graph_fields(graph), source.decode)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from flowrl.data import DataProto
from flowrl.data.fields import Field
from flowrl.graph import Graph


def graph_fields(graph: Graph) -> dict[str, Field]:
    """Every field of ``graph`` by its graph name, as its producer declares it."""
    out = {f.name: f for f in graph.source_fields}
    for node in graph.nodes.values():
        out.update({f.name: f for f in node.outputs})
    return out


def row_value(data: DataProto, name: str, i: int, spec: Field | None, decode: Callable[[list[int]], str] | None) -> Any:
    """Row ``i`` of column ``name`` as a JSON value (see the module docstring)."""
    if name in data.non_tensor_batch:
        return str(data.non_tensor_batch[name][i])
    value = data.batch[name][i]
    if value.dim() == 0:
        return value.item()
    if decode is not None and not value.is_floating_point() and spec is not None and spec.dtype != "bool":
        return decode(value.tolist())
    return value.tolist()


def write_rollouts(path: Path, data: DataProto, fields: dict[str, Field],
                   decode: Callable[[list[int]], str] | None = None) -> Path:
    """Write every row of ``data`` (the dumped columns of one step) to ``path`` as JSON lines."""
    cols = [n for n in fields if n in data.non_tensor_batch or (data.batch is not None and n in data.batch.keys())]
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for i in range(len(data)):
            f.write(json.dumps({n: row_value(data, n, i, fields.get(n), decode) for n in cols}) + "\n")
    return path


__all__ = ["graph_fields", "row_value", "write_rollouts"]
