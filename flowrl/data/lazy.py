"""Package exports imported on first use, so importing a package costs only what is used.

A package ``__init__`` lists where each public name lives and hands the list to
:func:`lazy_exports`; ``from pkg import name`` then imports only ``name``'s
module. The CLI relies on this: ``flowrl --help`` and ``flowrl validate`` never
import torch, tensordict or transformers unless an operator module they load does.

Example (in a package's ``__init__.py``)::

    __getattr__, __dir__ = lazy_exports(__name__, {"DataProto": "flowrl.data.proto"})
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable


def lazy_exports(package: str, home: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A module-level ``__getattr__`` and ``__dir__`` resolving ``home[name]`` on first access."""

    def __getattr__(name: str) -> Any:
        module = home.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)  # later lookups skip this function
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(home))

    return __getattr__, __dir__


__all__ = ["lazy_exports"]
