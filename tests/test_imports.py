"""Graph modules import as Python imports them (issue 24.5).

``flowrl run mymod:graph`` finds ``mymod`` in the current directory, as ``python -m`` would (the
installed ``flowrl`` script does not put the current directory on the path: ``-P`` reproduces
that here), and a Python graph file sees the modules beside it, as a YAML graph does: in the
driver and in every Ray worker, which imports a graph file's own operators by name.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# a small GRPO step whose only operator from the user's module runs on the actor's worker
GRAPH_PY = '''
from flowrl import graph
from operators import actor, advantage, reward, rollout

import myops  # beside this file


@graph(
    name="mine",
    roles={"actor": {"model": "builtin:tiny", "optim": {"lr": 5.0e-4}}},
    pools={"train": {"workers": 1, "cpus": 1, "roles": ["actor"]}},
    data={"source": "builtin:copy", "batch_size": 4},
    schedule={"micro_batches": 1, "staleness": 0},
    trainer={"steps": 1, "seed": 0, "out": "runs/mine"},
)
def mine(batch):
    batch = rollout.generate(batch, n=2, max_new_tokens=4)
    batch = reward.rule(batch)
    batch = myops.bonus(batch)
    batch = advantage.grpo(batch, inputs={"token_level_rewards": "bonus_rewards"})
    return actor.update(batch, inputs={"old_log_probs": "rollout_log_probs"})
'''

OPS_PY = '''
import os

from flowrl.graph import operator

import helper  # beside this file too: imported again wherever the operator runs


@operator("myops.bonus", role="actor", scope="row",
          inputs={"token_level_scores": "float32[B, R]"}, outputs={"bonus_rewards": "float32[B, R]"})
def bonus(actor, batch, p):
    helper.record(os.getpid())
    return {"bonus_rewards": batch["token_level_scores"] + helper.BONUS}
'''

HELPER_PY = '''
import os

BONUS = 0.0


def record(pid):
    with open(os.environ["MYOPS_PIDS"], "a") as f:
        f.write(f"{pid}\\n")
'''


def write_project(where: Path) -> Path:
    """``where/sub/{g.py, myops.py, helper.py}``: a graph file and the two modules it imports."""
    sub = where / "sub"
    sub.mkdir(parents=True)
    (sub / "g.py").write_text(GRAPH_PY)
    (sub / "myops.py").write_text(OPS_PY)
    (sub / "helper.py").write_text(HELPER_PY)
    return sub


def flowrl(*args: str, cwd: Path, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    """The ``flowrl`` command as the installed script runs it: the current directory not on the path.
    ``pid`` on the result: the process that ran the driver."""
    environ = dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="400", OMP_NUM_THREADS="1", **env)
    with subprocess.Popen([sys.executable, "-P", "-m", "flowrl.cli", *args], cwd=cwd, env=environ,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    res = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    res.pid = proc.pid
    return res


def test_module_graph_resolves_from_the_current_directory(tmp_path):
    (tmp_path / "mymod.py").write_text((ROOT / "graphs" / "grpo.py").read_text())
    res = flowrl("validate", "mymod:grpo", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "ok grpo" in res.stdout


def test_package_module_graph_resolves_from_the_current_directory(tmp_path):
    # a package of graph modules in the user's project (flowrl's own graphs/ is one: graphs.ppo:ppo)
    (tmp_path / "mygraphs").mkdir()
    (tmp_path / "mygraphs" / "ppo.py").write_text((ROOT / "graphs" / "ppo.py").read_text())
    res = flowrl("validate", "mygraphs.ppo:ppo", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "ok ppo: 9 nodes" in res.stdout


def test_flowrls_own_graph_module_by_import_path():
    res = flowrl("validate", "graphs.ppo:ppo", cwd=ROOT)
    assert res.returncode == 0, res.stderr


def test_a_module_that_is_nowhere_or_raises_is_named(tmp_path):
    res = flowrl("validate", "nosuchmod:g", cwd=ROOT)
    assert res.returncode == 1 and "cannot import module 'nosuchmod'" in res.stderr
    (tmp_path / "badpkg").mkdir()
    (tmp_path / "badpkg" / "__init__.py").write_text("raise RuntimeError('boom in init')\n")
    bad = flowrl("validate", "badpkg.graphs:g", cwd=tmp_path)
    assert bad.returncode == 1 and "raised RuntimeError: boom in init" in bad.stderr
    assert "Traceback" not in res.stderr + bad.stderr


@pytest.mark.parametrize("ref", ["sub/g.py", "sub/g.py:mine"])
def test_a_python_graph_file_sees_the_modules_beside_it(tmp_path, ref):
    write_project(tmp_path)
    res = flowrl("validate", ref, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "ok mine: 5 nodes" in res.stdout


def test_a_python_graph_files_own_modules_import_in_every_ray_worker(tmp_path):
    """The user's operator runs in the actor's Ray worker, which imports ``myops`` and ``helper`` by name."""
    sub = write_project(tmp_path / "project")
    pids = tmp_path / "pids.txt"
    res = flowrl("run", str(sub / "g.py"), "--out", str(tmp_path / "run"), cwd=tmp_path, timeout=600,
                 MYOPS_PIDS=str(pids))
    assert res.returncode == 0, res.stdout + res.stderr
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1]
    ran_in = {int(x) for x in pids.read_text().split()}
    assert ran_in and res.pid not in ran_in  # a worker process, not the driver
    assert "No module named" not in res.stdout + res.stderr
