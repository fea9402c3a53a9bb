"""The plan says everything a step will run: reads, rows, dispatch, gates, syncs."""

from __future__ import annotations

from flowrl.graph import load_graph
from flowrl.runtime.plan import make_plan
from flowrl.runtime.staleness import Gate


def test_every_task_has_its_reads_dispatch_gates_and_syncs():
    plan = make_plan(load_graph("grpo_async"))
    gen = plan.tasks[("generate", None)]
    assert gen.factor == 8 and gen.dispatch == "split" and gen.ranks == (0,)
    # one step off: generate at step t waits for the update of step t-2 and loads it into the rollout role
    assert gen.gates == (Gate("actor", "update_actor", "generate", 1, "rollout"),)
    assert gen.syncs == gen.gates and gen.gates[0].update_step(5) == 3 and gen.gates[0].min_version(5) == 4
    reward = plan.tasks[("reward", None)]
    data_read = next(r for r in reward.reads if r.srcs == (("data", None),))
    assert data_read.repeat == 8  # prompt columns repeated to the 8 samples of each prompt
    update = plan.tasks[("update_actor", None)]
    assert (update.updates, update.publishes, update.dispatch) == ("actor", True, "all")


def test_two_workers_split_rows_and_an_update_runs_on_every_rank():
    plan = make_plan(load_graph("ppo", overrides={"pools.train.workers": 2}))
    old = plan.tasks[("old_logprob", 0)]
    assert (old.ranks, old.collected, old.world) == ((0, 1), (0, 1), 2)
    update = plan.tasks[("update_actor", None)]
    # the ranks form a process group: data parallel, each rank its balanced share, all report
    assert (update.ranks, update.collected, update.dispatch) == ((0, 1), (0, 1), "balanced")
    assert plan.tasks[("advantage", None)].ranks == (0,)  # a driver node runs once
    # threads sharing one process (the local backend) form no group: each rank the whole batch
    local = make_plan(load_graph("ppo", overrides={"pools.train.workers": 2}), data_parallel=False)
    update = local.tasks[("update_actor", None)]
    assert (update.ranks, update.collected, update.dispatch) == ((0, 1), (0,), "all")


def test_flowrl_plan_prints_the_tasks(capsys):
    from rich.console import Console

    from visualizer.plan import render_tasks

    plan = make_plan(load_graph("grpo_async"))
    console = Console(width=300, record=True)
    console.print(render_tasks(plan, {}))
    text = console.export_text()
    assert "load rollout ← actor@t-2" in text and "32 → 256" in text
