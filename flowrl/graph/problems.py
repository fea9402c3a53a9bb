"""What can be wrong with a graph, as data: locations, build problems, checker problems.

The bottom of :mod:`flowrl.graph` with :mod:`flowrl.graph.spec`: it imports
nothing else from the package, so the IR (which records build problems), the
loaders (which raise syntax errors) and the checks all share these types.

Example::

    raise GraphError([SchemaError("unknown key 'nodez'", location=Location("ppo.yaml", 3))])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar
from flowrl.errors import ConfigError


@dataclass(frozen=True)
class Location:
    """Where something was written: a file and a line, either possibly unknown."""

    file: str | None = None
    line: int | None = None

    def __str__(self) -> str:
        if self.file and self.line:
            return f"{self.file}:{self.line}"
        return self.file or (f"line {self.line}" if self.line else "")


@dataclass
class BuildProblem:
    """A problem met while resolving the config; turned into a checker error."""

    kind: str  # "unknown_operator" | "parameter" | "import" | "source" | "role_kind" | "role_settings"
    message: str
    node: str | None = None
    field: str | None = None
    path: tuple[Any, ...] = ()
    fix: str = ""


class GraphProblem(ConfigError):
    """One thing wrong with a graph definition."""

    severity: ClassVar[str] = "error"
    title: ClassVar[str] = "problem"

    def __init__(
        self,
        message: str,
        *,
        node: str | None = None,
        field: str | None = None,
        location: Location | None = None,
        fix: str = "",
    ) -> None:
        self.message, self.node, self.field, self.fix = message, node, field, fix
        self.location = location or Location()
        super().__init__(str(self))

    def where(self) -> str:
        parts = []
        if str(self.location):
            parts.append(str(self.location))
        if self.node:
            parts.append(f"node {self.node!r}")
        if self.field:
            parts.append(f"field {self.field!r}")
        return ", ".join(parts)

    def __str__(self) -> str:
        where = self.where()
        text = f"{where}: {self.message}" if where else self.message
        return f"{text}\n    fix: {self.fix}" if self.fix else text


class GraphSyntaxError(GraphProblem):
    """The file is not valid YAML (or the Python module did not import)."""

    title = "syntax"


class GraphImportError(GraphProblem):
    """A module the graph names (its ``imports``, a Python graph file, an operator's path) did not import."""

    title = "import"


class SchemaError(GraphProblem):
    """A key is unknown, missing or of the wrong type in the graph file."""

    title = "schema"


class CycleError(GraphProblem):
    """The nodes depend on each other in a loop within one step."""

    title = "cycle"


class MissingProducerError(GraphProblem):
    """A node reads a field nothing produces."""

    title = "missing producer"


class DuplicateProducerError(GraphProblem):
    """Two nodes (or a node and the data source) write the same field."""

    title = "two producers"


class FieldTypeError(GraphProblem):
    """A producer's dtype or shape does not match what a consumer expects."""

    title = "type mismatch"


class UnknownOperatorError(GraphProblem):
    """``op:`` names no registered operator and no importable one."""

    title = "unknown operator"


class ParameterError(GraphProblem):
    """An operator (or data source or role) parameter is unknown, missing or ill-typed."""

    title = "parameter"


class ParameterWarning(GraphProblem):
    """A parameter that is valid but most likely not what the graph means (e.g. a reward for other data)."""

    severity = "warning"
    title = "parameter"


class RoleError(GraphProblem):
    """A node names a role that does not exist, or of the wrong kind, or takes none."""

    title = "role"


class RoleWithoutPoolError(GraphProblem):
    """A role is used but no pool hosts it."""

    title = "role without pool"


class PoolError(GraphProblem):
    """A pool names an unknown role, or a role sits in two pools."""

    title = "pool"


class ResourceError(GraphProblem):
    """The pools ask for more CPUs or GPUs than the cluster has."""

    title = "resources"


class DataSourceError(GraphProblem):
    """The data source is unknown or misconfigured."""

    title = "data source"


class UnresolvedInputWarning(GraphProblem):
    """An input with no producer while some node's operator is unknown (likely its output)."""

    severity = "warning"
    title = "unresolved input"


class UnusedOutputWarning(GraphProblem):
    """A node writes a field nobody reads."""

    severity = "warning"
    title = "unused output"


class GraphError(ConfigError):
    """A graph that cannot run; ``problems`` lists every error found."""

    def __init__(self, problems: list[GraphProblem], warnings: list[GraphProblem] | None = None):
        self.problems = problems
        self.warnings = warnings or []
        n = len(problems)
        body = "\n".join(f"  {i}. [{p.title}] {p}" for i, p in enumerate(problems, 1))
        super().__init__(f"{n} error{'s' if n != 1 else ''} in the graph:\n{body}")


__all__ = [
    "BuildProblem", "CycleError", "DataSourceError", "DuplicateProducerError", "FieldTypeError", "GraphError",
    "GraphProblem", "GraphSyntaxError", "Location", "MissingProducerError", "ParameterError", "ParameterWarning", "PoolError",
    "ResourceError", "RoleError", "RoleWithoutPoolError", "SchemaError", "UnknownOperatorError",
    "UnresolvedInputWarning", "UnusedOutputWarning",
]
