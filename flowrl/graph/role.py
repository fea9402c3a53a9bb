"""A role as the runtime's worker sees it: the contract every role kind's object declares.

A role kind (``@role_kind("actor", config=...)``) builds one object per worker
of its pool. The worker never probes that object for what it can do; it calls
the methods of :class:`Role`, which every role kind derives from:

============================  ===============================================================
``get_weights()``             the full weights, for a load on another pool (a sync)
``set_weights(weights)``      load another pool's :meth:`~Role.get_weights`
``set_version(version)``      the worker's word on the weights the role now holds (see below)
``held_bytes()``              bytes of parameters and optimizer state this rank holds
``weights_for_digest()``      this rank's weights for the run's fingerprints (no collective)
``close()``                   stop what the role started (a rollout engine's processes)
``frozen_view()``             a frozen role served by this object (when its config offers one)
============================  ===============================================================

A role whose state a checkpoint must hold is also :class:`Stateful`
(``state_dict()`` / ``load_state_dict(state)``, torchtitan's and DCP's contract).

**The weight version has one owner: the worker.** It counts the updates a role's
weights went through, and after each change (an update task, a load from another
pool, a restore from a checkpoint) calls :meth:`Role.set_version` with the version
the weights now carry. A role never computes a version: it stamps the version it was
last told on what it produces (a sample's ``weight_version``) and hands it to
whatever keeps its own copy of the weights (a rollout engine's ``update_weights(...,
version=)``); the metrics of that hand-over are the task's.

Example::

    @role_kind("my_policy", config=MyConfig)
    class MyPolicy(Role):
        def __init__(self, cfg, ctx):
            self.w = torch.zeros(cfg.width)

        def get_weights(self):
            return self.w.clone()

        def set_weights(self, w):
            self.w = w.clone()
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from flowrl.errors import RunError


class Role:
    """The object a role kind builds, as the worker calls it (see the module docstring)."""

    #: the version of the weights this role holds: set by the worker through :meth:`set_version` only
    version: int = 0

    def get_weights(self) -> Any:
        """The full weights, for another pool's :meth:`set_weights`."""
        raise RunError(f"role {type(self).__name__} has no weights to send to another pool: "
                                  f"implement get_weights and set_weights")

    def set_weights(self, weights: Any) -> None:
        """Load another pool's :meth:`get_weights` (the worker then calls :meth:`set_version`)."""
        raise RunError(f"role {type(self).__name__} cannot load weights from another pool: "
                                  f"implement get_weights and set_weights")

    def weights_for_digest(self) -> Any:
        """``(name, tensor)`` pairs of this rank's weights (no collective), for the runtime's weight
        fingerprints; None: nothing to digest."""
        return None

    def set_version(self, version: int) -> dict[str, float]:
        """The weights this role holds are now ``version`` (decided by the worker, never by the role):
        stamp it from now on, and hand it to anything that keeps its own copy of the weights.
        Returns the metrics of that hand-over (none here)."""
        self.version = version
        return {}

    def held_bytes(self) -> dict[str, int]:
        """Bytes of parameters and optimizer state this rank holds, by kind (none here)."""
        return {}

    def close(self) -> None:
        """Stop what the role started that outlives a run otherwise (nothing here)."""

    def frozen_view(self) -> "Role":
        """A frozen role derived from this one, served by this object (no second copy), for a role kind
        whose config's ``frozen_view()`` says so (:mod:`flowrl.plan.pools`)."""
        raise RunError(f"role {type(self).__name__} offers no frozen view: a frozen role derived from it "
                       f"gets a copy of its own")


@runtime_checkable
class Stateful(Protocol):
    """A role with state for a checkpoint (``torch.distributed.checkpoint``'s ``Stateful``):
    ``state_dict()``'s tensors go through DCP, the rest as JSON; ``load_state_dict`` takes it back."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class RoleContext:
    """What a role factory learns about where it lives."""

    name: str
    rank: int
    world_size: int
    seed: int
    frozen: bool = False
    device: str = "cpu"
    #: the pool's process group (:class:`~flowrl.runtime.distributed.PoolGroup`): every rank of a
    #: pool of N workers on the ray backend; a group of one where the ranks share no group
    group: Any = None


__all__ = ["Role", "RoleContext", "Stateful"]
