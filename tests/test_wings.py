"""The architecture as a test (issue 33): the wings of ``flowrl/`` and their one-way arrows, as
``docs/architecture.md`` draws them, read from every module's imports; no package over 15
modules; and one error root every flowrl exception derives from.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: each wing and the wings it may import (besides itself); the rows run bottom to top
ALLOWED = {
    "errors": set(),
    "data": {"errors"},
    "graph": {"errors", "data"},
    "plan": {"errors", "data", "graph"},
    "store": {"errors", "data", "graph"},
    "runtime": {"errors", "data", "graph", "plan", "store"},
    "provenance": {"errors", "data", "graph", "plan", "store", "runtime"},
    "recovery": {"errors", "data", "graph", "plan", "store", "runtime"},
    "run": {"errors", "data", "graph", "plan", "store", "runtime", "provenance", "recovery"},
    "operators": {"errors", "data", "graph"},
    "visualizer": {"errors", "data", "graph", "plan", "store", "runtime", "provenance", "run"},
}

#: crossings still to be cut (the worker reaches into observers and recovery); each one removed
#: from the code must be removed here, and none may be added
PENDING: set[str] = set()


#: modules at the very bottom, which every wing may import: the error root and the table of default time limits
BOTTOM = {"errors", "timeouts"}


def wing(module: str) -> str:
    parts = module.split(".")
    if parts[0] != "flowrl":
        return parts[0]
    if len(parts) == 1 or parts[1].startswith("cli"):
        return "cli"
    return parts[1]


def crossings() -> dict[tuple[str, str], set[str]]:
    """Every import (top level, in a function, or for type checking) from one wing into another."""
    found: dict[tuple[str, str], set[str]] = defaultdict(set)
    for top in ("flowrl", "operators", "visualizer"):
        for path in (ROOT / top).rglob("*.py"):
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and not node.level and node.module:
                    targets = [node.module]
                elif isinstance(node, ast.Import):
                    targets = [a.name for a in node.names]
                else:
                    continue
                for target in targets:
                    if target.split(".")[0] in ("flowrl", "operators", "visualizer"):
                        a, b = wing(module), wing(target)
                        if a != b and a != "cli":
                            found[(a, b)].add(f"{module} -> {target}")
    return found


def test_arrows_point_one_way():
    found = crossings()
    assert set(ALLOWED) | BOTTOM >= {a for a, _ in found}, "a package that is no wing"
    wrong = {edge for (a, b), edges in found.items() if b not in ALLOWED[a] | BOTTOM for edge in edges}
    assert wrong - PENDING == set(), "imports against the arrows of docs/architecture.md"
    assert PENDING - wrong == set(), "a pending crossing is gone: remove it from PENDING"


def test_no_package_over_fifteen_modules():
    for folder in [ROOT / "flowrl", *(p for p in (ROOT / "flowrl").rglob("*") if p.is_dir())]:
        modules = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
        assert len(modules) <= 15, f"{folder.relative_to(ROOT)} has {len(modules)} modules"


def test_the_architecture_page_names_every_wing():
    page = (ROOT / "docs" / "architecture.md").read_text()
    for name in ALLOWED:
        if name not in ("operators", "visualizer", "errors"):
            assert f"`flowrl/{name}`" in page, name


def _exception_classes():
    for top in ("flowrl", "operators", "visualizer"):
        package = importlib.import_module(top)
        for info in pkgutil.walk_packages(package.__path__, top + "."):
            try:
                module = importlib.import_module(info.name)
            except ImportError as e:  # an optional engine (vllm, sglang) not installed here
                if any(name in str(e) for name in ("vllm", "sglang", "wandb", "tensorboard")):
                    continue
                raise
            for _, cls in inspect.getmembers(module, inspect.isclass):
                if issubclass(cls, BaseException) and cls.__module__ == info.name:
                    yield cls


def test_one_error_root():
    from flowrl.errors import ConfigError, FlowrlError, RunError

    classes = list(_exception_classes())
    assert len(classes) > 40
    stray = [f"{c.__module__}.{c.__qualname__}" for c in classes
             if c not in (FlowrlError, ConfigError, RunError) and not issubclass(c, (ConfigError, RunError))]
    assert stray == []
    assert not issubclass(ConfigError, RunError) and not issubclass(RunError, ConfigError)


@pytest.mark.parametrize("name, builtin", [("flowrl.plan.rowspace:PlanError", ValueError),
                                           ("flowrl.graph.registry:UnknownNameError", KeyError),
                                           ("flowrl.graph.registry:ImportPathError", ImportError),
                                           ("flowrl.errors:NodeError", RuntimeError)])
def test_errors_keep_their_builtin(name, builtin):
    module, cls = name.split(":")
    assert issubclass(getattr(importlib.import_module(module), cls), builtin)


def test_every_default_time_limit_is_the_tables():
    """A graph's limits, the plan's, the process group's, the backends' and a rollout's tool calls all
    default to ``flowrl/timeouts.py``: one number each, whoever asks."""
    from flowrl.graph import load_graph
    from flowrl import timeouts as T
    from flowrl.plan.planner import make_plan
    from flowrl.runtime.distributed import PoolGroup
    from flowrl.runtime.hangs import STACKS_TIMEOUT_S
    from flowrl.runtime.local import LocalSupervisor
    from flowrl.runtime.ray_backend import RayBackend, RaySupervisor
    from flowrl.runtime.worker import Worker
    from operators.rollout.conversation import AgentConfig

    def default(fn, name):
        return inspect.signature(fn).parameters[name].default

    g = load_graph("grpo_async")
    assert g.config.schedule.timeout_s == T.TASK_S == 3600.0
    assert {p.timeout_s for p in g.config.pools.values()} == {p.timeout_s for p in make_plan(g).pools} == {300.0}
    assert T.COLLECTIVE_S == 300.0
    assert default(PoolGroup.join, "timeout_s") == default(Worker.join_group, "timeout_s") == T.COLLECTIVE_S
    assert default(PoolGroup.join, "join_timeout_s") == T.GROUP_JOIN_S
    assert default(RayBackend.__init__, "placement_timeout_s") == T.PLACEMENT_S
    assert STACKS_TIMEOUT_S == default(LocalSupervisor.stacks, "timeout") == default(RaySupervisor.stacks, "timeout")
    assert STACKS_TIMEOUT_S == T.STACKS_S
    assert AgentConfig().tool_timeout_s == T.TOOL_CALL_S
