"""The registered backends, by the name ``flowrl run --backend`` takes: ``ray`` (the default)
and ``local`` (one process). Importing this module registers both; a plugin backend
registers itself with :func:`~flowrl.runtime.backend.backend`.

Example::

    rt_backend = make_backend("local")
"""

from __future__ import annotations

from pathlib import Path

from flowrl.runtime.backend import BACKENDS, Backend, backend, describe_death
from flowrl.runtime.local import LocalBackend
from flowrl.plan.pools import DRIVER, PoolSpec
from flowrl.runtime.ray_backend import RayBackend
from flowrl.store.runlog import quiet_known_warnings


def make_backend(name: str, address: str | None = None, log_path: Path | None = None) -> Backend:
    """A new backend of the registered kind ``name``; ``log_path``: the run's log, for what worker
    processes print (:mod:`flowrl.store.runlog`)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; registered backends: {', '.join(sorted(BACKENDS))}")
    quiet_known_warnings()  # in this process too: the local backend runs operators here
    made = BACKENDS[name](address=address)
    made.log_path = log_path
    return made


def start_early(made: Backend, pools: list[PoolSpec], driver: bool = True) -> None:
    """Begin starting ``pools``' worker processes (and the driver's, where ``driver``) before
    :meth:`Backend.start` where ``made`` can (ray: as soon as Ray is up, so that they import while the
    driver finishes its own start); elsewhere nothing."""
    if isinstance(made, RayBackend):
        made.prepare(pools, driver)


def stop_early(made: Backend) -> None:
    """End the worker processes :func:`start_early` asked for when the run ended before using them."""
    if isinstance(made, RayBackend):
        made.drop_unstarted()


__all__ = ["BACKENDS", "DRIVER", "Backend", "backend", "LocalBackend", "RayBackend", "PoolSpec", "make_backend",
           "describe_death", "start_early", "stop_early"]
