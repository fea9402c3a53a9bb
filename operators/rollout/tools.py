"""Tools the agent loop can call: the ``BaseTool`` API, plain functions as tools, a YAML tool config.

A tool's life in one conversation follows verl's ``BaseTool``: ``create``
(once, with the sample's ``tools_kwargs[name]["create_kwargs"]``) → ``execute``
per call → ``calc_reward`` → ``release``. ``execute`` returns
``(text, reward, metrics)``; the step rewards and ``calc_reward`` add up in the
trajectory's ``tool_reward``, which ``reward.agent`` adds to the score.

A class written to verl's contract works unchanged: ``create`` may return
``(instance_id, ToolResponse)`` and ``execute`` ``(ToolResponse, reward,
metrics)`` (:func:`as_tool_result` reads any object with a ``text``), and a
class that is not a flowrl :class:`BaseTool` (a subclass of verl's
``verl.tools.base_tool.BaseTool``) is built as verl builds it, with a
:class:`ToolSchema`, and called through :class:`ContractTool`.

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
import inspect
import numbers
import threading
import uuid
from pathlib import Path
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import yaml
from pydantic import BaseModel, ConfigDict

from flowrl.errors import ConfigError
from flowrl.graph.registry import ImportPathError, load_object


class ToolConfigError(ConfigError, ValueError):
    """A tool config or tool reference is wrong: names the file, entry and field."""


class ToolResult(NamedTuple):
    """What one call returns: the text the model reads, a step reward, metrics."""

    text: str
    reward: float = 0.0
    metrics: dict = {}


def as_tool_result(value: Any) -> ToolResult:
    """What ``execute`` returned, as a :class:`ToolResult`; ``TypeError`` says what it should have been.

    Accepted: a :class:`ToolResult`, a ``str``, or verl's ``(ToolResponse, reward,
    metrics)`` where the response is a ``str`` or has a ``text`` (``None``: empty).

    Example::

        >>> class ToolResponse:
        ...     text = "85"
        >>> as_tool_result((ToolResponse(), 0.5, {"calls": 1}))
        ToolResult(text='85', reward=0.5, metrics={'calls': 1})
    """
    if isinstance(value, str):
        return ToolResult(value)
    response, reward, metrics = value if isinstance(value, tuple) and len(value) == 3 else (value, 0.0, {})
    text = response if isinstance(response, str) else getattr(response, "text", None)
    if text is None and hasattr(response, "text"):
        text = ""
    if (isinstance(text, str) and isinstance(reward, numbers.Real)
            and (metrics is None or isinstance(metrics, Mapping))):
        return ToolResult(text, float(reward), dict(metrics or {}))
    raise TypeError(f"returned {_describe(value)}; execute returns ToolResult(text, reward, metrics), "
                    "(ToolResponse, reward, metrics) or a str")


def _describe(value: Any) -> str:
    if isinstance(value, tuple):
        return f"a tuple of ({', '.join(type(v).__name__ for v in value)})"
    return f"a {type(value).__name__}"


def truncate_text(text: str, limit: int, side: str) -> str:
    """``text`` cut to ``limit`` characters: keep its start (``right``), its end (``left``) or both ends.

    Example::

        >>> truncate_text("0123456789", 6, "right"), truncate_text("0123456789", 6, "left")
        ('012345...', '...456789')
    """
    if len(text) <= limit:
        return text
    if side == "right":
        return text[:limit] + "..."
    if side == "left":
        return "..." + text[-limit:]
    half = limit // 2
    return text[:half] + "..." + text[len(text) - (limit - half):]


def instance_id_of(created: Any) -> Any:
    """The instance id ``create`` returned: flowrl's ``id`` or verl's ``(id, ToolResponse)``."""
    return created[0] if isinstance(created, tuple) and len(created) == 2 else created


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


async def run_in_thread(call: Callable[[], Any]) -> Any:
    """``call()`` in a daemon thread of its own; awaiting it can be cancelled (a timeout) at any time.

    Not a shared pool: a call that hangs past its timeout is abandoned with its
    thread, so it neither takes a worker from later calls nor keeps the
    process from exiting.
    """
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(value: Any, error: BaseException | None) -> None:
        if not future.done():  # an abandoned call's answer has nobody left to hear it
            future.set_exception(error) if error is not None else future.set_result(value)

    def target() -> None:
        try:
            value, error = call(), None
        except BaseException as err:  # handed to the awaiting task, which says what the tool raised
            value, error = None, err
        try:
            loop.call_soon_threadsafe(settle, value, error)
        except RuntimeError:  # the rollout's event loop has closed: the call was abandoned long ago
            pass

    threading.Thread(target=target, daemon=True, name="flowrl-tool").start()
    return await future


class FunctionTool(BaseTool):
    """A plain (sync or async) typed function as a stateless tool; its return value, as text, is the response.

    A synchronous function runs in a daemon thread of its own
    (:func:`run_in_thread`); past the loop's ``tool_timeout_s`` the call is
    answered with a timeout error and abandoned: a thread cannot be stopped, so
    it finishes in the background (write long-running tools as ``async def``).
    """

    def __init__(self, fn: Callable[..., Any], config: Mapping[str, Any] | None = None):
        self.fn = fn
        super().__init__(config, schema_from_function(fn))

    async def execute(self, instance_id: str, parameters: dict[str, Any], **execute_kwargs: Any) -> ToolResult:
        if inspect.iscoroutinefunction(self.fn):
            value = await self.fn(**parameters)
        else:
            value = await run_in_thread(functools.partial(self.fn, **parameters))
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

    @staticmethod
    def max_reward(config: Mapping[str, Any]) -> float:
        """The most one conversation is paid: ``reward`` for a call with both operands right."""
        return float(config.get("reward", 0.0))

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


def tools_reward_max(node: Mapping[str, Any]) -> float | None:
    """The most a conversation of a node (its config dump) is paid by its tools and environment: the sum of
    its inline tools' declared ``max_reward(config)``; None where one is not declared (a tool config file,
    a function tool, an environment)."""
    if node.get("tool_config") or node.get("tool_functions") or node.get("environment"):
        return None
    total = 0.0
    for entry in node.get("tools") or ():
        target = entry.get("class_name") if isinstance(entry, Mapping) else None
        cls = import_object(target, "tools") if target else None
        if not hasattr(cls, "max_reward"):
            return None
        total += float(cls.max_reward(entry.get("config") or {}))
    return total


def _digit_share(written: str, target: str) -> float:
    return sum(w == t for w, t in zip(written, target)) / max(len(written), len(target), 1)


def import_object(path: str, where: str) -> Any:
    """``pkg.mod:name``, ``pkg.mod.name`` or ``file.py:name`` → the object; errors say ``where``."""
    try:
        return load_object(path)
    except (ImportPathError, SyntaxError) as err:
        raise ToolConfigError(f"{where}: {err}") from err


class ToolSchema(BaseModel):
    """An OpenAI function schema as an object, read as verl's ``OpenAIFunctionToolSchema`` is.

    verl builds its tools with one (``tool.tool_schema.function.name``,
    ``tool_schema.model_dump()``); flowrl's own tools take the plain mapping.
    """

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    class Function(BaseModel):
        model_config = ConfigDict(extra="allow", allow_inf_nan=False)
        name: str
        description: str = ""
        parameters: dict[str, Any] = {"type": "object", "properties": {}, "required": []}

    type: str = "function"
    function: Function


class ContractTool(BaseTool):
    """A tool object written to verl's ``BaseTool`` contract, called as flowrl calls its tools.

    Its methods are called unchanged; their verl-shaped results are read by
    :func:`instance_id_of` and :func:`as_tool_result` in the agent loop.
    """

    def __init__(self, tool: Any):
        schema = tool.tool_schema
        if hasattr(schema, "model_dump"):
            schema = schema.model_dump(exclude_unset=True, exclude_none=True)
        super().__init__(getattr(tool, "config", None), schema)
        self.tool = tool

    async def create(self, instance_id: str | None = None, **create_kwargs: Any) -> Any:
        return await self.tool.create(instance_id, **create_kwargs)

    async def execute(self, instance_id: str, parameters: dict[str, Any], **execute_kwargs: Any) -> Any:
        return await self.tool.execute(instance_id, parameters, **execute_kwargs)

    async def calc_reward(self, instance_id: str, **calc_reward_kwargs: Any) -> float:
        return await self.tool.calc_reward(instance_id, **calc_reward_kwargs)

    async def release(self, instance_id: str, **release_kwargs: Any) -> None:
        await self.tool.release(instance_id, **release_kwargs)


_CONTRACT = ("create", "execute", "calc_reward", "release")


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
    if inspect.isclass(cls) and issubclass(cls, BaseTool):
        return cls(config, entry.get("tool_schema"))
    if not (inspect.isclass(cls) and all(inspect.iscoroutinefunction(getattr(cls, m, None)) for m in _CONTRACT)):
        raise ToolConfigError(f"{where}.class_name: {entry['class_name']!r} is neither a BaseTool subclass nor a "
                              f"class with verl's tool methods (async {', '.join(_CONTRACT)})")
    schema = entry.get("tool_schema")
    try:
        # built as verl's tool registry builds it: keyword arguments, the schema as an object
        return ContractTool(cls(config=config,
                                tool_schema=None if schema is None else ToolSchema.model_validate(schema)))
    except Exception as err:  # the user's constructor or schema: name the entry
        raise ToolConfigError(f"{where}: building {entry['class_name']!r} raised {type(err).__name__}: {err}") from err


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
