"""Tool-call parsers: the model's text → tool calls, and the calls it got wrong.

A parser never raises on what a model writes: a malformed call comes back as a
:class:`ToolCallError` (its ``kind`` names the mistake, its ``message`` is what
the model is told), which the agent loop turns into a tool-error turn and a
metric. Parsers are looked up by name in :data:`PARSERS`; register another
format with :func:`register_parser`.

The Hermes / Qwen format (``hermes``)::

    >>> calls, errors = HermesToolParser().parse(
    ...     'let me add <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>')
    >>> calls, errors
    ([ToolCall(name='add', arguments={'a': 1, 'b': 2})], [])
    >>> HermesToolParser().parse('<tool_call>{"name": "add", "arguments": {"a": 1')[1][0].kind
    'unclosed_tag'
"""

from __future__ import annotations

import abc
import json
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass(frozen=True)
class ToolCall:
    """One well-formed call: the tool's name and its arguments (a JSON object)."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ToolCallError:
    """A call the loop could not make: ``kind`` (a metric name) and the message sent back to the model.

    Kinds: ``bad_json``, ``unclosed_tag``, ``bad_call`` (no name, arguments not
    an object), ``parser_error`` (a parser raised), ``unknown_tool``,
    ``bad_arguments``, ``tool_exception``, ``timeout``, ``bad_tool_output`` (not
    a ToolResult, a str or verl's ``(ToolResponse, reward, metrics)``),
    ``too_many_calls``; for environments ``env_exception``, ``env_timeout`` and
    ``bad_env_output``; and, counted by the loop, ``reward_exception``: a
    raising ``calc_reward`` or ``release``.
    """

    kind: str
    message: str

    def as_text(self) -> str:
        return f"Error: {self.message}"


class ToolParser(abc.ABC):
    """Finds tool calls in an assistant turn's text."""

    @abc.abstractmethod
    def parse(self, text: str) -> tuple[list[ToolCall], list[ToolCallError]]:
        """``(calls, errors)`` in the order they appear; both empty when the turn calls nothing."""


PARSERS: dict[str, type[ToolParser]] = {}


def register_parser(name: str) -> Callable[[type[ToolParser]], type[ToolParser]]:
    """Class decorator: make a :class:`ToolParser` available as ``tool_parser: <name>``."""
    def wrap(cls: type[ToolParser]) -> type[ToolParser]:
        PARSERS[name] = cls
        return cls
    return wrap


def get_parser(name: str) -> ToolParser:
    """A new parser of the format ``name``; an error listing the known formats otherwise."""
    if name not in PARSERS:
        raise ValueError(f"unknown tool_parser {name!r}; available: {', '.join(sorted(PARSERS))} "
                         "(add one with operators.rollout.tool_parsers.register_parser)")
    return PARSERS[name]()


def call_from_json(payload: str) -> ToolCall | ToolCallError:
    """``{"name": ..., "arguments": {...}}`` → a call; ``arguments`` may also be a JSON string of an object."""
    try:
        obj = json.loads(payload)
    except json.JSONDecodeError as err:
        return ToolCallError("bad_json", f"the tool call is not valid JSON ({err.msg} at char {err.pos})")
    except (ValueError, RecursionError) as err:  # nested too deep, or an integer past Python's digit limit
        return ToolCallError("bad_json", f"the tool call cannot be read as JSON ({_reason(err)})")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCallError("bad_call", 'a tool call needs {"name": "<tool>", "arguments": {...}}')
    arguments = obj.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):  # JSONDecodeError is a ValueError
            return ToolCallError("bad_json", f"the arguments of {obj['name']!r} are not valid JSON")
    if not isinstance(arguments, dict):
        return ToolCallError("bad_call", f"the arguments of {obj['name']!r} must be a JSON object")
    return ToolCall(obj["name"], arguments)


def _reason(err: Exception) -> str:
    return "nested too deeply" if isinstance(err, RecursionError) else str(err).split(":")[0]


def parse_safely(parser: ToolParser, text: str) -> tuple[list[ToolCall], list[ToolCallError]]:
    """``parser.parse(text)``, with whatever a parser raises on model output turned into a ``parser_error``.

    Model output must never fail a batch: a (user-registered) parser that
    raises still gives the model an error turn.
    """
    try:
        return parser.parse(text)
    except Exception as err:  # a parser bug on odd output: the conversation's problem, not the run's
        return [], [ToolCallError("parser_error", f"the tool call could not be parsed ({type(err).__name__})")]


@register_parser("hermes")
class HermesToolParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number per turn (Hermes, Qwen2.5/3)."""

    open_tag, close_tag = "<tool_call>", "</tool_call>"

    def parse(self, text: str) -> tuple[list[ToolCall], list[ToolCallError]]:
        # one forward scan with str.find: a regex's lazy ``(.*?)</tool_call>`` retried from every
        # unclosed open tag is quadratic (8,000 of them took 21.7 s and stalled the event loop)
        calls: list[ToolCall] = []
        errors: list[ToolCallError] = []
        pos = 0
        while (start := text.find(self.open_tag, pos)) >= 0:
            body = start + len(self.open_tag)
            end = text.find(self.close_tag, body)
            if end < 0:  # no close after this tag, so none after any later one either
                errors.append(ToolCallError("unclosed_tag", f"a {self.open_tag} was never closed with {self.close_tag}"))
                break
            result = call_from_json(text[body:end].strip())
            (calls if isinstance(result, ToolCall) else errors).append(result)
            pos = end + len(self.close_tag)
        return calls, errors
