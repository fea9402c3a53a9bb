"""verl's own DataProto unit tests (``tests/test_protocol_on_cpu.py`` of the verl
distribution), run against :mod:`flowrl.data` with only the import changed.

The test file is read from the installed verl package (``.ci/run`` installs it
with ``--no-deps``, see :mod:`tests.verl_reference`), never copied here. While its tests run, ``verl``,
``verl.protocol`` and ``verl.utils.tensordict_utils`` resolve to :mod:`flowrl.data`
and :mod:`flowrl.data.verl_functions`, so ``from verl import DataProto`` gets
flowrl's DataProto.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
import types
from pathlib import Path

import pytest

import flowrl.data
from flowrl.data import verl_functions
from tests.verl_reference import INSTALL, add_verl_to_path

VERL_TEST = "tests/test_protocol_on_cpu.py"


def _verl_test_file() -> Path | None:
    try:
        files = importlib.metadata.files("verl") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in files:
        if str(f).replace("\\", "/") == VERL_TEST:
            path = Path(f.locate())
            return path if path.is_file() else None
    return None


def _as_verl() -> dict[str, types.ModuleType]:
    """Module objects that answer verl's imports with flowrl's DataProto API."""
    verl = types.ModuleType("verl")
    verl.DataProto = flowrl.data.DataProto
    utils = types.ModuleType("verl.utils")
    utils.tensordict_utils = verl_functions
    verl.protocol, verl.utils = flowrl.data, utils
    return {"verl": verl, "verl.protocol": flowrl.data, "verl.utils": utils,
            "verl.utils.tensordict_utils": verl_functions}


def _swap_modules(modules: dict[str, types.ModuleType]) -> dict[str, types.ModuleType | None]:
    saved = {name: sys.modules.get(name) for name in modules}
    sys.modules.update(modules)
    return saved


def _restore_modules(saved: dict[str, types.ModuleType | None]) -> None:
    for name, module in saved.items():
        if module is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = module


add_verl_to_path()
_PATH = _verl_test_file()
if _PATH is None:
    pytest.skip(f"verl is not installed ({INSTALL}): its DataProto tests ship with it", allow_module_level=True)

_saved = _swap_modules(_as_verl())
try:
    _spec = importlib.util.spec_from_file_location("verl_test_protocol_on_cpu", _PATH)
    _verl_tests = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_verl_tests)
finally:
    _restore_modules(_saved)

# pytest collects these names from this module; they run verl's test bodies unchanged
globals().update({name: fn for name, fn in vars(_verl_tests).items() if name.startswith("test_")})


@pytest.fixture(autouse=True)
def _verl_imports_are_flowrl():
    """verl's tests also import inside their bodies: answer those with flowrl too."""
    saved = _swap_modules(_as_verl())
    yield
    _restore_modules(saved)
