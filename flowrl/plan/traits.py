"""What a backend is, as far as planning goes: its traits, registered by backend name.

The plan depends on the backend (:func:`~flowrl.plan.planner.make_plan` takes
its traits), and ``flowrl plan --backend``, ``flowrl validate --backend`` and the
run all ask here, so what is printed is what runs. The table is light: it
imports no backend (Ray, torch), so inspecting a graph stays fast.

Example::

    make_plan(graph, traits_of("local"))     # an update runs as "all" on every thread
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BackendTraits:
    """``process_groups``: the workers of a pool are processes that form one
    torch.distributed group (data parallel, sharded roles); otherwise every rank of a
    pool holds its own full roles and takes the whole batch of an update."""

    name: str
    process_groups: bool = False


#: every backend's traits, by the name ``--backend`` takes (a backend registers its own)
TRAITS: dict[str, BackendTraits] = {}


def register_traits(traits: BackendTraits) -> BackendTraits:
    """Add ``traits`` under its name (what :func:`~flowrl.runtime.backends.backend` does)."""
    TRAITS[traits.name] = traits
    return traits


def traits_of(name: str) -> BackendTraits:
    """The traits of backend ``name``, or a ValueError listing the registered ones."""
    try:
        return TRAITS[name]
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; registered backends: {', '.join(sorted(TRAITS))}") from None


LOCAL = register_traits(BackendTraits("local", process_groups=False))
RAY = register_traits(BackendTraits("ray", process_groups=True))

__all__ = ["LOCAL", "RAY", "TRAITS", "BackendTraits", "register_traits", "traits_of"]
