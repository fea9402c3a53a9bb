"""Cost files: fitted from task records by rows, validated and keyed to their graph on load; every run
checks its plan's prediction against what it measures (``plan/predicted_step_s``, ``plan/error``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flowrl.cli import app
from flowrl.cli_plan import farthest_micro_batches, fit_runs, role_memory
from flowrl.graph import load_graph
from flowrl.plan.costfit import calibrate_overheads, fit_line, predict_step, solo_seconds
from flowrl.plan.costs import (CostFile, CostFileError, NodeCost, Record, RoleMemory, Transfer, graph_key,
                                  load_costs, rank_rows, save_costs, task_records, task_seconds)
from flowrl.plan.planner import make_plan
from flowrl.plan.plancheck import PlanCheck

#: the synthetic truth: seconds of one task on one rank = fixed + per_row × rows
TRUTH = {"generate": (0.05, 0.002), "reward": (0.01, 0.0001), "advantage": (0.002, 0.00002),
         "update_actor": (0.1, 0.004)}


def records(plan, steps: int = 4, slower: float = 1.0, slower_all: float = 1.0, extra: float = 0.0) -> list[Record]:
    """What a run of ``plan`` would record if every task took exactly the synthetic truth
    (``slower`` times it and ``extra`` seconds more on a pool of more than one worker, ``slower_all``
    times it everywhere)."""
    out, t = [], 0.0
    for step in range(steps):
        for key in plan.order:
            task = plan.tasks[key]
            fixed, per_row = TRUTH[task.node]
            wide = task.world > 1
            d = ((fixed + per_row * rank_rows(plan, task)) * (slower if wide else 1.0) + (extra if wide else 0.0)
                 ) * slower_all
            for rank in task.ranks:
                out.append(Record(task.node, task.mb, step, rank, t, t + d))
            t += d
    return out


def test_a_line_is_fitted_by_least_squares_and_through_the_origin_from_one_row_count():
    line = fit_line([(r, 0.3 + 0.01 * r) for r in (8, 16, 32, 64)])
    assert line.fit == "affine"
    assert line.fixed_s == pytest.approx(0.3) and line.per_row_s == pytest.approx(0.01)
    one = fit_line([(32, 0.64), (32, 0.64)])
    assert one.fit == "proportional" and one.fixed_s == 0 and one.per_row_s == pytest.approx(0.02)


def test_two_profiled_micro_batch_counts_recover_each_nodes_fixed_and_per_row_cost():
    g = load_graph("grpo", overrides={"schedule.micro_batches": 1})
    runs = []
    for k in (1, 2):
        plan = make_plan(load_graph("grpo", overrides={"schedule.micro_batches": k}))
        # the longest response, in the metric the generator declares counts it (tokens.max)
        runs.append((plan, records(plan), [{"response_length/max": 7.0 * k}, {"response_length/max": 3.0}]))
    costs = fit_runs(runs, g, "synthetic", Transfer())
    assert costs.tokens_per_row == 14.0
    for node, (fixed, per_row) in TRUTH.items():
        if len(costs.nodes[node].rows_seen) > 1:  # streamed nodes saw 256 and 128 rows
            assert costs.nodes[node].fixed_s == pytest.approx(fixed, rel=1e-6)
        assert costs.nodes[node].per_row_s == pytest.approx(per_row if len(costs.nodes[node].rows_seen) > 1
                                                            else per_row + fixed / 256, rel=1e-6)
    assert costs.roles["actor"].trainable and costs.roles["actor"].params > 0
    assert costs.task_latency_s == pytest.approx(0.0, abs=1e-9)  # the records have no gaps to calibrate
    # the prediction of the profiled configuration is its measured step
    plan = runs[0][0]
    assert predict_step(plan, costs, cpus=2)[0] == pytest.approx(
        sum(f + p * 256 for f, p in TRUTH.values()), rel=1e-6)


def test_a_run_on_twice_the_workers_measures_data_parallelism_instead_of_assuming_it():
    g = load_graph("grpo")
    runs = [(plan, records(plan), []) for plan in
            [make_plan(load_graph("grpo", overrides={"schedule.micro_batches": k})) for k in (1, 2)]]
    two = make_plan(load_graph("grpo", overrides={"pools.train.workers": 2}))
    runs.append((two, records(two, slower=1.8), []))  # two ranks sharing cores: 1.8× the line per rank
    costs = fit_runs(runs, g, "synthetic", Transfer(fixed_s=1.0))
    assert costs.nodes["generate"].world_factor == {2: pytest.approx(1.8)}  # an affine line: exactly
    assert 2 in costs.nodes["update_actor"].world_factor  # a line through the origin: the factor absorbs it
    assert costs.nodes["reward"].world_factor == {2: pytest.approx(1.8)}  # rank 0 of the pool: its cores too
    s = task_seconds(two, costs)
    # measured there: the factor replaces the assumed all-reduce (1 s fixed here, so it would show)
    for node in ("generate", "update_actor"):
        fixed, per_row = TRUTH[node]
        assert s[(node, None)] == pytest.approx((fixed + per_row * 128) * 1.8)
    four = make_plan(load_graph("grpo", overrides={"pools.train.workers": 4}))
    assert task_seconds(four, costs)[("update_actor", None)] > 1.0  # never profiled: line + all-reduce


def test_two_micro_batch_counts_on_twice_the_workers_fit_the_line_there():
    # on two ranks each task costs 1.5× its line plus 30 ms (synchronising the ranks): one row count
    # there cannot tell the two apart, two can, and a third row count is then predicted exactly
    g = load_graph("grpo")
    def run(workers: int, k: int):
        plan = make_plan(load_graph("grpo", overrides={"pools.train.workers": workers, "schedule.micro_batches": k}))
        return plan, records(plan, slower=1.5, extra=0.03), []
    costs = fit_runs([run(1, 1), run(1, 8), run(2, 1), run(2, 8)], g, "synthetic", Transfer())
    fixed, per_row = TRUTH["generate"]
    assert costs.nodes["generate"].world_line[2] == (pytest.approx(1.5 * fixed + 0.03), pytest.approx(1.5 * per_row))
    four = make_plan(load_graph("grpo", overrides={"pools.train.workers": 2, "schedule.micro_batches": 4}))
    assert task_seconds(four, costs)[("generate", 0)] == pytest.approx(1.5 * (fixed + per_row * 32) + 0.03)
    # a cost file profiled on one row count there scales the line by the factor measured at it
    one = fit_runs([run(1, 1), run(1, 8), run(2, 1)], g, "synthetic", Transfer())
    assert one.nodes["generate"].world_line == {}
    factor = one.nodes["generate"].world_factor[2]
    assert task_seconds(four, one)[("generate", 0)] == pytest.approx(factor * (fixed + per_row * 32))


def test_the_profile_adds_the_micro_batch_count_farthest_from_the_graphs():
    assert farthest_micro_batches(1, 64) == 8 and farthest_micro_batches(2, 64) == 8
    assert farthest_micro_batches(8, 64) == 1 and farthest_micro_batches(1, 4) == 4
    assert farthest_micro_batches(1, 1) is None
    assert farthest_micro_batches(1, 8, workers=2) == 4  # a prompt for each rank of each micro-batch


def test_a_trace_reads_back_as_the_records_it_was_written_from(tmp_path):
    from flowrl.runtime.timeline import Timeline
    from flowrl.runtime.worker import Info

    tl = Timeline()
    tl.add(Info("generate", 2, 1, "train", 0, 1, 10.0, 10.5, 16, None))
    tl.add(Info("update_actor", 2, None, "train", 1, 1, 10.5, 11.0, 32, None))
    tl.add(Info("generate", 2, None, "train", 0, 1, 12.0, 12.1, 4, None, plan="val"))
    trace = json.loads(tl.to_chrome_trace(tmp_path / "t.json").read_text())
    got = task_records(trace)
    assert [(r.node, r.mb, r.step, r.rank) for r in got] == [("generate", 1, 2, 0), ("update_actor", None, 2, 1)]
    assert [round(r.end - r.start, 6) for r in got] == [0.5, 0.5]


def cost_file(graph, **nodes: NodeCost) -> CostFile:
    return CostFile(graph=graph.name, key=graph_key(graph), nodes={n: nodes.get(n, NodeCost()) for n in graph.nodes},
                    roles={"actor": RoleMemory(params=1000, trainable=True)})


def test_a_cost_file_is_validated_and_belongs_to_one_graph(tmp_path):
    grpo, ppo = load_graph("grpo"), load_graph("ppo")
    path = save_costs(cost_file(grpo), tmp_path / "costs.json")
    assert load_costs(path, grpo).graph == "grpo"
    # pools, schedule and batch size are what the search varies: the same costs apply
    tuned = load_graph("grpo", overrides={"pools.train.workers": 2, "schedule.micro_batches": 4,
                                          "data.batch_size": 16})
    assert load_costs(path, tuned).key == graph_key(grpo)
    with pytest.raises(CostFileError, match="profiled for graph 'grpo'.*not this graph 'ppo'"):
        load_costs(path, ppo)
    with pytest.raises(CostFileError, match="profiled for graph"):  # another algorithm: another n
        load_costs(path, load_graph("grpo", overrides={"nodes.generate.n": 4}))
    raw = json.loads(path.read_text())
    (tmp_path / "v2.json").write_text(json.dumps({**raw, "version": 2}))
    with pytest.raises(CostFileError, match="version 2"):
        load_costs(tmp_path / "v2.json", grpo)
    raw["nodes"]["generate"]["per_row_s"] = -1
    (tmp_path / "bad.json").write_text(json.dumps(raw))
    with pytest.raises(CostFileError, match="nodes.generate.per_row_s"):
        load_costs(tmp_path / "bad.json", grpo)
    with pytest.raises(CostFileError, match="cannot read it"):
        load_costs(tmp_path / "missing.json", grpo)


def test_a_sync_and_an_all_reduce_are_priced_by_the_bytes_they_move():
    g = load_graph("grpo_async", overrides={"pools.train.workers": 2})
    plan = make_plan(g)
    costs = CostFile(graph=g.name, key=graph_key(g), nodes={n: NodeCost(per_row_s=0.001) for n in g.nodes},
                     transfer=Transfer(fixed_s=0.01, per_byte_s=1e-9),
                     roles={"actor": RoleMemory(params=1_000_000, trainable=True), "rollout": RoleMemory(params=1_000_000)})
    s = task_seconds(plan, costs)
    # generate loads the rollout role's 4 MB before it runs; the update all-reduces 2(N-1)/N of 4 MB
    assert s[("generate", None)] == pytest.approx(0.001 * 256 + 0.01 + 4e6 * 1e-9)
    assert s[("update_actor", None)] == pytest.approx(0.001 * 128 + 0.01 + 4e6 * 1e-9)


def test_every_step_logs_the_plans_prediction_and_a_lasting_drift_is_warned_once_naming_the_node(tmp_path):
    g = load_graph("grpo")
    plan = make_plan(g)
    save_costs(cost_file(g, generate=NodeCost(per_row_s=0.001), update_actor=NodeCost(per_row_s=0.002)),
               tmp_path / "costs.json")
    said: list[str] = []
    check = PlanCheck(plan, tmp_path, say=said.append, load=lambda: 0.5, cores=2)
    predicted = 0.001 * 256 + 0.002 * 256
    ok = check.observe({"step": 1, "timing/step": predicted, "timing/generate": 0.256, "timing/update_actor": 0.512})
    assert ok["plan/predicted_step_s"] == pytest.approx(predicted) and ok["plan/error"] == pytest.approx(0.0)
    assert ok["plan/predicted_critical_path_s"] == pytest.approx(predicted)  # one chain: the step is its path
    slow = {"step": 2, "timing/interval": predicted + 0.4, "timing/generate": 0.656, "timing/update_actor": 0.512}
    out = check.observe(slow)
    assert out["plan/error"] == pytest.approx(0.4 / predicted)
    calm = {"timing/interval": predicted, "timing/generate": 0.256, "timing/update_actor": 0.512}
    for step in (3, 4, 5):  # the calm steps the run's spread is judged from
        check.observe({**calm, "step": step})
    check.observe({**slow, "step": 6})
    check.observe({**calm, "step": 7})
    assert said == []  # one slow step between calm ones: noise, not drift
    for step in range(8, 16):  # 1.168 s a step: three in a row are a burst of load, not a drift that lasts
        check.observe({**slow, "step": step})
    assert said == [] and check.observe({**slow, "step": 16})["plan/error"] == pytest.approx(0.4 / predicted)
    # LASTING_S = 10: the ninth slow step in a row makes 10.5 s of them
    assert len(said) == 1 and "'generate'" in said[0] and "9 steps in a row (10.5s)" in said[0]
    for step in range(17, 21):
        check.observe({**slow, "step": step})
    assert len(said) == 1  # once per run


def test_a_drift_on_a_loaded_machine_goes_to_the_log_with_the_load(tmp_path):
    g = load_graph("grpo")
    plan = make_plan(g)
    said, logged = [], []
    check = PlanCheck(plan, tmp_path, say=said.append, log=logged.append, load=lambda: 7.5, cores=2)
    row = {"timing/step": 1.0, "timing/generate": 0.25, "timing/update_actor": 0.75}
    for step in range(1, 6):  # the first warms up; 2-5 are the baseline, within 2% of each other
        check.observe({**row, "step": step, "timing/step": 1.0 + 0.01 * (step % 2)})
    for step in range(6, 10):  # a lasting slowdown of the update: 3 s a step
        check.observe({"step": step, "timing/step": 3.0, "timing/generate": 0.25, "timing/update_actor": 2.75})
    assert said == [] and len(logged) == 1
    assert "'update_actor'" in logged[0] and "7.5" in logged[0] and "2 cores" in logged[0]


def test_a_slowdown_within_the_runs_own_spread_is_not_drift(tmp_path):
    plan = make_plan(load_graph("grpo"))
    said: list[str] = []
    check = PlanCheck(plan, tmp_path, say=said.append, load=lambda: 0.1, cores=2)
    # a noisy machine: steps of 0.6-1.4 s around 1 s (a median absolute deviation of 20%)
    for step, secs in enumerate([1.0, 1.0, 0.6, 1.4, 1.0, 0.8, 1.2, 1.0, 1.4, 0.6, 1.0], 1):
        check.observe({"step": step, "timing/step": secs, "timing/generate": 0.25 * secs,
                       "timing/update_actor": 0.75 * secs})
    for step in range(12, 16):  # +50% for four steps: inside 4 deviations of this run's own steps
        check.observe({"step": step, "timing/step": 1.5, "timing/generate": 0.375, "timing/update_actor": 1.125})
    assert said == []


def test_without_a_cost_file_the_prediction_comes_from_the_steps_before(tmp_path):
    plan = make_plan(load_graph("grpo"))
    check = PlanCheck(plan, tmp_path, say=lambda m: None)
    row = {"timing/step": 1.0, "timing/generate": 0.25, "timing/update_actor": 0.75}
    assert check.observe({**row, "step": 1}) == {}  # warm-up: nothing measured to predict from
    assert check.observe({**row, "step": 2}) == {}
    out = check.observe({**row, "step": 3})
    assert out["plan/predicted_step_s"] == pytest.approx(1.0) and out["plan/error"] == pytest.approx(0.0)


def _plan_check_lines(tmp_path, slow: dict) -> list[str]:
    """The plan check's warnings of a 12-step local run whose ``slow`` node waits on the steps it is told:
    on the terminal or, the machine loaded, in the run's log."""
    import yaml

    from flowrl.run.trainer import Trainer

    data = yaml.safe_load((Path(__file__).resolve().parents[1] / "graphs" / "grpo.yaml").read_text())
    data["nodes"]["slow"] = {"op": "tests.userpkg.slow:slow_steps", **slow}
    del data["nodes"]["advantage"]["inputs"]  # it reads the slow node's token_level_rewards
    data["data"]["batch_size"] = 4
    data["nodes"]["generate"]["n"] = 2
    data["trainer"].update(val_every=0, checkpoint_every=0)
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "slow.yaml"
    path.write_text(yaml.safe_dump(data))
    said: list[str] = []
    trainer = Trainer(load_graph(str(path)), backend="local", steps=12, out=tmp_path / "run", say=said.append)
    trainer.run()
    log = trainer.log_path.read_text() if trainer.log_path.is_file() else ""
    return [m for m in said + log.splitlines() if "plan check:" in m]


def test_one_slow_step_of_a_run_is_not_warned_and_a_lasting_slowdown_is(tmp_path):
    # every step waits 1 s, which a loaded machine cannot stretch (the rest of a step takes a fraction of one,
    # which it can, by half at a load of 18 on 2 cores); 3 s more is a slowdown far past that noise
    one = {"base_seconds": 1.0, "seconds": 3.0}
    assert _plan_check_lines(tmp_path / "one", {**one, "steps": [7]}) == []
    lasting = _plan_check_lines(tmp_path / "lasting", {**one, "from_step": 7})
    assert len(lasting) == 1 and "3 steps in a row" in lasting[0] and "'slow'" in lasting[0]


def test_profile_refuses_a_directory_that_is_not_a_run(tmp_path):
    res = CliRunner().invoke(app, ["profile", str(tmp_path)])
    assert res.exit_code == 1 and "Traceback" not in res.output
    assert isinstance(res.exception, SystemExit)


def test_a_line_goes_through_each_row_counts_median_so_a_stalled_task_does_not_move_it():
    samples = [(r, 0.3 + 0.01 * r) for r in (8, 16) for _ in range(5)] + [(16, 4.0)]  # one task stalled 10×
    line = fit_line(samples)
    assert line.fixed_s == pytest.approx(0.3) and line.per_row_s == pytest.approx(0.01)


def test_tasks_that_shared_the_cores_are_fitted_at_the_seconds_they_would_take_alone():
    plan = make_plan(load_graph("grpo_async"))
    # generate (gen pool) and the update (train pool) ran at once for 2 s on 1 core: 1 s of work each;
    # reward and advantage (driver threads of one process) at once with them, then alone
    recs = [Record("generate", None, 0, 0, 0.0, 2.0), Record("update_actor", None, 0, 0, 0.0, 2.0),
            Record("reward", None, 0, 0, 2.0, 3.0), Record("advantage", None, 0, 0, 2.0, 3.0)]
    assert solo_seconds(plan, recs, cpus=1) == pytest.approx([1.0, 1.0, 0.5, 0.5])
    assert solo_seconds(plan, recs, cpus=2) == pytest.approx([2.0, 2.0, 0.5, 0.5])  # threads share their process
    assert solo_seconds(plan, recs, cpus=None) == pytest.approx([2.0, 2.0, 1.0, 1.0])


def test_calibration_tells_the_latency_of_a_task_from_the_drivers_work_per_step():
    g = load_graph("grpo")
    plans = [make_plan(load_graph("grpo", overrides={"schedule.micro_batches": k})) for k in (1, 2)]
    costs = CostFile(graph=g.name, key=graph_key(g), nodes={n: NodeCost(fixed_s=0.05) for n in g.nodes})
    truth = costs.model_copy(update={"task_latency_s": 0.01, "step_overhead_s": 0.06})
    # one core: the driver's work per step takes it from the worker, every step pays it whole
    runs = [(p, predict_step(p, truth, cpus=1)[0]) for p in plans]
    latency, overhead = calibrate_overheads(runs, costs, cpus=1)
    assert latency == pytest.approx(0.01, abs=2e-3) and overhead == pytest.approx(0.06, abs=5e-3)
    for p, measured in runs:
        fitted = costs.model_copy(update={"task_latency_s": latency, "step_overhead_s": overhead})
        assert predict_step(p, fitted, cpus=1)[0] == pytest.approx(measured, rel=0.02)


def test_the_live_view_shows_predicted_against_measured_step_and_critical_path():
    from visualizer.live import plan_line

    assert plan_line({"timing/step": 1.0}) is None  # no prediction: nothing to compare
    text = plan_line({"timing/interval": 1.2, "timing/step": 1.0, "plan/predicted_step_s": 1.0,
                      "scheduler/critical_path": 0.9, "plan/predicted_critical_path_s": 0.75})
    assert "1.2 s/step measured, 1 predicted (+20%)" in text
    assert "critical path 0.9 s measured, 0.75 predicted (+20%)" in text


def test_a_machine_that_slows_while_profiling_is_measured_by_the_repeated_first_run_and_divided_out():
    g = load_graph("grpo")
    plans = [make_plan(load_graph("grpo", overrides={"schedule.micro_batches": k})) for k in (1, 2, 1)]
    # the neighbours' load grows evenly: the second run 1.25x as slow, the third (the first again) 1.5x
    runs = [(p, records(p, steps=6, slower_all=f), []) for p, f in zip(plans, (1.0, 1.25, 1.5))]
    costs = fit_runs(runs, g, "synthetic", Transfer(), drift=True)
    assert costs.measured_with["drift"] == pytest.approx(1.5)
    for node in ("generate", "update_actor"):
        fixed, per_row = TRUTH[node]
        assert costs.nodes[node].seconds(256) == pytest.approx(fixed + per_row * 256, rel=1e-6)
    skewed = fit_runs(runs, g, "synthetic", Transfer())  # read as costs, the drift bends the lines
    assert skewed.nodes["generate"].seconds(256) != pytest.approx(TRUTH["generate"][0] + TRUTH["generate"][1] * 256,
                                                                  rel=1e-3)


def test_the_profile_widens_every_pool_within_the_cores_or_puts_every_role_on_one_wider_pool(monkeypatch):
    from flowrl import cli_plan

    monkeypatch.setattr(cli_plan.os, "cpu_count", lambda: 2)
    assert cli_plan.wider_variant(load_graph("grpo"), "grpo", {}) == {"pools.train.workers": 2}
    # two pools of one worker: twice each would need 4 cores; both roles on one pool of 2 fit
    wider = cli_plan.wider_variant(load_graph("grpo_async"), "grpo_async", {})
    (pool,) = wider["pools"].values()
    assert sorted(pool["roles"]) == ["actor", "rollout"] and pool["workers"] == 2
    assert load_graph("grpo_async", overrides=wider).check().ok
    monkeypatch.setattr(cli_plan.os, "cpu_count", lambda: 1)
    assert cli_plan.wider_variant(load_graph("grpo"), "grpo", {}) is None


def test_a_vision_language_models_memory_is_read_from_its_decoder():
    # its config nests the decoder (text_config): profile read num_hidden_layers off the top and failed
    vl = role_memory(load_graph(Path(__file__).resolve().parents[1] / "graphs" / "grpo_vision.yaml"))["actor"]
    text = role_memory(load_graph("grpo"))["actor"]
    assert vl.trainable and vl.params > text.params > 0  # the vision tower's parameters counted too
    assert vl.kv_bytes_per_token > 0 and vl.activation_bytes_per_token > 0
