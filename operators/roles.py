"""Role kinds: the stateful things operators run against.

``actor``: a causal LM with its optimizer and a rollout engine sharing its
weights; a frozen actor (``ref: {from: actor, frozen: true}``) is the same
model from the same seed, without an optimizer. An actor with ``lora:`` trains
peft adapters only (:mod:`operators.models.lora`), and a frozen actor derived
from it in its pool is its own model with the adapters off (no second copy). ``critic``: the same backbone
with a value head. ``reward_model``: a sequence classifier scoring responses.

Example YAML::

    roles:
      actor:  {model: builtin:tiny, optim: {lr: 5.0e-4, grad_clip: 1.0}}
      ref:    {from: actor, frozen: true}
      critic: {model: builtin:tiny, optim: {lr: 1.0e-3}}

With LoRA (the reference is then the actor's base)::

    roles:
      actor: {model: builtin:smollm2-135m, lora: {r: 8, alpha: 16}, optim: {lr: 2.0e-4}}
      ref:   {from: actor, frozen: true}
"""

from __future__ import annotations

import base64
import contextlib
from pathlib import Path
from typing import Annotated, Any, Callable, Literal

import torch
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from flowrl.graph import Role, Stateful, role_kind
from operators.models import ModelLoadError, OptimConfig, check_model_spec, is_gguf_spec, load_model
from operators.models.engine import ENGINES, LossFn, build_engine
from operators.models.lora import BaseView, LoraConfig, add_adapters, check_targets, is_lora, model_linear_names, \
    plain_copy
from operators.models.sharded_checkpoint import ModelState
from operators.rewards import RewardModelScorer
from operators.rollout.base import RolloutEngine, prompt_seeds
from operators.rollout.engines import EngineSource, build_rollout_engine, check_engine_options, engine_spec
from operators.rollout.unsharded import UnshardedEngine


class RolloutConfig(BaseModel):
    """Which engine generates (``operators.rollout.engines``): ``hf`` (transformers, CPU or GPU),
    ``sglang`` (GPU), ``vllm`` (vLLM, CPU or GPU) or ``auto`` (vllm where it imports, else hf);
    ``engine_kwargs`` are checked against its options."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    engine: str = "hf"
    engine_kwargs: dict[str, Any] = Field(default_factory=dict, description="the engine's options: vllm's "
                                          "VLLMOptions, sglang.Engine's keyword arguments")
    drop_finished: bool = Field(True, description="hf: finished rows leave the decode batch and responses are "
                                "as wide as the longest; false: every row steps to the end, max_new_tokens wide")

    @model_validator(mode="after")
    def _known_engine_and_options(self) -> "RolloutConfig":
        check_engine_options(self.engine, self.options())
        return self

    def options(self) -> dict[str, Any]:
        """The engine's options: ``engine_kwargs``, and ``drop_finished`` for ``hf``."""
        if engine_spec(self.engine).name == "hf":
            return {"drop_finished": self.drop_finished, **self.engine_kwargs}
        return dict(self.engine_kwargs)


def check_model_path(spec: str) -> str:
    """``builtin:*``, a GGUF file or a local model directory whose config loads — checked with the graph,
    before any worker starts."""
    if not spec.startswith("builtin:") and not is_gguf_spec(spec) and not Path(spec).is_dir():
        raise ValueError(f"no model directory {spec!r}: pass 'builtin:tiny' or the path of a local "
                         f"Hugging Face model directory (nothing is downloaded)")
    try:
        check_model_spec(spec)
    except ModelLoadError as err:
        raise ValueError(str(err)) from None
    return spec


ModelPath = Annotated[str, AfterValidator(check_model_path)]


class ModelRoleConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    model: ModelPath = Field("builtin:tiny", description="'builtin:tiny', 'builtin:smollm2-135m', a local "
                            "Hugging Face directory or a GGUF file (a path, or pkg:<package>/<file>)")
    dtype: Literal["float32", "bfloat16", "bf16", "fp32"] = "float32"
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=5e-4))
    engine: str | None = Field(None, description="the training engine: 'local' (one process) or 'fsdp2' (sharded "
                               "over the pool's workers); unset: fsdp2 on a pool of several workers, else local")
    max_tokens_per_micro_batch: int | None = Field(
        None, ge=1, description="token budget of one forward/backward pass: rows bucketed by length, each "
        "micro-batch cut to its longest response (verl's use_dynamic_bsz); none: micro_batch_size rows, full width")

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, name: str | None) -> str | None:
        if name is not None and name not in ENGINES:
            raise ValueError(f"no training engine {name!r}; registered: {', '.join(sorted(ENGINES))}")
        return name


class ActorConfig(ModelRoleConfig):
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    lora: LoraConfig | None = Field(None, description="train LoRA adapters (peft) instead of every weight: "
                                    "{r, alpha, target_modules, dropout}; the base stays frozen")

    @model_validator(mode="after")
    def _lora_targets_exist(self) -> "ActorConfig":
        if self.lora is not None:
            check_targets(self.lora.target_modules, model_linear_names(self.model), self.model)
        return self

    def frozen_view(self) -> str | None:
        """With LoRA, a frozen role derived from this actor in its pool is the actor's own model with
        the adapters off (verl's ``ref_in_actor``), said in words; without, None (a copy of its own)."""
        if self.lora is None:
            return None
        return ("the actor's own model with its LoRA adapters switched off (peft's disable_adapter): the "
                "frozen base weights, no second copy")


class TrainableRole(Role, Stateful):
    """A model trained by a registered engine (:mod:`operators.models.engine`), unless frozen.

    The engine is the role's ``engine:`` (``local``, ``fsdp2``), or by the
    pool: ``fsdp2`` on a pool whose ranks form a process group (``ctx.group``
    of N > 1), ``local`` otherwise. The role holds the math; ``fit``,
    ``forward`` and the weights are the engine's.
    """

    def __init__(self, model: torch.nn.Module, cfg: ModelRoleConfig, ctx: Any) -> None:
        self.cfg, self.ctx = cfg, ctx
        self.train_engine = build_engine(cfg.engine, model, optim=None if ctx.frozen else cfg.optim,
                                         group=getattr(ctx, "group", None), seed=ctx.seed,
                                         max_tokens_per_micro_batch=cfg.max_tokens_per_micro_batch)

    # what the engine holds, as the role's (a checkpoint reads and writes them)
    model = property(lambda self: self.train_engine.model)
    optimizer = property(lambda self: self.train_engine.optimizer)
    scheduler = property(lambda self: self.train_engine.scheduler)
    group = property(lambda self: self.train_engine.group)

    @property
    def updates(self) -> int:
        return self.train_engine.updates

    @updates.setter
    def updates(self, value: int) -> None:
        self.train_engine.updates = value

    def fit(self, batch: Any, loss_fn: LossFn, *, mini_batch_size: int | None, epochs: int,
            micro_batch_size: int | None) -> dict[str, float]:
        """PPO-style training on ``batch`` (:meth:`TrainEngine.train_batch`)."""
        return self.train_engine.train_batch(batch, loss_fn, mini_batch_size=mini_batch_size, epochs=epochs,
                                             micro_batch_size=micro_batch_size)

    def forward(self, batch: Any, fn: Callable[[Any], torch.Tensor]) -> torch.Tensor:
        """``fn(micro_batch) -> [b, r, ...]`` over the whole batch, no gradients (:meth:`TrainEngine.infer_batch`)."""
        return self.train_engine.infer_batch(batch, fn)

    def held_bytes(self) -> dict[str, int]:
        return self.train_engine.held_bytes()

    def get_weights(self) -> dict[str, torch.Tensor] | None:
        """The full weights, on CPU. Sharded: a collective on every rank, the dict on rank 0 (None elsewhere)."""
        return self.train_engine.get_weights()

    def weights_for_digest(self) -> Any:
        """``(name, tensor)`` of this rank's weights (its shards when sharded; no collective): what
        the runtime's fingerprints digest after an update and before every task."""
        return self.model.state_dict().items()

    def set_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Load full weights (another pool's :meth:`get_weights`); sharded: each rank copies its part."""
        self.train_engine.set_weights(weights)

    def state_dict(self) -> dict[str, Any]:
        """Everything a checkpoint needs to continue exactly, as a ``Stateful`` for the runtime's
        checkpointer: the model's and the optimizer's tensors (this rank's shards when the model is
        sharded: the pool's ranks write them together, and any number of ranks loads them back),
        the LR schedule and the update count."""
        state: dict[str, Any] = {**self._model_state().state_dict(), "updates": self.updates}
        if self.optimizer is not None:
            state["scheduler"] = self.scheduler.state_dict()
        return state

    def _model_state(self) -> ModelState:
        # with LoRA the frozen base is the model the graph names, rebuilt as it was: only the adapters
        return ModelState(self.model, self.optimizer, trainable_only=is_lora(self.model))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load :meth:`state_dict`'s output (its tensors laid out for this rank by the checkpointer)."""
        self._model_state().load_state_dict(state)
        if self.optimizer is not None and "scheduler" in state:
            self.scheduler.load_state_dict(state["scheduler"])
        self.updates = state.get("updates", 0)


@role_kind("actor", config=ActorConfig)
class Actor(TrainableRole):
    """A policy LM: generates, scores its own log-probs, and takes PPO steps.

    It owns two engines, as verl's actor worker does: the training engine, which
    :meth:`fit` runs, and the rollout engine, which generates. An engine that
    keeps its own copy of the weights (vLLM, sglang) gives its memory back while
    the training engine runs, and takes the new weights when the worker has
    counted the update and tells the actor its version (:meth:`set_version`): the
    push is stamped with the worker's version, never one the actor computes.
    """

    def __init__(self, cfg: ActorConfig, ctx: Any) -> None:
        model, self.tokenizer = load_model(cfg.model, dtype=cfg.dtype, seed=ctx.seed, device=ctx.device)
        if cfg.lora is not None and not ctx.frozen:  # a frozen copy is the base
            model = add_adapters(model, cfg.lora, seed=ctx.seed)
        super().__init__(model, cfg, ctx)
        self._engine: RolloutEngine | None = None
        self._rng: torch.Tensor | None = None  # a restored sampling stream, for the engine not built yet

    @property
    def engine(self) -> RolloutEngine:
        """The rollout engine, built on first use (a frozen reference never needs one) from the model's
        weights of the version the actor was last told."""
        if self._engine is None:
            rollout = self.cfg.rollout
            own_copy = not engine_spec(rollout.engine).shares_model
            # an engine that saves its own copy starts from plain Hugging Face weights: the adapters merged
            model = plain_copy(self.model) if own_copy and is_lora(self.model) else self.model
            source = EngineSource(model, self.tokenizer, self.cfg.model, seed=self.ctx.seed * 1009 + self.ctx.rank,
                                  world_size=self.group.world_size, version=self.version)
            engine = build_rollout_engine(rollout.engine, source, rollout.options())
            if engine_spec(rollout.engine).shares_model and self.group.world_size > 1:
                # generation calls forward per token: gather once
                engine = UnshardedEngine(engine, self.model, self.group)
            if self._rng is not None:
                engine.set_rng_state(self._rng)
                self._rng = None
            self._engine = engine
        return self._engine

    def frozen_view(self) -> BaseView:
        """The reference this actor serves when it has LoRA: its own model with the adapters off."""
        return BaseView(self)

    def close(self) -> None:
        """Stop the rollout engine's own processes (vLLM, sglang) when it started any: a run that ends
        in a process that goes on (the local backend, a notebook) must not keep them and their memory."""
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.shutdown()

    def sampling_seeds(self, batch: Any) -> torch.Tensor | None:
        """The rollout seed of each prompt of ``batch``, from its ``uid`` and the run's seed: the same
        samples on whichever rank a prompt lands; ``None`` when the batch has no uids."""
        return prompt_seeds(batch["uid"], self.ctx.seed) if "uid" in batch else None

    def full_weights(self):
        """A block in which the rollout engine generates on full parameters however often it is
        called: for a sharded actor, one all-gather on entry on every rank (a collective) and a
        reshard on exit; otherwise nothing."""
        engine = self.engine
        return engine.held() if isinstance(engine, UnshardedEngine) else contextlib.nullcontext()

    def fit(self, batch: Any, loss_fn: LossFn, **schedule: Any) -> dict[str, float]:
        """The training engine's update (:meth:`TrainEngine.train_batch`), with a rollout engine of its
        own copy of the weights handed its memory back meanwhile, where the device allows. The new
        weights reach that engine when the worker tells the actor their version (:meth:`set_version`)."""
        engine = self._own_copy()
        if engine is not None:
            engine.release_memory()
        try:
            return self.train_engine.train_batch(batch, loss_fn, **schedule)
        finally:
            if engine is not None:
                engine.resume_memory()

    def set_version(self, version: int) -> dict[str, float]:
        """The worker's word after an update, a load from another pool or a restore: the weights are
        now ``version``. A rollout engine that keeps its own copy loads them, stamped ``version``,
        and is checked to compute what this model computes (the engine's ``check_weights``): a push
        that silently delivered nothing fails the task, named, instead of sampling on old weights.
        Returns the push's and the check's metrics (none before the engine is built: it starts
        from these weights, or when it runs this very model: ``hf``)."""
        self.version = version
        engine = self._own_copy()
        if engine is None:
            return {}
        metrics = dict(engine.update_weights(self.train_engine.named_weights(), version=version))
        metrics.update(engine.check_weights(self.model))
        metrics.update(engine.memory_metrics())
        return metrics

    def _own_copy(self) -> RolloutEngine | None:
        """The rollout engine when it is built and keeps its own copy of the weights, else None."""
        if self._engine is None or engine_spec(self.cfg.rollout.engine).shares_model:
            return None
        return self._engine

    def state_dict(self) -> dict[str, Any]:
        """As :meth:`TrainableRole.state_dict`, plus this rank's own sampling stream (under
        ``rank_local``: the checkpointer gives it back only to the rank that wrote it, so a rank
        new to the pool keeps its fresh stream rather than repeat another rank's samples)."""
        state = super().state_dict()
        rng = self._engine.rng_state() if self._engine is not None else self._rng
        if rng is not None:
            state["rank_local"] = {"rollout_rng": base64.b64encode(rng.numpy().tobytes()).decode()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        rng = (state.get("rank_local") or {}).get("rollout_rng")
        if rng is not None:
            rng = torch.frombuffer(bytearray(base64.b64decode(rng)), dtype=torch.uint8)
            if self._engine is not None:
                self._engine.set_rng_state(rng)
            else:  # the engine takes it when it is built (from the weights just loaded)
                self._rng = rng


@role_kind("critic", config=ModelRoleConfig)
class Critic(TrainableRole):
    """A value model: the policy's backbone with a scalar head per token."""

    def __init__(self, cfg: ModelRoleConfig, ctx: Any) -> None:
        model, self.tokenizer = load_model(cfg.model, head="value", dtype=cfg.dtype, seed=ctx.seed,
                                           device=ctx.device)
        super().__init__(model, cfg, ctx)


class RewardModelConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    model: ModelPath = Field(..., description="a local sequence-classification model directory (or builtin:tiny)")
    dtype: Literal["float32", "bfloat16", "bf16", "fp32"] = "float32"


@role_kind("reward_model", config=RewardModelConfig)
class RewardModel(Role):
    """A frozen sequence classifier that scores prompt+response."""

    def __init__(self, cfg: RewardModelConfig, ctx: Any) -> None:
        model, self.tokenizer = load_model(cfg.model, head="reward", dtype=cfg.dtype, seed=ctx.seed,
                                           device=ctx.device)
        model.requires_grad_(False).eval()
        self.scorer = RewardModelScorer(model)
