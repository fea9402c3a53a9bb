"""User reward functions, loaded by import path: ``mypkg.mod:fn`` or ``path/to/file.py:fn``.

The function has verl's signature
``compute_score(data_source, solution_str, ground_truth, extra_info) -> float | dict``;
a dict must carry the score under ``"score"`` (its other keys become metrics).
Import paths are resolved by flowrl's one loader
(:func:`flowrl.graph.registry.load_object`), as operators and tools are.

Example::

    >>> fn = load_reward_fn("operators.rewards.rule:exact_match_score")
    >>> split_score(fn("x", "7", "7", {}))
    (1.0, {})
    >>> split_score({"score": 0.5, "acc": 1.0})
    (0.5, {'acc': 1.0})
"""

from __future__ import annotations

from typing import Any, Callable

from flowrl.errors import ConfigError
from flowrl.graph.registry import ImportPathError, load_object


class RewardFnError(ConfigError, ValueError):
    """A reward function spec could not be loaded, or a reward function returned a bad value."""


def load_reward_fn(spec: str) -> Callable[..., Any]:
    """Import ``module.path:name`` or ``file.py:name`` and return the callable it names."""
    try:
        fn = load_object(spec, what="function")
    except (ImportPathError, SyntaxError) as err:
        raise RewardFnError(f"reward function {spec!r}: {err}") from err
    if not callable(fn):
        raise RewardFnError(f"reward function {spec!r}: {spec.rpartition(':')[2]!r} is a {type(fn).__name__}, "
                            "not a function")
    return fn


def split_score(result: Any) -> tuple[float, dict[str, Any]]:
    """A reward function's result as ``(score, extras)``: a number, or a dict with ``"score"``."""
    if isinstance(result, dict):
        if "score" not in result:
            raise RewardFnError(f"a reward function returned a dict without 'score': keys {sorted(result)}")
        extras = {k: v for k, v in result.items() if k != "score"}
        return float(result["score"]), extras
    try:
        return float(result), {}
    except (TypeError, ValueError):
        raise RewardFnError(
            f"a reward function returned {type(result).__name__} {result!r}; return a float or a dict with 'score'"
        ) from None
