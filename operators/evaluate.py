"""``flowrl eval``'s scoring: a policy's pass@1 (greedy) and pass@k (sampled) on a graph's held-out prompts.

The prompts are the graph's validation split (``make_source(config, split="val")``: a reasoning-gym task's
held-out questions, a builtin task's held-out seed, ``data.val_source``), ``data.val_size`` of them. The
policy is the role's model (``roles.actor.model``), with a checkpoint's weights when given. Responses come
from the ``hf`` rollout engine (the actor's own forward; greedy is deterministic), ``batch_size`` prompts
at a time, as long as the graph's generate node allows (``max_new_tokens``) unless told otherwise. The
graph's own scoring node (a ``reward.rule``: its ``fn``) scores them, so eval and training agree on what
an answer is (for reasoning-gym rows, the task's verifier reading the row's ``answer_format``).

A response *passes* when its score is full credit: the reward's ``correct`` when it reports one (a
reasoning-gym verifier's own score, without ``format_score``), else the score, at least 1.

- **pass@1**: the share of prompts whose greedy response passes.
- **pass@k**: the share of prompts of which at least one of ``k`` samples at ``temperature`` passes (with
  exactly k samples, the unbiased estimator of the Codex paper is this share).
- **mean@k**: the share of the ``k × prompts`` samples that pass (a sampled pass@1).

Example::

    result = evaluate(graph, weights=state["model"], k=8, temperature=1.0)
    print(result.pass_at_1, result.pass_at_k)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Mapping

import numpy as np
import torch

from flowrl.errors import ConfigError
from flowrl.graph import Graph, make_source
from flowrl.graph.registry import source_kind
from operators.models.export import role_model
from operators.models.lora import is_lora
from operators.rewards import compute_scores
from operators.rollout.hf_engine import HFRolloutEngine


class EvalError(ConfigError, ValueError):
    """What ``flowrl eval`` cannot evaluate: a graph without held-out prompts or a rule reward, weights
    that do not fit the model, a bad option; says which and how to fix it."""


@dataclass(frozen=True)
class EvalResult:
    """The scores of one evaluation; every share is in [0, 1]."""

    prompts: int
    pass_at_1: float
    score: float  # the greedy responses' mean reward: what validation reports as val/reward/mean
    k: int
    temperature: float
    pass_at_k: float | None  # None when k == 0 (greedy only)
    mean_at_k: float | None
    formatted: float | None  # greedy responses in which the reward read an answer, when it reports that
    max_new_tokens: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


#: the operators whose graph node decides what a held-out answer scores (``fn``, ``batched``)
RULE_OPS = ("reward.rule", "reward.rule_extras")


def evaluate(graph: Graph, weights: Mapping[str, torch.Tensor] | None = None, *, role: str = "actor",
             k: int = 0, temperature: float = 1.0, max_new_tokens: int | None = None, batch_size: int = 32,
             seed: int = 0, size: int | None = None, where: str = "the graph") -> EvalResult:
    """Score ``role``'s model (the graph's, with ``weights`` loaded when given) on ``graph``'s held-out
    prompts: greedy pass@1, and with ``k > 0`` pass@k and mean@k of ``k`` samples at ``temperature``.
    ``size``: prompts to take (default ``data.val_size``); ``where`` names the weights' origin in errors."""
    if k < 0 or batch_size < 1 or temperature <= 0 or (max_new_tokens is not None and max_new_tokens < 1):
        raise EvalError(f"k={k}, batch_size={batch_size}, temperature={temperature}, "
                        f"max_new_tokens={max_new_tokens}: k >= 0, batch_size >= 1, temperature > 0 and "
                        f"max_new_tokens >= 1")
    rule, generate = _scoring_nodes(graph)
    tokens = max_new_tokens or int(generate.config.dump().get("max_new_tokens", 16))
    config = graph.config
    if size is not None:
        config = config.model_copy(update={"data": config.data.model_copy(update={"val_size": size})})
    batch = make_source(config, split="val").next_batch()
    model, tokenizer = _policy(graph, role, weights, where)
    engine = HFRolloutEngine(model, tokenizer, seed=seed)
    greedy = _passes(engine, tokenizer, batch, rule, batch_size, greedy=True, max_new_tokens=tokens)
    result = {"pass_at_k": None, "mean_at_k": None}
    if k:
        sampled = _passes(engine, tokenizer, batch, rule, batch_size, n=k, temperature=temperature,
                          max_new_tokens=tokens, seed=seed)["passed"].reshape(len(batch), k)
        result = {"pass_at_k": float(sampled.any(1).mean()), "mean_at_k": float(sampled.mean())}
    return EvalResult(prompts=len(batch), pass_at_1=float(greedy["passed"].mean()), score=greedy["score"], k=k,
                      temperature=temperature,
                      formatted=greedy["formatted"], max_new_tokens=tokens, **result)


def has_held_out_split(graph: Graph) -> bool:
    """Whether ``graph``'s data has prompts no training step reads: a generated task (its own held-out
    split) or a ``data.val_source``; a dataset file alone has none."""
    data = graph.config.data.dump()
    return source_kind(str(data["source"])) != "file" or bool(data.get("val_source"))


def _scoring_nodes(graph: Graph) -> tuple[Any, Any]:
    scorer = graph.scorer()
    if scorer is None or graph.nodes[scorer[0]].op_name not in RULE_OPS:
        raise EvalError(f"graph {graph.name!r}: eval scores with the graph's rule reward (reward.rule), and "
                        f"{'nothing scores' if scorer is None else f'node {scorer[0]!r} is a model'}")
    generate = next((node for node in graph.nodes.values() if node.op_name == "rollout.generate"), None)
    if generate is None:
        raise EvalError(f"graph {graph.name!r} has no rollout.generate node: nothing says how the policy answers")
    if not has_held_out_split(graph):
        raise EvalError(f"graph {graph.name!r} has no held-out split: data.source {graph.config.data.source!r} "
                        f"is a file every step trains on; set data.val_source to held-out prompts")
    return graph.nodes[scorer[0]], generate


def _policy(graph: Graph, role: str, weights: Mapping[str, torch.Tensor] | None, where: str):
    model, tokenizer, _ = role_model(graph.config.dump()["roles"], role, weights, where, error=EvalError)
    if is_lora(model):  # one matrix a layer generates faster than a base and its adapters
        model = model.merge_and_unload()
    return model.eval(), tokenizer


def _passes(engine: HFRolloutEngine, tokenizer: Any, batch: Any, rule: Any, batch_size: int,
            **sampling: Any) -> dict[str, Any]:
    """Every response's pass (a bool array, ``n`` per prompt in prompt order) and the share formatted."""
    n = int(sampling.get("n", 1))
    passed, formatted, total = [], [], 0.0
    for start in range(0, len(batch), batch_size):
        part = batch[start:start + batch_size]
        with torch.no_grad():
            out = engine.generate(part.batch["prompts"], part.batch["prompt_mask"], **sampling)
        columns = {key: np.repeat(np.asarray(part.non_tensor_batch[key], dtype=object), n)
                   for key in ("data_source", "ground_truth", "extra_info", "reward_style")
                   if key in part.non_tensor_batch}
        scores, extras = compute_scores(out["responses"], out["response_mask"], tokenizer=tokenizer,
                                        fn=rule.params.fn, batched=rule.params.batched, **columns)
        correct = extras.get("correct")
        full = scores.numpy() if correct is None else np.array([c or 0.0 for c in correct], dtype=float)
        passed.append(full >= 1.0)
        total += float(scores.sum())
        formatted.extend(extras.get("formatted") or [])
    shown = [f for f in formatted if f is not None]
    done = np.concatenate(passed)
    return {"passed": done, "score": total / len(done), "formatted": float(np.mean(shown)) if shown else None}
