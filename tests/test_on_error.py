"""A node's failure policy (on_error): retries, fail, drop_group; and the fault switch."""

from __future__ import annotations

import numpy as np
import pytest

import tests.faulty_reward as faulty
from flowrl.data import DataProto
from flowrl.data.dispatch import DROPPED
from flowrl.graph import load_graph
from flowrl.graph.config import OnErrorConfig
from flowrl.graph.registry import make_source
from flowrl.errors import NodeError
from flowrl.recovery.faults import FaultSpecError, parse_fault, run_guarded
from flowrl.recovery.recovery import Recovery
from flowrl.runtime.scheduler import Runtime

BIG = {"CPU": 64.0, "GPU": 0.0}
SMALL = {"data.batch_size": 4, "nodes.generate.n": 4, "nodes.generate.max_new_tokens": 4,
         "nodes.reward.fn": "tests.faulty_reward:compute_score", "trainer.val_every": 0,
         "trainer.checkpoint_every": 0}


def grpo(**overrides):
    return load_graph("grpo", overrides={**SMALL, **overrides})


def prompts(graph, steps: int) -> list[DataProto]:
    src = make_source(graph.config)
    return [src.next_batch() for _ in range(steps)]


def run(graph, batches: list[DataProto], backend: str = "local") -> list[dict[str, float]]:
    with Runtime(graph, backend=backend, resources=BIG) as rt:
        return [r.metrics for r in rt.run(iter(batches), steps=len(batches))]


@pytest.fixture(autouse=True)
def _no_failures():
    faulty.FAIL_ON.clear()
    yield
    faulty.FAIL_ON.clear()


def _learning(metrics: dict[str, float]) -> dict[str, float]:
    """What the advantages and the update computed (the rollout saw every prompt either way)."""
    return {k: v for k, v in metrics.items() if k.split("/")[0] in ("actor", "critic", "reward", "advantage")}


@pytest.mark.parametrize("backend", ["local", "ray"])
def test_drop_group_equals_a_run_that_never_saw_the_failed_prompts(backend, request):
    if backend == "ray":
        request.getfixturevalue("ray_session")
    g = grpo(**{"nodes.reward.on_error": "drop_group", "nodes.reward.fn": "tests.faulty_reward:flaky_score"})
    full = prompts(g, 2)
    bad = [[faulty.fails(t) for t in b.non_tensor_batch["ground_truth"]] for b in full]
    assert any(bad[0]) and not all(bad[0])  # the data this test needs: some prompts fail, not all
    dropped = run(g, full, backend)
    assert [m.get("faults/dropped_groups", 0) for m in dropped] == [sum(b) for b in bad]
    assert dropped[0]["faults/dropped_rows"] == sum(bad[0]) * 4

    never = [b.select_idxs(~np.array(f)) for b, f in zip(full, bad)]
    clean = run(grpo(), never, backend)
    for got, want in zip(dropped, clean):
        assert _learning(got).keys() == _learning(want).keys() and "actor/pg_loss" in _learning(got)
        for k, v in _learning(want).items():
            assert got[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k


def test_without_a_policy_the_failure_fails_the_step_named():
    g = grpo()
    batch = prompts(g, 1)
    faulty.FAIL_ON.add(batch[0].non_tensor_batch["ground_truth"][0])
    with pytest.raises(NodeError) as exc:
        run(g, batch)
    assert exc.value.node == "reward" and "ConnectionError: the reward server refused" in str(exc.value)


def test_when_every_group_fails_drop_group_fails_the_step():
    g = grpo(**{"nodes.reward.on_error": {"retries": 1, "then": "drop_group"}})
    batch = prompts(g, 1)
    faulty.FAIL_ON.update(batch[0].non_tensor_batch["ground_truth"])
    with pytest.raises(NodeError) as exc:
        run(g, batch)
    assert "failed on each of 2 attempts" in str(exc.value)


def test_retries_recover_from_a_transient_failure():
    retry = {"nodes.reward.on_error": {"retries": 1, "backoff_s": 0.01}}
    g = grpo(**retry, **{"trainer.fault": "node=reward,step=2,kind=raise,times=1"})
    metrics = run(g, prompts(g, 2))
    assert [m.get("faults/retries", 0) for m in metrics] == [0, 1]
    g = grpo(**retry, **{"trainer.fault": "node=reward,step=2,kind=raise"})
    with pytest.raises(NodeError) as exc:
        run(g, prompts(g, 2))
    assert exc.value.step == 1 and "injected by trainer.fault" in str(exc.value)


def test_on_error_is_validated_with_the_node_and_field(tmp_path):
    from flowrl.graph.problems import GraphError

    with pytest.raises(GraphError) as exc:
        load_graph("grpo", overrides={"nodes.reward.on_error": {"then": "skip"}})
    assert "reward" in str(exc.value) and "on_error" in str(exc.value)
    with pytest.raises(GraphError) as exc:
        load_graph("grpo", overrides={"nodes.reward.on_error": {"retries": -1}})
    assert "on_error" in str(exc.value)
    report = load_graph("grpo", overrides={"nodes.update_actor.on_error": "drop_group"}).check(resources=BIG)
    [problem] = report.errors
    assert problem.node == "update_actor" and problem.field == "on_error" and "updates its role" in problem.message


def test_the_python_front_end_takes_on_error():
    from flowrl import graph as traced
    import operators.rollout as rollout
    from operators import advantage, actor, reward

    @traced(name="t", data={"source": "builtin:copy", "batch_size": 4},
            roles={"actor": {"model": "builtin:tiny"}}, pools={"train": {"roles": ["actor"]}})
    def step(batch):
        batch = rollout.generate(batch, n=4)
        batch = reward.rule(batch, on_error={"retries": 2, "then": "drop_group"})
        batch = advantage.grpo(batch, inputs={"token_level_rewards": "token_level_scores"})
        return actor.update(batch, inputs={"old_log_probs": "rollout_log_probs"})

    policy = step.nodes["reward"].config.on_error
    assert (policy.retries, policy.backoff_s, policy.then) == (2, 0.0, "drop_group")


def test_groups_follow_the_declared_group_key_and_marks_reach_the_output():
    calls = []

    def op(b: DataProto):
        calls.append(len(b))
        if "b" in set(b.non_tensor_batch["prompt"]):
            raise ValueError("no")
        return DataProto.from_dict({"s": b.batch["x"] * 2.0}), {"m": 1.0}

    # the groups are the values of the column the node declares its group key (any name)
    batch = DataProto.from_dict({"x": torch_arange(6)}, {"prompt": np.array(list("aabbcc"), dtype=object)})
    out, metrics = run_guarded(op, batch, OnErrorConfig(then="drop_group"), key="prompt")
    assert out.non_tensor_batch[DROPPED].tolist() == [False, False, True, True, False, False]
    assert out.batch["s"].tolist() == [0.0, 2.0, 0.0, 0.0, 8.0, 10.0]
    assert metrics["faults/dropped_groups"] == 1 and metrics["m"] == 1.0
    # a later node sees only the kept rows, and hands the marks on
    seen = []
    out2, _ = run_guarded(lambda b: (seen.append(b.batch["s"].tolist()) or b, {}), out, None)
    assert seen == [[0.0, 2.0, 8.0, 10.0]] and out2.non_tensor_batch[DROPPED].tolist()[2:4] == [True, True]


def torch_arange(n):
    import torch

    return torch.arange(n)


def test_the_fault_switch_parses_and_refuses_what_it_cannot_read():
    from flowrl.graph.problems import GraphError

    f = parse_fault("node=reward,step=3,rank=0,kind=hang")
    assert (f.node, f.step, f.rank, f.kind, f.mb) == ("reward", 3, 0, "hang", None)
    for bad in ("node=reward", "node=reward,step=x", "node=reward,step=1,kind=explode", "node=r,step=1,when=now"):
        with pytest.raises(FaultSpecError):
            parse_fault(bad)
        with pytest.raises(GraphError) as exc:  # the graph's key refuses it, named
            grpo(**{"trainer.fault": bad})
        assert "trainer.fault" in str(exc.value)
    [problem] = grpo(**{"trainer.fault": "node=rewards,step=1"}).check(resources=BIG).errors
    assert problem.field == "fault" and "'rewards', which is not a node" in problem.message
    assert "did you mean 'reward'" in problem.fix


def test_flowrl_run_switches_the_fault_on_from_the_command_line(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from flowrl.cli import FAULT_ENV, app

    args = ["run", "grpo", "--backend", "local", "--steps", "2", "--out", str(tmp_path / "run"),
            *[f"--set={k}={v}" for k, v in SMALL.items() if k != "nodes.reward.fn"]]
    monkeypatch.delenv(FAULT_ENV, raising=False)
    failed = CliRunner().invoke(app, [*args, "--fault", "node=reward,step=2,kind=raise"])
    assert failed.exit_code == 1 and "injected by trainer.fault" in failed.output
    assert "Traceback" not in failed.output
    bad = CliRunner().invoke(app, [*args, "--fault", "node=reward,step=0"])
    assert bad.exit_code == 1 and "trainer.fault" in bad.output and "steps count from 1" in bad.output
    # the environment variable is the command's alias of --fault
    monkeypatch.setenv(FAULT_ENV, "node=reward,step=1,kind=raise")
    aliased = CliRunner().invoke(app, [*args, "--overwrite"])
    assert aliased.exit_code == 1 and "injected by trainer.fault" in aliased.output


REFILL = {"nodes.reward.on_error": "refill", "nodes.reward.fn": "tests.faulty_reward:flaky_score"}


@pytest.mark.parametrize("backend", ["local", "ray"])
def test_refill_replaces_the_failed_prompts_with_fresh_ones_and_keeps_every_group(backend, request):
    if backend == "ray":
        request.getfixturevalue("ray_session")
    g = grpo(**REFILL)
    full = prompts(g, 2)
    bad = [sum(faulty.fails(t) for t in b.non_tensor_batch["ground_truth"]) for b in full]
    with Runtime(g, backend=backend, resources=BIG, fetch=["uid", "ground_truth", "token_level_scores"],
                 recovery=Recovery()) as rt:
        results = list(rt.run(iter(full), steps=2))
    for r, b, n_bad in zip(results, full, bad):
        assert r.metrics["faults/refilled_groups"] >= n_bad > 0
        uids = list(r.data.non_tensor_batch["uid"])
        assert len(uids) == 4 * 4 and "faults/dropped_groups" not in r.metrics
        kept = [u for u, t in zip(b.non_tensor_batch["uid"], b.non_tensor_batch["ground_truth"]) if not faulty.fails(t)]
        assert set(kept) < set(uids) and any("-refill" in u for u in uids)
        assert not any(faulty.fails(t) for t in r.data.non_tensor_batch["ground_truth"])  # no failed prompt left


def test_refill_draws_the_same_prompts_on_resume(tmp_path):
    from flowrl.run.trainer import Trainer

    def train(out, steps, resume=False):
        g = load_graph("grpo", overrides={**SMALL, **REFILL, "trainer.checkpoint_every": 2})
        return Trainer(g, backend="local", steps=steps, out=out, resume=resume, say=lambda m: None).run()

    keys = ("reward/mean", "actor/pg_loss", "actor/entropy", "faults/refilled_groups", "response_length/mean")
    full = train(tmp_path / "full", 4)
    part = train(tmp_path / "part", 2) + train(tmp_path / "part", 4, resume=True)
    assert [[r.get(k) for k in keys] for r in part] == [[r.get(k) for k in keys] for r in full]
    assert sum(r.get("faults/refilled_groups", 0) for r in full) > 0


def test_refill_on_an_update_is_refused():
    report = load_graph("grpo", overrides={"nodes.update_actor.on_error": "refill"}).check(resources=BIG)
    [problem] = report.errors
    assert problem.field == "on_error" and "refill" in problem.message


def test_fetched_rows_leave_out_the_dropped_groups():
    g = grpo(**{"nodes.reward.on_error": "drop_group", "nodes.reward.fn": "tests.faulty_reward:flaky_score"})
    [batch] = prompts(g, 1)
    with Runtime(g, backend="local", resources=BIG, fetch=["ground_truth", "token_level_scores"]) as rt:
        r = rt.run_step(batch)
    truths = list(r.data.non_tensor_batch["ground_truth"])
    n_ok = sum(not faulty.fails(t) for t in batch.non_tensor_batch["ground_truth"])
    assert len(truths) == 4 * n_ok and not any(faulty.fails(t) for t in truths)
    assert "_dropped" not in r.data.non_tensor_batch
