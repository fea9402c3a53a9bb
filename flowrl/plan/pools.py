"""Pools as the plan sees them: the workers of each pool and the roles each builds.

A pool hosts roles (colocation: every role of a pool lives in the same worker
processes). Which objects a worker builds is decided here, once, from the
graph: a frozen derived role (``ref: {from: actor, frozen: true}``) gets its
own copy of the root role's model, unless the root's config offers a frozen
view (``frozen_view()``: an actor with LoRA adapters computes its base with them
off) and the root is in the same pool: then it is the root's
:meth:`~flowrl.graph.Role.frozen_view`, no second copy; a non-frozen derived
role in the same pool shares the object (and weights) of the role it derives from.

Example::

    for spec in pool_specs(graph):
        print(spec.name, spec.workers, [b.name for b in spec.roles])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flowrl.graph import REGISTRY, Graph
from flowrl.timeouts import COLLECTIVE_S

#: the pseudo-pool of stateless nodes that run on the driver
DRIVER = "driver"


@dataclass
class RoleBuild:
    """How to build one role in a worker: ``factory(config, ctx)``, or share
    another role's object (a non-frozen derived role in the same pool), or take
    its frozen view (``view``: why, in words, for ``flowrl validate``)."""

    name: str
    kind: str
    factory: Any
    config: Any
    shares: str | None = None
    frozen: bool = False
    view: str | None = None


@dataclass
class PoolSpec:
    """One pool: its workers and resources, the roles each worker builds, and its process group's settings."""

    name: str
    workers: int
    cpus: float
    gpus: float
    roles: list[RoleBuild]
    backend: str = "cpu:gloo,cuda:nccl"  # torch.distributed, per device type (a pool of N > 1)
    timeout_s: float = COLLECTIVE_S  # one collective's limit

    def role_modules(self) -> list[str]:
        """The modules this pool's roles are built from: what its worker processes import before the plan."""
        return sorted({rb.factory.__module__ for rb in self.roles if rb.shares is None and rb.factory is not None})


def pool_specs(graph: Graph) -> list[PoolSpec]:
    """Every pool of ``graph`` with the role builds of its workers."""
    return [PoolSpec(name, cfg.workers, cfg.cpus, cfg.gpus, role_builds(graph, cfg.roles), cfg.backend, cfg.timeout_s)
            for name, cfg in graph.config.pools.items()]


def role_builds(graph: Graph, names: list[str]) -> list[RoleBuild]:
    """The builds of the roles ``names`` of one pool, a shared role after the role it shares."""
    roles = graph.config.roles
    builds: list[RoleBuild] = []
    done: set[str] = set()

    def root(name: str) -> str:
        while roles[name].from_ is not None:
            name = roles[name].from_
        return name

    def add(name: str) -> None:
        if name in done:
            return
        cfg = roles[name]
        kind = graph.role_kinds[name]
        rk = REGISTRY.role_kind(kind)
        settings = rk.config.model_validate(roles[root(name)].settings)
        if cfg.from_ is not None and cfg.from_ in names and not cfg.frozen:
            add(cfg.from_)
            builds.append(RoleBuild(name, kind, rk.factory, None, shares=cfg.from_))
        elif cfg.frozen and cfg.from_ in names and roles[cfg.from_].from_ is None and frozen_view(settings):
            add(cfg.from_)
            builds.append(RoleBuild(name, kind, rk.factory, None, shares=cfg.from_, frozen=True,
                                    view=frozen_view(settings)))
        else:
            builds.append(RoleBuild(name, kind, rk.factory, settings, frozen=cfg.frozen))
        done.add(name)

    for n in names:
        add(n)
    return builds


def frozen_view(settings: Any) -> str | None:
    """What a role kind's validated config says a frozen role derived from it in its pool is (its
    ``frozen_view()``, in words), or None: such a role gets a copy of its own."""
    method = getattr(settings, "frozen_view", None)
    return method() if callable(method) else None


def role_notes(graph: Graph) -> list[str]:
    """What ``flowrl validate`` says about how roles are built beyond the graph's own words: each frozen
    role served as a view of another role's object."""
    return [f"role {rb.name!r} (from {rb.shares!r}, frozen) is {rb.view}"
            for spec in pool_specs(graph) for rb in spec.roles if rb.view is not None]


__all__ = ["DRIVER", "frozen_view", "role_notes", "PoolSpec", "RoleBuild", "pool_specs", "role_builds"]
