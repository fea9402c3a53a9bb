"""AdamW, a learning-rate schedule with warm-up, and gradient clipping.

The schedule is a multiplier on ``lr`` for update ``t`` (0-based):

- warm-up (``t < warmup_steps``): ``(t + 1) / warmup_steps``
- then, with ``p = (t - warmup_steps) / (total_steps - warmup_steps)`` in [0, 1]:
  ``constant`` → 1, ``linear`` → ``1 - (1 - min_lr_ratio)·p``,
  ``cosine`` → ``min_lr_ratio + (1 - min_lr_ratio)·½(1 + cos(πp))``.

Example::

    >>> model = torch.nn.Linear(2, 1)
    >>> opt, sched = build_optimizer(model.parameters(), {"lr": 1e-3, "schedule": "cosine",
    ...                                                  "warmup_steps": 10, "total_steps": 100})
    >>> round(opt.param_groups[0]["lr"], 6)   # the first update runs at 1/10 of lr
    0.0001
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Literal, Mapping, Union

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator


class OptimConfig(BaseModel):
    """What a role's ``optim:`` block may say. Unknown keys are an error."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    lr: float = Field(1e-4, gt=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.01, ge=0)
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    #: total number of optimizer updates; needed by ``linear`` and ``cosine``
    total_steps: int | None = Field(None, gt=0)
    #: the schedule's floor, as a fraction of ``lr``
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    #: max global grad norm for :func:`clip_grad_norm`; ``None`` disables clipping
    grad_clip: float | None = Field(1.0, gt=0)

    @model_validator(mode="after")
    def _needs_total(self) -> "OptimConfig":
        if self.schedule != "constant" and self.total_steps is None:
            raise ValueError(f"optim.schedule={self.schedule!r} needs optim.total_steps")
        if self.total_steps is not None and self.warmup_steps > self.total_steps:
            raise ValueError(
                f"optim.warmup_steps={self.warmup_steps} exceeds optim.total_steps={self.total_steps}"
            )
        return self


def lr_multiplier(step: int, cfg: OptimConfig) -> float:
    """The factor on ``cfg.lr`` for the update with 0-based index ``step``.

    Example::

        >>> cfg = OptimConfig(schedule="linear", warmup_steps=2, total_steps=6)
        >>> [lr_multiplier(t, cfg) for t in range(6)]
        [0.5, 1.0, 1.0, 0.75, 0.5, 0.25]
    """
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    decay_steps = max(1, cfg.total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    if cfg.schedule == "linear":
        return 1.0 - (1.0 - cfg.min_lr_ratio) * progress
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(
    params: Iterable[torch.nn.Parameter],
    cfg: Union[OptimConfig, Mapping[str, Any]],
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over ``params`` and its LR scheduler (call ``scheduler.step()`` after each update).

    ``cfg`` is an :class:`OptimConfig` or a dict of its fields.
    """
    cfg = cfg if isinstance(cfg, OptimConfig) else OptimConfig(**cfg)
    optimizer = torch.optim.AdamW(
        [p for p in params if p.requires_grad],
        lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, cfg))
    return optimizer, scheduler


def clip_grad_norm(params: Iterable[torch.nn.Parameter], max_norm: float | None) -> float:
    """Clip the global grad norm to ``max_norm`` (``None``: just measure); return the norm before.

    A non-finite norm is returned as is, so the caller can skip the update.
    """
    params = [p for p in params if p.grad is not None]
    if not params:
        return 0.0
    if max_norm is None:
        return float(torch.linalg.vector_norm(torch.stack([p.grad.detach().norm() for p in params])))
    return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
