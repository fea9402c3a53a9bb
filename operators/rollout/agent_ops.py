"""``rollout.multi_turn`` (the agent loop as a graph operator) and ``reward.agent`` (its outcome + tool reward).

``rollout.multi_turn`` has ``rollout.generate``'s outputs, so every estimator
and loss downstream reads it unchanged, plus the conversation: ``response_mask``
is 1 on sampled tokens only (interior zeros on tool and user turns),
``attention_mask`` covers every real token, and each row carries its
``messages``, final ``answer``, ``tool_reward`` and ``finish_reason``.

Example YAML (``graphs/grpo_tools.yaml``)::

    generate: {op: rollout.multi_turn, n: 8, max_response_length: 32, max_assistant_turns: 3,
               tools: [{class_name: operators.rollout.tools.AddTool, config: {reward: 0.2}}]}
    reward:   {op: reward.agent}

``tool_reward`` holds a row's tool and environment rewards. Tools may also come
from a YAML file (``tool_config``) or typed functions (``tool_functions:
[mypkg.tools:search]``); an ``environment`` (``pkg.mod:Class``) answers turns
that call no tool. The dataset's ``extra_info.tools_kwargs`` and
``extra_info.interaction_kwargs`` reach each row's tools and environment.

Each row runs the agent loop its ``agent_name`` column names (verl's column:
a name registered with :func:`~operators.rollout.agent_loop.register_agent_loop`
or ``pkg.mod:Class``); rows without one run ``agent_loop`` (``tool_agent``).
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from pydantic import Field, model_validator

from flowrl.data.metrics import maximum, minimum
from flowrl.graph import Params, operator
from operators.data.dataset import object_array
from operators.rewards import split_score
from operators.rewards.rule import exact_match_score
from operators.rewards.scoring import auto_reward_fn, named_score_max, place_at_last_token, resolve_reward_fn
from operators.rollout.agent_loop import DEFAULT_AGENT_LOOP, AgentLoop, get_agent_loop, run_rollouts
from operators.rollout.batching import make_generator
from operators.rollout.conversation import (
    AgentConfig, AgentLoopError, Request, rollout_metrics, trajectory_tensors,
)
from operators.rollout.base import SamplingParams, sample_seeds
from operators.rollout.envs import Environment
from operators.rollout.ops import RESPONSE_LENGTHS, SEQUENCE_FIELDS, length_metrics, unshard_metrics
from operators.rollout.tool_parsers import get_parser
from operators.rollout.tools import ToolConfigError, build_tools, import_object, tools_reward_max


@lru_cache(maxsize=8)
def _environment(path: str | None) -> type[Environment] | None:
    if path is None:
        return None
    cls = import_object(path, "rollout.multi_turn.environment")
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ToolConfigError(f"rollout.multi_turn.environment: {path!r} is not an Environment subclass")
    return cls


class MultiTurn(AgentConfig):
    n: int = Field(1, ge=1, description="rows per prompt (a GRPO group): rollouts × trajectories per rollout")
    temperature: float = Field(1.0, ge=0, description="0 or greedy=true: argmax")
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, description="-1: no top-k filtering")
    greedy: bool = Field(False, description="argmax decoding (validation)")
    tools: tuple[dict, ...] = Field((), description="tool entries inline, as in a tool config: "
                                                   "{class_name, config, tool_schema} or {function}")
    tool_config: str | None = Field(None, description="a YAML tool config file (verl's layout: tools: [...])")
    tool_functions: tuple[str, ...] = Field((), description="typed functions as tools: 'pkg.mod:fn' / 'file.py:fn'")
    tool_parser: str = Field("hermes", description="how tool calls are written (hermes: <tool_call>{json}</tool_call>)")
    render_tool_schemas: bool = Field(False, description="pass the tools' schemas to the chat template")
    environment: str | None = Field(None, description="an Environment / Interaction class: 'pkg.mod:Class'")
    agent_loop: str = Field(DEFAULT_AGENT_LOOP, description="the loop of rows whose agent_name column is empty: "
                                                           "a registered name or 'pkg.mod:Class'")

    @model_validator(mode="after")
    def _resolvable(self) -> "MultiTurn":
        """Tools, parser and environment are found when the graph is checked, not mid-run."""
        try:
            get_parser(self.tool_parser)
            if self.tool_config is not None and not Path(self.tool_config).is_file():
                raise ToolConfigError(f"tool_config {self.tool_config!r}: no such file")
            for i, entry in enumerate(self.tools):
                target = entry.get("class_name") or entry.get("function") if isinstance(entry, dict) else None
                if not target:
                    raise ToolConfigError(f"tools[{i}]: give 'class_name' (a BaseTool subclass) or 'function'")
                import_object(str(target), f"tools[{i}]")
            for i, fn in enumerate(self.tool_functions):
                import_object(fn, f"tool_functions[{i}]")
            _environment(self.environment)
            get_agent_loop(self.agent_loop)
        except (ToolConfigError, AgentLoopError) as err:
            raise ValueError(str(err)) from None
        return self


_TOOLS: dict[str, dict] = {}


def _tools(p: MultiTurn) -> dict:
    """The node's tools, built once per process (tools may hold clients or caches)."""
    key = json.dumps([p.tools, p.tool_config, p.tool_functions], sort_keys=True, default=str)
    if key not in _TOOLS:
        _TOOLS[key] = build_tools(p.tool_config, p.tool_functions, p.tools)
    return _TOOLS[key]


def _row_kwargs(extra_info: Any, key: str) -> dict:
    return dict((extra_info or {}).get(key) or {}) if isinstance(extra_info, dict) else {}


@operator(
    "rollout.multi_turn", role="actor", scope="row", expands="n", cost=4.0, node_name="generate", params=MultiTurn,
    inputs={"prompts": "int64[B, P]", "prompt_mask": "int64[B, P]", "extra_info": "object[B]", "uid": "object[B]",
            "agent_name": "object[B]"},
    optional_inputs=("uid", "agent_name"),
    outputs={**SEQUENCE_FIELDS, "rollout_log_probs": "float32[B, R]", "weight_version": "int64[B]",
             "tool_reward": "float32[B]", "answer": "object[B]", "messages": "object[B]",
             "finish_reason": "object[B]"},
    aux_outputs=("rollout_log_probs", "weight_version", "messages", "finish_reason"),
    val_params={"greedy": True}, dumped=("prompts", "responses", "weight_version"),
    token_mask="response_mask",
    headline=(RESPONSE_LENGTHS.mean,), tokens=RESPONSE_LENGTHS,
)
def multi_turn(actor, batch, p: MultiTurn):
    """n conversations per prompt with tools / an environment; the mask keeps only what the model sampled."""
    env_cls = _environment(p.environment)
    per_rollout = env_cls.trajectories if env_cls is not None else 1
    if p.n % per_rollout:
        raise ValueError(f"rollout.multi_turn: n={p.n} is not a multiple of the {per_rollout} trajectories each "
                         f"rollout of {p.environment} yields; set n to a multiple of {per_rollout}")
    tokenizer = actor.tokenizer
    engine = actor.engine
    names = batch["agent_name"] if "agent_name" in batch else [None] * len(batch["prompts"])
    names = [str(name) if name else p.agent_loop for name in names]
    loops: dict[str, AgentLoop] = {
        name: get_agent_loop(name)(tokenizer, p, tools=_tools(p), parser=p.tool_parser, environment=env_cls,
                                   stop_token_ids=[int(i) for i in engine.stop_token_ids],
                                   render_tool_schemas=p.render_tool_schemas)
        for name in dict.fromkeys(names)}
    rollouts = p.n // per_rollout
    # each rollout's sampling is keyed by its prompt's uid: the same conversations on any rank
    prompt_keys = actor.sampling_seeds(batch)
    seeds = ([[None] * rollouts] * len(batch["prompts"]) if prompt_keys is None
             else sample_seeds(prompt_keys, rollouts).view(-1, rollouts).tolist())
    work = []
    for ids, mask, extra, row_seeds, name in zip(batch["prompts"], batch["prompt_mask"], batch["extra_info"], seeds,
                                                 names):
        work += [(loops[name], Request(ids[mask.bool()].tolist(), _row_kwargs(extra, "tools_kwargs"),
                                       _row_kwargs(extra, "interaction_kwargs"), seed, name)) for seed in row_seeds]
    sampling = SamplingParams(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, greedy=p.greedy)
    stop_ids = next(iter(loops.values())).stop_ids
    generator = make_generator(engine, sampling, stop_ids, tokenizer.pad_token_id)
    # conversations take as many rounds as they need, so ranks call the engine unequally often:
    # a sharded actor gathers its weights once for the whole rollout
    with actor.full_weights():
        trajectories = [t for rollout in run_rollouts(generator, work) for t in rollout]
    out = trajectory_tensors(trajectories, p.max_response_length, tokenizer.pad_token_id, batch["prompts"].shape[1])
    metrics = {**rollout_metrics(trajectories), **length_metrics(out["response_mask"]), **unshard_metrics(actor)}
    return {
        **{k: out[k] for k in SEQUENCE_FIELDS}, "rollout_log_probs": out["rollout_log_probs"],
        "weight_version": torch.full((len(trajectories),), actor.version, dtype=torch.int64),
        "tool_reward": torch.tensor([t.reward for t in trajectories], dtype=torch.float32),
        "answer": object_array([t.final_answer() for t in trajectories]),
        "messages": object_array([t.messages for t in trajectories]),
        "finish_reason": object_array([t.finish_reason for t in trajectories]),
    }, metrics


class AgentReward(Params):
    fn: str = Field("auto", description="the outcome score of the final answer: auto (exact match for builtin "
                                        "tasks, gsm8k for gsm8k sources), exact, partial, gsm8k, or "
                                        "pkg.mod:fn / file.py:fn with verl's compute_score signature")
    tool_reward_weight: float = Field(1.0, description="weight of the tools' and environment's rewards")


def outcome_fn(fn: str, data_source: str):
    """The text reward that scores a final answer (``auto``: exact match for builtin tasks)."""
    chosen = resolve_reward_fn(fn)
    if chosen is None:
        chosen = exact_match_score if data_source.startswith("builtin:") else auto_reward_fn(data_source)
    if getattr(chosen, "scores_token_ids", False):
        raise ValueError(f"reward.agent: fn={fn!r} scores token ids; the agent reward scores the final answer's "
                         "text: use exact, partial, gsm8k or a compute_score function")
    return chosen


def agent_score_max(p: AgentReward, graph: dict[str, Any]) -> float | None:
    """The best outcome score (1 for a named reward's exact answer) plus the weighted most the tools of the
    graph's multi-turn nodes pay; grpo_tools: 1 + 1.0 × AddTool's 0.2 = 1.2. None where either is unknown."""
    outcome = named_score_max(p.fn, str(graph["data"]["source"]))
    tools = [tools_reward_max(node) for node in graph["nodes"].values()
             if node.get("tools") or node.get("tool_config") or node.get("tool_functions") or node.get("environment")]
    if outcome is None or any(t is None for t in tools):
        return None
    return outcome + p.tool_reward_weight * max(tools, default=0.0)


@operator(
    "reward.agent", scope="row", node_name="reward", params=AgentReward, score_max=agent_score_max,
    inputs={"response_mask": "int64[B, R]", "answer": "object[B]", "tool_reward": "float32[B]",
            "data_source": "object[B]", "ground_truth": "object[B]", "extra_info": "object[B]"},
    outputs={"token_level_scores": "float32[B, R]"}, score="token_level_scores", dumped=("token_level_scores",),
    token_mask="response_mask",
    headline=("reward/mean",),
)
def agent_reward(batch, p: AgentReward):
    """score = fn(final answer, ground truth) + w · (tool + environment rewards), on the last sampled token."""
    outcome = torch.tensor([
        split_score(outcome_fn(p.fn, str(ds))(str(ds), answer, truth, extra or {}))[0]
        for ds, answer, truth, extra in zip(batch["data_source"], batch["answer"], batch["ground_truth"],
                                            batch["extra_info"])], dtype=torch.float32)
    scores = outcome + p.tool_reward_weight * batch["tool_reward"]
    metrics = {"reward/mean": scores.mean(), "reward/max": maximum(scores.max()), "reward/min": minimum(scores.min()),
               "reward/outcome": outcome.mean(), "reward/tool": batch["tool_reward"].mean()}
    return {"token_level_scores": place_at_last_token(scores, batch["response_mask"])}, metrics

