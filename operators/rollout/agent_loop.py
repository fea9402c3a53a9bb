"""The agent loop: multi-turn rollouts with tools, environments and simulated users, token in / token out.

Each conversation is a small state machine over one explicit record
(:class:`Conversation`), run concurrently with the others (``asyncio``)::

    PENDING → GENERATING → (TOOL_CALLING | INTERACTING → GENERATING)* → COMPLETED | FAILED

:class:`AgentLoop` has one handler per state — :meth:`~AgentLoop.handle_pending`
(tool instances, the environment's first turn), :meth:`~AgentLoop.handle_generating`
(one assistant turn), :meth:`~AgentLoop.handle_tool_calling`,
:meth:`~AgentLoop.handle_interacting` (an environment or simulated user) — each
returning the next state, and :meth:`~AgentLoop.handle_done` once it ends.
Another loop overrides one handler and registers under a name::

    @register_agent_loop("no_tools_after_two")
    class Impatient(AgentLoop):
        async def handle_tool_calling(self, conv):
            if conv.traj.assistant_turns >= 2:
                return self.end(conv, STOP)
            return await super().handle_tool_calling(conv)

and a sample picks it with the dataset's ``agent_name`` column (verl's name;
``rollout.multi_turn``'s ``agent_loop`` is the default, ``tool_agent``).

A conversation ends with a finish reason: ``stop`` (the model answered and
nothing asked for more), ``length`` (the response budget or the context ran
out, or a turn hit its token limit), ``max_turns`` (``max_assistant_turns`` or
``max_user_turns`` reached while the conversation wanted to go on) or
``tool_error`` (``max_tool_errors`` failed calls). What the model or a tool gets
wrong (a malformed call, a tool that raises, times out or answers with the
wrong type, an environment likewise) is an error turn the model reads and a
counted ``multi_turn/tool_errors/<kind>``, never an exception.

The response is one id list with a mask: 1 on sampled tokens, 0 on everything
the template and the tools added (:mod:`operators.rollout.turns`); log-probs
exist only where the mask is 1, and a cut at the response budget cuts ids,
mask and log-probs together. Turns are served by a generator from
:mod:`operators.rollout.batching`.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Mapping, Sequence

from flowrl.graph.registry import ImportPathError, load_object
from operators.rollout.conversation import (
    DONE_STATES, LENGTH, MAX_TURNS, STOP, TOOL_ERROR, AgentConfig, AgentLoopError, Generation, Request,
    RequestState, Trajectory, turn_seed,
)
from operators.rollout.envs import EnvStep, Environment
from operators.rollout.tool_calls import call_with_limits, execute_tool
from operators.rollout.tool_parsers import ToolCall, ToolCallError, ToolParser, get_parser, parse_safely
from operators.rollout.tools import BaseTool, instance_id_of, truncate_text
from operators.rollout.turns import TurnRenderer, first_mismatch

# type hints only: declaring operators (``flowrl validate``) does not import transformers
if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)


@dataclass
class Conversation:
    """Everything one conversation's handlers read and write (verl's ``AgentData``).

    ``traj`` is what it produces; the rest is its working state. ``extra`` is
    free for a loop of one's own.
    """

    request: Request
    generator: Any
    traj: Trajectory
    seed: int | None = None
    env: Environment | None = None
    #: conversations the environment asked for (lists of messages), run after this one
    spawned: list[list[dict[str, Any]]] = field(default_factory=list)
    #: tool name → this conversation's instance id
    instances: dict[str, Any] = field(default_factory=dict)
    #: the last assistant turn: as sampled, and its text
    turn: Generation | None = None
    text: str = ""
    #: the calls and call errors parsed from the last assistant turn
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[ToolCallError] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def state(self) -> RequestState:
        return self.traj.state


AGENT_LOOPS: dict[str, type["AgentLoop"]] = {}
DEFAULT_AGENT_LOOP = "tool_agent"


def register_agent_loop(name: str) -> Callable[[type["AgentLoop"]], type["AgentLoop"]]:
    """Class decorator: make an :class:`AgentLoop` subclass selectable as ``agent_name: <name>``."""
    def wrap(cls: type[AgentLoop]) -> type[AgentLoop]:
        old = AGENT_LOOPS.get(name)
        if old is not None and (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
            raise ValueError(f"agent loop {name!r} is registered twice: {old.__module__}.{old.__qualname__} "
                             f"and {cls.__module__}.{cls.__qualname__}; pick another name")
        AGENT_LOOPS[name] = cls
        return cls
    return wrap


def get_agent_loop(name: str) -> type["AgentLoop"]:
    """The loop class registered as ``name``, or named by import path (``pkg.mod:MyLoop``)."""
    if name in AGENT_LOOPS:
        return AGENT_LOOPS[name]
    if ":" in name:
        try:
            cls = load_object(name, what="AgentLoop")
        except (ImportPathError, SyntaxError) as err:
            raise AgentLoopError(f"agent loop {name!r}: {err}") from err
        if isinstance(cls, type) and issubclass(cls, AgentLoop):
            return cls
        raise AgentLoopError(f"agent loop {name!r} is not an AgentLoop subclass")
    raise AgentLoopError(f"unknown agent loop {name!r}; registered: {', '.join(sorted(AGENT_LOOPS))}. Register one "
                         "with operators.rollout.agent_loop.register_agent_loop, or give 'pkg.module:Class'")


@register_agent_loop(DEFAULT_AGENT_LOOP)
class AgentLoop:
    """Runs conversations: generation turns from a generator, tool calls, environment turns.

    ``tools`` by name; ``environment`` a class made per conversation from the
    sample's ``interaction_kwargs`` (an :class:`~operators.rollout.envs.Environment`
    or :class:`~operators.rollout.envs.Interaction`); ``stop_token_ids`` end a turn.
    Subclass it and override one ``handle_*`` method to change one state.
    """

    #: the method that handles each live state
    HANDLERS: Mapping[RequestState, str] = {
        RequestState.PENDING: "handle_pending",
        RequestState.GENERATING: "handle_generating",
        RequestState.TOOL_CALLING: "handle_tool_calling",
        RequestState.INTERACTING: "handle_interacting",
    }

    def __init__(self, tokenizer: PreTrainedTokenizerBase, config: AgentConfig | None = None, *,
                 tools: Mapping[str, BaseTool] | None = None, parser: str | ToolParser = "hermes",
                 environment: type[Environment] | None = None, stop_token_ids: Sequence[int] | None = None,
                 render_tool_schemas: bool = False):
        self.tokenizer = tokenizer
        self.config = config or AgentConfig()
        self.tools = dict(tools or {})
        self.parser = get_parser(parser) if isinstance(parser, str) else parser
        self.environment = environment
        stops = stop_token_ids if stop_token_ids is not None else [tokenizer.eos_token_id]
        self.stop_ids = {int(i) for i in stops if i is not None}
        if not self.stop_ids:
            raise AgentLoopError("the agent loop needs a stop token (the tokenizer has no EOS)")
        schemas = [t.tool_schema for t in self.tools.values()] if render_tool_schemas else None
        self.renderer = TurnRenderer(tokenizer, schemas)

    def run(self, generator: Any, requests: Sequence[Request]) -> list[list[Trajectory]]:
        """Every request's trajectories, in request order (blocking)."""
        return run_rollouts(generator, [(self, r) for r in requests])

    async def rollout(self, generator: Any, request: Request) -> list[Trajectory]:
        """One rollout: the main conversation, then any conversations its environment spawned."""
        env = self.environment(**dict(request.interaction_kwargs)) if self.environment else None
        main = Conversation(request, generator, Trajectory(list(request.prompt_ids)), turn_seed(request.seed, 0),
                            env)
        try:
            await self.conversation(main)
        finally:
            if env is not None:
                await env.close()
        children = await asyncio.gather(*(
            self.conversation(Conversation(
                request, generator, Trajectory(self.renderer.encode(messages, generation_prompt=True)),
                turn_seed(request.seed, k)))
            for k, messages in enumerate(main.spawned, start=1)))
        for child in children:
            child.outcome_messages = main.traj.messages
        trajectories = [main.traj, *children]
        expected = env.trajectories if env is not None else 1
        if len(trajectories) != expected:
            raise AgentLoopError(
                f"environment {type(env).__name__} declares trajectories={expected} per rollout but this one "
                f"made {len(trajectories)}; spawn exactly {expected - 1} conversations per rollout or change "
                "its 'trajectories'")
        return trajectories

    async def conversation(self, conv: Conversation) -> Trajectory:
        """Run one conversation's handlers until it is done; the model's mistakes end up in the trajectory.

        The generator counts the conversation as live from the start of its rollout
        (:func:`run_rollouts`); conversations it spawns become live as it ends, before it
        leaves, so a round of turns never starts without one that is about to ask.
        """
        try:
            while conv.state not in DONE_STATES:
                conv.traj.state = await getattr(self, self.HANDLERS[conv.state])(conv)
            conv.generator.live += len(conv.spawned)
        finally:
            conv.generator.live -= 1
            await self.handle_done(conv)
        return conv.traj

    # --- the states ---

    async def handle_pending(self, conv: Conversation) -> RequestState:
        """Make this conversation's tool instances; the environment may speak first."""
        for name, tool in self.tools.items():
            try:
                conv.instances[name] = instance_id_of(
                    await tool.create(**self._tool_kwargs(conv.request, name, "create_kwargs")))
            except Exception as err:  # a setup bug, not the model's: stop with what and where
                raise AgentLoopError(f"tool {name!r}: create() failed with {type(err).__name__}: {err} "
                                     f"(create_kwargs from the row's extra_info.tools_kwargs.{name})") from err
        if conv.env is not None:
            conv.env.messages = conv.traj.messages
            first = await self._env_call(conv, conv.env.reset, "reset", allow_none=True)
            if first:
                if not self.append_turns(conv.traj, [{"role": conv.env.role, "content": first}]):
                    return self.end(conv, LENGTH)
        return RequestState.GENERATING

    async def handle_generating(self, conv: Conversation) -> RequestState:
        """One assistant turn; then its tool calls, the environment, or the end."""
        traj = conv.traj
        if traj.assistant_turns >= self.config.max_assistant_turns:
            return self.end(conv, MAX_TURNS)
        budget = self._budget(traj)
        if budget <= 0:
            return self.end(conv, LENGTH)
        conv.turn = await conv.generator.generate(traj.prompt_ids + traj.response_ids, budget,
                                                  turn_seed(conv.seed, traj.assistant_turns))
        self._append(traj, conv.turn.ids, [1] * len(conv.turn.ids), conv.turn.log_probs)
        traj.assistant_turns += 1
        conv.text = self.renderer.assistant_text(conv.turn.ids, self.stop_ids)
        traj.messages.append({"role": "assistant", "content": conv.text})
        if conv.turn.finish_reason == LENGTH:
            return self.end(conv, LENGTH)
        conv.calls, conv.errors = parse_safely(self.parser, conv.text) if self.tools else ([], [])
        if conv.calls or conv.errors:
            if traj.assistant_turns >= self.config.max_assistant_turns:
                return self.end(conv, MAX_TURNS)
            return RequestState.TOOL_CALLING
        if conv.env is None:
            return self.end(conv, STOP)
        if traj.user_turns >= self.config.max_user_turns:
            return self.end(conv, MAX_TURNS)
        return RequestState.INTERACTING

    async def handle_tool_calling(self, conv: Conversation) -> RequestState:
        """Run the turn's calls; every reply, answer or error, is a tool turn the model reads next."""
        cfg, traj = self.config, conv.traj
        replies = await self._call_tools(conv)
        if cfg.max_tool_errors is not None and sum(traj.tool_errors.values()) >= cfg.max_tool_errors:
            return self.end(conv, TOOL_ERROR, RequestState.FAILED)
        if not self.append_turns(traj, [{"role": "tool", "content": r} for r in replies]):
            return self.end(conv, LENGTH)
        return RequestState.GENERATING

    async def handle_interacting(self, conv: Conversation) -> RequestState:
        """The environment (or simulated user) answers a turn that called no tool."""
        traj, env = conv.traj, conv.env
        step = await self._env_call(conv, lambda: env.step(conv.text), "step")
        if isinstance(step, str):  # the environment failed: the model reads why, as the user's turn
            traj.user_turns += 1
            if not self.append_turns(traj, [{"role": env.role, "content": step}]):
                return self.end(conv, LENGTH)
            return RequestState.GENERATING
        traj.env_reward += float(step.reward)
        conv.spawned.extend(step.info.get("spawn", []))
        if step.done:
            return self.end(conv, STOP)
        traj.user_turns += 1
        if not self.append_turns(traj, [{"role": env.role, "content": step.observation}]):
            return self.end(conv, LENGTH)
        return RequestState.GENERATING

    async def handle_done(self, conv: Conversation) -> None:
        """Collect the tools' rewards, release their instances, check the tokenisation."""
        traj = conv.traj
        for name, instance in conv.instances.items():
            tool = self.tools[name]
            try:
                traj.tool_reward += float(await tool.calc_reward(
                    instance, **self._tool_kwargs(conv.request, name, "calc_reward_kwargs")))
                await tool.release(instance, **self._tool_kwargs(conv.request, name, "release_kwargs"))
            except Exception:  # counted, like a failing call: one tool's bug does not end the run
                log.warning("tool %s: calc_reward/release raised", name, exc_info=True)
                traj.tool_errors["reward_exception"] += 1
        self._check_tokenization(traj)

    @staticmethod
    def end(conv: Conversation, reason: str, state: RequestState = RequestState.COMPLETED) -> RequestState:
        """End the conversation with ``reason``; returns the final state for a handler to return."""
        conv.traj.finish_reason = reason
        return state

    # --- pieces of a conversation ---

    def _budget(self, traj: Trajectory) -> int:
        cfg = self.config
        budget = cfg.max_response_length - len(traj.response_ids)
        if cfg.max_tokens_per_turn is not None:
            budget = min(budget, cfg.max_tokens_per_turn)
        if cfg.max_model_len is not None:
            budget = min(budget, cfg.max_model_len - len(traj.prompt_ids) - len(traj.response_ids))
        return budget

    def _append(self, traj: Trajectory, ids: Sequence[int], mask: Sequence[int], log_probs: Sequence[float]) -> bool:
        """Append ids, mask and log-probs together, cut together at the response budget; False when cut."""
        room = self.config.max_response_length - len(traj.response_ids)
        traj.response_ids += list(ids)[:room]
        traj.response_mask += list(mask)[:room]
        traj.log_probs += list(log_probs)[:room]
        return len(ids) <= room

    def append_turns(self, traj: Trajectory, messages: list[dict[str, Any]]) -> bool:
        """Append turns from outside the model (masked out, log-prob 0); False when the budget cut them."""
        traj.messages.extend(messages)
        ids = self.renderer.new_turns(messages)
        return self._append(traj, ids, [0] * len(ids), [0.0] * len(ids))

    @staticmethod
    def _tool_kwargs(request: Request, name: str, key: str) -> dict[str, Any]:
        return dict((request.tools_kwargs.get(name) or {}).get(key) or {})

    def _reply(self, text: str) -> str:
        cfg = self.config
        return truncate_text(text, cfg.max_tool_response_length, cfg.tool_response_truncate_side)

    async def _call_tools(self, conv: Conversation) -> list[str]:
        """Each call's reply text, in order; every mistake becomes an error reply and a counted kind."""
        cfg, traj = self.config, conv.traj
        calls, extra = conv.calls[:cfg.max_parallel_calls], conv.calls[cfg.max_parallel_calls:]
        errors = list(conv.errors) + [ToolCallError("too_many_calls", f"at most {cfg.max_parallel_calls} call(s) "
                                                    f"per turn; {call.name!r} was not run") for call in extra]
        outcomes = await asyncio.gather(*(self._call_one(call, conv) for call in calls))
        names = [call.name for call in calls] + [""] * len(errors)
        replies = []
        for name, outcome in zip(names, list(outcomes) + errors):
            traj.tool_calls += 1
            if isinstance(outcome, ToolCallError):
                traj.tool_errors[outcome.kind] += 1
                replies.append(self._reply(outcome.as_text()))
            else:  # already cut to size where the tool's task read it
                traj.tool_successes += 1
                traj.tool_reward += outcome.reward
                traj.tool_metrics.append((name, outcome.metrics))
                replies.append(outcome.text)
        return replies

    async def _call_one(self, call: ToolCall, conv: Conversation) -> Any:
        tool = self.tools.get(call.name)
        if tool is None:
            return ToolCallError("unknown_tool", f"there is no tool {call.name!r}; tools: "
                                                 f"{', '.join(sorted(self.tools))}")
        problem = tool.check_arguments(call.arguments)
        if problem:
            return ToolCallError("bad_arguments", problem)
        outcome, retries = await execute_tool(
            tool, conv.instances[call.name], call, self._tool_kwargs(conv.request, call.name, "execute_kwargs"),
            self.config)
        conv.traj.tool_retries += retries
        return outcome

    async def _env_call(self, conv: Conversation, call: Callable[[], Awaitable[Any]], method: str,
                        allow_none: bool = False) -> Any:
        """An environment's ``reset`` or ``step`` under the tool timeout; a failure is an error text, counted."""
        env = conv.env
        outcome = await call_with_limits(call, self.config.tool_timeout_s, f"{type(env).__name__}.{method}")
        if not isinstance(outcome, ToolCallError):
            expected = str if method == "reset" else EnvStep
            if isinstance(outcome, expected) or (allow_none and outcome is None):
                return outcome
            outcome = ToolCallError("bad_env_output", f"{f'{type(env).__name__}.{method}'!r} returned a "
                                                      f"{type(outcome).__name__}, not {expected.__name__}")
        log.warning("environment %s: %s", type(env).__name__, outcome.message)
        conv.traj.tool_errors[outcome.kind] += 1
        return self._reply(outcome.as_text())

    def _check_tokenization(self, traj: Trajectory) -> None:
        mode = self.config.tokenization_check
        if mode == "off":
            return
        ends_with_prompt = bool(traj.messages) and traj.messages[-1]["role"] != "assistant"
        whole = self.renderer.response_as_whole(traj.messages, ends_with_prompt)
        incremental = traj.response_ids
        if traj.finish_reason == LENGTH:  # a cut response is compared on what it kept
            whole = whole[:len(incremental)]
        traj.tokenization_mismatch = first_mismatch(incremental, whole, mode, self.tokenizer)
        if traj.tokenization_mismatch is not None:
            log.warning("multi-turn tokenisation drift at response position %d: incremental %s vs re-tokenised %s",
                        traj.tokenization_mismatch,
                        incremental[traj.tokenization_mismatch:traj.tokenization_mismatch + 5],
                        whole[traj.tokenization_mismatch:traj.tokenization_mismatch + 5])


def run_rollouts(generator: Any, work: Sequence[tuple[AgentLoop, Request]]) -> list[list[Trajectory]]:
    """Each ``(loop, request)``'s trajectories, in order, all concurrently through one ``generator`` (blocking).

    Requests of different loops share the generator's rounds of turns.
    """
    async def all_of_them() -> list[list[Trajectory]]:
        # every rollout is live before any asks for a turn: the first round waits for all of them
        generator.live += len(work)
        return list(await asyncio.gather(*(loop.rollout(generator, request) for loop, request in work)))

    return asyncio.run(all_of_them())
