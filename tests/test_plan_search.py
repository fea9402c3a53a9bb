"""``flowrl plan --search``: on synthetic costs (every node's seconds a known function of its rows)
the search returns the configuration arithmetic says is fastest, never one over the memory budget,
and bad inputs give one clear message each."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from flowrl.cli import app
from flowrl.graph import load_graph
from flowrl.plan.costs import GIB, CostFile, NodeCost, RoleMemory, Transfer, graph_key, load_costs, save_costs
from flowrl.plan.planner import make_plan
from flowrl.plan.search import Budget, SearchError, candidates, describe, search, set_partitions
from flowrl.plan.simulate import simulate_steps

ROWS = 256  # grpo_async: 32 prompts × 8 samples


def synthetic(graph, nodes: dict[str, NodeCost], params: int = 0) -> CostFile:
    """Costs nobody measured: generate and update take fixed + per-row seconds, the rest nothing."""
    full = {n: nodes.get(n, NodeCost()) for n in graph.nodes}
    roles = {r: RoleMemory(params=params, trainable=r == "actor") for r in graph.config.roles}
    return CostFile(graph=graph.name, key=graph_key(graph), nodes=full, transfer=Transfer(), roles=roles)


def builder(name: str):
    return lambda overrides: load_graph(name, overrides=overrides)


# generate: 0.4 s + 0.6 s over all 256 rows; update: the same. On 2 CPUs:
#   rollout and actor in one pool of 2 workers: each rank 128 rows, 0.7 s + 0.7 s = 1.4 s per step
#   one pool each, staleness 0: 1.0 s then 1.0 s = 2.0 s; staleness 1: both pools busy at once, 1.0 s
GEN = NodeCost(fixed_s=0.4, per_row_s=0.6 / ROWS)
UPD = NodeCost(fixed_s=0.4, per_row_s=0.6 / ROWS)


def test_the_search_returns_the_known_optimum_with_and_without_staleness():
    g = load_graph("grpo_async")
    costs = synthetic(g, {"generate": GEN, "update_actor": UPD})
    own = search(g, builder("grpo_async"), costs, Budget(cpus=2))
    assert all(o.overrides["schedule.staleness"] == 1 for o in own.ranked)  # the graph's own, unless asked
    assert own.best.step_s == pytest.approx(1.0) and own.shipped.step_s == pytest.approx(1.0)
    sync = search(g, builder("grpo_async"), costs, Budget(cpus=2, max_staleness=0))
    best = sync.best
    assert best.step_s == pytest.approx(1.4)
    (pool,) = best.overrides["pools"].values()
    assert sorted(pool["roles"]) == ["actor", "rollout"] and pool["workers"] == 2
    assert all(o.overrides["schedule.staleness"] == 0 for o in sync.ranked)
    stale = search(g, builder("grpo_async"), costs, Budget(cpus=2, max_staleness=1)).best
    assert stale.step_s == pytest.approx(1.0)
    assert stale.overrides["schedule.staleness"] == 1
    assert sorted(sorted(p["roles"]) for p in stale.overrides["pools"].values()) == [["actor"], ["rollout"]]


def test_a_known_optimum_on_more_cpus_than_this_machine_is_labelled_extrapolated():
    g = load_graph("grpo_async")
    costs = synthetic(g, {"generate": GEN, "update_actor": UPD})
    result = search(g, builder("grpo_async"), costs, Budget(cpus=8, max_staleness=0), machine=(2.0, 0))
    # 8 workers on one pool: 0.4 + 0.6/8 twice = 0.95 s; split pools cannot beat it without staleness
    assert result.best.step_s == pytest.approx(2 * (0.4 + 0.6 / 8))
    assert sum(p["workers"] for p in result.best.overrides["pools"].values()) == 8
    assert result.extrapolated


def test_a_configuration_over_the_memory_budget_is_never_returned():
    g = load_graph("grpo_async")
    # 100M parameters of 4 bytes: the trainable actor adds gradients and Adam (12 more, sharded over a
    # pool's process group), the rollout copy holds its weights only
    costs = synthetic(g, {"generate": GEN, "update_actor": UPD}, params=100_000_000)
    free = search(g, builder("grpo_async"), costs, Budget(cpus=2, max_staleness=1)).best
    assert free.step_s == pytest.approx(1.0) and free.memory["train"] == 1_600_000_000  # pools of 1: 16 B
    budget = Budget(cpus=2, memory_per_device=1.35 * GIB, max_staleness=1)
    result = search(g, builder("grpo_async"), costs, budget)
    for o in result.ranked:
        assert max(o.memory.values()) <= budget.memory_per_device
    assert any(describe(o) == describe(free) and o.rejected.startswith("memory") for o in result.rejected)
    # what fits: both roles on one pool of 2, the rollout sharing the actor's object: 16 bytes per parameter
    # sharded over 2 ranks, plus the other half of the weights gathered to generate (0.93 GiB), 1.4 s
    best = result.best
    (pool,) = best.overrides["pools"].values()
    assert pool["workers"] == 2 and best.step_s == pytest.approx(1.4)
    assert max(best.memory.values()) == 1_000_000_000


def test_an_impossible_budget_and_a_staleness_the_graph_cannot_use_are_one_error_each():
    g = load_graph("grpo_async")
    costs = synthetic(g, {"generate": GEN, "update_actor": UPD}, params=100_000_000)
    with pytest.raises(SearchError, match="no configuration fits 0.10 GiB per device"):
        search(g, builder("grpo_async"), costs, Budget(cpus=2, memory_per_device=0.1 * GIB, max_staleness=0))
    with pytest.raises(SearchError, match="cannot host one worker"):
        search(g, builder("grpo_async"), costs, Budget(cpus=0.5))
    grpo = load_graph("grpo")
    with pytest.raises(SearchError, match="reads the role it updates"):
        search(grpo, builder("grpo"), synthetic(grpo, {}), Budget(cpus=2, max_staleness=1))


def test_back_to_back_steps_overlap_only_under_staleness():
    g = load_graph("grpo_async")
    plan = make_plan(g)
    seconds = {k: (1.0 if t.node in ("generate", "update_actor") else 0.0) for k, t in plan.tasks.items()}
    ends = simulate_steps(plan, seconds, 6)
    assert [round(b - a, 6) for a, b in zip(ends[1:], ends[2:])] == [1.0] * 4  # staleness 1: pools overlap
    sync = make_plan(load_graph("grpo_async", overrides={"schedule.staleness": 0}))
    ends = simulate_steps(sync, {k: seconds[k] for k in sync.tasks}, 6)
    assert [round(b - a, 6) for a, b in zip(ends[1:], ends[2:])] == [2.0] * 4


def test_set_partitions_are_every_grouping_once():
    parts = list(set_partitions(["a", "b", "c"]))
    assert len(parts) == 5  # Bell(3)
    assert len({tuple(sorted(tuple(sorted(g)) for g in p)) for p in parts}) == 5


def test_no_candidate_leaves_a_rank_without_a_prompt_to_generate():
    g = load_graph("grpo", overrides={"data.batch_size": 8})
    shapes = {(c["pools"]["train"]["workers"], c["schedule.micro_batches"]) for c in candidates(g, Budget(cpus=4))}
    assert (4, 4) not in shapes and (2, 8) not in shapes and (4, 2) in shapes and (1, 8) in shapes


def test_the_cli_ranks_writes_the_best_and_refuses_bad_inputs(tmp_path):
    g = load_graph("grpo_async")
    path = save_costs(synthetic(g, {"generate": GEN, "update_actor": UPD}, params=100_000_000), tmp_path / "costs.json")
    runner = CliRunner()
    tuned = tmp_path / "tuned.yaml"
    res = runner.invoke(app, ["plan", "grpo_async", "--search", "--costs", str(path), "--cpus", "2",
                              "--max-staleness", "1", "--write", str(tuned)])
    assert res.exit_code == 0, res.output
    written = load_graph(tuned)
    assert written.config.schedule.staleness == 1
    assert sorted(sorted(p.roles) for p in written.config.pools.values()) == [["actor"], ["rollout"]]
    assert yaml.safe_load(tuned.read_text())["name"] == "grpo_async"
    assert written.check().ok

    ppo = load_graph("ppo")
    other = save_costs(synthetic(ppo, {}), tmp_path / "ppo_costs.json")
    bad = {
        "another graph's costs": ["plan", "grpo_async", "--search", "--costs", str(other), "--cpus", "2"],
        "impossible budget": ["plan", "grpo_async", "--search", "--costs", str(path), "--cpus", "2",
                              "--memory-per-device", "0.000001"],
        "staleness the state edges forbid": ["plan", "ppo", "--search", "--costs", str(other), "--cpus", "2",
                                             "--max-staleness", "1"],
        "no cost file": ["plan", "grpo_async", "--search", "--cpus", "2"],
    }
    for what, args in bad.items():
        res = runner.invoke(app, args)
        assert res.exit_code == 1, (what, res.output)
        assert "Traceback" not in res.output and res.output.count("error") == 1, (what, res.output)
        assert isinstance(res.exception, SystemExit), what


def test_the_search_piped_to_a_file_shows_every_configuration_whole(tmp_path):
    g = load_graph("grpo_async")
    path = save_costs(synthetic(g, {"generate": GEN, "update_actor": UPD}, params=100_000_000), tmp_path / "costs.json")
    ranked = search(g, builder("grpo_async"), load_costs(path, g), Budget(cpus=2, max_staleness=1)).ranked
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "COLUMNS": "80", "PYTHONPATH": str(root)}
    out = tmp_path / "search.txt"
    with out.open("w") as f:  # a file, as `flowrl plan ... --search > search.txt` writes it
        proc = subprocess.run([sys.executable, "-m", "flowrl.cli", "plan", "grpo_async", "--search", "--costs",
                               str(path), "--cpus", "2", "--max-staleness", "1"], cwd=root, env=env, stdout=f,
                              stderr=subprocess.PIPE, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = out.read_text().splitlines()
    shown = ranked[:10]
    assert len(shown) >= 3
    for o in shown:  # each configuration's whole text on one row, past the 80 columns of the window
        assert any(describe(o) in line for line in lines), (describe(o), lines)
    assert max(len(line) for line in lines) > 80
    assert "…" not in out.read_text()


def test_describe_names_pools_workers_and_schedule():
    g = load_graph("grpo_async")
    costs = synthetic(g, {"generate": GEN, "update_actor": UPD})
    best = search(g, builder("grpo_async"), costs, Budget(cpus=2, max_staleness=1)).best
    text = describe(best)
    assert "rollout ×1" in text and "actor ×1" in text and "staleness=1" in text


def test_simulated_tasks_share_the_cores_they_are_given():
    g = load_graph("grpo_async")  # staleness 1: generate and the update run at once on their two pools
    plan = make_plan(g)
    seconds = {k: (1.0 if t.node in ("generate", "update_actor") else 0.0) for k, t in plan.tasks.items()}
    per_step = {}
    for cpus in (None, 2, 1):
        ends = simulate_steps(plan, seconds, 8, cpus=cpus)  # the last steps end sooner: nothing shares them
        per_step[cpus] = [round(b - a, 6) for a, b in zip(ends[2:5], ends[3:6])]
    assert per_step[None] == per_step[2] == [1.0] * 3
    assert per_step[1] == [2.0] * 3  # two processes on one core: each at half speed
    # two workers of one pool on one core: every task of the pool takes twice as long
    two = make_plan(load_graph("grpo", overrides={"pools.train.workers": 2}))
    ends = simulate_steps(two, {k: (1.0 if t.node == "update_actor" else 0.0) for k, t in two.tasks.items()}, 4,
                          cpus=1)
    assert round(ends[3] - ends[2], 6) == 2.0


def test_the_plans_timeline_is_one_step_of_the_simulator_and_its_critical_path_the_searchs():
    from flowrl.plan.critical import critical_path
    from flowrl.plan.simulate import bounds_of, spread

    plan = make_plan(load_graph("grpo_async", overrides={"schedule.staleness": 0}))
    measured = {"generate": 1.0, "update_actor": 2.0}  # seconds per step of each node; the rest declared
    seconds = {k: t.cost for k, t in plan.tasks.items()} | spread(plan, measured)
    assert spread(plan, measured) == {("generate", None): 1.0, ("update_actor", None): 2.0}
    sim = plan.simulate(measured)
    (end,) = simulate_steps(plan, seconds, 1)
    assert sim.makespan == end == max(sim.end.values())
    # the longest chain: every task of the step, generate first, the update last
    cp = critical_path(plan.tasks, seconds, plan.order)
    assert cp.path[0] == ("generate", None) and cp.path[-1] == ("update_actor", None)
    assert cp.length == pytest.approx(sum(seconds.values())) == pytest.approx(sim.makespan)
    assert bounds_of(plan, seconds)[0] == pytest.approx(cp.length)
    # the planner's upward ranks are the same walk on declared costs: a task's cost and all after it
    declared = critical_path(plan.tasks)
    assert [plan.tasks[k].rank for k in plan.order] == [declared.upward_rank(k) for k in plan.order]
    assert plan.tasks[("generate", None)].rank == pytest.approx(declared.length)
