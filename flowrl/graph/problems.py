"""What can be wrong with a graph, as data: locations, build problems, checker problems.

The bottom of :mod:`flowrl.graph` with :mod:`flowrl.graph.spec`: it imports
nothing else from the package, so the IR (which records build problems), the
loaders (which raise syntax errors) and the checks all share these types.

Example::

    raise GraphError([SchemaError("unknown key 'nodez'", location=Location("ppo.yaml", 3))])
"""

from __future__ import annotations

import difflib
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


# --- pydantic errors of settings, in words -----------------------------------------------------

def pydantic_message(err: dict[str, Any]) -> str:
    """One pydantic error of a node's, a role's or the data source's settings, in words."""
    loc = ".".join(str(x) for x in err["loc"])
    if err["type"] == "extra_forbidden":
        return f"unknown parameter {loc!r}"
    if err["type"] == "missing":
        return f"missing required parameter {loc!r}"
    got = err.get("input")
    return f"parameter {loc!r}: {err['msg']} (got {got!r})" if loc else f"{err['msg']} (got {got!r})"


def parameter_fix(model: type, err: dict[str, Any]) -> str:
    """What to do about one pydantic error of ``model``: for an unknown key, the closest valid one
    and the keys valid at that level; otherwise what the value must be."""
    loc = [str(x) for x in err["loc"]]
    if err["type"] == "extra_forbidden":
        names = _field_names(model, loc[:-1])
        close = difflib.get_close_matches(loc[-1], names, n=1) if loc else []
        listed = f"valid parameters: {', '.join(names)}" if names else "it takes no parameters"
        return f"did you mean {close[0]!r}? {listed}" if close else listed
    where = ".".join(loc) or "the value"
    if err["type"] == "missing":
        return f"set {where!r}"
    return f"change {where!r}: {err['msg'][:1].lower()}{err['msg'][1:]}"


def _field_names(model: type, path: list[str]) -> list[str]:
    """The field names of ``model``'s nested model at ``path`` (its own where the path leaves models)."""
    for key in path:
        field = getattr(model, "model_fields", {}).get(key)
        inner = field.annotation if field is not None else None
        if not (isinstance(inner, type) and hasattr(inner, "model_fields")):
            break
        model = inner
    return list(getattr(model, "model_fields", {}))
