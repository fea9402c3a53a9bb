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
from typing import Annotated, Any, Literal

import torch
from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from flowrl.graph import role_kind
from operators.models import (ModelLoadError, OptimConfig, build_optimizer, check_model_spec, clip_grad_norm,
                              load_model)
from operators.rewards import RewardModelScorer


class RolloutConfig(BaseModel):
    """Which engine generates: ``hf`` (transformers, CPU or GPU) or ``sglang`` (GPU)."""

    model_config = ConfigDict(extra="forbid")
    engine: Literal["hf", "sglang"] = "hf"
    engine_kwargs: dict[str, Any] = Field(default_factory=dict, description="passed to sglang.Engine")


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

    def fit(self, batch: Any, loss_fn, *, mini_batch_size: int | None, epochs: int,
            micro_batch_size: int | None) -> dict[str, float]:
        """PPO-style training on ``batch``: ``epochs`` passes over shuffled mini-batches,
        one optimizer step per mini-batch, gradients accumulated over micro-batches.

        ``loss_fn(micro_batch) -> (loss, metrics)``; the loss is scaled by the
        micro-batch's share of its mini-batch before backward. Returns the
        metrics averaged over every micro-batch, plus ``grad_norm`` and ``lr``.
        """
        n = len(batch)
        mini = min(mini_batch_size or n, n)
        micro = min(micro_batch_size or mini, mini)
        gen = torch.Generator().manual_seed(self.ctx.seed * 7919 + self.updates)
        totals: dict[str, list[float]] = {}

        def accumulate(mb_rows: torch.Tensor) -> None:
            for start in range(0, len(mb_rows), micro):
                rows = mb_rows[start:start + micro]
                loss, metrics = loss_fn(batch[rows])
                (loss * len(rows) / len(mb_rows)).backward()
                for k, v in metrics.items():
                    totals.setdefault(k, []).append(float(v.detach()) if torch.is_tensor(v) else float(v))

        for _ in range(epochs):
            order = torch.randperm(n, generator=gen) if mini < n else torch.arange(n)
            for start in range(0, n, mini):
                for k, v in self.step(lambda: accumulate(order[start:start + mini])).items():
                    totals.setdefault(k, []).append(v)
        return {k: sum(v) / len(v) for k, v in totals.items()}

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

                self._engine = HFRolloutEngine(self.model, self.tokenizer, seed=seed)
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
