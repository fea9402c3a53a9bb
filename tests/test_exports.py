"""Lazily exported names resolve to what the package promises, even after its submodules load.

A package that exports lazily (``flowrl.data.lazy``) loses a name to the import
system when a submodule has the same name: importing the submodule sets the
package attribute to the module. Every exported name must therefore differ
from every submodule's name, whatever order things are imported in.
"""

from __future__ import annotations

import importlib
import pkgutil
import types

import pytest

LAZY_PACKAGES = ["flowrl.data", "operators.algos", "operators.models", "operators.rewards", "operators.data"]


@pytest.mark.parametrize("name", LAZY_PACKAGES)
def test_every_export_is_the_promised_object_after_all_submodules_load(name):
    pkg = importlib.import_module(name)
    for info in pkgutil.iter_modules(pkg.__path__):
        importlib.import_module(f"{name}.{info.name}")
    modules = [n for n in pkg.__all__ if isinstance(getattr(pkg, n), types.ModuleType)]
    assert modules == [], f"{name} exports names that resolve to modules: {modules}"
