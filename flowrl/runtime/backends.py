"""The registered backends, by the name ``flowrl run --backend`` takes: ``ray`` (the default)
and ``local`` (one process). Importing this module registers both; a plugin backend
registers itself with :func:`~flowrl.runtime.backend.backend`.

Example::

    rt_backend = make_backend("local")
"""

from __future__ import annotations

from flowrl.runtime.backend import BACKENDS, Backend, backend, describe_death
from flowrl.runtime.local import LocalBackend
from flowrl.runtime.pools import DRIVER, PoolSpec
from flowrl.runtime.ray_backend import RayBackend


def make_backend(name: str, address: str | None = None) -> Backend:
    """A new backend of the registered kind ``name``."""
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; registered backends: {', '.join(sorted(BACKENDS))}")
    return BACKENDS[name](address=address)


__all__ = ["BACKENDS", "DRIVER", "Backend", "backend", "LocalBackend", "RayBackend", "PoolSpec", "make_backend",
           "describe_death"]
