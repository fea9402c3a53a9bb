"""A task past its timeout fails with the stuck worker's Python stack; every node has a default timeout."""

from __future__ import annotations

import inspect
import os
import signal

import pytest

import tests.graph_ops as ops
from flowrl.graph.config import ScheduleConfig
from flowrl.recovery import faults
from flowrl.errors import NodeTimeoutError
from flowrl.recovery.recovery import Recovery
from flowrl.runtime.scheduler import Runtime
from tests.test_runtime import BIG, batches, graph_from


def _line_of(fn, text: str) -> int:
    lines, first = inspect.getsourcelines(fn)
    return first + next(i for i, line in enumerate(lines) if text in line)


SLEEP = f'graph_ops.py", line {_line_of(ops.fault.fn if hasattr(ops.fault, "fn") else ops.fault, "time.sleep(3600)")}'


def _hang(backend: str, tmp_path, fault: str | None = None, **node) -> NodeTimeoutError:
    g = graph_from("ppo.yaml", tmp_path, nodes__fault={"op": "test.fault", "role": "critic", "mode": "hang",
                                                      "timeout_s": 1.0, **node}, trainer__fault=fault)
    rt = Runtime(g, backend=backend, resources=BIG, recovery=Recovery())
    try:
        with pytest.raises(NodeTimeoutError) as exc:
            list(rt.run(batches(4), steps=1))
    finally:
        rt.close()
    return exc.value


def test_a_hung_operator_fails_with_the_line_it_sleeps_on_local(tmp_path):
    msg = str(_hang("local", tmp_path))
    assert "node 'fault'" in msg and "past its timeout_s=1" in msg and "critic[0]" in msg and "every thread" in msg
    assert SLEEP in msg and "in fault" in msg


def test_a_hung_operator_fails_with_the_line_it_sleeps_on_ray(ray_session, tmp_path):
    msg = str(_hang("ray", tmp_path))
    assert "node 'fault'" in msg and "past its timeout_s=1" in msg and "critic[0]" in msg
    assert SLEEP in msg and "in fault" in msg


def test_the_fault_switch_hangs_a_chosen_node_and_the_stack_names_it(tmp_path):
    # the switch fires before the operator runs
    msg = str(_hang("local", tmp_path, "node=fault,step=1,kind=hang", mode="raise"))
    assert f'faults.py", line {_line_of(faults._sleep_forever, "time.sleep")}' in msg


def test_a_stopped_worker_is_named_as_stopped(ray_session, tmp_path):
    g = graph_from("ppo.yaml", tmp_path, nodes__values={"op": "test.values", "role": "critic", "timeout_s": 2.0})
    rt = Runtime(g, backend="ray", resources=BIG, recovery=Recovery()).start()
    pid = rt.backend.pids[("critic", 0)]
    os.kill(pid, signal.SIGSTOP)
    try:
        with pytest.raises(NodeTimeoutError) as exc:
            list(rt.run(batches(4), steps=1))
    finally:
        os.kill(pid, signal.SIGCONT)
        rt.close()
    msg = str(exc.value)
    assert "node 'values'" in msg and "did not answer for its stacks" in msg and "stopped" in msg


def test_every_node_has_a_generous_default_timeout_that_can_be_changed_or_lifted():
    assert ScheduleConfig().timeout_s == 3600.0
    assert ScheduleConfig(timeout_s=None).timeout_s is None
    assert ScheduleConfig(timeout_s=30).timeout_s == 30


def test_a_weight_sync_past_the_default_timeout_is_named_with_the_stack(tmp_path):
    import time

    from flowrl.plan.planner import make_plan
    from flowrl.recovery.watchdog import check_timeouts

    g = graph_from("ppo.yaml", tmp_path, schedule={"timeout_s": 0.5})
    plan = make_plan(g)
    sync, queued = object(), object()
    pending = {sync: (None, "critic", 0), queued: (plan.pool_order["critic"][0], "critic", 0)}
    with pytest.raises(NodeTimeoutError) as exc:
        check_timeouts(0, plan, g, pending, {}, time.time() - 2, {}, lambda p, r: f"{p}[{r}]",
                       lambda p, r: 'File "x.py", line 3, in set_weights')
    msg = str(exc.value)
    assert "loading weights on critic[0] (for step 1)" in msg and "schedule.timeout_s=0.5" in msg
    assert 'line 3, in set_weights' in msg
    # behind a task still pending on its worker, a sync is queued, not stuck
    check_timeouts(0, plan, g, {queued: pending[queued], sync: pending[sync]}, {}, time.time() - 2, {},
                   lambda p, r: f"{p}[{r}]")


def test_a_checkpoint_state_that_never_comes_is_named():
    import concurrent.futures as cf

    from flowrl.runtime.hangs import get_within

    with pytest.raises(NodeTimeoutError) as exc:
        get_within(lambda h, timeout: h.result(timeout=timeout), cf.Future(), 0.05, "the state of gen[0]")
    assert "the state of gen[0] did not come within schedule.timeout_s=0.05" in str(exc.value)


def test_a_rank_that_never_reaches_the_collective_is_named_and_the_node_marked_stuck(ray_session):
    from flowrl.graph import load_graph
    from flowrl.recovery.watchdog import TaskTimeout
    from tests.shared_runs import TWO
    from visualizer.live import LiveView

    # rank 1 hangs in Python before generating; rank 0 waits for it in the rollout's unshard collective
    g = load_graph("grpo", overrides={**TWO, "nodes.generate.timeout_s": 2,
                                      "trainer.fault": "node=generate,step=1,rank=1,kind=hang"})
    progress: list[dict[str, str]] = []
    rt = Runtime(g, backend="ray", on_progress=lambda step, states: progress.append(states), recovery=Recovery())
    try:
        with pytest.raises(TaskTimeout) as exc:
            list(rt.run(iter(batches_of(g)), steps=1))
    finally:
        rt.close()
    msg = str(exc.value)
    summary = next(line for line in msg.splitlines() if line.startswith("collective "))
    assert "'unshard for rollout" in summary and "of pool 'train'" in summary
    assert "ranks inside it: 0 (waiting" in summary and "not inside it: rank 1 (in no collective" in summary
    assert f'faults.py", line {_line_of(faults._sleep_forever, "time.sleep")}' in msg  # rank 1's stack
    assert "--- where train[0]" in msg and "--- where train[1]" in msg
    assert exc.value.node == "generate" and progress[-1]["generate"] == "stuck"
    view = LiveView(g, total_steps=1)
    view.progress(0, progress[-1])
    assert view.states["generate"] == "stuck"


def batches_of(g):
    from tests.test_distributed_runtime import first_batch

    return [first_batch(g)]


def test_the_collective_summary_names_the_ranks_that_did_not_arrive_and_those_that_did_not_answer():
    from flowrl.runtime.hangs import collective_line, collective_summary, unanswered

    inside = collective_line(0, (7, "actor update", 4.25), (6, "token count"))
    behind = collective_line(1, (6, "token count", 9.0), (5, "rendezvous"))
    never = collective_line(2, None, None)
    stopped = unanswered("train[3] (pid 42)", None, 5)
    text = collective_summary("train", {0: inside + "Thread ...", 1: behind, 2: never, 3: stopped})
    assert text.startswith("collective 'actor update' #7 of pool 'train': ranks inside it: 0 (waiting 4.2s)")
    assert "rank 1 (inside an earlier one, 'token count' #6)" in text
    assert "rank 2 (in no collective)" in text
    assert "rank 3 (no answer: train[3] (pid 42) did not answer for its stacks within 5s" in text
    assert collective_summary("train", {0: never, 1: stopped}) == ""  # nobody waits in a collective


def test_a_task_far_past_its_measured_time_is_reported_stuck_with_its_stack_long_before_the_timeout(tmp_path):
    """Issue 36 item 7: with the defaults a hang was reported only after schedule.timeout_s (an hour). Once the
    run has measured steps, a task stuck_factor times past its predicted seconds (and stuck_min_s) is reported
    with its stacks; the hard timeout still fails it."""
    from flowrl.graph import load_graph
    from flowrl.run.trainer import Trainer

    said: list[str] = []
    g = load_graph("grpo", overrides={"data.batch_size": 4, "nodes.generate.n": 2, "nodes.generate.max_new_tokens": 4,
                                      "trainer.fault": "node=reward,step=4,kind=hang", "trainer.stuck_min_s": 0.5,
                                      "schedule.timeout_s": 30})
    trainer = Trainer(g, backend="local", steps=4, out=tmp_path / "run", say=said.append)
    with pytest.raises(NodeTimeoutError) as exc:
        trainer.run()
    assert "past its timeout_s=30" in str(exc.value)  # the hard timeout stays
    [report] = [m for m in said if "it looks stuck" in m]
    assert report.startswith("node 'reward' (step 4) has run ") and "its predicted" in report
    assert "trainer.stuck_factor=10, trainer.stuck_min_s=0.5" in report and "schedule.timeout_s=30 fails it" in report
    assert f'faults.py", line {_line_of(faults._sleep_forever, "time.sleep")}' in report  # the stack it hangs in


def test_the_stuck_report_needs_a_prediction_and_can_be_turned_off():
    from flowrl.graph import load_graph
    from flowrl.recovery.watchdog import StuckReport

    g = load_graph("grpo")
    assert g.config.trainer.stuck_factor == 10 and g.config.trainer.stuck_min_s == 60  # the declared defaults
    key = ("reward", None)
    said: list[str] = []
    report = StuckReport(said.append, lambda: None)
    assert report.past(g, 0, key, 10_000.0) is None  # nothing measured yet, no cost file: no prediction
    report = StuckReport(said.append, lambda: {key: 2.0})
    assert report.past(g, 0, key, 59.0) is None  # 10x is 20 s, but stuck_min_s is 60
    assert report.past(g, 0, key, 61.0) == 2.0 and report.past(g, 0, key, 99.0) is None  # once per task
    off = load_graph("grpo", overrides={"trainer.stuck_factor": None})
    assert StuckReport(said.append, lambda: {key: 2.0}).past(off, 0, key, 10_000.0) is None
