"""Training engines: a model, its optimizer, and the passes that train and score it.

A role (actor, critic) holds its math; the engine holds the model and runs
it. The contract is verl's ``BaseEngine`` in small: :meth:`TrainEngine.train_batch`
(the update's mini-batch steps: :meth:`forward_backward` over a mini-batch's
micro-batches with a loss function, then :meth:`optimizer_step`),
:meth:`infer_batch` (forward only), weights out and in, and what a
checkpoint saves (``model``, ``optimizer``, ``scheduler``, ``updates``).
Engines are registered by name and chosen per role in the graph::

    roles:
      actor: {model: builtin:tiny, engine: fsdp2}

* ``local`` — one process holds the whole model (a pool of one worker, or the
  local backend).
* ``fsdp2`` — the model sharded over the pool's process group with FSDP2
  (:mod:`operators.models.fsdp`); every rank runs its rows of each mini-batch,
  gradients summed over ranks, so N ranks take the step one process takes.

Left unset, a role on a pool whose workers form a group gets ``fsdp2``, else
``local``. A new backend is a class registered with :func:`register_engine`.

Example::

    engine = build_engine(None, model, optim=OptimConfig(lr=1e-4), group=None, seed=0)
    metrics = engine.train_batch(batch, loss_fn, mini_batch_size=8, epochs=1, micro_batch_size=4)
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ClassVar, Iterator

import torch

from flowrl.data.dispatch import TASK_ROWS
from flowrl.data.metrics import MAX, MEAN, MIN, SUM, Metric, Reduction, mean
from operators.models.data_parallel import LossNorm, data_parallel_forward, pass_count
from operators.models.fsdp import (fsdp_units, full_state_dict, full_tensor, is_dtensor, local_part, shard_model,
                                   state_bytes)
from operators.models.lora import is_lora, load_merged, merged_weights
from operators.models.microbatch import response_lengths, restore, token_budget_split, trim
from operators.models.optim import OptimConfig, build_optimizer, clip_grad_norm
from operators.models.schedule import update_schedule

#: a loss function: ``loss_fn(micro_batch, norm) -> (loss, metrics)``; the loss is normalised by ``norm``
#: (the whole mini-batch's counts), metrics declare their reduction (:mod:`flowrl.data.metrics`)
LossFn = Callable[[Any, LossNorm], "tuple[torch.Tensor, dict[str, Any]]"]



class SingleProcess:
    """The group of a role that shares none (a pool of one, or the local backend's threads)."""

    rank, world_size = 0, 1

    def all_reduce(self, tensor: torch.Tensor, name: str = "", op: str = "sum") -> torch.Tensor:
        return tensor

    def guard(self, name: str):
        return contextlib.nullcontext()


ENGINES: dict[str, type["TrainEngine"]] = {}


def register_engine(name: str):
    """Register a :class:`TrainEngine` subclass under ``name`` (the graph's ``engine:``)."""
    def register(cls: type[TrainEngine]) -> type[TrainEngine]:
        cls.name = name
        ENGINES[name] = cls
        return cls
    return register


def engine_for(name: str | None, world_size: int) -> type["TrainEngine"]:
    """The engine class a role asks for; ``None`` picks by the pool: ``fsdp2`` when its workers form
    a group, else ``local``."""
    if name is None:
        name = "fsdp2" if world_size > 1 else "local"
    if name not in ENGINES:
        raise ValueError(f"no training engine {name!r}; registered: {', '.join(sorted(ENGINES))}")
    cls = ENGINES[name]
    if world_size > cls.max_world_size:
        raise ValueError(f"engine {name!r} runs in one process, but the pool has {world_size} workers "
                         f"forming one group: use engine: fsdp2 or one worker")
    return cls


def build_engine(name: str | None, model: torch.nn.Module, *, optim: OptimConfig | None, group: Any = None,
                 seed: int = 0, max_tokens_per_micro_batch: int | None = None) -> "TrainEngine":
    """The registered engine ``name`` over ``model``; ``optim=None`` builds a frozen one (no optimizer)."""
    group = group or SingleProcess()
    return engine_for(name, group.world_size)(model, optim=optim, group=group, seed=seed,
                                              max_tokens_per_micro_batch=max_tokens_per_micro_batch)


class TrainEngine:
    """One process's model and optimizer; the base of every engine (the ``local`` one as it is).

    ``updates`` counts optimizer steps: with the run's ``seed`` it keys each
    update's mini-batch permutation, and a checkpoint saves it.
    """

    name: ClassVar[str] = ""
    max_world_size: ClassVar[float] = 1

    def __init__(self, model: torch.nn.Module, *, optim: OptimConfig | None, group: Any, seed: int,
                 max_tokens_per_micro_batch: int | None = None) -> None:
        self.group, self.seed, self.max_tokens = group, seed, max_tokens_per_micro_batch
        self.model = self.prepare(model)
        self.optim = optim
        self.updates = 0
        self.optimizer = self.scheduler = None
        if optim is None:
            self.model.requires_grad_(False)
        else:
            self.optimizer, self.scheduler = build_optimizer(self.model.parameters(), optim)
        self.model.eval()

    def prepare(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model as this engine runs it (sharded, moved); before the optimizer is built."""
        return model

    # -- training ----------------------------------------------------------------------------

    def train_batch(self, batch: Any, loss_fn: LossFn, *, mini_batch_size: int | None, epochs: int,
                    micro_batch_size: int | None) -> dict[str, Metric]:
        """PPO-style training on ``batch``: ``epochs`` passes over mini-batches cut from one
        permutation of the whole batch (:func:`~operators.models.schedule.update_schedule`), one
        optimizer step each, gradients accumulated over micro-batches.

        ``loss_fn(micro_batch, norm)`` normalises its loss by ``norm`` (the whole
        mini-batch's token and row counts over every rank), so the micro-batch
        losses add up to the mini-batch's and the step does not depend on how it
        is cut. Its metrics declare their reduction: a token mean with its token
        count as weight (:func:`flowrl.data.metrics.mean`), a share of the
        mini-batch's value as a sum. Each mini-batch's metrics are reduced over
        its micro-batches and ranks; the result is their mean over mini-batches
        (maxima and minima over them), plus ``grad_norm`` and ``lr``.
        """
        positions, total = self._positions(batch)
        steps = update_schedule(total, mini_batch_size=mini_batch_size, epochs=epochs,
                                seed=self.seed * 7919 + self.updates, positions=positions)
        prompt_length = batch["input_ids"].shape[1] - batch["responses"].shape[1]
        lengths = response_lengths(batch)
        micro = min(micro_batch_size or total, total)
        over_steps = Reduction()
        for rows in steps:
            parts = token_budget_split(lengths[rows], prompt_length, self.max_tokens, micro) if len(rows) else []
            micro_batches = [self._cut(batch, rows[p], lengths) for p in parts]
            if not micro_batches:  # no row of this mini-batch here: a weightless pass keeps the ranks in step
                micro_batches = [batch[torch.arange(1)]]
                real = 0
            else:
                real = len(micro_batches)
            self.zero_grad()
            metrics = self.forward_backward(micro_batches, loss_fn, real=real)
            metrics.update(self.optimizer_step())
            over_steps.add(_per_step(metrics))
        return over_steps.values()

    def forward_backward(self, micro_batches: list[Any], loss_fn: LossFn, *, real: int | None = None) -> dict[str, Metric]:
        """Accumulate the gradients of one mini-batch, this rank's ``micro_batches`` of it (the first
        ``real``; the rest keep the ranks in step with no weight); its metrics reduced over every
        rank. Every rank runs as many passes as the busiest (a sharded forward is a collective)."""
        real = len(micro_batches) if real is None else real
        norm = LossNorm.of([mb["response_mask"] for mb in micro_batches[:real]], self.group)
        reduction = Reduction()
        self.model.train()
        with self.group.guard("update: forward/backward"):
            passes = pass_count(micro_batches, self.group)
            for i in range(passes):
                self._before_backward(last=i == passes - 1)
                mb = micro_batches[min(i, len(micro_batches) - 1)]
                loss, metrics = loss_fn(mb, norm)
                weighted = i < real
                (loss if weighted else loss * 0.0).backward()
                reduction.add(metrics, weight=mb["response_mask"].shape[0], real=weighted)
        return self._over_ranks(reduction)

    def zero_grad(self) -> None:
        self._require_optimizer()
        self.optimizer.zero_grad(set_to_none=True)

    def optimizer_step(self) -> dict[str, float]:
        """Clip the global grad norm, step the optimizer and the schedule; ``grad_norm`` (before
        clipping) and ``lr``."""
        self._require_optimizer()
        with self.group.guard("update: grad norm"):  # the global norm over every rank's shards
            grad_norm = clip_grad_norm(self.model.parameters(), self.optim.grad_clip)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.model.eval()
        self.updates += 1
        return {"grad_norm": grad_norm, "lr": lr}

    # -- forward only ------------------------------------------------------------------------

    def infer_batch(self, batch: Any, fn: Callable[[Any], torch.Tensor]) -> torch.Tensor:
        """``fn(micro_batch) -> [b, r, ...]`` over the whole batch without gradients, in row order,
        ``R`` wide. Under a token budget the rows go in length buckets, each cut to its own
        longest response (positions past it come back 0); without one, one call on the batch."""
        if self.max_tokens is None:
            return data_parallel_forward([batch], fn, self.group)[0]
        width = batch["responses"].shape[1]
        lengths = response_lengths(batch)
        splits = token_budget_split(lengths, batch["input_ids"].shape[1] - width, self.max_tokens)
        micro_batches = [self._cut(batch, rows, lengths) for rows in splits]
        return restore(data_parallel_forward(micro_batches, fn, self.group), splits, width)

    # -- weights -----------------------------------------------------------------------------

    def get_weights(self) -> dict[str, torch.Tensor] | None:
        """The full weights, on CPU (sharded: a collective, the dict on rank 0, ``None`` elsewhere);
        with LoRA, the base's names with the adapters merged in."""
        if is_lora(self.model):
            weights = {name: t.to("cpu", copy=True) for name, t in self.named_weights()}
            return weights if self.group.rank == 0 else None
        return full_state_dict(self.model, self.group)

    def set_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Load full weights (another pool's :meth:`get_weights`); with LoRA, as the base (adapters zeroed)."""
        if is_lora(self.model):
            return load_merged(self.model, weights)
        self.model.load_state_dict(weights)

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, full tensor)`` for every entry of the model's state dict, one at a time, on every
        rank: what a colocated rollout engine loads after an update. Sharded, each tensor is
        gathered when it is reached (a collective: every rank iterates to the end), so no rank
        holds all the full weights at once. Tied weights come under each of their names: an
        engine may keep its own copy of each (vLLM's CPU build prepacks ``lm_head`` apart from
        the embeddings). With LoRA: the base's names, each adapted weight merged (``W + scale·BA``)."""
        with self.group.guard("weights for the rollout engine"):
            if is_lora(self.model):
                yield from merged_weights(self.model)
                return
            for name, tensor in self.model.state_dict(keep_vars=True).items():
                yield name, full_tensor(tensor).detach()

    def held_bytes(self) -> dict[str, int]:
        """Bytes of parameters and optimizer state on this rank (its shards, when sharded)."""
        return state_bytes(self.model, self.optimizer)

    # -- helpers -----------------------------------------------------------------------------

    def _positions(self, batch: Any) -> tuple[torch.Tensor | None, int]:
        """Where this rank's rows sit in the whole batch, and its row count over every rank."""
        return None, len(batch)

    def _before_backward(self, last: bool) -> None:
        """Called before each pass's backward (``last``: the mini-batch's last pass)."""

    def _cut(self, batch: Any, rows: torch.Tensor, lengths: torch.Tensor) -> Any:
        """Rows ``rows`` of ``batch``; under a token budget, cut to their own longest response."""
        part = batch[rows]
        return part if self.max_tokens is None else trim(part, max(1, int(lengths[rows].max())))

    def _over_ranks(self, reduction: Reduction) -> dict[str, Metric]:
        return reduction.values()

    def _require_optimizer(self) -> None:
        if self.optimizer is None:
            raise RuntimeError("this model is frozen (no optimizer): it cannot be updated")


register_engine("local")(TrainEngine)


@register_engine("fsdp2")
class FSDP2Engine(TrainEngine):
    """The model sharded over the pool's ranks with FSDP2 (rank 0's initial weights on every rank)."""

    max_world_size = float("inf")
    #: reduce-scatter the gradients once, after a mini-batch's last pass, instead of after every pass:
    #: less traffic, but every rank holds full-size gradients between passes
    reduce_once = False

    def prepare(self, model: torch.nn.Module) -> torch.nn.Module:
        """Shard ``model`` (rank 0's weights on every rank); one sharded already (built by
        :func:`~operators.models.fsdp.build_sharded`) is taken as it is."""
        return model if fsdp_units(model) else shard_model(model, self.group)

    def _before_backward(self, last: bool) -> None:
        if self.reduce_once:
            for unit in fsdp_units(self.model):
                unit.set_requires_gradient_sync(last, recurse=False)

    def set_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Each rank copies its part of the full ``weights``; no communication."""
        if self.group.world_size == 1:
            return super().set_weights(weights)
        with torch.no_grad():
            for name, target in self.model.state_dict().items():
                local_part(target).copy_(_part_of(target, weights[name]))

    def _positions(self, batch: Any) -> tuple[torch.Tensor | None, int]:
        if self.group.world_size == 1:
            return None, len(batch)
        rows = batch.meta_info.get(TASK_ROWS)
        if rows is None:  # the whole batch on every rank would take every step N times
            raise RuntimeError(f"rank {self.group.rank}: a sharded update needs its rows' places in the "
                               f"batch (a balanced dispatch leaves them in meta_info[{TASK_ROWS!r}])")
        positions, total = rows
        return torch.as_tensor(positions, dtype=torch.long), int(total)

    def _over_ranks(self, reduction: Reduction) -> dict[str, Metric]:
        """One all-reduce per kind: sums for means and sums, max for maxima, min for minima (every rank
        holds the same names: padding passes record them with no value)."""
        packed = reduction.packed()
        if self.group.world_size > 1 and packed:
            names = sorted(packed)
            out = {}
            for kinds, op in (((MEAN, SUM), "sum"), ((MAX,), "max"), ((MIN,), "min")):
                chosen = [n for n in names if packed[n][0] in kinds]
                if not chosen:
                    continue
                values = torch.tensor([[packed[n][1], packed[n][2]] for n in chosen], dtype=torch.float64)
                self.group.all_reduce(values, name=f"update metrics ({op})", op=op)
                out.update({n: (packed[n][0], *v) for n, v in zip(chosen, values.tolist())})
            reduction.merge(out)
        return reduction.values()


def _per_step(metrics: dict[str, float]) -> dict[str, float]:
    """A mini-batch's metrics as one value each, to average over mini-batches (maxima and minima
    stay what they are)."""
    return {k: v if isinstance(v, Metric) and v.reduce in (MAX, MIN) else mean(v, 1.0) for k, v in metrics.items()}


def _part_of(target: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``full``, laid out as the (sharded) ``target``; no communication."""
    if not is_dtensor(target):
        return full
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(full.shape, target.device_mesh, target.placements)
    return full[tuple(slice(o, o + n) for o, n in zip(offset, shape))]


__all__ = ["ENGINES", "FSDP2Engine", "LossFn", "SingleProcess", "TASK_ROWS", "TrainEngine", "build_engine",
           "engine_for", "register_engine"]
