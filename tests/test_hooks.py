"""Worker-task hooks (flowrl.runtime.hooks): a registered provider's hooks run with every task of
the nodes it names, built once per worker, around the operator call, and report into the task's Info."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from flowrl.data import DataProto
from flowrl.data.metrics import total
from flowrl.runtime import hooks
from flowrl.runtime.hooks import HookSpec, Run, TaskHook, TaskRun
from flowrl.runtime.scheduler import Runtime
from tests.test_runtime import BIG, batches, graph_from


class Seen(TaskHook):
    """Records each point of each task it is on."""

    def __init__(self, pool: str) -> None:
        self.pool = pool
        self.events: list[tuple[Any, ...]] = []

    def before(self, task: TaskRun) -> None:
        self.events.append(((task.call.step, task.call.mb), "before", task.batch is None))

    def around(self, task: TaskRun, run: Run) -> Run:
        def counted(rows: DataProto) -> tuple[DataProto, dict[str, float]]:
            out, metrics = run(rows)
            self.events.append(((task.call.step, task.call.mb), "run", len(rows), sorted(out.batch.keys())))
            return out, {**metrics, "seen/rows": total(len(rows))}

        return counted

    def after(self, task: TaskRun, out: DataProto) -> dict[str, Any]:
        self.events.append(((task.call.step, task.call.mb), "after", len(out)))
        return {}


@dataclass(eq=False)
class SeenSpec(HookSpec):
    built: list

    def build(self, worker: Any) -> TaskHook:
        hook = Seen(worker.pool)
        self.built.append(hook)
        return hook


def test_a_registered_hook_wraps_every_task_of_its_node_and_reports(tmp_path, monkeypatch):
    built: list[Seen] = []
    spec = SeenSpec(built)
    hooks.load_hook_plugins()  # the wings' own providers first: they register into the list this test restores
    monkeypatch.setattr(hooks, "_PROVIDERS", [*hooks._PROVIDERS, lambda plan: {"reward": spec}])
    g = graph_from("ppo.yaml", tmp_path)  # two micro-batches of 4 prompts, one sample each
    with Runtime(g, backend="local", resources=BIG) as rt:
        results = list(rt.run(batches(4), steps=2))
        workers = len(rt.backend.workers)
    assert len(built) == workers  # one hook per worker, whichever nodes it runs
    events = [e for hook in built for e in hook.events]
    tasks = sorted({e[0] for e in events})
    assert tasks == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for task in tasks:  # in each task's order (tasks of one worker may run at once)
        assert [e[1:] for e in events if e[0] == task] == [
            ("before", True),  # before the input is assembled
            ("run", 2, ["token_level_scores"]),
            ("after", 2)]
    # what the wrapper adds to the operator's metrics reaches the step's metrics
    assert [r.metrics["seen/rows"] for r in results] == [4.0, 4.0]  # summed over the step's two tasks
    infos = [i for r in results for i in r.infos if i.node == "reward"]
    assert len(infos) == 4 and all(i.end >= i.start > 0 for i in infos)  # timing is a hook too


def test_hooks_cross_to_worker_processes_pickled(ray_session, tmp_path):
    # the failure policy wraps the fault switch in a Ray worker: a retry fires the switch again
    g = graph_from("ppo.yaml", tmp_path, nodes__values={"op": "test.values", "role": "critic",
                                                        "on_error": {"retries": 1}},
                   trainer__fault="node=values,step=1,kind=raise,times=1")
    with Runtime(g, backend="ray", resources=BIG) as rt:
        [result] = list(rt.run(batches(4), steps=1))
    assert result.metrics["faults/retries"] == 1.0


def test_without_its_policy_the_switch_fails_the_step_naming_the_node(tmp_path):
    from flowrl.errors import NodeError

    g = graph_from("ppo.yaml", tmp_path, trainer__fault="node=values,step=2,mb=1,kind=raise")
    with Runtime(g, backend="local", resources=BIG) as rt:
        with pytest.raises(NodeError) as exc:
            list(rt.run(batches(4), steps=2))
    assert (exc.value.node, exc.value.step, exc.value.mb) == ("values", 1, 1)
    assert "injected by trainer.fault (node=values, step=2, kind=raise)" in str(exc.value)


def test_a_runtime_without_the_run_wing_gets_every_wings_hooks():
    """The hooks come through the flowrl.hooks entry points, not through whoever imported the wings first:
    a plan made in a fresh interpreter that never imports flowrl.run still runs the failure policies
    (which also leave dropped rows out) and the fingerprints."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from flowrl.graph import load_graph\n"
            "from flowrl.plan.planner import make_plan\n"
            "from flowrl.plan.traits import traits_of\n"
            "from flowrl.runtime.hooks import hook_specs\n"
            "specs = hook_specs(make_plan(load_graph('grpo'), traits_of('local')))\n"
            "assert 'flowrl.run' not in sys.modules\n"
            "print(sorted({type(s).__module__ for ss in specs.values() for s in ss}))\n")
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=root)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["['flowrl.provenance.fingerprints',", "'flowrl.recovery.faults']"]
