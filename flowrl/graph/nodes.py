"""The graph IR's parts: a :class:`Node` (one operator instance, its fields and role) and a
:class:`StateEdge` (a role's update at step t feeding its users at step t+1). :class:`~flowrl.graph.ir.Graph`
builds them from a config and holds them."""

from __future__ import annotations

from dataclasses import dataclass, field

from flowrl.data.fields import Field
from flowrl.graph.config import NodeConfig
from flowrl.graph.problems import Location
from flowrl.graph.spec import OperatorSpec, Params


@dataclass
class Node:
    """One operator instance in the graph."""

    name: str
    config: NodeConfig
    op: OperatorSpec | None = None  # None when the operator could not be resolved
    params: Params | None = None  # None when invalid
    role: str | None = None
    inputs: tuple[Field, ...] = ()  # graph-level field names (after renames)
    outputs: tuple[Field, ...] = ()
    location: Location = field(default_factory=Location)

    @property
    def op_name(self) -> str:
        return self.op.name if self.op is not None else self.config.op

    @property
    def scope(self) -> str:
        return self.op.scope if self.op is not None else "batch"

    @property
    def updates_role(self) -> bool:
        return bool(self.op is not None and self.op.updates_role)

    @property
    def cost(self) -> float:
        if self.config.cost is not None:
            return self.config.cost
        return self.op.cost if self.op is not None else 1.0

    @property
    def timeout_s(self) -> float | None:
        return self.config.timeout_s

    def input_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.inputs)

    def output_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.outputs)

    def op_field(self, graph_field: str) -> str:
        """The operator's own name for a (possibly renamed) graph field."""
        for op_name, g_name in {**self.config.inputs, **self.config.outputs}.items():
            if g_name == graph_field:
                return op_name
        return graph_field


@dataclass(frozen=True)
class StateEdge:
    """``src`` (updating ``role``) at step t feeds ``dst`` at step t+1, at most
    ``staleness`` versions behind."""

    role: str
    src: str
    dst: str
    staleness: int
