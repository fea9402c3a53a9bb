"""A rollout engine over a sharded actor's model: generation on full parameters.

A colocated engine that runs the actor's own module (``hf``) calls forward once
per token; on a model sharded with FSDP2 each call would all-gather. The
actor wraps such an engine in :class:`UnshardedEngine`, which gathers once
around a ``generate`` (or a whole :meth:`UnshardedEngine.held` block) and
reshards after.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from operators.models.fsdp import unsharded
from operators.rollout.base import RolloutEngine


class UnshardedEngine(RolloutEngine):
    """A rollout engine over a sharded model: each ``generate`` runs on full parameters
    (one all-gather on entry, resharded after), ``memory`` the last change it made.

    Inside :meth:`held` the full parameters stay for every ``generate``: a rollout
    that calls the engine a number of times of its own (a multi-turn conversation's
    rounds differ from rank to rank) gathers once, and no rank waits on another's call.
    Everything else is the wrapped engine's.
    """

    def __init__(self, engine: RolloutEngine, model: torch.nn.Module, group: Any) -> None:
        self._engine, self._model, self._group = engine, model, group
        self.serves_requests, self.takes_images = engine.serves_requests, engine.takes_images
        self.memory = None
        self._holding = False

    @property
    def stop_token_ids(self) -> Any:
        return self._engine.stop_token_ids

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

    async def generate_one(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return await self._engine.generate_one(*args, **kwargs)

    def update_weights(self, weights: Any, *, version: int) -> dict[str, float]:
        return self._engine.update_weights(weights, version=version)

    def check_weights(self, model: torch.nn.Module) -> dict[str, float]:
        return self._engine.check_weights(model)

    def release_memory(self) -> None:
        self._engine.release_memory()

    def resume_memory(self) -> None:
        self._engine.resume_memory()

    def memory_metrics(self) -> dict[str, float]:
        return self._engine.memory_metrics()

    def rng_state(self) -> torch.Tensor | None:
        return self._engine.rng_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        self._engine.set_rng_state(state)

    def shutdown(self) -> None:
        self._engine.shutdown()


__all__ = ["UnshardedEngine"]
