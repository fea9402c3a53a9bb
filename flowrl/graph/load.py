"""Loading a graph from a YAML file, a Python module, or a built-in name.

Every problem in the file itself — YAML syntax, an unknown or ill-typed key — is
reported with the file, line and column, all at once, as a
:class:`~flowrl.graph.checks.GraphError`; semantic problems (an unknown
operator, a missing producer) are left to :func:`~flowrl.graph.checks.check`.

Example::

    graph = load_graph("graphs/ppo.yaml")          # a YAML file
    graph = load_graph("graphs/ppo.py")            # the Graph defined in a module
    graph = load_graph("mypkg.graphs:ppo")         # one Graph by import path
    graph = load_graph("grpo")                     # a graph shipped in graphs/
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from flowrl.graph.config import GraphConfig, PoolConfig, ScheduleConfig, TrainerConfig
from flowrl.graph.ir import Graph
from flowrl.graph.problems import GraphError, GraphImportError, GraphProblem, GraphSyntaxError, Location, SchemaError
from flowrl.graph.registry import ImportPathError, load_module


def builtin_graphs_dir() -> Path | None:
    """The ``graphs/`` folder shipped with flowrl (repo checkout or installed data)."""
    here = Path(__file__).resolve()
    for cand in (here.parents[2] / "graphs", here.parents[1] / "graphs"):
        if cand.is_dir():
            return cand
    return None


def builtin_graphs() -> dict[str, Path]:
    root = builtin_graphs_dir()
    return {p.stem: p for p in sorted(root.glob("*.yaml"))} if root else {}


def load_graph(ref: str | Path, overrides: dict[str, Any] | None = None) -> Graph:
    """A graph from a ``.yaml`` file, a ``.py`` file, ``module:attr`` or a built-in name.

    ``overrides`` maps dotted keys (``trainer.steps``) to values applied to a YAML
    graph's data before validation.
    """
    ref_s = str(ref)
    path = Path(ref_s)
    if path.suffix in (".yaml", ".yml"):
        return load_yaml(path, overrides)
    if path.suffix == ".py" or (":" in ref_s and not path.exists()):
        return load_python(ref_s, overrides)
    if ref_s in builtin_graphs():  # a bare name: a local folder or file called "grpo" is no graph file
        return load_yaml(builtin_graphs()[ref_s], overrides)
    names = ", ".join(builtin_graphs()) or "(none found)"
    raise GraphError([SchemaError(
        f"no graph {ref_s!r}: give a .yaml file, a .py file, 'module:graph', or a built-in name",
        location=Location(ref_s), fix=f"built-in graphs: {names}",
    )])


def load_yaml(path: str | Path, overrides: dict[str, Any] | None = None) -> Graph:
    """Parse and validate a YAML graph file."""
    path = Path(path)
    shown = str(path)
    if not path.is_file():
        raise GraphError([GraphSyntaxError(f"no such file: {shown}", location=Location(shown),
                                           fix="check the path")])
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise GraphError([GraphSyntaxError(f"{shown} is not a text file (not UTF-8)", location=Location(shown),
                                           fix="give a YAML graph file")]) from None
    except OSError as e:
        raise GraphError([GraphSyntaxError(f"cannot read {shown}: {e.strerror or e}", location=Location(shown),
                                           fix="check the path and its permissions")]) from None
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except RecursionError:
        raise GraphError([GraphSyntaxError(
            "its values are nested too deeply to read", location=Location(shown),
            fix="a graph file nests a few levels; look for a run of unclosed [ or {")]) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = mark.line + 1 if mark is not None else None
        col = f", column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e)
        raise GraphError([GraphSyntaxError(
            f"malformed YAML{col}: {problem}", location=Location(shown, line),
            fix="check indentation, colons and brackets on that line",
        )]) from None
    problems = _structure_problems(node, shown)
    if problems:
        raise GraphError(problems)
    if not isinstance(data, dict):
        raise GraphError([SchemaError("a graph file must be a mapping with name, roles, pools, data, nodes, ...",
                                      location=Location(shown, 1))])
    lines = _line_index(node)
    config = _validated(data, overrides, lines, shown)
    importable(path.resolve().parent)
    return Graph.from_config(config, source_file=shown, lines=lines)


#: the most values a graph file may hold once its aliases are expanded: a real graph holds a few
#: hundred; a kilobyte of nested aliases (a "billion laughs") expands past any memory
MAX_EXPANDED_VALUES = 100_000
_MERGE = "tag:yaml.org,2002:merge"


def _structure_problems(root: yaml.Node | None, shown: str) -> list[GraphProblem]:
    """What PyYAML accepts but a graph must not hold: aliases that expand past
    :data:`MAX_EXPANDED_VALUES`, and a key written twice in one mapping (YAML keeps the last
    silently, so a node defined twice would lose its first definition without a word)."""
    if root is None:
        return []
    sizes: dict[int, int] = {}

    def size(n: yaml.Node, open_: frozenset[int]) -> int:
        if id(n) in sizes:
            return sizes[id(n)]
        if id(n) in open_:
            return MAX_EXPANDED_VALUES + 1  # an alias that contains itself expands forever
        children = ([x for kv in n.value for x in kv] if isinstance(n, yaml.MappingNode)
                    else n.value if isinstance(n, yaml.SequenceNode) else [])
        total = 1
        for child in children:
            total += size(child, open_ | {id(n)})
            if total > MAX_EXPANDED_VALUES:
                break
        sizes[id(n)] = total
        return total

    if size(root, frozenset()) > MAX_EXPANDED_VALUES:
        return [GraphSyntaxError(
            f"its aliases (*name) expand to more than {MAX_EXPANDED_VALUES:,} values",
            location=Location(shown, root.start_mark.line + 1),
            fix="write the repeated values out, or alias each one once; a graph file needs no nested aliases")]
    problems: list[GraphProblem] = []
    seen: set[int] = set()

    def walk(n: yaml.Node, path: tuple[Any, ...]) -> None:
        if id(n) in seen:  # an aliased node: its keys were checked where it was defined
            return
        seen.add(id(n))
        if isinstance(n, yaml.SequenceNode):
            for i, v in enumerate(n.value):
                walk(v, path + (i,))
        if not isinstance(n, yaml.MappingNode):
            return
        first: dict[Any, int] = {}
        for k, v in n.value:
            if isinstance(k, yaml.ScalarNode) and k.tag != _MERGE:
                line = k.start_mark.line + 1
                if k.value in first:
                    problems.append(_twice(path, k.value, first[k.value], line, shown))
                else:
                    first[k.value] = line
            walk(v, path + (getattr(k, "value", None),))

    walk(root, ())
    return problems


def _twice(path: tuple[Any, ...], key: Any, first: int, again: int, shown: str) -> GraphProblem:
    if path == ("nodes",):
        return SchemaError(f"node {key!r} is defined twice (lines {first} and {again}); YAML would keep only "
                           "the second", node=str(key), location=Location(shown, again),
                           fix="give each node its own name, or delete one definition")
    where = ".".join(str(p) for p in (*path, key))
    return SchemaError(f"key {where!r} is written twice (lines {first} and {again}); YAML would keep only "
                       "the second", location=Location(shown, again), fix="delete one of them")


def _validated(data: dict[str, Any], overrides: dict[str, Any] | None, lines: dict[tuple[Any, ...], int],
               shown: str) -> GraphConfig:
    """``data`` with ``--set`` overrides applied, validated (problems name the file, line and key)."""
    problems: list[GraphProblem] = []
    for key, value in (overrides or {}).items():
        try:
            set_dotted(data, key, value)
        except KeyError as e:
            problems.append(SchemaError(f"--set {key}={value!r}: {e.args[0]}", location=Location(shown),
                                        fix="override a key inside a section (path.to.key=value)"))
    if problems:
        raise GraphError(problems)
    try:
        return GraphConfig.model_validate(data)
    except ValidationError as e:
        raise GraphError(schema_problems(e, lines, shown)) from None


def importable(directory: Path) -> None:
    """Let ``op: mymod:fn`` find ``mymod.py`` next to the graph file, here and in workers started later."""
    entry = str(directory)
    if entry not in sys.path:
        sys.path.append(entry)  # appended: a user's file never shadows an installed package
        parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        os.environ["PYTHONPATH"] = os.pathsep.join([*parts, entry])


def _importable_beside(mod_ref: str) -> None:
    """Resolve a graph module as ``python`` does, here and in every worker: ``mod:graph`` from
    the current directory (the ``flowrl`` script, unlike ``python -m``, does not put it on the
    path), and the modules beside the graph's file (as for a YAML graph)."""
    if mod_ref.endswith(".py") or "/" in mod_ref or "\\" in mod_ref:
        path = Path(mod_ref).expanduser()
        if path.is_file():
            importable(path.resolve().parent)
        return
    importable(Path.cwd().resolve())
    try:
        spec = importlib.util.find_spec(mod_ref)  # runs the parent package's __init__, which may raise
    except Exception:  # noqa: BLE001 - load_module imports it again and names what was raised
        return
    if spec is not None and spec.origin and spec.has_location:
        importable(Path(spec.origin).resolve().parent)


def load_python(ref: str, overrides: dict[str, Any] | None = None) -> Graph:
    """The :class:`Graph` a Python file or module defines (``file.py`` or ``file.py:name``),
    with ``overrides`` (``--set``) applied to its config."""
    mod_ref, _, attr = ref.partition(":") if not ref.endswith(".py") else (ref, "", "")
    try:
        _importable_beside(mod_ref)
        module = load_module(mod_ref)
    except ImportPathError as e:
        raise GraphError([GraphImportError(str(e), location=Location(mod_ref))]) from None
    except SyntaxError as e:
        raise GraphError([GraphSyntaxError(f"Python syntax error: {e.msg}",
                                           location=Location(e.filename, e.lineno))]) from None
    graph = _python_graph(module, mod_ref, attr, ref)
    if not overrides:
        return graph
    config = _validated(graph.config.dump(), overrides, {}, mod_ref)
    return Graph.from_config(config, source_file=graph.source_file)


def _python_graph(module: Any, mod_ref: str, attr: str, ref: str) -> Graph:
    if attr:
        obj = getattr(module, attr, None)
        if not isinstance(obj, Graph):
            raise GraphError([SchemaError(f"{ref!r} is not a graph (decorate a step function with @graph)",
                                          location=Location(mod_ref))])
        return obj
    graphs = [v for v in vars(module).values() if isinstance(v, Graph)]
    if len(graphs) != 1:
        found = ", ".join(g.name for g in graphs) or "none"
        raise GraphError([SchemaError(
            f"{mod_ref} defines {len(graphs)} graphs ({found}); name one as {mod_ref}:<variable>",
            location=Location(mod_ref),
        )])
    return graphs[0]


def set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    """``set_dotted(d, "trainer.steps", 5)`` sets ``d["trainer"]["steps"] = 5``."""
    parts = key.split(".")
    cur = data
    for part in parts[:-1]:
        nxt = cur.get(part)
        if nxt is None:
            nxt = cur[part] = {}
        if not isinstance(nxt, dict):
            raise KeyError(f"{key!r}: {part!r} is not a section")
        cur = nxt
    cur[parts[-1]] = value


def schema_problems(e: ValidationError, lines: dict[tuple[Any, ...], int], file: str | None) -> list[GraphProblem]:
    """One :class:`SchemaError` per pydantic error, located by the error's key path."""
    out: list[GraphProblem] = []
    for err in e.errors():
        loc = tuple(err["loc"])
        path = ".".join(str(x) for x in loc) or "(top level)"
        line = None
        probe = loc
        while probe and line is None:
            line = lines.get(probe)
            probe = probe[:-1]
        node = str(loc[1]) if len(loc) >= 2 and loc[0] == "nodes" else None
        if err["type"] == "extra_forbidden":
            msg, fix = f"unknown key {path!r}", _allowed_keys(loc)
        elif err["type"] == "missing":
            msg, fix = f"missing key {path!r}", "add it"
        else:
            msg, fix = f"{path}: {err['msg']} (got {err.get('input')!r})", ""
        out.append(SchemaError(msg, node=node, location=Location(file, line or lines.get(())), fix=fix))
    return out


def _allowed_keys(loc: tuple[Any, ...]) -> str:
    sections = {"schedule": ScheduleConfig, "trainer": TrainerConfig}
    if loc[:1] == ("pools",) and len(loc) == 3:
        model: Any = PoolConfig
    elif len(loc) == 2 and loc[0] in sections:
        model = sections[loc[0]]
    else:
        model = GraphConfig
    return "allowed keys: " + ", ".join(model.model_fields)


def _line_index(node: yaml.Node | None) -> dict[tuple[Any, ...], int]:
    """Map every key path of a composed YAML document to its 1-based line."""
    out: dict[tuple[Any, ...], int] = {}

    def walk(n: yaml.Node, path: tuple[Any, ...]) -> None:
        out.setdefault(path, n.start_mark.line + 1)
        if isinstance(n, yaml.MappingNode):
            for k, v in n.value:
                key = path + (k.value,)
                out[key] = k.start_mark.line + 1
                walk(v, key)
        elif isinstance(n, yaml.SequenceNode):
            for i, v in enumerate(n.value):
                walk(v, path + (i,))

    if node is not None:
        walk(node, ())
    return out
