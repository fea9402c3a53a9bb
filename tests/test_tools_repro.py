"""The tool graph repeats run to run: rounds of turns form by count, whatever the tools' timing.

The batching front used to launch a round 20 ms after its first request, so a
tool that answered late (a busy machine) pushed its conversation into a round of
its own: other padding, other rounding, other metrics. These tests give the
tool a random delay and ask for the same rounds and the same run.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from flowrl.data.metrics import measured
from operators.data.tool_tasks import tool_call_text
from operators.rollout.tools import AddTool, ToolResult

from tests.test_multi_turn import run

ROOT = Path(__file__).resolve().parents[1]


def computed(row: dict) -> dict:
    """What the run computed: the metrics that measure the machine (time, memory) left out."""
    return {k: v for k, v in row.items() if not measured(k)}
#: the delays are not seeded on purpose: they stand for a machine's timing, which no seed fixes
JITTER = random.Random()


class JitteryAddTool(AddTool):
    """The calculator, answering after 0-60 ms, as a tool on a busy machine does."""

    async def execute(self, instance_id, parameters, **kwargs) -> ToolResult:
        await asyncio.sleep(JITTER.uniform(0.0, 0.06))
        return await super().execute(instance_id, parameters, **kwargs)


def test_a_round_waits_for_every_live_conversation_however_late_its_tool_answers():
    prompts = [f"{a}+{a + 1}=" for a in range(10, 18)]
    script = lambda user: [tool_call_text("add", dict(zip("ab", map(int, user[:-1].split("+"))))),
                           str(sum(map(int, user[:-1].split("+"))))]
    for _ in range(3):
        results, engine, front = run(script, prompts, tools={"add": JitteryAddTool({"reward": 0.1})})
        assert [r[0].final_answer() for r in results] == [str(2 * a + 1) for a in range(10, 18)]
        assert engine.calls == [8, 8] and front.rounds == 2


def test_two_runs_of_grpo_tools_with_one_seed_give_identical_metrics(tmp_path, monkeypatch):
    import operators.models.tiny_tools as tiny_tools
    from flowrl.graph import load_graph
    from flowrl.run.trainer import Trainer

    # a short format warm-up (cached under tmp_path) already writes calls the tool answers
    monkeypatch.setattr(tiny_tools, "WARMUP_STEPS", 40)
    monkeypatch.setenv("FLOWRL_CACHE_DIR", str(tmp_path / "cache"))
    tiny_tools._warmed_up_state.cache_clear()
    overrides = {"data.batch_size": 4, "nodes.generate.n": 4, "trainer.val_every": 0,
                 "nodes.generate.tools": [{"class_name": "tests.test_tools_repro.JitteryAddTool",
                                           "config": {"reward": 0.2}}]}
    runs = [Trainer(load_graph(ROOT / "graphs" / "grpo_tools.yaml", overrides=overrides), backend="local",
                    steps=3, out=tmp_path / f"run{i}", say=lambda _: None).run() for i in range(2)]
    tiny_tools._warmed_up_state.cache_clear()
    first, second = ([computed(row) for row in history] for history in runs)
    assert first[-1]["multi_turn/tool_calls_per_sample"] > 0   # the tool was called, so its delays were in play
    assert first == second
