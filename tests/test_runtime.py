"""The runtime on both backends: overlap, streaming, staleness, padding, failures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

import tests.graph_ops as ops
from flowrl.data import DataProto
from flowrl.graph import load_graph
from flowrl.errors import NodeError, PlacementError, WorkerDiedError
from flowrl.plan.planner import make_plan
from flowrl.runtime.scheduler import Runtime

HERE = Path(__file__).parent
BIG = {"CPU": 64.0, "GPU": 0.0}


def graph_from(name: str, tmp_path: Path | None = None, **edits):
    data = yaml.safe_load((HERE / "data" / name).read_text())
    for dotted, value in edits.items():
        cur = data
        *head, last = dotted.split("__")
        for k in head:
            cur = cur.setdefault(k, {})
        cur[last] = value
    path = (tmp_path or HERE / "data") / f"_edited_{name}"
    path.write_text(yaml.safe_dump(data))
    try:
        return load_graph(path)
    finally:
        path.unlink()


def batches(batch_size: int):
    src = ops.TestData(ops.SourceCfg(source="x", batch_size=batch_size))
    while True:
        b = src.next_batch()
        yield DataProto.from_dict(tensors={"prompts": b["prompts"]},
                                  non_tensors={"uid": b["uid"], "ground_truth": b["ground_truth"]})


@pytest.fixture(params=["local", "ray"])
def backend(request):
    if request.param == "ray":
        request.getfixturevalue("ray_session")
    return request.param


def test_pools_overlap_and_micro_batches_stream(backend, tmp_path):
    g = graph_from("ppo.yaml", tmp_path, nodes__values__sleep_s=0.3, nodes__old_logprob__sleep_s=0.15,
                   nodes__ref_logprob__sleep_s=0.15, nodes__generate__sleep_s=0.15)
    with Runtime(g, backend=backend, resources=BIG, fetch=["responses", "advantages"]) as rt:
        (r,) = list(rt.run(batches(4), steps=1))
        tl = rt.timeline
        # values runs on the critic pool while old/ref log-probs run on the train pool: the
        # recorded tasks of the two pools ran at the same time
        assert {(v.pool, o.pool) for v, o in tl.overlapping("values", 0, "old_logprob", 0)} == {("critic", "train")}
        # streaming: values on micro-batch 0 ran while generate's last micro-batch did
        assert [(v.mb, g1.mb) for v, g1 in tl.overlapping("values", 0, "generate", 0)] == [(0, 1)]
        # the values are the step's real values: responses = last prompt token + sum(w)=4
        prompts = next(batches(4)).batch["prompts"]
        assert r.data.batch["responses"][:, 0].tolist() == (prompts[:, -1] + 4).tolist()
        assert len(r.data) == 4
        assert 0 < r.metrics["scheduler/efficiency"] <= 1.0 + 1e-9
        # a node's time is its recorded tasks' time
        assert r.metrics["timing/values"] == pytest.approx(sum(i.end - i.start for i in tl.of_node("values", 0)))
        assert r.metrics["critic/vf_loss"] >= 0


def test_staleness_one_overlaps_rollout_with_training_within_the_bound(backend, tmp_path):
    g = load_graph(HERE / "data" / "async.yaml")
    with Runtime(g, backend=backend, resources=BIG, fetch=["policy_version"]) as rt:
        results = list(rt.run(batches(4), steps=4))
        tl = rt.timeline
        versions = [r.data.batch["policy_version"].tolist() for r in results]
        # at step t the rollout weights are no older than t - 1 (and never newer than t)
        for t, v in enumerate(versions):
            assert all(t - 1 <= x <= t for x in v), (t, v)
        assert any(v[0] == t - 1 for t, v in enumerate(versions) if t > 0)  # it did run ahead
        # generation of step t+1 ran while step t trained
        assert any(tl.overlapping("generate", t + 1, "update_actor", t) for t in range(3))
        assert len(results[0].data) == 8  # n=2 samples of 4 prompts
        # overlapped steps: measured between finished steps, against the busiest pool's work
        assert "scheduler/pipeline_efficiency" not in results[0].metrics
        for r in results[1:]:
            assert 0 < r.metrics["scheduler/pipeline_efficiency"] <= 1.0
            assert r.metrics["timing/interval"] > 0


def test_staleness_zero_never_runs_ahead(backend, tmp_path):
    g = graph_from("async.yaml", tmp_path, schedule__staleness=0)
    with Runtime(g, backend=backend, resources=BIG, fetch=["policy_version"]) as rt:
        results = list(rt.run(batches(4), steps=3))
        tl = rt.timeline
    # exactly synchronous: step t generates with the weights of t updates, all 8 samples
    assert [r.data.batch["policy_version"].tolist() for r in results] == [[t] * 8 for t in range(3)]
    assert [r.metrics["actor/version"] for r in results] == [0, 1, 2]  # the update of step t trains version t
    for t in range(2):
        assert tl.span("generate", t + 1)[0] >= tl.span("update_actor", t)[1]


def test_padding_never_reaches_outputs(backend, tmp_path):
    g = graph_from("ppo.yaml", tmp_path, pools__train__workers=2, pools__train__cpus=0.5, schedule__micro_batches=1,
                   data__batch_size=3)
    with Runtime(g, backend=backend, resources=BIG, fetch=["responses", "old_log_probs"]) as rt:
        r = rt.run_step(next(batches(3)))
    assert len(r.data) == 3
    prompts = next(batches(3)).batch["prompts"]
    assert r.data.batch["responses"][:, 0].tolist() == (prompts[:, -1] + 4).tolist()
    ranks = {(i.node, i.rank): i.rows for i in r.infos if i.node == "generate"}
    assert ranks == {("generate", 0): 2, ("generate", 1): 1}  # 3 rows over 2 ranks: 2 + (1 + 1 pad)


def test_prompt_columns_are_repeated_to_sample_rows(tmp_path):
    g = graph_from("ppo.yaml", tmp_path, nodes__generate__n=3)
    plan = make_plan(g)
    assert plan.spaces["generate"].factor == 3
    with Runtime(g, backend="local", resources=BIG, fetch=["responses", "uid"]) as rt:
        r = rt.run_step(next(batches(4)))
    assert len(r.data) == 12
    assert list(r.data.non_tensor_batch["uid"][:6]) == ["s0-0"] * 3 + ["s0-1"] * 3


def _fault_graph(tmp_path, mode: str, **extra):
    return graph_from("ppo.yaml", tmp_path, nodes__fault={"op": "test.fault", "role": "critic", "mode": mode,
                                                          **extra}, **{})


def test_operator_exception_names_node_step_worker_and_traceback(backend, tmp_path):
    g = _fault_graph(tmp_path, "raise")
    rt = Runtime(g, backend=backend, resources=BIG)
    with pytest.raises(NodeError) as exc:
        list(rt.run(batches(4), steps=1))
    msg = str(exc.value)
    assert "node 'fault' failed at step 1" in msg and "critic[0]" in msg
    assert "ValueError: the reward server returned garbage" in msg
    assert "remote traceback" in msg and "graph_ops.py" in msg
    rt.close()


# a node past its timeout_s: test_hangs (the same run, also naming the line the operator hangs on)


def test_a_task_queued_behind_slow_work_is_not_timed_out(tmp_path):
    # values[1] waits ~0.8 s behind values[0] on the critic pool: queued, not running past 0.5 s
    g = graph_from("ppo.yaml", tmp_path, nodes__values={"op": "test.values", "role": "critic", "sleep_s": 0.4,
                                                       "timeout_s": 0.5})
    from flowrl.recovery.recovery import Recovery

    with Runtime(g, backend="local", resources=BIG, recovery=Recovery()) as rt:  # the watchdog on
        r = rt.run_step(next(batches(4)))
    assert r.metrics["timing/values"] >= 0.8


def test_killed_worker_fails_the_step_at_once(ray_session, tmp_path):
    g = _fault_graph(tmp_path, "die")
    rt = Runtime(g, backend="ray", resources=BIG)
    with pytest.raises(WorkerDiedError) as exc:
        list(rt.run(batches(4), steps=1))
    msg = str(exc.value)
    assert "worker critic[0]" in msg and "died while running node" in msg
    rt.close()


def test_infeasible_placement_fails_fast(ray_session, tmp_path):
    g = graph_from("ppo.yaml", tmp_path, pools__train__workers=3, data__batch_size=6)  # a prompt per rank
    rt = Runtime(g, backend="ray", resources=BIG)  # the graph check passes with BIG; Ray has 2 CPUs
    with pytest.raises(PlacementError) as exc:
        rt.start()
    assert "the pools ask for 4 CPUs" in str(exc.value) and "the Ray cluster has 2 CPUs" in str(exc.value)
    rt.close()


def test_chrome_trace_has_every_task(tmp_path):
    g = load_graph(HERE / "data" / "ppo.yaml")
    with Runtime(g, backend="local", resources=BIG) as rt:
        list(rt.run(batches(4), steps=1))
        path = rt.timeline.to_chrome_trace(tmp_path / "t.json")
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    names = {e["name"] for e in events}
    assert {"generate[0]", "generate[1]", "advantage", "update_actor", "update_critic"} <= names
    assert all(e["dur"] >= 0 for e in events)


def test_plan_orders_critical_path_first_and_predicts_overlap():
    g = load_graph(HERE / "data" / "ppo.yaml")
    plan = make_plan(g)
    assert plan.pool_order["critic"] == [("values", 0), ("values", 1), ("update_critic", None)]
    train = plan.pool_order["train"]
    assert train[0] == ("generate", 0) and train[-1] == ("update_actor", None)
    sim = plan.simulate()
    # overlap across pools: the predicted makespan is below the sum of all work
    total = sum(t.cost for t in plan.tasks.values())
    assert sim.makespan < total
    assert sim.lower_bound <= sim.makespan + 1e-9


def test_after_edges_hold_across_pools(tmp_path):
    # values (critic pool) must wait for all of old_logprob (train pool), though no field links them
    g = graph_from("ppo.yaml", tmp_path, nodes__values={"op": "test.values", "role": "critic",
                                                       "after": ["old_logprob"]},
                   nodes__old_logprob={"op": "test.old_logprob", "role": "actor", "sleep_s": 0.1})
    with Runtime(g, backend="local", resources=BIG) as rt:
        rt.run_step(next(batches(4)))
        assert rt.timeline.span("values", 0)[0] >= rt.timeline.span("old_logprob", 0)[1]


def test_run_step_can_be_called_repeatedly():
    g = load_graph(HERE / "data" / "ppo.yaml")
    with Runtime(g, backend="local", resources=BIG, fetch=["policy_version"]) as rt:
        source = batches(4)
        first = rt.run_step(next(source), step=0)
        second = rt.run_step(next(source), step=1)
    assert first.data.batch["policy_version"].tolist() == [0] * 4
    assert second.data.batch["policy_version"].tolist() == [1] * 4


def test_driver_step_hooks_see_every_step_its_row_and_its_fields():
    from flowrl.runtime.steps import StepHook

    class Seen(StepHook):
        def __init__(self) -> None:
            self.rows: list[dict] = []
            self.versions: list[list[int]] = []

        def step_done(self, done) -> None:
            done.row["hook/seen"] = 1.0  # a hook adds to the row the hooks after it see
            self.rows.append(dict(done.row))
            self.versions.append(done.read(["policy_version"]).batch["policy_version"].tolist())

    first, second = Seen(), Seen()
    g = load_graph(HERE / "data" / "ppo.yaml")
    with Runtime(g, backend="local", resources=BIG, hooks=[first, second]) as rt:
        results = list(rt.run(batches(4), steps=3))
    assert [r["step"] for r in first.rows] == [1, 2, 3] and first.versions == [[0] * 4, [1] * 4, [2] * 4]
    assert second.rows == first.rows and all(r["hook/seen"] == 1.0 for r in second.rows)
    assert [r.data for r in results] == [None] * 3  # nothing fetched for the caller: the hooks read their own
    assert [r["critic/vf_loss"] for r in first.rows] == [r.metrics["critic/vf_loss"] for r in results]


def test_declared_order_runs_each_pool_as_written(tmp_path):
    g = graph_from("ppo.yaml", tmp_path, schedule__order="declared")
    train = make_plan(g).pool_order["train"]
    assert train == [("generate", 0), ("generate", 1), ("old_logprob", 0), ("old_logprob", 1),
                     ("ref_logprob", 0), ("ref_logprob", 1), ("update_actor", None)]


def test_light_nodes_between_one_pool_run_in_its_process(tmp_path):
    from flowrl.plan.planner import place_light_nodes

    # grpo-shaped: generate (train) -> reward -> advantage -> update (train): no trip to the driver
    data = yaml.safe_load((HERE / "data" / "async.yaml").read_text())
    data["roles"] = {"actor": data["roles"]["actor"]}
    data["pools"] = {"train": {"workers": 1, "cpus": 1, "roles": ["actor"]}}
    data["nodes"]["generate"]["role"] = "actor"
    data["schedule"]["staleness"] = 0
    path = tmp_path / "sync.yaml"
    path.write_text(yaml.safe_dump(data))
    g = load_graph(path)
    assert place_light_nodes(g) == {"reward": "train", "kl_reward": "train", "advantage": "train"}
    with Runtime(g, backend="local", resources=BIG, fetch=["advantages"]) as rt:
        r = rt.run_step(next(batches(4)))
    assert {i.pool for i in r.infos if i.node in ("reward", "advantage")} == {"train"}
    assert len(r.data) == 8
    assert ("driver", 0) not in rt.backend.workers  # no node runs on the driver: no driver worker
    # pools are joined (ppo: train and critic feed the advantage): they stay on the driver
    assert place_light_nodes(load_graph(HERE / "data" / "ppo.yaml")) == {}


def test_outputs_that_break_their_declared_shapes_name_the_operator():
    from flowrl.data import DataProto
    from flowrl.graph import OperatorOutputError
    from tests.userpkg.faults import ragged_reward

    import torch

    batch = DataProto.from_dict(tensors={"responses": torch.zeros(2, 3, dtype=torch.int64),
                                         "response_mask": torch.ones(2, 3, dtype=torch.int64)})
    with pytest.raises(OperatorOutputError) as exc:
        ragged_reward(batch)
    assert "operator 'userpkg.ragged_reward' returned outputs that do not match its declaration" in str(exc.value)
    assert "R=3 but R=4" in str(exc.value) or "R=4 but R=3" in str(exc.value)


def test_a_source_batch_unlike_its_declared_columns_fails_naming_them():
    from flowrl.runtime.scheduler import DataSourceMismatch

    g = load_graph(HERE / "data" / "ppo.yaml")
    bad = next(batches(4))
    bad.batch["prompts"] = bad.batch["prompts"].float()
    with Runtime(g, backend="local", resources=BIG) as rt:
        with pytest.raises(DataSourceMismatch) as exc:
            rt.run_step(bad)
    assert "step 1" in str(exc.value) and "prompts: dtype float32, expected int64" in str(exc.value)


def test_an_operator_returning_the_wrong_number_of_rows_fails_naming_node_and_counts(tmp_path):
    g = graph_from("ppo.yaml", tmp_path, nodes__reward={"op": "tests.userpkg.faults:short_reward"})
    with Runtime(g, backend="local", resources=BIG) as rt:
        with pytest.raises(NodeError) as exc:
            rt.run_step(next(batches(4)))
    # 4 prompts × n=1 in 2 micro-batches: each reward task gets 2 rows and returns 1
    assert exc.value.node == "reward"
    assert "node 'reward' returned 1 rows, expected 2" in str(exc.value)


def test_the_eager_path_checks_row_counts_too():
    import torch

    from flowrl.data.expand import RowCountError
    from tests.userpkg.faults import short_reward

    batch = DataProto.from_dict(tensors={"responses": torch.zeros(3, 2, dtype=torch.int64),
                                         "response_mask": torch.ones(3, 2, dtype=torch.int64)})
    with pytest.raises(RowCountError) as exc:
        short_reward(batch)
    assert (exc.value.node, exc.value.expected, exc.value.actual) == ("userpkg.short_reward", 3, 2)


def test_backends_are_registered_by_name():
    from flowrl.runtime.backends import BACKENDS, LocalBackend, make_backend

    assert {"local", "ray"} <= set(BACKENDS) and isinstance(make_backend("local"), LocalBackend)
    with pytest.raises(ValueError) as exc:
        make_backend("slurm")
    assert "unknown backend 'slurm'" in str(exc.value) and "local, ray" in str(exc.value)


def test_a_role_kind_declares_the_role_contract_or_is_refused_when_declared():
    from flowrl.graph import Role, role_kind

    with pytest.raises(TypeError, match="'test_duck': class Duck must derive from flowrl.graph.Role"):
        @role_kind("test_duck", config=ops.PolicyCfg)
        class Duck:  # what the worker used to probe with hasattr
            def get_weights(self):
                return None
    policy = ops.TestPolicy(ops.PolicyCfg())
    assert isinstance(policy, Role) and policy.set_version(3) == {} and policy.version == 3
    assert policy.held_bytes() == {} and policy.weights_for_digest() is None
