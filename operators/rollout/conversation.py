"""What a conversation of the agent loop is made of: its limits, its request, its record and its result.

The agent loop (:mod:`operators.rollout.agent_loop`) drives each conversation
through :class:`RequestState` s; this module holds the plain data it works on
and how finished conversations become the rows of ``rollout.multi_turn``
(:func:`trajectory_tensors`) and its ``multi_turn/*`` metrics
(:func:`rollout_metrics`). It runs nothing.
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Sequence

import torch
from pydantic import Field

from flowrl.errors import RunError
from flowrl.data.metrics import mean, total
from flowrl.graph import Params
from flowrl.timeouts import TOOL_CALL_S
from operators.data.dataset import left_pad, position_ids_from_mask
from operators.rollout.base import derive_seed

STOP, LENGTH, MAX_TURNS, TOOL_ERROR = "stop", "length", "max_turns", "tool_error"
FINISH_REASONS = (STOP, LENGTH, MAX_TURNS, TOOL_ERROR)


class RequestState(enum.Enum):
    """Where a conversation is; the loop runs the handler of its state until it is COMPLETED or FAILED."""

    PENDING = "pending"
    GENERATING = "generating"
    TOOL_CALLING = "tool_calling"
    INTERACTING = "interacting"
    COMPLETED = "completed"
    FAILED = "failed"


DONE_STATES = (RequestState.COMPLETED, RequestState.FAILED)


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
    max_concurrent_tool_calls: int = Field(
        16, ge=1, description="tool calls running at once on a worker, over all its conversations: a tool's whole "
        "output is held until it is cut, so the worker holds at most this many uncut outputs")
    tool_response_truncate_side: Literal["left", "right", "middle"] = "right"
    tool_timeout_s: float = Field(TOOL_CALL_S, gt=0, description="one tool call's or environment step's limit")
    tool_retries: int = Field(0, ge=0, description="extra tries of a tool call that raised or timed out")
    tool_retry_backoff_s: float = Field(0.0, ge=0, description="wait before a retry, doubled at each")
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
    ``agent_name`` picks the registered loop that runs it (``None``: the
    operator's default), as verl's ``agent_name`` column does.
    """

    prompt_ids: list[int]
    tools_kwargs: Mapping[str, Any] = field(default_factory=dict)
    interaction_kwargs: Mapping[str, Any] = field(default_factory=dict)
    seed: int | None = None
    agent_name: str | None = None


def turn_seed(seed: int | None, *path: int) -> int | None:
    """The seed of a conversation (``path = (k,)``: the rollout's k-th) or of its turn ``(k, turn)``."""
    return None if seed is None else derive_seed(seed, *path)


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
    #: failed calls and environment steps by kind (``timeout``, ``tool_exception``, ...)
    tool_errors: Counter = field(default_factory=Counter)
    #: tries of a call beyond its first (``tool_retries``)
    tool_retries: int = 0
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


class AgentLoopError(RunError):
    """The loop was set up wrong (not a model's mistake: those become tool-error turns)."""


def rollout_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """``multi_turn/*`` metrics: tool calls per sample, call success rate, turns, rewards, finish reasons."""
    n = max(len(trajectories), 1)
    calls = sum(t.tool_calls for t in trajectories)
    metrics = {
        "multi_turn/tool_calls_per_sample": calls / n,
        # a mean over calls, not samples; counts add up over micro-batches and ranks
        "multi_turn/tool_success_rate": mean(sum(t.tool_successes for t in trajectories) / calls if calls else 0.0,
                                             weight=calls),
        "multi_turn/assistant_turns": sum(t.assistant_turns for t in trajectories) / n,
        "multi_turn/user_turns": sum(t.user_turns for t in trajectories) / n,
        "multi_turn/tool_reward": sum(t.tool_reward for t in trajectories) / n,
        "multi_turn/env_reward": sum(t.env_reward for t in trajectories) / n,
        "multi_turn/tokenization_mismatch": total(sum(t.tokenization_mismatch is not None for t in trajectories)),
    }
    retries = sum(t.tool_retries for t in trajectories)
    if retries:
        metrics["multi_turn/tool_retries"] = total(retries)
    reasons = Counter(t.finish_reason for t in trajectories)
    for reason in FINISH_REASONS:
        metrics[f"multi_turn/finish/{reason}"] = total(reasons.get(reason, 0))
    errors = sum((t.tool_errors for t in trajectories), Counter())
    for kind, count in errors.items():
        metrics[f"multi_turn/tool_errors/{kind}"] = total(count)
    per_tool: dict[str, list[float]] = {}
    for t in trajectories:
        for name, values in t.tool_metrics:
            for key, value in values.items():
                per_tool.setdefault(f"multi_turn/tool/{name}/{key}", []).append(float(value))
    metrics.update({key: mean(sum(v) / len(v), weight=len(v)) for key, v in per_tool.items()})  # over successful calls
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
