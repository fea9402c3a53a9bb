"""The graph language: operators, the graph IR, its two front ends and its checks.

``flowrl.graph`` is both this package and the ``@graph`` decorator (the module
is callable), so the design's ``from flowrl import graph`` / ``@graph(...)``
works while ``flowrl.graph.checks`` stays importable.

Example::

    from flowrl.graph import load_graph
    graph = load_graph("graphs/ppo.yaml")
    graph.check().raise_if_errors()
"""

from __future__ import annotations

import sys
import types
from typing import Any

from flowrl.graph.checks import Report, check
from flowrl.graph.problems import (
    CycleError,
    DataSourceError,
    DuplicateProducerError,
    FieldTypeError,
    GraphError,
    GraphImportError,
    GraphProblem,
    GraphSyntaxError,
    MissingProducerError,
    ParameterError,
    PoolError,
    ResourceError,
    RoleError,
    RoleWithoutPoolError,
    SchemaError,
    UnknownOperatorError,
    UnusedOutputWarning,
)
from flowrl.graph.config import GraphConfig
from flowrl.graph.declare import operator
from flowrl.graph.ir import Graph
from flowrl.graph.nodes import Node, StateEdge
from flowrl.graph.load import builtin_graphs, load_graph
from flowrl.graph.registry import REGISTRY, make_source, role_kind, source
from flowrl.graph.role import Role, Stateful
from flowrl.graph.spec import SOURCE, NoParams, OperatorOutputError, OperatorSpec, Params, StateSpec, TokenMetrics
from flowrl.graph.trace import GraphBuilder, TracedBatch, graph

__all__ = [
    "CycleError", "DataSourceError", "DuplicateProducerError", "FieldTypeError", "Graph", "GraphBuilder",
    "GraphConfig", "GraphError", "GraphImportError", "GraphProblem", "GraphSyntaxError", "MissingProducerError", "Node",
    "NoParams", "OperatorOutputError", "OperatorSpec", "ParameterError", "Params", "PoolError", "REGISTRY",
    "Report", "ResourceError", "Role", "RoleError", "RoleWithoutPoolError", "SOURCE", "SchemaError", "StateEdge", "StateSpec", "Stateful",
    "TokenMetrics", "TracedBatch", "UnknownOperatorError", "UnusedOutputWarning", "builtin_graphs", "check", "graph",
    "load_graph", "make_source", "operator", "role_kind", "source",
]


class _CallableModule(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return graph(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
