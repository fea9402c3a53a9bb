"""Role kinds: the stateful things operators run against.

``actor``: a causal LM with its optimizer and a rollout engine sharing its
weights; a frozen actor (``ref: {from: actor, frozen: true}``) is the same
model from the same seed, without an optimizer. ``critic``: the same backbone
with a value head. ``reward_model``: a sequence classifier scoring responses.

Example YAML::

    roles:
      actor:  {model: builtin:tiny, optim: {lr: 5.0e-4, grad_clip: 1.0}}
      ref:    {from: actor, frozen: true}
      critic: {model: builtin:tiny, optim: {lr: 1.0e-3}}
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Callable, Literal, NamedTuple

import torch
from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from flowrl.graph import role_kind
from operators.models import (ModelLoadError, OptimConfig, build_optimizer, check_model_spec, clip_grad_norm,
                              load_model)
from operators.models.microbatch import response_lengths, restore, token_budget_split, trim
from operators.rewards import RewardModelScorer


class RolloutConfig(BaseModel):
    """Which engine generates: ``hf`` (transformers, CPU or GPU) or ``sglang`` (GPU)."""

    model_config = ConfigDict(extra="forbid")
    engine: Literal["hf", "sglang"] = "hf"
    engine_kwargs: dict[str, Any] = Field(default_factory=dict, description="passed to sglang.Engine")
    drop_finished: bool = Field(True, description="hf: finished rows leave the decode batch and responses are "
                                "as wide as the longest; false: every row steps to the end, max_new_tokens wide")


def check_model_path(spec: str) -> str:
    """``builtin:*`` or a local model directory whose config loads — checked with the graph, before
    any worker starts."""
    if not spec.startswith("builtin:") and not Path(spec).is_dir():
        raise ValueError(f"no model directory {spec!r}: pass 'builtin:tiny' or the path of a local "
                         f"Hugging Face model directory (nothing is downloaded)")
    try:
        check_model_spec(spec)
    except ModelLoadError as err:
        raise ValueError(str(err)) from None
    return spec


ModelPath = Annotated[str, AfterValidator(check_model_path)]


class ModelRoleConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: ModelPath = Field("builtin:tiny", description="'builtin:tiny' or a local Hugging Face directory")
    dtype: Literal["float32", "bfloat16", "bf16", "fp32"] = "float32"
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=5e-4))
    max_tokens_per_micro_batch: int | None = Field(
        None, ge=1, description="token budget of one forward/backward pass: rows bucketed by length, each "
        "micro-batch cut to its longest response (verl's use_dynamic_bsz); none: micro_batch_size rows, full width")


class LossNorm(NamedTuple):
    """What a micro-batch's loss is normalised by: its mini-batch's counts, not its own.

    ``tokens``: real response tokens (``response_mask`` ones) of the mini-batch;
    ``seqs``: its rows with at least one. The losses of the micro-batches then
    sum to the mini-batch's loss, however ragged the micro-batches are.
    """

    tokens: float
    seqs: float

    def weight(self, mask: torch.Tensor) -> float:
        """A micro-batch's share of the mini-batch's tokens: the weight of a mean over its tokens."""
        return float(mask.sum()) / max(self.tokens, 1.0)


class ActorConfig(ModelRoleConfig):
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)


class TrainableRole:
    """A model, its optimizer (unless frozen), and an optimizer step with grad clipping."""

    def __init__(self, model: torch.nn.Module, cfg: ModelRoleConfig, ctx: Any) -> None:
        self.model, self.cfg, self.ctx = model, cfg, ctx
        self.version = 0
        self.updates = 0
        self.extra_state: dict[str, Any] = {}  # operators' state across steps (an adaptive KL β)
        self.optimizer = self.scheduler = None
        if ctx.frozen:
            model.requires_grad_(False)
        else:
            self.optimizer, self.scheduler = build_optimizer(model.parameters(), cfg.optim)
        model.eval()

    def step(self, backward) -> dict[str, float]:
        """One optimizer step: ``backward()`` accumulates the gradients; returns grad_norm and lr."""
        assert self.optimizer is not None, f"role {self.ctx.name!r} is frozen"
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        backward()
        grad_norm = clip_grad_norm(self.model.parameters(), self.cfg.optim.grad_clip)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.model.eval()
        self.updates += 1
        return {"grad_norm": grad_norm, "lr": lr}

    def fit(self, batch: Any, loss_fn: Callable[[Any, LossNorm], tuple[torch.Tensor, dict]], *,
            mini_batch_size: int | None, epochs: int, micro_batch_size: int | None) -> dict[str, float]:
        """PPO-style training on ``batch``: ``epochs`` passes over shuffled mini-batches,
        one optimizer step per mini-batch, gradients accumulated over micro-batches.

        ``loss_fn(micro_batch, norm) -> (loss, metrics)`` normalises its loss by
        ``norm`` (:class:`LossNorm`, the mini-batch's token and sequence counts),
        so the micro-batch losses sum to the mini-batch's and are backpropagated
        as they are: the step does not depend on how the mini-batch is cut. Its
        metrics are contributions to the mini-batch's value in the same sense
        (a mean over the micro-batch's tokens times ``norm.weight(mask)``) and
        are summed per mini-batch (``*_max`` metrics: the largest is kept). With the role's ``max_tokens_per_micro_batch``
        the micro-batches are length buckets under that budget, each cut to its
        own longest response; without it, ``micro_batch_size`` consecutive rows
        at full width. Returns the metrics averaged over mini-batches, plus
        ``grad_norm`` and ``lr``.
        """
        n = len(batch)
        mini = min(mini_batch_size or n, n)
        micro = min(micro_batch_size or mini, mini)
        budget = self.cfg.max_tokens_per_micro_batch
        prompt_length = batch["input_ids"].shape[1] - batch["responses"].shape[1]
        lengths = response_lengths(batch)
        mask = batch["response_mask"]
        gen = torch.Generator().manual_seed(self.ctx.seed * 7919 + self.updates)
        totals: dict[str, list[float]] = {}

        def accumulate(mb_rows: torch.Tensor) -> None:
            rows_mask = mask[mb_rows]
            norm = LossNorm(tokens=float(rows_mask.sum()), seqs=float((rows_mask.sum(-1) > 0).sum()))
            sums: dict[str, float] = {}
            for part in token_budget_split(lengths[mb_rows], prompt_length, budget, micro):
                rows = mb_rows[part]
                mb = batch[rows] if budget is None else trim(batch[rows], max(1, int(lengths[rows].max())))
                loss, metrics = loss_fn(mb, norm)
                loss.backward()
                for k, v in metrics.items():
                    v = float(v.detach()) if torch.is_tensor(v) else float(v)
                    sums[k] = max(sums.get(k, v), v) if k.endswith("_max") else sums.get(k, 0.0) + v
            for k, v in sums.items():
                totals.setdefault(k, []).append(v)

        for _ in range(epochs):
            order = torch.randperm(n, generator=gen) if mini < n else torch.arange(n)
            for start in range(0, n, mini):
                for k, v in self.step(lambda: accumulate(order[start:start + mini])).items():
                    totals.setdefault(k, []).append(v)
        return {k: max(v) if k.endswith("_max") else sum(v) / len(v) for k, v in totals.items()}

    def forward(self, batch: Any, fn: Callable[[Any], torch.Tensor]) -> torch.Tensor:
        """``fn(micro_batch) -> [b, r, ...]`` over the whole batch, in row order, ``R`` wide.

        Under the role's ``max_tokens_per_micro_batch`` the rows go in length
        buckets, each cut to its own longest response (positions past it come
        back 0; past a row's own response they are padding either way); without
        it, one call on the whole batch. Gradients
        are not tracked: this is for log-probs and values of a batch, not updates.
        """
        budget = self.cfg.max_tokens_per_micro_batch
        with torch.no_grad():
            if budget is None:
                return fn(batch)
            width = batch["responses"].shape[1]
            lengths = response_lengths(batch)
            splits = token_budget_split(lengths, batch["input_ids"].shape[1] - width, budget)
            parts = [fn(trim(batch[rows], max(1, int(lengths[rows].max())))) for rows in splits]
        return restore(parts, splits, width)

    def get_weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def set_weights(self, weights: dict[str, torch.Tensor]) -> None:
        self.model.load_state_dict(weights)

    def state_dict(self) -> dict[str, Any]:
        """Everything a checkpoint needs to continue exactly."""
        state: dict[str, Any] = {"model": self.model.state_dict(), "updates": self.updates,
                                 "extra_state": self.extra_state}
        if self.optimizer is not None:
            state["optimizer"] = self.optimizer.state_dict()
            state["scheduler"] = self.scheduler.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.updates = state.get("updates", 0)
        self.extra_state = dict(state.get("extra_state", {}))
        if self.optimizer is not None and "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])


@role_kind("actor", config=ActorConfig)
class Actor(TrainableRole):
    """A policy LM: generates (its rollout engine shares the weights), scores its
    own log-probs, and takes PPO steps."""

    def __init__(self, cfg: ActorConfig, ctx: Any) -> None:
        model, self.tokenizer = load_model(cfg.model, dtype=cfg.dtype, seed=ctx.seed, device=ctx.device)
        super().__init__(model, cfg, ctx)
        self._engine = None

    @property
    def engine(self):
        """The rollout engine, built on first use (a frozen reference never needs one)."""
        if self._engine is None:
            seed = self.ctx.seed * 1009 + self.ctx.rank
            if self.cfg.rollout.engine == "sglang":
                from operators.rollout import SGLangRolloutEngine

                self._engine = SGLangRolloutEngine(
                    self.cfg.model, pad_token_id=self.tokenizer.pad_token_id,
                    stop_token_ids=[self.tokenizer.eos_token_id], seed=seed, **self.cfg.rollout.engine_kwargs)
            else:
                from operators.rollout import HFRolloutEngine

                self._engine = HFRolloutEngine(self.model, self.tokenizer, seed=seed,
                                               drop_finished=self.cfg.rollout.drop_finished)
        return self._engine

    def set_weights(self, weights: dict[str, torch.Tensor]) -> None:
        super().set_weights(weights)
        if self._engine is not None and self.cfg.rollout.engine != "hf":
            self._engine.update_weights(weights)  # the hf engine holds this very model

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self._engine is not None and hasattr(self._engine, "rng_state"):
            state["rollout_rng"] = self._engine.rng_state()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if "rollout_rng" in state:
            self.engine.set_rng_state(state["rollout_rng"])


@role_kind("critic", config=ModelRoleConfig)
class Critic(TrainableRole):
    """A value model: the policy's backbone with a scalar head per token."""

    def __init__(self, cfg: ModelRoleConfig, ctx: Any) -> None:
        model, self.tokenizer = load_model(cfg.model, head="value", dtype=cfg.dtype, seed=ctx.seed,
                                           device=ctx.device)
        super().__init__(model, cfg, ctx)


class RewardModelConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: ModelPath = Field(..., description="a local sequence-classification model directory (or builtin:tiny)")
    dtype: Literal["float32", "bfloat16", "bf16", "fp32"] = "float32"


@role_kind("reward_model", config=RewardModelConfig)
class RewardModel:
    """A frozen sequence classifier that scores prompt+response."""

    def __init__(self, cfg: RewardModelConfig, ctx: Any) -> None:
        model, self.tokenizer = load_model(cfg.model, head="reward", dtype=cfg.dtype, seed=ctx.seed,
                                           device=ctx.device)
        model.requires_grad_(False).eval()
        self.scorer = RewardModelScorer(model)
        self.version = 0
