"""Row spaces and reads: which rows of which upstream task a task reads.

The data source yields prompt rows; an operator that ``expands``
(``rollout.generate`` with ``n`` samples) yields ``n`` rows per input row. A
node's outputs live in a *row space*: the expanding nodes since the source. A
consumer reading fields of two spaces gets the coarser one's columns repeated
to match (verl's ``repeat(n, interleave=True)``), so ``ground_truth`` and
``uid`` reach the reward and the GRPO grouping without any user code. A
streamed micro-batch reads its slice of a barrier's output; a barrier reads
every micro-batch of its producer, in order.

Example::

    spaces = row_spaces(graph)
    spaces["generate"].factor            # 8: each prompt became 8 rows
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from flowrl.errors import ConfigError
from flowrl.graph import SOURCE, Graph


class PlanError(ConfigError, ValueError):
    """The graph cannot be planned (e.g. it mixes two unrelated row spaces)."""


@dataclass(frozen=True)
class Space:
    """A row space: the expanding nodes since the source and their factors."""

    path: tuple[tuple[str, int], ...] = ()

    @property
    def factor(self) -> int:
        return math.prod(f for _, f in self.path)

    def extends(self, other: "Space") -> bool:
        return self.path[: len(other.path)] == other.path

    def then(self, node: str, factor: int) -> "Space":
        return self if factor == 1 else Space(self.path + ((node, factor),))


@dataclass(frozen=True)
class Read:
    """What a task reads from one upstream node.

    ``srcs`` are the producer's tasks ``(node, mb)`` whose outputs are
    concatenated in order (``mb`` is ``None`` for a batch-scoped producer and
    for the source's whole batch); ``rows`` slices the result;
    ``repeat`` repeats each row to reach the consumer's space; ``fields`` names
    the columns taken.
    """

    srcs: tuple[tuple[str, int | None], ...]
    fields: tuple[str, ...]
    rows: tuple[int, int] | None = None
    repeat: int = 1


def row_spaces(graph: Graph) -> dict[str, Space]:
    """Node → the row space of its outputs (a :class:`PlanError` where two unrelated ones meet)."""
    spaces: dict[str, Space] = {SOURCE: Space()}
    producers = {f: ps[0] for f, ps in graph.producers().items()}
    for name in graph.topological_order():
        node = graph.nodes[name]
        ins = [spaces[producers[f.name]] for f in node.inputs if f.name in producers]
        space = Space()
        for s in ins:
            if s.extends(space):
                space = s
            elif not space.extends(s):
                raise PlanError(
                    f"node {name!r} reads rows of two unrelated expansions "
                    f"({_space_name(space)} and {_space_name(s)}); rows cannot be matched"
                )
        factor = node.op.expansion(node.params) if node.op is not None and node.params is not None else 1
        spaces[name] = space.then(name, factor)
    return spaces


def _space_name(s: Space) -> str:
    return " × ".join(f"{n}(n={f})" for n, f in s.path) or "the prompts"


def reads_of(graph: Graph, tasks: dict[Any, Any], spaces: dict[str, Space], name: str, mb: int | None,
             src: str, fields: tuple[str, ...], bounds: list[int]) -> list[Read]:
    """What micro-batch ``mb`` of node ``name`` reads of ``fields`` from producer ``src``,
    given the producer's tasks already planned."""
    mine = input_space(graph, spaces, name)
    theirs = spaces[src]
    repeat = mine.factor // theirs.factor
    if src == SOURCE:
        return [Read(((SOURCE, None),), fields, _prompt_rows(bounds, mb, theirs), repeat)]
    src_tasks = sorted((t for t in tasks.values() if t.node == src), key=lambda t: t.mb or 0)
    if mb is None:  # a barrier reads every micro-batch of its producer, in order
        return [Read(tuple(t.key for t in src_tasks), fields, None, repeat)]
    if (src, mb) in tasks:  # streaming to streaming: micro-batch m feeds micro-batch m
        return [Read(((src, mb),), fields, None, repeat)]
    return [Read(((src, None),), fields, _prompt_rows(bounds, mb, theirs), repeat)]


def _prompt_rows(bounds: list[int], mb: int | None, space: Space) -> tuple[int, int] | None:
    if mb is None:
        return None
    return (bounds[mb] * space.factor, bounds[mb + 1] * space.factor)


def input_space(graph: Graph, spaces: dict[str, Space], name: str) -> Space:
    """The finest row space among a node's inputs: the rows it runs on."""
    producers = {f: ps[0] for f, ps in graph.producers().items()}
    space = Space()
    for f in graph.nodes[name].inputs:
        if f.name in producers and spaces[producers[f.name]].extends(space):
            space = spaces[producers[f.name]]
    return space


__all__ = ["PlanError", "Read", "Space", "input_space", "reads_of", "row_spaces"]
