"""One data-parallel optimizer step: every rank's share of a mini-batch, one global normaliser.

Each rank holds its rows of the mini-batch (:func:`flowrl.data.balance.balance_ranks`)
cut into micro-batches. The loss of a micro-batch is divided by the
mini-batch's real token count over *all* ranks (:class:`LossNorm`, one
all-reduce), so summing the gradients over micro-batches and ranks (FSDP2's
reduce-scatter with SUM, see :func:`operators.models.fsdp.shard_model`) gives
exactly the gradient one process computes on the whole mini-batch, however
ragged the responses are and however they are split.

The loss function has the signature ``TrainableRole.fit`` uses,
``loss_fn(micro_batch, norm) -> (loss, metrics)``: token-mean divides by
``norm.tokens``, seq-mean modes by ``norm.seqs``.

Forward-only operators use :func:`data_parallel_forward`: the same pass
count on every rank, no gradients.

Example (every rank of the pool runs the same call on its own rows)::

    norm = LossNorm.of([mb["response_mask"] for mb in micro_batches], group)
    metrics = data_parallel_step(model, optimizer, micro_batches, loss_fn, group,
                                 norm=norm, grad_clip=1.0)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from operators.models.fsdp import Group, fsdp_units
from operators.models.optim import clip_grad_norm


@dataclass(frozen=True)
class LossNorm:
    """The mini-batch's real token count and its number of rows with a real token, over all ranks."""

    tokens: float
    seqs: float

    @classmethod
    def of(cls, masks: Sequence[torch.Tensor], group: Group | None = None) -> "LossNorm":
        """Count ``masks`` (this rank's response masks) and sum the counts over ``group``.

        One all-reduce of two numbers (SUM; a pool of one or ``group=None``
        reduces nothing). Counts are floats in float64, exact up to 2**53.
        """
        counts = torch.zeros(2, dtype=torch.float64)
        for mask in masks:
            counts[0] += float(mask.sum())
            counts[1] += float((mask.sum(-1) > 0).sum())
        if group is not None:
            group.all_reduce(counts, name="loss normaliser (token and row counts)")
        return cls(tokens=max(float(counts[0]), 1.0), seqs=max(float(counts[1]), 1.0))

    def weight(self, mask: torch.Tensor) -> float:
        """A micro-batch's share of the mini-batch's tokens: the weight of a mean over its tokens."""
        return float(mask.sum()) / max(self.tokens, 1.0)


def pass_count(micro_batches: Sequence[Any], group: Group) -> int:
    """How many passes every rank runs: the most micro-batches any rank holds (one all-reduce)."""
    if not micro_batches:
        raise ValueError(f"rank {group.rank}: no rows for this rank; give every rank at least one row "
                         f"(FSDP2 needs every rank in every forward)")
    count = torch.tensor([len(micro_batches)], dtype=torch.int64)
    return int(group.all_reduce(count, name="micro-batch count", op="max"))


def data_parallel_forward(micro_batches: Sequence[Any], forward: Callable[[Any], Any], group: Group) -> list[Any]:
    """``forward(mb)`` without gradients for each of this rank's micro-batches (log-probs, values).

    Every rank runs as many passes as the busiest one (a sharded model's
    forward is a collective); the outputs of the extra passes are dropped, so
    the result has one entry per micro-batch of this rank.
    """
    passes = pass_count(micro_batches, group)
    outputs = []
    with torch.no_grad(), group.guard("forward-only passes"):
        for i in range(passes):
            out = forward(micro_batches[min(i, len(micro_batches) - 1)])
            if i < len(micro_batches):
                outputs.append(out)
    return outputs


LossFn = Callable[[Any, LossNorm], "tuple[torch.Tensor, dict[str, Any]]"]


def data_parallel_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                       micro_batches: Sequence[Any], loss_fn: LossFn, group: Group, *,
                       norm: LossNorm, grad_clip: float | None,
                       reduce_once: bool = False) -> dict[str, float]:
    """Accumulate ``loss_fn`` over this rank's ``micro_batches``, reduce, clip, step.

    Every rank runs as many forward/backward passes as the rank with the most
    micro-batches (FSDP2's collectives must line up); a rank with fewer repeats
    its last micro-batch with a zero loss weight, which adds nothing to the
    gradient. Gradients are reduce-scattered after every pass, so a rank only
    ever holds its shard of them (verl's FSDP workers do the same);
    ``reduce_once=True`` reduces once, after the last pass: less traffic, but
    full-size gradients are held between passes.
    Returns this rank's metrics averaged over its real micro-batches, plus
    ``grad_norm`` (global, before clipping).
    """
    passes = pass_count(micro_batches, group)
    units = fsdp_units(model)
    totals: dict[str, list[float]] = {}
    model.train()
    optimizer.zero_grad(set_to_none=True)
    with group.guard("update: forward/backward"):
        for i in range(passes):
            sync = not reduce_once or i == passes - 1
            for unit in units:
                unit.set_requires_gradient_sync(sync, recurse=False)
            real = i < len(micro_batches)
            loss, metrics = loss_fn(micro_batches[min(i, len(micro_batches) - 1)], norm)
            (loss if real else loss * 0.0).backward()
            if real:
                for k, v in metrics.items():
                    totals.setdefault(k, []).append(float(v.detach()) if torch.is_tensor(v) else float(v))
    with group.guard("update: grad norm"):
        grad_norm = clip_grad_norm(model.parameters(), grad_clip)
    optimizer.step()
    model.eval()
    out = {k: sum(v) / len(v) for k, v in totals.items()}
    out["grad_norm"] = float(grad_norm)
    return out
