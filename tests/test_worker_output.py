"""What a person sees in the terminal on the Ray path (issue 24, items 1 and 2).

Each test runs ``flowrl run`` as a user does, in a subprocess whose output is
captured; on Ray it joins the session's Ray (``--address``), so the run's
worker processes are real Ray actors whose output Ray would forward to the
terminal. Lines are counted, never matched against text a terminal may wrap.
"""

from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest

from flowrl.errors import NodeError, user_frame
from flowrl.store.runlog import RUN_LOG, WARNING_TAG, record_failure, warning_notes

ROOT = Path(__file__).resolve().parents[1]


def flowrl_run(*args: str, address: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
               OMP_NUM_THREADS="1", COLUMNS="250")
    argv = [sys.executable, "-m", "flowrl.cli", "run", *args] + (["--address", address] if address else [])
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture
def ray_address(ray_session) -> str:
    return ray_session.get_runtime_context().gcs_address


def write_reward(tmp_path: Path, body: str) -> str:
    path = tmp_path / "my_reward.py"
    path.write_text("import warnings\n\n\n"
                    "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n" + body)
    return f"{path}:compute_score"


def test_the_default_job_on_ray_prints_no_warning_twice(ray_address, tmp_path):
    # a reward of the user's own that warns on every call, next to transformers' FutureWarning
    # (raised on every generation step): each is one line with its count, the rest in run.log
    fn = write_reward(tmp_path, "    warnings.warn('my grader is approximate')\n    return 0.0\n")
    out = tmp_path / "run"
    proc = flowrl_run("graphs/grpo.yaml", "--steps", "2", "--out", str(out), "--set", f"nodes.reward.fn={fn}",
                      address=ray_address)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = (proc.stdout + proc.stderr).splitlines()
    warned = [line for line in lines if "Warning" in line]
    assert len(warned) == len(set(warned)) == 1, "\n".join(lines)  # the user's warning, once
    assert sum("my grader is approximate" in line for line in lines) == 1
    assert not [line for line in lines if "past_key_values" in line]  # filtered at the source
    log = (out / RUN_LOG).read_text()
    assert log.count(f"{WARNING_TAG} ") >= 2  # every one the worker showed, each step
    notes = warning_notes(out / RUN_LOG)
    assert len(notes) == 1 and notes[0].startswith("warning ×")


def _failure_lines(proc: subprocess.CompletedProcess, out: Path) -> list[str]:
    """The run's error message, with what differs from run to run (pids, the run directory) replaced."""
    text = proc.stdout + proc.stderr
    start = text.index("run failed")
    message = text[start:].replace(str(out), "OUT")
    return [re.sub(r"pid \d+", "pid N", line) for line in message.splitlines() if line.strip()]


def test_a_failing_node_reads_the_same_on_both_backends(ray_address, tmp_path):
    fn = write_reward(tmp_path, "    raise ZeroDivisionError('the grader divided by zero')\n")
    shapes = {}
    for backend in ("local", "ray"):
        out = tmp_path / backend
        proc = flowrl_run("graphs/grpo.yaml", "--steps", "1", "--out", str(out), "--backend", backend,
                          "--set", f"nodes.reward.fn={fn}", address=ray_address if backend == "ray" else None)
        assert proc.returncode == 1, proc.stderr[-3000:]
        text = proc.stdout + proc.stderr
        for noise in ("Traceback", "^^^", "ray::", "worker.py", "remote traceback"):
            assert noise not in text, f"{backend}: {noise!r} in the terminal:\n{text}"
        shapes[backend] = _failure_lines(proc, out)
        log = (out / RUN_LOG).read_text()
        assert "Traceback (most recent call last)" in log and "the grader divided by zero" in log
    assert shapes["local"] == shapes["ray"]
    head, frame, details = shapes["ray"]
    assert "node 'reward' failed at step 1 on " in head and "ZeroDivisionError: the grader divided by zero" in head
    assert frame.strip() == f"in your code: {tmp_path / 'my_reward.py'}:5, in compute_score"
    assert details.strip() == f"details: OUT/{RUN_LOG}"


def test_a_node_error_names_the_users_frame_and_then_the_log(tmp_path):
    tb = ('Traceback (most recent call last):\n'
          f'  File "{ROOT}/flowrl/runtime/worker.py", line 218, in execute\n    out = run()\n'
          f'  File "/home/me/proj/reward.py", line 3, in score\n    return 1 / 0\n'
          f'  File "{sys.prefix}/lib/python3.11/fractions.py", line 9, in f\n    x\n'
          'ZeroDivisionError: division by zero\n')
    e = NodeError("reward", 0, None, "driver[0] (pid 1)", "ZeroDivisionError: division by zero", tb)
    assert user_frame(tb) == "/home/me/proj/reward.py:3, in score"
    assert "--- remote traceback ---" in str(e)  # no log yet: the traceback has nowhere else to go
    record_failure(tmp_path / RUN_LOG, e)
    assert str(e).splitlines() == ["node 'reward' failed at step 1 on driver[0] (pid 1): ZeroDivisionError: "
                                   "division by zero", "  in your code: /home/me/proj/reward.py:3, in score",
                                   f"  details: {tmp_path / RUN_LOG}"]
    assert tb.strip() in (tmp_path / RUN_LOG).read_text()
    # pickled (a worker's error crossing to the driver) with everything it carries
    assert str(pickle.loads(pickle.dumps(e))) == str(e)
