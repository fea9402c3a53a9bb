"""Rewards: rule functions (built-in tasks, gsm8k, user functions) and reward models.

The score of a response lands on its last token: ``token_level_scores[B, R]``.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from pydantic import Field

from flowrl.data.metrics import maximum, minimum
from flowrl.graph import Params, operator
from flowrl.graph.checks import ParameterError, ParameterWarning, graph_check
from operators.data.dataset import DatasetError, data_sources
from operators.models import load_tokenizer
from operators.rewards import (TASK_REWARDS, auto_reward_fn, compute_scores, extra_info_rows, extra_metrics,
                               named_score_max, place_at_last_token, resolve_reward_fn)


class Rule(Params):
    fn: str = Field("auto", description="auto (by data_source), a task name, task_eos, gsm8k, exact, partial, "
                                        "reasoning_gym, "
                                        "or pkg.mod:fn / file.py:fn with verl's compute_score signature")
    batched: bool = Field(False, description="call fn once per batch: fn(data_sources=, solution_strs=, "
                                             "ground_truths=, extra_infos=) -> one float or dict per response")


@lru_cache(maxsize=4)
def tokenizer_for(spec: str):
    return load_tokenizer(spec)


RULE = dict(scope="row", node_name="reward", params=Rule, optional_inputs=("reward_style",),
            inputs={"responses": "int64[B, R]", "response_mask": "int64[B, R]", "data_source": "object[B]",
                    "ground_truth": "object[B]", "extra_info": "object[B]", "reward_style": "object[B]",
                    "tokenizer": "meta"},
            score="token_level_scores", dumped=("token_level_scores",), headline=("reward/mean",),
            score_max=lambda p, graph: named_score_max(p.fn, str(graph["data"]["source"])))


@operator("reward.rule", outputs={"token_level_scores": "float32[B, R]"}, **RULE, token_mask="response_mask")
def rule(batch, p: Rule):
    """score_i = fn(response_i, ground_truth_i), placed on the last response token.

    A dict result's other numeric keys become ``reward/<key>/mean`` metrics.
    """
    scores, extras, metrics = _score(batch, p)
    return {"token_level_scores": place_at_last_token(scores, batch["response_mask"])}, metrics


@operator("reward.rule_extras", outputs={"token_level_scores": "float32[B, R]", "reward_extra_info": "object[B]"},
          **RULE, token_mask="response_mask")
def rule_extras(batch, p: Rule):
    """reward.rule that also keeps each response's other dict keys: ``reward_extra_info[i]`` is a dict.

    verl's ``reward_extra_info``: GDPO reads its reward components there
    (``advantage.gdpo``'s ``reward_keys``). A separate operator, so graphs that
    score twice (ReMax's greedy baseline) keep one producer per field.
    """
    scores, extras, metrics = _score(batch, p)
    return {"token_level_scores": place_at_last_token(scores, batch["response_mask"]),
            "reward_extra_info": extra_info_rows(extras, len(scores))}, metrics


def _score(batch, p: Rule):
    scores, extras = compute_scores(
        batch["responses"], batch["response_mask"], data_source=batch["data_source"],
        ground_truth=batch["ground_truth"], extra_info=batch["extra_info"],
        tokenizer=tokenizer_for(batch.meta_info["tokenizer"]), fn=p.fn, batched=p.batched,
        reward_style=batch["reward_style"] if "reward_style" in batch else None,
    )
    metrics = {"reward/mean": scores.mean(), "reward/max": maximum(scores.max()), "reward/min": minimum(scores.min()),
               **extra_metrics(extras)}
    return scores, extras, metrics


@graph_check
def _reward_fn_resolves(graph):
    """A misspelled name or an import path that does not import fails at validate time, not at step 1."""
    for name, node in graph.nodes.items():
        if node.op_name != "reward.rule" or node.params is None:
            continue
        try:
            resolve_reward_fn(node.params.fn)
        except ValueError as err:  # RewardFnError is a ValueError
            yield ParameterError(str(err), node=name, field="fn", location=graph.locate("nodes", name, "fn"),
                                 fix="fix the name or the import path (the module's directory must be importable)")


@graph_check
def _task_reward_reads_a_task(graph):
    """A builtin task's reward (``task``, ``task_eos``, a task's name: the answer's tokens matched position
    by position) over data that is not a builtin task is almost surely a graph pointed at new data that kept
    the default job's reward: it would score a free-form answer near zero."""
    for name, node in graph.nodes.items():
        if node.op_name != "reward.rule" or node.params is None or not isinstance(node.params.fn, str):
            continue
        fn = node.params.fn.removeprefix("builtin:")
        if ":" in fn or fn not in TASK_REWARDS:
            continue
        for key in ("source", "val_source"):
            spec = graph.config.data.dump().get(key)
            if isinstance(spec, str) and not spec.startswith("builtin:"):
                yield ParameterWarning(
                    f"fn {fn!r} scores a builtin task's answer tokens position by position, but data.{key} is "
                    f"{spec!r}, not a builtin task", node=name, field="fn",
                    location=graph.locate("nodes", name, "fn"),
                    fix=f"set nodes.{name}.fn=auto (picked by each row's data_source), or exact, partial, gsm8k "
                        "or your own pkg.module:compute_score")
                break


@graph_check
def _auto_reward_covers_the_data(graph):
    """``fn: auto`` picks the reward by each row's ``data_source``: a file whose rows name a source with no
    built-in rule fails at the first step that scores it."""
    auto = [name for name, node in graph.nodes.items()
            if node.op_name == "reward.rule" and node.params is not None and node.params.fn == "auto"]
    if not auto:
        return
    data = graph.config.data.dump()
    for key in ("source", "val_source"):
        spec = data.get(key)
        if not isinstance(spec, str) or spec.startswith("builtin:") or not Path(spec).is_file():
            continue  # a builtin task is scored by its own rule; a missing file is the data check's
        try:
            sources = data_sources(spec)
        except (DatasetError, OSError, ValueError, KeyError):
            continue  # the data check names what is wrong with the file
        for source, row in sources.items():
            try:
                auto_reward_fn(source)
            except ValueError as err:
                name = auto[0]
                yield ParameterError(
                    f"{spec}: row {row}: {err}", node=name, field="fn", location=graph.locate("data", key),
                    fix=f"set nodes.{name}.fn to a reward for these rows (exact, partial, gsm8k, or "
                        "pkg.module:compute_score)")
                break


@operator(
    "reward.model", role="reward_model", scope="row", node_name="reward_model", cost=2.0, balance_by="attention_mask",
    inputs={"input_ids": "int64[B, T]", "attention_mask": "int64[B, T]", "position_ids": "int64[B, T]",
            "response_mask": "int64[B, R]"},
    outputs={"token_level_scores": "float32[B, R]"}, score="token_level_scores", dumped=("token_level_scores",),
    token_mask="response_mask",
    headline=("reward/mean",),
)
def model(rm, batch, p):
    """A sequence classifier's scalar score of prompt+response, on the last response token."""
    scores = rm.scorer.score(batch["input_ids"], batch["attention_mask"], batch["position_ids"])
    return {"token_level_scores": place_at_last_token(scores, batch["response_mask"])}, {
        "reward/mean": scores.mean()}
