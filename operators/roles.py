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

import contextlib
import math
from pathlib import Path
from typing import Annotated, Any, Callable, Literal

import torch
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from flowrl.graph import role_kind
from operators.models import (ModelLoadError, OptimConfig, build_optimizer, check_model_spec, clip_grad_norm,
                              load_model)
from operators.models.data_parallel import LossNorm, data_parallel_forward, pass_count
from operators.models.fsdp import full_state_dict, shard_model, state_bytes, unsharded
from operators.models.microbatch import response_lengths, restore, token_budget_split, trim
from operators.models.sharded_checkpoint import load_sharded, save_sharded
from operators.rewards import RewardModelScorer
from operators.rollout.base import prompt_seeds
from operators.rollout.engines import EngineSource, build_rollout_engine, check_engine_options, engine_spec


class RolloutConfig(BaseModel):
    """Which engine generates (``operators.rollout.engines``): ``hf`` (transformers, CPU or GPU),
    ``sglang`` (GPU) or ``vllm`` (vLLM, CPU or GPU); ``engine_kwargs`` are checked against its options."""

    model_config = ConfigDict(extra="forbid")
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
        if self.engine == "hf":
            return {"drop_finished": self.drop_finished, **self.engine_kwargs}
        return dict(self.engine_kwargs)


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


class ActorConfig(ModelRoleConfig):
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)


class _NoGroup:
    """The group of a role that shares none (a pool of one, or the local backend's threads)."""

    rank, world_size = 0, 1

    def all_reduce(self, tensor: torch.Tensor, name: str = "", op: str = "sum") -> torch.Tensor:
        return tensor

    def guard(self, name: str):
        return contextlib.nullcontext()


class TrainableRole:
    """A model, its optimizer (unless frozen), and an optimizer step with grad clipping.

    On a pool whose ranks form a process group (``ctx.group`` of N > 1) the
    model is sharded with FSDP2 before the optimizer is built (rank 0's initial
    weights on every rank), and :meth:`fit` / :meth:`forward` are data
    parallel: each rank runs its rows, every rank the same number of passes.
    """

    def __init__(self, model: torch.nn.Module, cfg: ModelRoleConfig, ctx: Any) -> None:
        self.group = getattr(ctx, "group", None) or _NoGroup()
        if self.group.world_size > 1:
            model = shard_model(model, self.group)
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
        with self.group.guard("update: grad norm"):  # the global norm over every rank's shards
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
        group = self.group
        n = len(batch)
        total = n if group.world_size == 1 else int(group.all_reduce(
            torch.tensor([n], dtype=torch.int64), name="update: rows over ranks"))
        mini = min(mini_batch_size or total, total)
        micro = min(micro_batch_size or mini, mini)
        budget = self.cfg.max_tokens_per_micro_batch
        prompt_length = batch["input_ids"].shape[1] - batch["responses"].shape[1]
        lengths = response_lengths(batch)
        mask = batch["response_mask"]
        gen = torch.Generator().manual_seed(self.ctx.seed * 7919 + self.updates)
        totals: dict[str, list[float]] = {}

        def accumulate(mb_rows: torch.Tensor) -> None:
            # one all-reduce: every rank's loss is normalised by the whole mini-batch's counts
            norm = LossNorm.of([mask[mb_rows]], group)
            parts = token_budget_split(lengths[mb_rows], prompt_length, budget, micro)
            sums: dict[str, float] = {}
            # a sharded forward is a collective: every rank runs as many passes as the busiest,
            # a rank with fewer repeats its last micro-batch with no weight
            with group.guard("update: forward/backward"):
                for i in range(pass_count(parts, group)):
                    rows = mb_rows[parts[min(i, len(parts) - 1)]]
                    mb = batch[rows] if budget is None else trim(batch[rows], max(1, int(lengths[rows].max())))
                    loss, metrics = loss_fn(mb, norm)
                    if i >= len(parts):
                        (loss * 0.0).backward()
                        continue
                    loss.backward()
                    for k, v in metrics.items():
                        v = float(v.detach()) if torch.is_tensor(v) else float(v)
                        sums[k] = max(sums.get(k, v), v) if k.endswith("_max") else sums.get(k, 0.0) + v
            for k, v in _reduce_metrics(sums, group).items():
                totals.setdefault(k, []).append(v)

        for _ in range(epochs):
            order = torch.randperm(n, generator=gen) if mini < total else torch.arange(n)
            for rows in _mini_batches(order, total, mini, group.world_size):
                for k, v in self.step(lambda rows=rows: accumulate(rows)).items():
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
        if budget is None:
            return data_parallel_forward([batch], fn, self.group)[0]
        width = batch["responses"].shape[1]
        lengths = response_lengths(batch)
        splits = token_budget_split(lengths, batch["input_ids"].shape[1] - width, budget)
        micro_batches = [trim(batch[rows], max(1, int(lengths[rows].max()))) for rows in splits]
        return restore(data_parallel_forward(micro_batches, fn, self.group), splits, width)

    def held_bytes(self) -> dict[str, int]:
        """Bytes of parameters and optimizer state on this rank (its shards, when sharded)."""
        return state_bytes(self.model, self.optimizer)

    def get_weights(self) -> dict[str, torch.Tensor] | None:
        """The full weights, on CPU. Sharded: a collective on every rank, the dict on rank 0 (None elsewhere)."""
        return full_state_dict(self.model, self.group)

    def set_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Load full weights (another pool's :meth:`get_weights`); sharded: each rank copies its part."""
        self._load_full_model(weights)

    def _load_full_model(self, weights: dict[str, torch.Tensor]) -> None:
        if self.group.world_size == 1:
            self.model.load_state_dict(weights)
            return
        with torch.no_grad():
            for name, target in self.model.state_dict().items():
                _local_of(target).copy_(_part_of(target, weights[name]))

    def state_dict(self, shards: str | Path | None = None) -> dict[str, Any]:
        """Everything a checkpoint needs to continue exactly.

        One process: the model's and optimizer's tensors, copied. Sharded over a
        pool's ranks: a collective that writes the shards of the model and the
        optimizer state to ``<shards>/<role>`` (``torch.distributed.checkpoint``,
        safetensors; any number of ranks loads it back) and returns the rest.
        """
        state: dict[str, Any] = {"updates": self.updates, "extra_state": self.extra_state}
        if self.group.world_size > 1:
            if shards is None:
                raise ValueError(f"role {self.ctx.name!r} is sharded over {self.group.world_size} ranks: its "
                                 f"state is written to a directory, pass shards=")
            save_sharded(Path(shards) / self.ctx.name, self.model, self.optimizer, self.group)
            state["sharded"] = self.ctx.name
        else:
            state["model"] = _copied(self.model.state_dict())
            if self.optimizer is not None:
                optim = self.optimizer.state_dict()
                state["optimizer"] = {**optim, "state": {i: _copied(s) for i, s in optim["state"].items()}}
        if self.optimizer is not None:
            state["scheduler"] = self.scheduler.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any], shards: str | Path | None = None, own: bool = True) -> None:
        """Load :meth:`state_dict`'s output, written by any number of ranks (``shards``: the directory
        a sharded state was written under). ``own`` is for roles with per-rank state (see :class:`Actor`)."""
        if "sharded" in state:
            if shards is None:
                raise ValueError(f"role {self.ctx.name!r}: the state was sharded; pass the directory it was "
                                 f"written under as shards=")
            load_sharded(Path(shards) / state["sharded"], self.model, self.optimizer, self.group)
        else:  # one process's whole state; sharded, each rank takes its part
            self._load_full_model(state["model"])
            if self.optimizer is not None and "optimizer" in state:
                optim = state["optimizer"]
                if self.group.world_size > 1:
                    params = [p for g in self.optimizer.param_groups for p in g["params"]]
                    optim = {**optim, "state": {i: {k: _sharded_part(params[int(i)], v) for k, v in s.items()}
                                                for i, s in optim["state"].items()}}
                self.optimizer.load_state_dict(optim)
        if self.optimizer is not None and "scheduler" in state:
            self.scheduler.load_state_dict(state["scheduler"])
        self.updates = state.get("updates", 0)
        self.extra_state = dict(state.get("extra_state", {}))


def _local_of(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _copied(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with every tensor copied (a checkpoint must not change as training goes on)."""
    return {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in state.items()}


def _part_of(target: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``full``, laid out as the (sharded) ``target``; no communication."""
    if not isinstance(target, DTensor):
        return full
    shape, offset = compute_local_shape_and_global_offset(full.shape, target.device_mesh, target.placements)
    return full[tuple(slice(o, o + n) for o, n in zip(offset, shape))]


def _sharded_part(param: torch.Tensor, value: Any) -> Any:
    """This rank's part of a whole optimizer-state tensor, as a DTensor laid out like ``param``
    (scalars such as Adam's step count stay plain)."""
    if not isinstance(param, DTensor) or not torch.is_tensor(value) or value.dim() == 0:
        return value
    return DTensor.from_local(_part_of(param, value).clone(), param.device_mesh, param.placements,
                              run_check=False, shape=param.shape, stride=param.stride())


def _mini_batches(order: torch.Tensor, total: int, mini: int, world: int) -> list[torch.Tensor]:
    """This rank's rows of each mini-batch, cut from its shuffled ``order``.

    One process: consecutive ``mini`` rows. ``world`` ranks: as many mini-batches
    as ``total`` rows over all ranks make, each rank's rows cut into that many
    near-equal runs, so every rank steps the same number of times.
    """
    if world == 1:
        return [order[s:s + mini] for s in range(0, len(order), mini)]
    count = math.ceil(total / mini)
    per, extra = divmod(len(order), count)
    bounds = [i * per + min(i, extra) for i in range(count + 1)]
    return [order[bounds[i]:bounds[i + 1]] for i in range(count)]


def _reduce_metrics(sums: dict[str, float], group: Any) -> dict[str, float]:
    """One mini-batch's metric contributions summed over ranks (``*_max``: the largest)."""
    if group.world_size == 1 or not sums:
        return sums
    keys = sorted(sums)
    out: dict[str, float] = {}
    for op in ("sum", "max"):
        names = [k for k in keys if k.endswith("_max") == (op == "max")]
        if names:
            values = group.all_reduce(torch.tensor([sums[k] for k in names], dtype=torch.float64),
                                      name=f"update metrics ({op})", op=op)
            out.update(zip(names, values.tolist()))
    return out


class _UnshardedEngine:
    """A rollout engine over a sharded model: each ``generate`` runs on full parameters
    (one all-gather on entry, resharded after), ``memory`` the last change it made.

    Inside :meth:`held` the full parameters stay for every ``generate``: a rollout
    that calls the engine a number of times of its own (a multi-turn conversation's
    rounds differ from rank to rank) gathers once, and no rank waits on another's call.
    """

    def __init__(self, engine: Any, model: torch.nn.Module, group: Any) -> None:
        self._engine, self._model, self._group = engine, model, group
        self.memory = None
        self._holding = False

    @contextlib.contextmanager
    def held(self):
        """Full parameters for the whole block: a collective on entry (every rank enters), none inside."""
        if self._holding:
            yield
            return
        with unsharded(self._model, self._group) as change:
            self._holding = True
            try:
                yield
            finally:
                self._holding = False
        self.memory = change

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        if self._holding:
            return self._engine.generate(*args, **kwargs)
        with self.held():
            return self._engine.generate(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


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
            rollout = self.cfg.rollout
            source = EngineSource(self.model, self.tokenizer, self.cfg.model, seed=self.ctx.seed * 1009 + self.ctx.rank,
                                  world_size=self.group.world_size)
            self._engine = build_rollout_engine(rollout.engine, source, rollout.options())
            if engine_spec(rollout.engine).shares_model and self.group.world_size > 1:
                # generation calls forward per token: gather once
                self._engine = _UnshardedEngine(self._engine, self.model, self.group)
        return self._engine

    def sampling_seeds(self, batch: Any) -> torch.Tensor | None:
        """The rollout seed of each prompt of ``batch``, from its ``uid`` and the run's seed: the same
        samples on whichever rank a prompt lands; ``None`` when the batch has no uids."""
        return prompt_seeds(batch["uid"], self.ctx.seed) if "uid" in batch else None

    def full_weights(self):
        """A block in which the rollout engine generates on full parameters however often it is
        called: for a sharded actor, one all-gather on entry on every rank (a collective) and a
        reshard on exit; otherwise nothing."""
        engine = self.engine
        return engine.held() if isinstance(engine, _UnshardedEngine) else contextlib.nullcontext()

    def set_weights(self, weights: dict[str, torch.Tensor]) -> None:
        super().set_weights(weights)
        if self._engine is not None and self.cfg.rollout.engine != "hf":
            self._engine.update_weights(weights)  # the hf engine holds this very model

    def state_dict(self, shards: str | Path | None = None) -> dict[str, Any]:
        state = super().state_dict(shards)
        if self._engine is not None and hasattr(self._engine, "rng_state"):
            state["rollout_rng"] = self._engine.rng_state()  # this rank's own sampling stream
        return state

    def load_state_dict(self, state: dict[str, Any], shards: str | Path | None = None, own: bool = True) -> None:
        """As :meth:`TrainableRole.load_state_dict`; the rollout RNG only from this rank's own state
        (a rank new to the pool keeps its fresh stream rather than repeat another rank's samples)."""
        super().load_state_dict(state, shards, own)
        if own and "rollout_rng" in state:
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
