"""The start-up timeline (issue 26): which process did what, when, in the trace and in ``flowrl run -v``."""

from __future__ import annotations

import json
import os
import time

import pytest

from flowrl.graph import load_graph
from flowrl.runtime import ray_start, timeline
from flowrl.store.rundir import RunDirectoryError
from flowrl.runtime.timeline import Span, describe, process_start
from flowrl.run.trainer import Trainer

TINY = {"data.batch_size": 4, "nodes.generate.n": 2, "nodes.generate.max_new_tokens": 4}


def test_a_process_started_before_it_imported_anything():
    assert process_start() <= timeline.IMPORTED_AT <= time.time()
    assert process_start(os.getppid()) <= process_start()  # the parent was there first


def test_the_timeline_reads_in_order_of_start():
    spans = [Span("train[0]", "role actor built (actor)", 12.0, 14.5), Span("driver", "ray.init", 10.5, 11.0)]
    lines = describe(spans, t0=10.0)
    assert lines[1].split() == ["0.50", "→", "1.00", "(", "0.50", "s)", "driver", "ray.init"]
    built = ["2.00", "→", "4.50", "(", "2.50", "s)", "train[0]", "role", "actor", "built", "(actor)"]
    assert lines[2].split() == built
    assert describe([]) == []


def test_ray_start_joins_a_running_ray_without_owning_it(ray_session):
    boot = ray_start.begin(None)
    assert ray_start.take(None) is boot  # the backend takes the start `flowrl run` began
    assert boot.ready() is ray_session and not boot.started_ray  # not ours to shut down
    assert boot.span is not None and boot.span.start <= boot.span.end


def test_a_ray_run_records_each_process_start_in_the_trace_and_prints_it(ray_session, tmp_path):
    said: list[str] = []
    trace = tmp_path / "trace.json"
    trainer = Trainer(load_graph("grpo", overrides=TINY), backend="ray", steps=1, out=tmp_path / "run",
                      trace=trace, say=said.append, show_startup=True)
    trainer.run()
    spans = trainer.runtime.backend.startup_spans()
    by = {(s.who, s.what): s for s in spans}
    worker = [by[("train[0]", w)] for w in ("interpreter and Ray started", "flowrl runtime imported",
                                              "imported its roles' modules", "role actor built (actor)")]
    assert all(a.end <= b.start + 1e-6 for a, b in zip(worker, worker[1:]))  # one after another, in order
    placed, started = by[("driver", "placement groups ready")], by[("driver", "workers started, roles built")]
    assert placed.end <= started.start + 1e-6 and worker[-1].end <= started.end  # waited for, then built
    # the Trainer asked for the worker process when it made the plan, before its run began
    asked = by[("driver", "worker processes asked for")]
    assert asked.end <= by[("driver", "waited for the workers asked for early")].end <= started.start + 1e-6
    assert len({s.pid for s in spans if s.who == "train[0]"}) == 1 and os.getpid() not in {w.pid for w in worker}

    # flowrl run -v: the timeline after the first step, each worker's first task last
    first = said.index("start-up timeline (seconds since the command started):")
    timeline = said[first + 1:first + 1 + len(spans) + 1]
    assert "train[0]" in timeline[-1] and timeline[-1].endswith("first task (generate, step 1)")
    assert sum("role actor built (actor)" in line for line in timeline) == 1

    # the trace: a "start-up" process with a thread per process, before the pools' tasks
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e["args"]["name"] for e in events if e["name"] in ("process_name", "thread_name")}
    assert {"start-up", "driver", "train[0]", "pool train"} <= names
    built = next(e for e in events if e["name"] == "role actor built (actor)")
    generate = next(e for e in events if e["name"] == "generate")
    assert built["ts"] + built["dur"] <= generate["ts"]


def test_the_driver_worker_is_asked_for_with_the_pools_before_the_run_begins(ray_session, tmp_path):
    """Its process imports flowrl's runtime beside the pool's worker, not after the run has begun."""
    from flowrl.plan.pools import DRIVER

    trainer = Trainer(load_graph("grpo_async", overrides=TINY), backend="ray", steps=1, out=tmp_path,
                      say=lambda m: None)  # its reward and advantage run on the driver's worker
    backend = trainer.runtime.backend
    deadline = time.monotonic() + 300
    while not any(s.what == "worker processes asked for" for s in backend.startup_spans()):
        assert time.monotonic() < deadline, "the workers were never asked for"
        time.sleep(0.05)
    assert trainer.runtime.plan.driver and set(backend.actors) == {("gen", 0), ("train", 0), (DRIVER, 0)}
    trainer.run()
    built = {(s.who, s.what) for s in backend.startup_spans()}
    assert {("driver[0]", "flowrl runtime imported"), ("train[0]", "role actor built (actor)")} <= built


def test_workers_asked_for_early_end_with_a_run_that_never_starts(ray_session, tmp_path):
    (tmp_path / "metrics.jsonl").write_text("{}\n")  # another run's: this one is refused before its first step
    trainer = Trainer(load_graph("grpo", overrides=TINY), backend="ray", steps=1, out=tmp_path, say=lambda m: None)
    with pytest.raises(RunDirectoryError):
        trainer.run()
    mine = [pg for pg in ray_session.util.placement_group_table().values()
            if pg["name"].startswith(f"flowrl-train-{os.getpid()}-")]
    assert mine and all(pg["state"] == "REMOVED" for pg in mine)  # its workers' resources given back


def test_a_local_ray_that_times_out_is_started_again_with_a_growing_pause(monkeypatch):
    monkeypatch.delenv("FLOWRL_RAY_START_TRIES", raising=False)
    calls, pauses, cleaned = [], [], []

    def init():
        calls.append(1)
        if len(calls) < 3:
            raise Exception("The current node timed out during startup. This could happen because ...")

    ray_start._start_local(init, lambda: cleaned.append(1), sleep=pauses.append)
    assert len(calls) == 3 and len(cleaned) == 2 and pauses == list(ray_start.BACKOFF_S)


def test_a_ray_that_never_starts_is_one_named_error_that_touches_nothing(monkeypatch):
    monkeypatch.setenv("FLOWRL_RAY_START_TRIES", "2")

    def init():
        raise Exception("The current node timed out during startup. This could happen because ...")

    with pytest.raises(ray_start.RayStartError) as err:
        ray_start._start_local(init, lambda: None, sleep=lambda s: None)
    message = str(err.value)
    assert "2 tries" in message and "The current node timed out during startup" in message
    assert "checkpoints are untouched" in message and "--backend local" in message
    assert "unreadable" not in message
