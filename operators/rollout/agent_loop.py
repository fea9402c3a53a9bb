"""The agent loop: multi-turn rollouts with tools, environments and simulated users, token in / token out.

Each request is a small state machine, run concurrently with the others
(``asyncio``)::

    PENDING → GENERATING → (TOOL_CALLING | INTERACTING → GENERATING)* → COMPLETED | FAILED

and ends with a finish reason: ``stop`` (the model answered and nothing asked
for more), ``length`` (the response budget or the context ran out, or a turn
hit its token limit), ``max_turns`` (``max_assistant_turns`` or
``max_user_turns`` reached while the conversation wanted to go on) or
``tool_error`` (``max_tool_errors`` failed calls).

**Token in, token out.** The ids the model sampled are kept exactly as sampled;
only the turns that come from outside (tool responses, user turns) are
rendered with the chat template (:class:`TurnRenderer`) and appended. The
response is one id list with a mask: 1 on sampled tokens, 0 on everything the
template and the tools added; log-probs exist only where the mask is 1, and a
cut at the response budget cuts ids, mask and log-probs together.
:func:`first_mismatch` compares the ids built this way with a re-tokenisation
of the whole conversation and reports the first differing position
(``strict``, ``ignore_strippable``: differences that decode to whitespace only
are ignored, or ``off``).

**Engines.** The loop asks a *generator* for one turn at a time
(``await generator.generate(context_ids, max_new_tokens)``).
:class:`BatchingFront` serves it from any engine's batch ``generate`` (the
transformers engine on CPU): requests waiting for a turn are gathered into one
batched call, so a batch of conversations costs one forward loop per round of
turns, not one per conversation. Engines that batch by themselves
(``serves_requests = True``, sglang) are called per request through their
``generate_one`` (sglang's ``async_generate``) by :class:`RequestGenerator`.
"""

from __future__ import annotations

import asyncio
import difflib
import enum
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Mapping, Sequence

import torch
from pydantic import Field

from flowrl.graph import Params
from operators.data.dataset import left_pad, position_ids_from_mask
from operators.rollout.base import RolloutEngine, SamplingParams, derive_seed
from operators.rollout.envs import Environment
from operators.rollout.tool_parsers import ToolCall, ToolCallError, ToolParser, get_parser
from operators.rollout.tools import BaseTool

# type hints only: declaring operators (``flowrl validate``) does not import transformers
if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

STOP, LENGTH, MAX_TURNS, TOOL_ERROR = "stop", "length", "max_turns", "tool_error"
FINISH_REASONS = (STOP, LENGTH, MAX_TURNS, TOOL_ERROR)


class RequestState(enum.Enum):
    """Where a request is in its conversation."""

    PENDING = "pending"
    GENERATING = "generating"
    TOOL_CALLING = "tool_calling"
    INTERACTING = "interacting"
    COMPLETED = "completed"
    FAILED = "failed"


class AgentConfig(Params):
    """The loop's limits. Lengths are in tokens except ``max_tool_response_length`` (characters, as in verl).

    The ``rollout.multi_turn`` operator's parameters extend it.
    """

    max_response_length: int = Field(64, ge=1, description="response tokens in all: sampled + tool + user")
    max_tokens_per_turn: int | None = Field(None, ge=1, description="one assistant turn's limit")
    max_model_len: int | None = Field(None, ge=1, description="prompt + response, checked before each turn")
    max_assistant_turns: int = Field(4, ge=1)
    max_user_turns: int = Field(1, ge=0, description="environment / simulated-user turns")
    max_parallel_calls: int = Field(1, ge=1, description="calls executed per assistant turn")
    max_tool_response_length: int = Field(256, ge=1, description="characters of a tool response kept")
    tool_response_truncate_side: Literal["left", "right", "middle"] = "right"
    tool_timeout_s: float = Field(10.0, gt=0)
    max_tool_errors: int | None = Field(None, ge=1, description="failed calls that end the conversation")
    tokenization_check: Literal["strict", "ignore_strippable", "off"] = "strict"


@dataclass
class Generation:
    """One assistant turn: the sampled ids (stop token last when it stopped), their log-probs, why it ended."""

    ids: list[int]
    log_probs: list[float]
    finish_reason: str


@dataclass
class Request:
    """A conversation to run: the prompt's ids and the sample's ``tools_kwargs`` / ``interaction_kwargs``.

    ``seed`` keys the sampling of every turn (:func:`turn_seed`), so the
    conversation samples the same tokens whatever other conversations share
    its rounds; ``None`` leaves the engine's own generator to it.
    """

    prompt_ids: list[int]
    tools_kwargs: Mapping[str, Any] = field(default_factory=dict)
    interaction_kwargs: Mapping[str, Any] = field(default_factory=dict)
    seed: int | None = None


@dataclass
class Trajectory:
    """A finished conversation: response ids, mask and log-probs, messages, counts and rewards."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    state: RequestState = RequestState.PENDING
    finish_reason: str = ""
    assistant_turns: int = 0
    user_turns: int = 0
    tool_calls: int = 0
    tool_successes: int = 0
    tool_errors: Counter = field(default_factory=Counter)
    #: the ``metrics`` of each successful call, as ``(tool name, metrics)``
    tool_metrics: list[tuple[str, dict]] = field(default_factory=list)
    tool_reward: float = 0.0
    env_reward: float = 0.0
    #: first position where the incremental ids and a re-tokenisation differ (None: they agree or unchecked)
    tokenization_mismatch: int | None = None
    #: for a spawned trajectory: the messages of the rollout's main conversation (whose outcome is scored)
    outcome_messages: list[dict[str, Any]] | None = None

    @property
    def reward(self) -> float:
        """Tool and environment rewards: the row's ``tool_reward`` (``reward.agent`` adds the outcome score)."""
        return self.tool_reward + self.env_reward

    def final_answer(self) -> str:
        """The last assistant message of the conversation that is scored."""
        for message in reversed(self.outcome_messages or self.messages):
            if message["role"] == "assistant":
                return message["content"]
        return ""


class AgentLoopError(RuntimeError):
    """The loop was set up wrong (not a model's mistake: those become tool-error turns)."""


# --- rendering new turns -----------------------------------------------------------------------


class TurnRenderer:
    """Token ids of turns appended to a conversation, rendered by the chat template alone.

    The ids of new messages are those the template adds when they follow a
    fixed base conversation, with the generation prompt for the next assistant
    turn: ``render(base + new, gen) - render(base)``. Nothing already in the
    conversation is re-tokenised.
    """

    BASE = [{"role": "user", "content": "0"}]

    def __init__(self, tokenizer: PreTrainedTokenizerBase, tools: Sequence[Mapping[str, Any]] | None = None):
        self.tokenizer = tokenizer
        self.tools = list(tools) if tools else None
        self._base = self.encode(self.BASE, generation_prompt=False)

    def encode(self, messages: Sequence[Mapping[str, Any]], generation_prompt: bool) -> list[int]:
        """The whole conversation through the chat template, as ids."""
        kwargs = {"tools": self.tools} if self.tools else {}
        text = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=generation_prompt,
                                                  tokenize=False, **kwargs)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def new_turns(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """Ids of ``messages`` appended after an assistant turn, ending with the next generation prompt."""
        ids = self.encode(self.BASE + list(messages), generation_prompt=True)
        if ids[:len(self._base)] != self._base:
            raise AgentLoopError("the chat template renders earlier messages differently once more are "
                                 "appended, so new turns cannot be rendered alone; use a template whose "
                                 "rendering of a conversation is a prefix of the rendering of its continuation")
        return ids[len(self._base):]

    def assistant_text(self, ids: Sequence[int], stop_ids: set[int]) -> str:
        """The text of a sampled turn, its stop token left out (the template writes it)."""
        ids = list(ids)
        if ids and ids[-1] in stop_ids:
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def response_as_whole(self, messages: Sequence[Mapping[str, Any]], ends_with_prompt: bool) -> list[int]:
        """The response part of the conversation re-tokenised in one piece: what :func:`first_mismatch` checks."""
        head = self.encode(self.BASE, generation_prompt=True)
        whole = self.encode(self.BASE + list(messages), generation_prompt=ends_with_prompt)
        return whole[len(head):] if whole[:len(head)] == head else whole


def first_mismatch(incremental: Sequence[int], retokenized: Sequence[int], mode: str,
                   tokenizer: PreTrainedTokenizerBase | None = None) -> int | None:
    """The first position where ``incremental`` and ``retokenized`` differ, or ``None``.

    ``strict``: any difference counts. ``ignore_strippable``: a differing span
    whose two sides both decode to whitespace only is ignored (needs
    ``tokenizer``). ``off``: always ``None``.

    Example::

        >>> first_mismatch([5, 6, 7, 8], [5, 6, 9, 8], "strict")
        2
        >>> first_mismatch([5, 6], [5, 6], "strict") is None
        True
    """
    if mode == "off":
        return None
    if mode not in ("strict", "ignore_strippable"):
        raise ValueError(f"tokenization_check must be 'strict', 'ignore_strippable' or 'off', got {mode!r}")
    incremental, retokenized = list(incremental), list(retokenized)
    if incremental == retokenized:
        return None
    matcher = difflib.SequenceMatcher(a=incremental, b=retokenized, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            continue
        if mode == "ignore_strippable" and tokenizer is not None:
            left = tokenizer.decode(incremental[i1:i2], skip_special_tokens=False)
            right = tokenizer.decode(retokenized[j1:j2], skip_special_tokens=False)
            if not left.strip() and not right.strip():
                continue
        return i1
    return None


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


# --- generators: one turn of one request ---------------------------------------------------------


def turn_seed(seed: int | None, *path: int) -> int | None:
    """The seed of a conversation (``path = (k,)``: the rollout's k-th) or of its turn ``(k, turn)``."""
    return None if seed is None else derive_seed(seed, *path)


def _finish(ids: list[int], log_probs: list[float], budget: int, stop_ids: set[int]) -> Generation:
    """Cut a sampled turn at its first stop token or at ``budget``, and say which ended it."""
    for i, token in enumerate(ids[:budget]):
        if token in stop_ids:
            return Generation(ids[:i + 1], log_probs[:i + 1], STOP)
    return Generation(ids[:budget], log_probs[:budget], LENGTH)


class BatchingFront:
    """Serves single turns from an engine's batch ``generate``: waiting requests share one call.

    A round is launched once every live conversation is waiting for a turn (or
    ``max_wait_s`` after the first one asked, so a slow tool delays no one). The
    batched call runs in a thread, so tools keep running meanwhile. Rows are
    left-padded prompts of different lengths; each row is cut to its own token
    budget afterwards.
    """

    def __init__(self, engine: RolloutEngine, params: SamplingParams, stop_token_ids: set[int],
                 pad_token_id: int, max_wait_s: float = 0.02):
        self.engine, self.params = engine, params
        self.stop_ids, self.pad_token_id = set(stop_token_ids), pad_token_id
        self.max_wait_s = max_wait_s
        self.live = 0
        self.rounds = 0
        self._queue: list[tuple[list[int], int, int | None, asyncio.Future]] = []
        self._arrived: asyncio.Event | None = None
        self._runner: asyncio.Task | None = None

    async def generate(self, context_ids: list[int], max_new_tokens: int, seed: int | None = None) -> Generation:
        loop = asyncio.get_running_loop()
        if self._arrived is None:
            self._arrived = asyncio.Event()
        future: asyncio.Future = loop.create_future()
        self._queue.append((list(context_ids), max_new_tokens, seed, future))
        self._arrived.set()
        if self._runner is None or self._runner.done():
            self._runner = asyncio.ensure_future(self._run())
        return await future

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while self._queue:
            deadline = loop.time() + self.max_wait_s
            while len(self._queue) < self.live and loop.time() < deadline:
                self._arrived.clear()
                try:
                    await asyncio.wait_for(self._arrived.wait(), deadline - loop.time())
                except asyncio.TimeoutError:
                    break
            batch, self._queue = self._queue, []
            try:
                results = await asyncio.to_thread(self._generate, [request[:3] for request in batch])
            except Exception as err:  # the engine failed: every waiting request learns why
                for *_, future in batch:
                    future.set_exception(err)
                continue
            for (*_, future), result in zip(batch, results):
                future.set_result(result)

    def _generate(self, batch: list[tuple[list[int], int, int | None]]) -> list[Generation]:
        self.rounds += 1
        input_ids, attention_mask = left_pad([ids for ids, _, _ in batch], self.pad_token_id)
        params = self.params.model_copy(update={"n": 1, "max_new_tokens": max(n for _, n, _ in batch)})
        seeds = [seed for _, _, seed in batch]
        keyed = {} if None in seeds else {"seeds": torch.tensor(seeds, dtype=torch.int64)}
        out = self.engine.generate(input_ids, attention_mask, params, **keyed)
        results = []
        for row, (_, budget, _) in enumerate(batch):
            length = int(out["response_mask"][row].sum())
            results.append(_finish(out["responses"][row, :length].tolist(),
                                   out["rollout_log_probs"][row, :length].tolist(), budget, self.stop_ids))
        return results


class RequestGenerator:
    """One engine call per turn (``generate_one``): for engines that batch requests themselves (sglang)."""

    def __init__(self, engine: RolloutEngine, params: SamplingParams, stop_token_ids: set[int]):
        self.engine, self.params, self.stop_ids = engine, params, set(stop_token_ids)
        self.live = 0

    async def generate(self, context_ids: list[int], max_new_tokens: int, seed: int | None = None) -> Generation:
        out = await self.engine.generate_one(list(context_ids), self.params, max_new_tokens=max_new_tokens,
                                             **({} if seed is None else {"seed": seed}))
        return _finish(list(out["response_ids"]), list(out["log_probs"]), max_new_tokens, self.stop_ids)


def make_generator(engine: RolloutEngine, params: SamplingParams, stop_token_ids: set[int],
                   pad_token_id: int) -> BatchingFront | RequestGenerator:
    """The right front for ``engine``: per request when it batches by itself, else :class:`BatchingFront`."""
    if getattr(engine, "serves_requests", False):
        return RequestGenerator(engine, params, stop_token_ids)
    return BatchingFront(engine, params, stop_token_ids, pad_token_id)


# --- the loop ------------------------------------------------------------------------------------


class AgentLoop:
    """Runs conversations: generation turns from a generator, tool calls, environment turns.

    ``tools`` by name; ``environment`` a class made per conversation from the
    sample's ``interaction_kwargs`` (an :class:`~operators.rollout.envs.Environment`
    or :class:`~operators.rollout.envs.Interaction`); ``stop_token_ids`` end a turn.
    """

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
        return asyncio.run(self.run_async(generator, requests))

    async def run_async(self, generator: Any, requests: Sequence[Request]) -> list[list[Trajectory]]:
        """All requests concurrently; ``gather`` keeps their order."""
        return list(await asyncio.gather(*(self.rollout(generator, r) for r in requests)))

    async def rollout(self, generator: Any, request: Request) -> list[Trajectory]:
        """One rollout: the main conversation, then any conversations its environment spawned."""
        env = self.environment(**dict(request.interaction_kwargs)) if self.environment else None
        spawned: list[list[dict[str, Any]]] = []
        try:
            main = await self.conversation(generator, request.prompt_ids, request, env, spawned,
                                           turn_seed(request.seed, 0))
        finally:
            if env is not None:
                await env.close()
        children = await asyncio.gather(*(
            self.conversation(generator, self.renderer.encode(messages, generation_prompt=True), request,
                              None, [], turn_seed(request.seed, k))
            for k, messages in enumerate(spawned, start=1)))
        for child in children:
            child.outcome_messages = main.messages
        trajectories = [main, *children]
        expected = env.trajectories if env is not None else 1
        if len(trajectories) != expected:
            raise AgentLoopError(
                f"environment {type(env).__name__} declares trajectories={expected} per rollout but this one "
                f"made {len(trajectories)}; spawn exactly {expected - 1} conversations per rollout or change "
                "its 'trajectories'")
        return trajectories

    async def conversation(self, generator: Any, prompt_ids: Sequence[int], request: Request,
                           env: Environment | None, spawned: list, seed: int | None = None) -> Trajectory:
        """Run one conversation to its end; the model's mistakes end up in the trajectory, never raised."""
        cfg = self.config
        traj = Trajectory(prompt_ids=list(prompt_ids))
        instances = {}
        for name, tool in self.tools.items():
            try:
                instances[name] = await tool.create(**self._tool_kwargs(request, name, "create_kwargs"))
            except Exception as err:  # a setup bug, not the model's: stop with what and where
                raise AgentLoopError(f"tool {name!r}: create() failed with {type(err).__name__}: {err} "
                                     f"(create_kwargs from the row's extra_info.tools_kwargs.{name})") from err
        generator.live += 1
        try:
            if env is not None:
                env.messages = traj.messages
                first = await env.reset()
                if first:
                    if not self._append_turns(traj, [{"role": env.role, "content": first}]):
                        return self._end(traj, LENGTH)
            while True:
                traj.state = RequestState.GENERATING
                if traj.assistant_turns >= cfg.max_assistant_turns:
                    return self._end(traj, MAX_TURNS)
                budget = self._budget(traj)
                if budget <= 0:
                    return self._end(traj, LENGTH)
                turn = await generator.generate(traj.prompt_ids + traj.response_ids, budget,
                                                turn_seed(seed, traj.assistant_turns))
                self._append(traj, turn.ids, [1] * len(turn.ids), turn.log_probs)
                traj.assistant_turns += 1
                text = self.renderer.assistant_text(turn.ids, self.stop_ids)
                traj.messages.append({"role": "assistant", "content": text})
                if turn.finish_reason == LENGTH:
                    return self._end(traj, LENGTH)
                calls, errors = self.parser.parse(text) if self.tools else ([], [])
                if calls or errors:
                    if traj.assistant_turns >= cfg.max_assistant_turns:
                        return self._end(traj, MAX_TURNS)
                    traj.state = RequestState.TOOL_CALLING
                    replies = await self._call_tools(traj, calls, errors, instances, request)
                    if cfg.max_tool_errors is not None and sum(traj.tool_errors.values()) >= cfg.max_tool_errors:
                        return self._end(traj, TOOL_ERROR, RequestState.FAILED)
                    if not self._append_turns(traj, [{"role": "tool", "content": r} for r in replies]):
                        return self._end(traj, LENGTH)
                    continue
                if env is None:
                    return self._end(traj, STOP)
                if traj.user_turns >= cfg.max_user_turns:
                    return self._end(traj, MAX_TURNS)
                traj.state = RequestState.INTERACTING
                step = await env.step(text)
                traj.env_reward += float(step.reward)
                spawned.extend(step.info.get("spawn", []))
                if step.done:
                    return self._end(traj, STOP)
                traj.user_turns += 1
                if not self._append_turns(traj, [{"role": env.role, "content": step.observation}]):
                    return self._end(traj, LENGTH)
        finally:
            generator.live -= 1
            for name, tool in self.tools.items():
                try:
                    traj.tool_reward += float(await tool.calc_reward(
                        instances[name], **self._tool_kwargs(request, name, "calc_reward_kwargs")))
                    await tool.release(instances[name], **self._tool_kwargs(request, name, "release_kwargs"))
                except Exception:  # counted, like a failing call: one tool's bug does not end the run
                    log.warning("tool %s: calc_reward/release raised", name, exc_info=True)
                    traj.tool_errors["reward_exception"] += 1
            self._check_tokenization(traj)

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

    def _append_turns(self, traj: Trajectory, messages: list[dict[str, Any]]) -> bool:
        traj.messages.extend(messages)
        ids = self.renderer.new_turns(messages)
        return self._append(traj, ids, [0] * len(ids), [0.0] * len(ids))

    @staticmethod
    def _end(traj: Trajectory, reason: str, state: RequestState = RequestState.COMPLETED) -> Trajectory:
        traj.finish_reason, traj.state = reason, state
        return traj

    @staticmethod
    def _tool_kwargs(request: Request, name: str, key: str) -> dict[str, Any]:
        return dict((request.tools_kwargs.get(name) or {}).get(key) or {})

    async def _call_tools(self, traj: Trajectory, calls: list[ToolCall], errors: list[ToolCallError],
                          instances: dict[str, str], request: Request) -> list[str]:
        """Each call's reply text, in order; every mistake becomes an error reply and a counted kind."""
        cfg = self.config
        extra = calls[cfg.max_parallel_calls:]
        errors = list(errors) + [ToolCallError("too_many_calls", f"at most {cfg.max_parallel_calls} call(s) "
                                               f"per turn; {call.name!r} was not run") for call in extra]
        run = calls[:cfg.max_parallel_calls]
        outcomes = await asyncio.gather(*(self._call_one(call, instances, request) for call in run))
        names = [call.name for call in run] + [""] * len(errors)
        replies = []
        for name, outcome in zip(names, list(outcomes) + errors):
            traj.tool_calls += 1
            if isinstance(outcome, ToolCallError):
                traj.tool_errors[outcome.kind] += 1
                text = outcome.as_text()
            else:
                traj.tool_successes += 1
                traj.tool_reward += float(outcome.reward)
                traj.tool_metrics.append((name, dict(outcome.metrics or {})))
                text = outcome.text
            replies.append(truncate_text(text, cfg.max_tool_response_length, cfg.tool_response_truncate_side))
        return replies

    async def _call_one(self, call: ToolCall, instances: dict[str, str], request: Request) -> Any:
        tool = self.tools.get(call.name)
        if tool is None:
            return ToolCallError("unknown_tool", f"there is no tool {call.name!r}; tools: "
                                                 f"{', '.join(sorted(self.tools))}")
        problem = tool.check_arguments(call.arguments)
        if problem:
            return ToolCallError("bad_arguments", problem)
        try:
            return await asyncio.wait_for(
                tool.execute(instances[call.name], call.arguments,
                             **self._tool_kwargs(request, call.name, "execute_kwargs")),
                self.config.tool_timeout_s)
        except asyncio.TimeoutError:
            return ToolCallError("timeout", f"{call.name!r} did not answer within {self.config.tool_timeout_s:g}s")
        except Exception as err:  # a tool's bug is the conversation's problem, not the run's
            log.debug("tool %s raised", call.name, exc_info=True)
            return ToolCallError("tool_exception", f"{call.name!r} failed: {type(err).__name__}: {err}")

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


def rollout_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """``multi_turn/*`` metrics: tool calls per sample, call success rate, turns, rewards, finish reasons."""
    n = max(len(trajectories), 1)
    calls = sum(t.tool_calls for t in trajectories)
    metrics = {
        "multi_turn/tool_calls_per_sample": calls / n,
        "multi_turn/tool_success_rate": sum(t.tool_successes for t in trajectories) / calls if calls else 0.0,
        "multi_turn/assistant_turns": sum(t.assistant_turns for t in trajectories) / n,
        "multi_turn/user_turns": sum(t.user_turns for t in trajectories) / n,
        "multi_turn/tool_reward": sum(t.tool_reward for t in trajectories) / n,
        "multi_turn/env_reward": sum(t.env_reward for t in trajectories) / n,
        "multi_turn/tokenization_mismatch": float(sum(t.tokenization_mismatch is not None for t in trajectories)),
    }
    reasons = Counter(t.finish_reason for t in trajectories)
    for reason in FINISH_REASONS:
        metrics[f"multi_turn/finish/{reason}"] = float(reasons.get(reason, 0))
    errors = sum((t.tool_errors for t in trajectories), Counter())
    for kind, count in errors.items():
        metrics[f"multi_turn/tool_errors/{kind}"] = float(count)
    per_tool: dict[str, list[float]] = {}
    for t in trajectories:
        for name, values in t.tool_metrics:
            for key, value in values.items():
                per_tool.setdefault(f"multi_turn/tool/{name}/{key}", []).append(float(value))
    metrics.update({key: sum(v) / len(v) for key, v in per_tool.items()})  # mean over successful calls
    return metrics


def trajectory_tensors(trajectories: Sequence[Trajectory], response_length: int, pad_token_id: int,
                       prompt_length: int = 0) -> dict[str, torch.Tensor]:
    """The rollout fields of ``rollout.generate`` from trajectories, with interior zeros in ``response_mask``.

    ``attention_mask`` is 1 on every real token (tool and user tokens are context
    the model reads); ``response_mask`` is 1 only on sampled tokens;
    ``rollout_log_probs`` is 0 wherever ``response_mask`` is.
    """
    prompts, prompt_mask = left_pad([t.prompt_ids for t in trajectories], pad_token_id,
                                    max([prompt_length] + [len(t.prompt_ids) for t in trajectories]))
    rows = len(trajectories)
    responses = torch.full((rows, response_length), pad_token_id, dtype=torch.long)
    response_mask = torch.zeros((rows, response_length), dtype=torch.long)
    real = torch.zeros((rows, response_length), dtype=torch.long)
    log_probs = torch.zeros((rows, response_length), dtype=torch.float32)
    for i, t in enumerate(trajectories):
        k = min(len(t.response_ids), response_length)
        responses[i, :k] = torch.tensor(t.response_ids[:k], dtype=torch.long)
        response_mask[i, :k] = torch.tensor(t.response_mask[:k], dtype=torch.long)
        real[i, :k] = 1
        log_probs[i, :k] = torch.tensor(t.log_probs[:k], dtype=torch.float32) * response_mask[i, :k]
    attention_mask = torch.cat([prompt_mask, real], dim=-1)
    return {
        "prompts": prompts,
        "responses": responses,
        "response_mask": response_mask,
        "input_ids": torch.cat([prompts, responses], dim=-1),
        "attention_mask": attention_mask,
        "position_ids": position_ids_from_mask(attention_mask),
        "rollout_log_probs": log_probs,
    }
