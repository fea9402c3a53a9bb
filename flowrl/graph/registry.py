"""Where graphs find operators, data sources and role kinds by name.

The core names no operator. Packages declare theirs on import and announce the
module through the ``flowrl.operators`` entry-point group (flowrl's own
``operators`` package does); a user's module plugs in by import path
(``op: mypkg.ops:length_penalty``) or through a graph's ``imports:`` list.

A graph's data source is made in one place, :func:`make_source` (the run, its
validation prompts and refills all draw through it).

Example::

    from flowrl.graph.registry import REGISTRY, make_source
    spec = REGISTRY.operator("advantage.gae")
    prompts = make_source(graph.config)          # seeded by trainer.seed
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import sys
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

from pydantic import BaseModel

from flowrl.errors import ConfigError
from flowrl.data.fields import Field
from flowrl.graph.role import Role
from flowrl.graph.spec import OperatorSpec

if TYPE_CHECKING:
    from flowrl.graph.config import GraphConfig

ENTRY_POINT_GROUP = "flowrl.operators"


class UnknownNameError(ConfigError, KeyError):
    """A name that is not registered; ``suggestions`` holds close names."""

    def __init__(self, what: str, name: str, suggestions: list[str], hint: str = ""):
        self.what, self.name, self.suggestions, self.hint = what, name, suggestions, hint
        msg = f"unknown {what} {name!r}"
        if suggestions:
            msg += f"; did you mean {' or '.join(repr(s) for s in suggestions)}?"
        if hint:
            msg += f" {hint}"
        super().__init__(msg)

    def __str__(self) -> str:
        return self.args[0]

    def did_you_mean(self) -> str:
        """``"did you mean 'x' or 'y'? "`` or empty when nothing is close."""
        if not self.suggestions:
            return ""
        return f"did you mean {' or '.join(repr(s) for s in self.suggestions)}? "


class ImportPathError(ConfigError, ImportError):
    """``module:attr`` could not be imported."""


@dataclass(frozen=True)
class SourceSpec:
    """A data source kind (``builtin:copy``, ``parquet``...): its columns and config."""

    kind: str
    fields: Callable[[BaseModel], tuple[Field, ...]]
    config: type[BaseModel]
    factory: Callable[..., Any]
    doc: str = ""


@dataclass(frozen=True)
class RoleKind:
    """A kind of role (``policy``, ``value``...): its config schema and how to build it."""

    kind: str
    config: type[BaseModel]
    factory: Callable[..., Any]
    doc: str = ""


def load_object(path: str, what: str = "name") -> Any:
    """Import ``pkg.mod:attr``, ``path/to/file.py:attr`` or ``pkg.mod.attr`` and return the attribute.

    The one loader for everything a graph names by import path: operators,
    reward functions, tools, environments, agent loops. ``attr`` may be dotted
    (``mod:Class.method``); ``what`` names the kind of object in the message
    when ``path`` has no module part. Raises :class:`ImportPathError`.

    Example::

        >>> load_object("operators.rewards.rule:exact_match_score").__name__
        'exact_match_score'
        >>> load_object("operators.rewards.rule.exact_match_score").__name__
        'exact_match_score'
    """
    if ":" in path:
        mod_name, _, attr = path.rpartition(":")
    elif "." in path and not path.endswith(".py"):
        mod_name, _, attr = path.rpartition(".")  # verl's class_name form
    else:
        mod_name, attr = "", ""
    if not mod_name or not attr:
        raise ImportPathError(f"{path!r} is not an import path: expected 'package.module:{what}' or "
                              f"'path/to/file.py:{what}'")
    module = load_module(mod_name)
    try:
        obj: Any = module
        for part in attr.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        raise ImportPathError(f"module {mod_name!r} has no attribute {attr!r}") from None
    return obj


def load_module(name: str) -> Any:
    """Import a module by dotted name or by file path (``graphs/ppo.py``); a file is run once per process."""
    if name.endswith(".py") or "/" in name or "\\" in name:
        path = Path(name).expanduser()
        if not path.is_file():
            raise ImportPathError(f"Python file {str(path)!r} does not exist (resolved: {path.resolve()})")
        mod_name = f"_flowrl_user_{abs(hash(str(path.resolve())))}"
        if mod_name in sys.modules:
            return sys.modules[mod_name]
        spec = importlib.util.spec_from_file_location(mod_name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = module
        try:
            spec.loader.exec_module(module)
        except SyntaxError:
            del sys.modules[mod_name]
            raise
        except Exception as e:
            del sys.modules[mod_name]
            raise ImportPathError(f"running {path} raised {type(e).__name__}: {e}") from e
        except BaseException:
            del sys.modules[mod_name]
            raise
        return module
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        raise ImportPathError(f"cannot import module {name!r}: {e}") from e
    except SyntaxError:
        raise
    except Exception as e:  # the user's module itself failed: say which, and what it raised
        raise ImportPathError(f"importing module {name!r} raised {type(e).__name__}: {e}") from e


class Registry:
    """Operators, data sources and role kinds, by name."""

    def __init__(self) -> None:
        self.operators: dict[str, OperatorSpec] = {}
        self.sources: dict[str, SourceSpec] = {}
        self.roles: dict[str, RoleKind] = {}
        self._plugins_loaded = False

    # -- declaring
    def add_operator(self, spec: OperatorSpec) -> None:
        old = self.operators.get(spec.name)
        if old is not None and old.module != spec.module:
            raise ValueError(
                f"operator {spec.name!r} is declared twice: in {old.module} and in {spec.module}"
            )
        self.operators[spec.name] = spec

    def add_source(self, spec: SourceSpec) -> None:
        self.sources[spec.kind] = spec

    def add_role_kind(self, spec: RoleKind) -> None:
        self.roles[spec.kind] = spec

    # -- plugins
    def load_plugins(self) -> None:
        """Import every module announced under the ``flowrl.operators`` entry points (once)."""
        if self._plugins_loaded:
            return
        self._plugins_loaded = True
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            importlib.import_module(ep.value.split(":")[0])

    # -- finding
    def operator(self, name: str) -> OperatorSpec:
        """An operator by registered name or by import path (``mypkg.ops:length_penalty``)."""
        if ":" in name:
            obj = load_object(name)
            if not isinstance(obj, OperatorSpec):
                raise ImportPathError(f"{name!r} is not an operator: decorate it with @flowrl.graph.declare")
            return obj
        self.load_plugins()
        if name not in self.operators:
            raise UnknownNameError(
                "operator", name, difflib.get_close_matches(name, list(self.operators), n=3, cutoff=0.5),
                "List them with `flowrl ops`; a module of your own is named as 'package.module:function'.",
            )
        return self.operators[name]

    def source(self, kind: str) -> SourceSpec:
        self.load_plugins()
        if kind not in self.sources:
            raise UnknownNameError(
                "data source", kind, difflib.get_close_matches(kind, list(self.sources), n=3, cutoff=0.5)
            )
        return self.sources[kind]

    def role_kind(self, kind: str) -> RoleKind:
        self.load_plugins()
        if kind not in self.roles:
            raise UnknownNameError(
                "role kind", kind, difflib.get_close_matches(kind, list(self.roles), n=3, cutoff=0.5)
            )
        return self.roles[kind]


REGISTRY = Registry()


def source_kind(source: str) -> str:
    """The registered kind a ``data.source`` names: ``builtin:copy`` → ``builtin``; a path → ``file``."""
    return source.split(":", 1)[0] if ":" in source else "file"


def make_source(config: GraphConfig, *, seed: int | None = None, split: str | None = None) -> Any:
    """The data source ``config.data`` declares, built by its registered factory with the graph's roles
    (a source may take its tokenizer from a role's model): seeded by ``trainer.seed`` unless ``seed``
    is given; ``split="val"`` for the held-out prompts (default: the factory's own, the training split).

    Example::

        source = make_source(graph.config)
        batch = next(source)
    """
    spec = REGISTRY.source(source_kind(config.data.source))
    data = spec.config.model_validate(config.data.dump())
    extra = {} if split is None else {"split": split}
    return spec.factory(data, seed=config.trainer.seed if seed is None else seed, roles=config.roles, **extra)


def source(kind: str, *, config: type[BaseModel], fields: Callable[[Any], Mapping[str, str | Field]]):
    """Declare a data source kind; ``fields(config)`` names the columns it yields.

    Example::

        @source("builtin", config=BuiltinData, fields=lambda c: {"input_ids": "int64[B, P]", ...})
        def builtin_source(config, seed): ...
    """

    def wrap(factory: Callable[..., Any]) -> Callable[..., Any]:
        def to_fields(cfg: Any) -> tuple[Field, ...]:
            return tuple(
                f.renamed(n) if isinstance(f, Field) else Field.parse(n, f) for n, f in fields(cfg).items()
            )

        REGISTRY.add_source(SourceSpec(kind, to_fields, config, factory, factory.__doc__ or ""))
        return factory

    return wrap


def role_kind(kind: str, *, config: type[BaseModel]):
    """Declare a role kind (``policy``, ``value``...) and the class that implements it.

    The class is built as ``factory(config, ctx)`` on each worker of the role's
    pool and derives from :class:`~flowrl.graph.role.Role`, the contract the
    worker calls: weights out and in (syncs between pools), the weight version
    it is told after each change, held bytes, close; a role with checkpoint
    state is also :class:`~flowrl.graph.role.Stateful`.
    """

    def wrap(factory: Callable[..., Any]) -> Callable[..., Any]:
        if isinstance(factory, type) and not issubclass(factory, Role):
            raise TypeError(f"role kind {kind!r}: class {factory.__name__} must derive from flowrl.graph.Role, "
                            f"the contract the runtime's worker calls")
        REGISTRY.add_role_kind(RoleKind(kind, config, factory, factory.__doc__ or ""))
        return factory

    return wrap
