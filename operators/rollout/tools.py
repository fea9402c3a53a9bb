"""Tools the agent loop can call: the ``BaseTool`` API, plain functions as tools, a YAML tool config.

A tool's life in one conversation follows verl's ``BaseTool``: ``create``
(once, with the sample's ``tools_kwargs[name]["create_kwargs"]``) → ``execute``
per call → ``calc_reward`` → ``release``. ``execute`` returns
``(text, reward, metrics)``; the step rewards and ``calc_reward`` add up in the
trajectory's ``tool_reward``, which ``reward.agent`` adds to the score.

A typed Python function is a tool; its schema comes from the signature and the
docstring, and its arguments are checked against the annotations before it runs::

    >>> def mul(a: int, b: int) -> int:
    ...     '''Multiply two integers.'''
    ...     return a * b
    >>> tool = FunctionTool(mul)
    >>> tool.tool_schema["function"]["parameters"]["properties"]
    {'a': {'type': 'integer'}, 'b': {'type': 'integer'}}
    >>> tool.check_arguments({"a": 2, "b": "3"})
    "argument 'b' of 'mul' must be integer, got str"

A YAML tool config (verl's layout) names classes or functions::

    tools:
      - class_name: operators.rollout.tools.AddTool      # a BaseTool subclass
        config: {reward: 0.1}
        tool_schema: {type: function, function: {name: add, description: ..., parameters: {...}}}
      - function: mypkg.tools:search                      # a typed function
"""

from __future__ import annotations

import abc
import asyncio
import functools
import importlib
import importlib.util
import inspect
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import yaml


class ToolConfigError(ValueError):
    """A tool config or tool reference is wrong: names the file, entry and field."""


class ToolResult(NamedTuple):
    """What one call returns: the text the model reads, a step reward, metrics."""

    text: str
    reward: float = 0.0
    metrics: dict = {}


class BaseTool(abc.ABC):
    """A tool with per-conversation state (verl's ``BaseTool`` API).

    Subclass it and override :meth:`execute` (and :meth:`create`,
    :meth:`calc_reward`, :meth:`release` when the tool keeps state). ``config``
    is the YAML entry's ``config`` mapping; ``tool_schema`` the OpenAI function
    schema the model is shown.
    """

    def __init__(self, config: Mapping[str, Any] | None = None, tool_schema: Mapping[str, Any] | None = None):
        self.config = dict(config or {})
        if tool_schema is None:
            raise ToolConfigError(f"{type(self).__name__}: a tool needs an OpenAI function schema "
                                  "({type: function, function: {name, description, parameters}})")
        self._schema = dict(tool_schema)
        self.name = self._schema.get("function", {}).get("name") or ""
        if not self.name:
            raise ToolConfigError(f"{type(self).__name__}: the tool schema has no function.name")
        self._instances: dict[str, dict[str, Any]] = {}

    @property
    def tool_schema(self) -> dict[str, Any]:
        """The OpenAI function schema (``{"type": "function", "function": {...}}``)."""
        return self._schema

    def check_arguments(self, arguments: Mapping[str, Any]) -> str | None:
        """``None`` when ``arguments`` fit the schema's parameters; else what is wrong."""
        params = self._schema.get("function", {}).get("parameters") or {}
        properties: dict[str, Any] = params.get("properties") or {}
        for name in params.get("required") or []:
            if name not in arguments:
                return f"{self.name!r} needs argument {name!r}"
        for name, value in arguments.items():
            if name not in properties:
                return f"{self.name!r} has no argument {name!r} (it takes {', '.join(properties) or 'none'})"
            expected = properties[name].get("type")
            if expected and not _is_json_type(value, expected):
                return f"argument {name!r} of {self.name!r} must be {expected}, got {type(value).__name__}"
        return None

    async def create(self, instance_id: str | None = None, **create_kwargs: Any) -> str:
        """Start the tool's state for one conversation; returns its instance id."""
        instance_id = instance_id or uuid.uuid4().hex
        self._instances[instance_id] = dict(create_kwargs)
        return instance_id

    @abc.abstractmethod
    async def execute(self, instance_id: str, parameters: dict[str, Any], **execute_kwargs: Any) -> ToolResult:
        """Run one call; the text goes back to the model."""

    async def calc_reward(self, instance_id: str, **calc_reward_kwargs: Any) -> float:
        """The tool's reward for the whole conversation, added to the step rewards (0 by default)."""
        return 0.0

    async def release(self, instance_id: str, **release_kwargs: Any) -> None:
        """Free the conversation's state."""
        self._instances.pop(instance_id, None)


_JSON_TYPES: dict[str, Callable[[Any], bool]] = {
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "string": lambda v: isinstance(v, str),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
}
_PY_TO_JSON = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array", dict: "object"}


def _is_json_type(value: Any, expected: str | list[str]) -> bool:
    kinds = [expected] if isinstance(expected, str) else list(expected)
    return any(_JSON_TYPES.get(k, lambda v: True)(value) for k in kinds)


def schema_from_function(fn: Callable[..., Any]) -> dict[str, Any]:
    """An OpenAI function schema from ``fn``'s signature (annotations → JSON types) and docstring."""
    properties, required = {}, []
    for name, param in inspect.signature(fn).parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        annotation = param.annotation
        if isinstance(annotation, str):  # from __future__ import annotations
            annotation = {"int": int, "float": float, "str": str, "bool": bool, "list": list, "dict": dict}.get(
                annotation, annotation)
        json_type = _PY_TO_JSON.get(getattr(annotation, "__origin__", annotation))
        properties[name] = {"type": json_type} if json_type else {}
        if param.default is param.empty:
            required.append(name)
    doc = inspect.getdoc(fn) or ""
    return {"type": "function", "function": {
        "name": fn.__name__, "description": doc.split("\n\n")[0].strip(),
        "parameters": {"type": "object", "properties": properties, "required": required}}}


#: where synchronous tools run: not asyncio's default executor, which ``asyncio.run`` waits for at
#: the end of a rollout, so a sync tool that hangs past its timeout does not hold the rollout up
_SYNC_TOOL_THREADS = ThreadPoolExecutor(max_workers=8, thread_name_prefix="flowrl-tool")


class FunctionTool(BaseTool):
    """A plain (sync or async) typed function as a stateless tool; its return value, as text, is the response.

    A synchronous function runs in a thread; past the loop's ``tool_timeout_s``
    the call is answered with a timeout error, but a thread cannot be stopped:
    it finishes in the background (write long-running tools as ``async def``).
    """

    def __init__(self, fn: Callable[..., Any], config: Mapping[str, Any] | None = None):
        self.fn = fn
        super().__init__(config, schema_from_function(fn))

    async def execute(self, instance_id: str, parameters: dict[str, Any], **execute_kwargs: Any) -> ToolResult:
        if inspect.iscoroutinefunction(self.fn):
            value = await self.fn(**parameters)
        else:
            call = functools.partial(self.fn, **parameters)
            value = await asyncio.get_running_loop().run_in_executor(_SYNC_TOOL_THREADS, call)
        return value if isinstance(value, ToolResult) else ToolResult(str(value))


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


class AddTool(BaseTool):
    """The calculator of ``builtin:tool_add``: ``add(a, b)``, paying up to ``config.reward`` for calling
    it with the conversation's own operands (``create_kwargs`` ``a`` and ``b``).

    The reward is dense, so a policy that copies some digits right is already
    paid a little: ``reward`` × the share of the operands' digits the best call
    got right, position by position (either operand order).

    Example::

        >>> import asyncio
        >>> tool = AddTool({"reward": 0.2})
        >>> async def once(a, b):
        ...     iid = await tool.create(a=37, b=48)
        ...     out = await tool.execute(iid, {"a": a, "b": b})
        ...     return out.text, round(await tool.calc_reward(iid), 3)
        >>> asyncio.run(once(48, 37)), asyncio.run(once(37, 41))
        (('85', 0.2), ('78', 0.15))
    """

    def __init__(self, config: Mapping[str, Any] | None = None, tool_schema: Mapping[str, Any] | None = None):
        super().__init__(config, tool_schema or schema_from_function(add))

    async def execute(self, instance_id: str, parameters: dict[str, Any], **execute_kwargs: Any) -> ToolResult:
        state = self._instances.setdefault(instance_id, {})
        a, b = parameters["a"], parameters["b"]
        metrics = {}
        if "a" in state:
            target = f"{state['a']}{state['b']}"
            share = max(_digit_share(f"{a}{b}", target), _digit_share(f"{b}{a}", target))
            state["best"] = max(state.get("best", 0.0), share)
            metrics = {"right_operands": float(share == 1.0), "digit_share": share}
        return ToolResult(str(add(a, b)), 0.0, metrics)

    async def calc_reward(self, instance_id: str, **calc_reward_kwargs: Any) -> float:
        return float(self.config.get("reward", 0.0)) * self._instances.get(instance_id, {}).get("best", 0.0)


def _digit_share(written: str, target: str) -> float:
    return sum(w == t for w, t in zip(written, target)) / max(len(written), len(target), 1)


def import_object(path: str, where: str) -> Any:
    """``pkg.mod:name``, ``pkg.mod.name`` or ``file.py:name`` → the object; errors say ``where``."""
    if ":" in path:
        module_name, attr = path.rsplit(":", 1)
    elif "." in path:
        module_name, attr = path.rsplit(".", 1)
    else:
        raise ToolConfigError(f"{where}: {path!r} is not an import path; write 'pkg.module:name' or 'file.py:name'")
    try:
        if module_name.endswith(".py"):
            file = Path(module_name)
            spec = importlib.util.spec_from_file_location(file.stem, file)
            if spec is None or not file.is_file():
                raise ToolConfigError(f"{where}: no such file {module_name!r}")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except ImportError as err:
        raise ToolConfigError(f"{where}: cannot import {module_name!r}: {err}") from err
    if not hasattr(module, attr):
        raise ToolConfigError(f"{where}: {module_name!r} has no {attr!r}")
    return getattr(module, attr)


def tool_from_entry(entry: Mapping[str, Any], where: str) -> BaseTool:
    """One YAML entry: ``{class_name, config, tool_schema}`` or ``{function, config}``."""
    if not isinstance(entry, Mapping):
        raise ToolConfigError(f"{where}: each tool is a mapping with 'class_name' or 'function'")
    unknown = set(entry) - {"class_name", "function", "config", "tool_schema"}
    if unknown:
        raise ToolConfigError(f"{where}: unknown keys {sorted(unknown)}; use class_name or function, "
                              "config, tool_schema")
    config = entry.get("config") or {}
    if "function" in entry:
        fn = import_object(str(entry["function"]), f"{where}.function")
        if not callable(fn):
            raise ToolConfigError(f"{where}.function: {entry['function']!r} is not callable")
        return FunctionTool(fn, config)
    if "class_name" not in entry:
        raise ToolConfigError(f"{where}: a tool needs 'class_name' (a BaseTool subclass) or 'function'")
    cls = import_object(str(entry["class_name"]), f"{where}.class_name")
    if not (inspect.isclass(cls) and issubclass(cls, BaseTool)):
        raise ToolConfigError(f"{where}.class_name: {entry['class_name']!r} is not a BaseTool subclass")
    return cls(config, entry.get("tool_schema"))


def load_tool_config(path: str | Path) -> list[BaseTool]:
    """The tools of a YAML tool config file (``tools:`` list, verl's layout)."""
    path = Path(path)
    if not path.is_file():
        raise ToolConfigError(f"tool config {str(path)!r} does not exist (resolved: {path.resolve()})")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ToolConfigError(f"{path}: not valid YAML: {err}") from err
    if not isinstance(data, Mapping) or not isinstance(data.get("tools"), list):
        raise ToolConfigError(f"{path}: a tool config is a mapping with a 'tools' list")
    return [tool_from_entry(e, f"{path}: tools[{i}]") for i, e in enumerate(data["tools"])]


def build_tools(config: str | None = None, functions: Sequence[str] = (),
                entries: Sequence[Mapping[str, Any]] = ()) -> dict[str, BaseTool]:
    """Tools by name from a tool config file, function import paths and inline entries; names must be unique."""
    tools = load_tool_config(config) if config else []
    tools += [tool_from_entry({"function": f}, f"tool_functions[{i}]") for i, f in enumerate(functions)]
    tools += [tool_from_entry(e, f"tools[{i}]") for i, e in enumerate(entries)]
    by_name: dict[str, BaseTool] = {}
    for tool in tools:
        if tool.name in by_name:
            raise ToolConfigError(f"two tools are named {tool.name!r}; tool names must be unique")
        by_name[tool.name] = tool
    return by_name
