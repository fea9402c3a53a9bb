"""User reward functions, loaded by import path: ``mypkg.mod:fn`` or ``path/to/file.py:fn``.

The function has verl's signature
``compute_score(data_source, solution_str, ground_truth, extra_info) -> float | dict``;
a dict must carry the score under ``"score"`` (its other keys become metrics).

Example::

    >>> fn = load_reward_fn("operators.rewards.rule:exact_match_score")
    >>> split_score(fn("x", "7", "7", {}))
    (1.0, {})
    >>> split_score({"score": 0.5, "acc": 1.0})
    (0.5, {'acc': 1.0})
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any, Callable


class RewardFnError(ValueError):
    """A reward function spec could not be loaded, or a reward function returned a bad value."""


def load_reward_fn(spec: str) -> Callable[..., Any]:
    """Import ``module.path:name`` or ``file.py:name`` and return the callable it names."""
    module_part, sep, name = spec.rpartition(":")
    if not sep or not module_part or not name:
        raise RewardFnError(
            f"reward function {spec!r}: expected 'package.module:function' or 'path/to/file.py:function'"
        )
    if module_part.endswith(".py") or "/" in module_part or "\\" in module_part:
        path = Path(module_part).expanduser()
        if not path.is_file():
            raise RewardFnError(f"reward function {spec!r}: file {path.resolve()} does not exist")
        module_name = f"flowrl_user_reward_{abs(hash(str(path.resolve())))}"
        file_spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(file_spec)
        sys.modules[module_name] = module
        try:
            file_spec.loader.exec_module(module)
        except Exception as err:
            del sys.modules[module_name]
            raise RewardFnError(f"reward function {spec!r}: importing {path} failed: {err!r}") from err
    else:
        try:
            module = importlib.import_module(module_part)
        except ImportError as err:
            raise RewardFnError(f"reward function {spec!r}: cannot import module {module_part!r}: {err}") from err
    fn = getattr(module, name, None)
    if fn is None:
        raise RewardFnError(f"reward function {spec!r}: {module_part} has no attribute {name!r}")
    if not callable(fn):
        raise RewardFnError(f"reward function {spec!r}: {name!r} is a {type(fn).__name__}, not a function")
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
