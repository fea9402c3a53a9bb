"""transformers, imported on first use and under a lock.

Declaring operators (``flowrl validate``, ``ops``, ``viz``, ``plan``) must not pay
the seconds transformers takes to import, so the modules that build models and
tokenizers fetch its classes when they build one. That first import is not
thread-safe: threads importing transformers at once get ``ImportError: cannot
import name ...`` from its lazy module, and operators run in threads (several
micro-batches of one node at a time). One lock serialises it.

Example::

    >>> LlamaConfig = hf("LlamaConfig")
    >>> LlamaConfig(hidden_size=64).hidden_size
    64
"""

from __future__ import annotations

import importlib
import threading
from typing import Any

_LOCK = threading.Lock()


def hf(name: str) -> Any:
    """``transformers.<name>``, importing transformers (once, one thread at a time) if needed."""
    with _LOCK:
        return getattr(importlib.import_module("transformers"), name)
