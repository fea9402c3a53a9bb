"""Calling a tool (or an environment) from the agent loop: time limit, retries, output read and capped.

Whatever a tool does wrong comes back as a :class:`ToolCallError` the model
is told about, never as an exception: it raises (``tool_exception``), it
outlives ``tool_timeout_s`` (``timeout``: the call is abandoned; a synchronous
tool's thread is left to finish on its own and holds up nothing), or it
returns something that is not a tool result (``bad_tool_output``). A call that
raised or timed out is tried again up to ``tool_retries`` times, waiting
``tool_retry_backoff_s`` (doubled each time) in between.

The text a tool returns is cut to ``max_tool_response_length`` inside the
task that runs the call, so a finished call holds only the capped text while
it waits for its conversation to read it: a batch of tools returning 50 MB
each costs 50 MB per running call, not per conversation. And at most
``max_concurrent_tool_calls`` calls run at once in a worker (the others wait
their turn, outside their time limit), so its memory for uncut outputs is
bounded by that many outputs, whatever the number of conversations.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from typing import Any, Awaitable, Callable, Mapping

from operators.rollout.conversation import AgentConfig
from operators.rollout.tool_parsers import ToolCall, ToolCallError
from operators.rollout.tools import BaseTool, ToolResult, as_tool_result, truncate_text

log = logging.getLogger(__name__)

#: failures worth another try; a wrong call or a wrong result type would fail the same way again
TRANSIENT = ("timeout", "tool_exception")

#: the running calls' gate of each event loop: a worker's conversations share one loop (``run_rollouts``)
_GATES: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, tuple[int, asyncio.Semaphore]]" = (
    weakref.WeakKeyDictionary())


def _gate(limit: int) -> asyncio.Semaphore:
    """The semaphore that lets ``limit`` tool calls of this event loop run at once."""
    loop = asyncio.get_running_loop()
    held = _GATES.get(loop)
    if held is None or held[0] != limit:
        held = _GATES[loop] = (limit, asyncio.Semaphore(limit))
    return held[1]


async def call_with_limits(call: Callable[[], Awaitable[Any]], timeout_s: float, name: str,
                           kinds: tuple[str, str] = ("env_timeout", "env_exception")) -> Any:
    """``await call()`` within ``timeout_s``; a timeout or an exception comes back as a :class:`ToolCallError`.

    ``kinds`` names the two errors (a timeout, an exception) for the metrics.
    """
    try:
        return await asyncio.wait_for(call(), timeout_s)
    except asyncio.TimeoutError:
        return ToolCallError(kinds[0], f"{name!r} did not answer within {timeout_s:g}s")
    except Exception as err:  # the tool's or environment's bug is the conversation's problem, not the run's
        log.debug("%s raised", name, exc_info=True)
        return ToolCallError(kinds[1], f"{name!r} failed: {type(err).__name__}: {err}")


async def execute_tool(tool: BaseTool, instance_id: Any, call: ToolCall, execute_kwargs: Mapping[str, Any],
                       cfg: AgentConfig) -> tuple[ToolResult | ToolCallError, int]:
    """One call of ``tool``, with ``cfg``'s timeout, retries and output cap: ``(outcome, retries taken)``."""

    async def once() -> ToolResult | ToolCallError:
        value = await tool.execute(instance_id, call.arguments, **execute_kwargs)
        try:
            result = as_tool_result(value)
        except TypeError as err:
            log.warning("tool %s: %s", call.name, err)
            return ToolCallError("bad_tool_output", f"{call.name!r} {err}")
        # cut here, in the call's own task, before the result waits for the conversation to read it
        text = truncate_text(result.text, cfg.max_tool_response_length, cfg.tool_response_truncate_side)
        return result._replace(text=text)

    async def gated() -> ToolResult | ToolCallError:
        async with _gate(cfg.max_concurrent_tool_calls):  # waiting for a turn is not the tool's time
            return await call_with_limits(once, cfg.tool_timeout_s, call.name, ("timeout", "tool_exception"))

    retries = 0
    outcome = await gated()
    while isinstance(outcome, ToolCallError) and outcome.kind in TRANSIENT and retries < cfg.tool_retries:
        await asyncio.sleep(cfg.tool_retry_backoff_s * 2 ** retries)
        retries += 1
        outcome = await gated()
    return outcome, retries
