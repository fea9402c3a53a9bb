"""What the inspecting commands import: ``validate``, ``ops``, ``viz`` and ``plan`` of the
built-in graphs declare every operator and run every check without transformers or
tensordict (issue 14.4: they cost seconds before the first line prints)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

HEAVY = ("transformers", "tensordict")

# one fresh interpreter: modules imported by earlier tests in this process would hide an import
SCRIPT = """
import json, sys
from typer.testing import CliRunner
from flowrl.cli import app
from flowrl.graph.load import builtin_graphs

HEAVY = sys.argv[1:]
runner = CliRunner()
codes = {}
for name in sorted(builtin_graphs()):
    codes["validate " + name] = runner.invoke(app, ["validate", name]).exit_code
codes["ops"] = runner.invoke(app, ["ops"]).exit_code
codes["viz grpo"] = runner.invoke(app, ["viz", "grpo"]).exit_code
codes["plan ppo"] = runner.invoke(app, ["plan", "ppo"]).exit_code
after_checks = [m for m in HEAVY if m in sys.modules]

# building what the checks only described does import them: the probe can see an import
from operators.models import load_model
from operators.sources import PromptSource, PromptSourceConfig
load_model("builtin:tiny")
PromptSource(PromptSourceConfig(source="builtin:copy", batch_size=2)).next_batch()
after_build = [m for m in HEAVY if m in sys.modules]
print(json.dumps({"codes": codes, "after_checks": after_checks, "after_build": after_build}))
"""


def test_inspecting_builtin_graphs_imports_no_transformers_or_tensordict():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    res = subprocess.run([sys.executable, "-c", SCRIPT, *HEAVY], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert "validate grpo" in out["codes"] and "validate ppo" in out["codes"]
    assert set(out["codes"].values()) == {0}, out["codes"]
    assert out["after_checks"] == []
    assert sorted(out["after_build"]) == sorted(HEAVY)


HELP = """
import json, sys
from typer.testing import CliRunner
from flowrl.cli import app
code = CliRunner().invoke(app, ["--help"]).exit_code
print(json.dumps({"code": code, "imported": [m for m in sys.argv[1:] if m in sys.modules]}))
"""


def test_help_imports_no_graph_code():
    """``flowrl --help`` answers with typer and rich alone (issue 24: under 0.5 s)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    probes = ["flowrl.graph", "networkx", "pydantic", "torch", "yaml"]
    res = subprocess.run([sys.executable, "-c", HELP, *probes], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout.strip().splitlines()[-1]) == {"code": 0, "imported": []}


DISTRIBUTED = """
import json, sys
from typer.testing import CliRunner
from flowrl.cli import app

PROBES = sys.argv[1:]
code = CliRunner().invoke(app, ["validate", "ppo"]).exit_code
after_validate = [m for m in PROBES if m in sys.modules]

# saving a role's state is what imports them: the probe can see an import
from operators.models import load_model
from operators.models.sharded_checkpoint import ModelState
ModelState(load_model("builtin:tiny")[0]).state_dict()
print(json.dumps({"code": code, "after_validate": after_validate,
                  "after_save": [m for m in PROBES if m in sys.modules]}))
"""


def test_validate_imports_no_torch_distributed_sharding_or_checkpoint():
    """torch.distributed's FSDP, DTensor and checkpoint modules cost a second of ``validate`` (issue 24)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    probes = ["torch.distributed.tensor", "torch.distributed.fsdp", "torch.distributed.checkpoint"]
    res = subprocess.run([sys.executable, "-c", DISTRIBUTED, *probes], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["code"] == 0 and out["after_validate"] == []
    assert out["after_save"] == probes
