"""Tools, environments and model output that misbehave: an error turn the model reads, a counted kind, never
a failed batch; retries for transient failures; verl's BaseTool contract unchanged."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
import threading
import tracemalloc
from pathlib import Path

import pytest

from flowrl.data.metrics import measured
from operators.data.tool_tasks import tool_call_text
from operators.rollout.conversation import AgentConfig, rollout_metrics
from operators.rollout.envs import EnvStep, Environment
from operators.rollout.tool_parsers import HermesToolParser, ToolParser, parse_safely
from operators.rollout.tools import AddTool, BaseTool, FunctionTool, ToolResult, add, build_tools
from tests.test_multi_turn import ROOT, run
from tests.verl_reference import TARGET, add_verl_to_path

SCHEMA = lambda name: {"type": "function", "function": {"name": name, "parameters": {}}}


class Flaky(BaseTool):
    """Raises on its first ``fails`` calls, then answers."""

    def __init__(self, fails: int):
        super().__init__(tool_schema=SCHEMA("tool"))
        self.fails, self.calls = fails, 0

    async def execute(self, instance_id, parameters, **kw):
        self.calls += 1
        if self.calls <= self.fails:
            raise ConnectionError("sandbox busy")
        return ToolResult("ok")


@pytest.mark.parametrize("retries, fails, errors, successes", [(1, 1, {}, 1), (1, 2, {"tool_exception": 1}, 0),
                                                               (0, 1, {"tool_exception": 1}, 0)])
def test_tool_retries_try_a_failing_call_again(retries, fails, errors, successes):
    tool = Flaky(fails)
    script = lambda user: [tool_call_text("tool", {}), "3"]
    [[traj]], _, _ = run(script, ["1+2="], AgentConfig(max_response_length=120, tool_retries=retries),
                         tools={"tool": tool})
    assert tool.calls == min(fails, retries) + 1
    assert traj.tool_errors == errors and traj.tool_successes == successes
    assert traj.tool_retries == min(fails, retries) and traj.final_answer() == "3"
    assert rollout_metrics([traj]).get("multi_turn/tool_retries", 0.0) == float(traj.tool_retries)
    assert traj.messages[1]["content"] == ("ok" if successes else "Error: 'tool' failed: ConnectionError: sandbox busy")


class Wrong(BaseTool):
    def __init__(self, value):
        super().__init__(tool_schema=SCHEMA("tool"))
        self.value = value

    async def execute(self, instance_id, parameters, **kw):
        return self.value


@pytest.mark.parametrize("value", [None, 42, ("85", "high", {}), ToolResult(85)])
def test_a_tool_that_returns_the_wrong_type_is_a_tool_error_turn(value):
    script = lambda user: [tool_call_text("tool", {}), "3"]
    [[traj]], _, _ = run(script, ["1+2="], AgentConfig(max_response_length=120), tools={"tool": Wrong(value)})
    assert traj.tool_errors == {"bad_tool_output": 1} and traj.final_answer() == "3"
    assert traj.messages[1]["content"].startswith("Error: 'tool' returned")


class Broken(Environment):
    """An environment whose step raises, hangs or answers with something that is not an EnvStep."""

    async def step(self, action):
        how = self.kwargs["how"]
        if how == "raise":
            raise KeyError("no such episode")
        if how == "hang":
            await asyncio.sleep(30)
        return {"observation": "again"} if how == "wrong" else EnvStep(done=True)


@pytest.mark.parametrize("how, kind", [("raise", "env_exception"), ("hang", "env_timeout"),
                                       ("wrong", "bad_env_output")])
def test_an_environment_that_fails_is_an_error_turn_the_model_reads(how, kind):
    script = lambda user: ["7", "9"]
    [[traj]], _, _ = run(script, ["4+5="], AgentConfig(max_response_length=80, max_user_turns=1, tool_timeout_s=0.2),
                         tools={}, environment=Broken, interaction_kwargs={"4+5=": {"how": how}})
    assert traj.tool_errors == {kind: 1}
    assert [m["role"] for m in traj.messages] == ["assistant", "user", "assistant"]
    assert traj.messages[1]["content"].startswith("Error: 'Broken.step'")
    assert traj.finish_reason == "max_turns" and traj.final_answer() == "9"


@pytest.mark.parametrize("text", ["<tool_call>" + "[" * 1200 + "</tool_call>",
                                  '<tool_call>{"name": "add", "arguments": {"a": ' + "1" * 4301 + ', "b": 1}}</tool_call>',
                                  '<tool_call>{"name": "add", "arguments": "' + "[" * 1200 + '"}</tool_call>'],
                         ids=["nested_1200_deep", "int_of_4301_digits", "nested_arguments_string"])
def test_model_output_the_json_reader_chokes_on_is_a_bad_json_turn(text):
    calls, errors = HermesToolParser().parse(text)
    assert calls == [] and [e.kind for e in errors] == ["bad_json"]
    [[traj]], _, _ = run(lambda user: [text, "3"], ["1+2="], AgentConfig(max_response_length=6000))
    assert traj.tool_errors == {"bad_json": 1} and traj.final_answer() == "3"


def _regex_parse(text):
    """The Hermes format as the regex it was parsed with before (quadratic on unclosed tags)."""
    import re

    found = [m.group(1).strip() for m in re.finditer(r"<tool_call>(.*?)</tool_call>", text, re.DOTALL)]
    tail = text[text.rfind("</tool_call>") + len("</tool_call>"):] if found else text
    return found, "<tool_call>" in tail


@pytest.mark.parametrize("seed", range(40))
def test_the_hermes_scan_finds_what_the_regex_found(seed):
    import random

    rng = random.Random(seed)
    pieces = ["<tool_call>", "</tool_call>", '{"name": "add", "arguments": {"a": 1, "b": 2}}', "text ", "{", "\n"]
    text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 30)))
    calls, errors = HermesToolParser().parse(text)
    bodies, unclosed = _regex_parse(text)
    assert len(calls) + len(errors) == len(bodies) + unclosed
    assert [e.kind for e in errors if e.kind == "unclosed_tag"] == (["unclosed_tag"] if unclosed else [])
    assert len(calls) == sum(b == '{"name": "add", "arguments": {"a": 1, "b": 2}}' for b in bodies)


@pytest.mark.timeout(60)  # a hang guard: quadratic scanning took 21.7 s at 8,000 tags, so ~50 min at 100,000
@pytest.mark.parametrize("close", [False, True], ids=["unclosed", "closed_empty"])
def test_a_hundred_thousand_tags_parse_in_one_pass(close):
    import time

    def seconds(n):
        text = ("<tool_call>" + ("</tool_call>" if close else "")) * n
        t0 = time.process_time()
        calls, errors = HermesToolParser().parse(text)
        took = time.process_time() - t0
        assert calls == [] and len(errors) == (n if close else 1)
        return took

    small, large = seconds(10_000), seconds(100_000)
    # ten times the tags: linear is ~10x the CPU time, quadratic ~100x (a ratio, not a wall time)
    assert large < 40 * max(small, 1e-3)


def test_a_parser_that_raises_is_a_parser_error_turn():
    class Fragile(ToolParser):
        def parse(self, text):
            raise IndexError("list index out of range")

    assert [e.kind for e in parse_safely(Fragile(), "<tool_call>")[1]] == ["parser_error"]


def test_a_sync_tool_that_outlives_its_timeout_does_not_wedge_later_calls():
    release = threading.Event()

    def sub(a: int, b: int) -> int:
        """Hangs until released."""
        release.wait(60)
        return a - b

    hanging = "".join(tool_call_text("sub", {"a": 1, "b": i}) for i in range(10))  # more than any thread pool
    script = lambda user: [hanging, tool_call_text("add", {"a": 1, "b": 2}), "3"]
    try:
        [[traj]], _, _ = run(script, ["1+2="], AgentConfig(max_response_length=400, tool_timeout_s=0.3,
                                                           max_parallel_calls=10),
                             tools={"sub": FunctionTool(sub), "add": FunctionTool(add)})
    finally:
        release.set()
    assert traj.tool_errors == {"timeout": 10} and traj.tool_successes == 1
    assert traj.messages[-2] == {"role": "tool", "content": "3"} and traj.final_answer() == "3"


def test_a_process_whose_sync_tool_never_returns_still_exits(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(textwrap.dedent(f"""
        import sys, threading
        sys.path.insert(0, {str(ROOT)!r})
        from operators.rollout.conversation import AgentConfig
        from operators.rollout.tools import FunctionTool
        from operators.data.tool_tasks import tool_call_text
        from tests.test_multi_turn import run

        def sub(a: int, b: int) -> int:
            '''Never returns.'''
            threading.Event().wait()

        [[traj]], _, _ = run(lambda user: [tool_call_text("sub", {{"a": 1, "b": 2}}), "3"], ["1+2="],
                             AgentConfig(max_response_length=120, tool_timeout_s=0.2), tools={{"sub": FunctionTool(sub)}})
        print(dict(traj.tool_errors))
    """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "{'timeout': 1}"


def test_tool_output_is_capped_in_the_call_that_reads_it():
    async def calc(x: int) -> str:
        """4 MB of text."""
        return "x" * 4_000_000

    prompts = [f"{a}+1=" for a in range(10, 42)]   # 32 conversations call it in the same round
    script = lambda user: [tool_call_text("calc", {"x": 1}), "3"]
    tracemalloc.start()
    try:
        results, _, _ = run(script, prompts, AgentConfig(max_response_length=400, max_tool_response_length=8),
                            tools={"calc": FunctionTool(calc)})
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert all(r[0].messages[1]["content"] == "xxxxxxxx..." for r in results)
    assert peak < 10 * 4_000_000   # a few calls' worth at most, not 32


VERL_TOOL = '''
from uuid import uuid4

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse


class CalcTool(BaseTool):
    """Written to verl's contract, as verl's gsm8k tool is."""

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema):
        super().__init__(config, tool_schema)
        self._instance_dict = {}

    async def create(self, instance_id=None, ground_truth=None, **kwargs):
        if instance_id is None:
            instance_id = str(uuid4())
        self._instance_dict[instance_id] = {"response": "", "ground_truth": ground_truth}
        return instance_id, ToolResponse()

    async def execute(self, instance_id, parameters, **kwargs):
        answer = str(parameters.get("answer", ""))
        self._instance_dict[instance_id]["response"] = answer
        right = float(answer == self._instance_dict[instance_id]["ground_truth"])
        return ToolResponse(text=f"checked {answer}"), 0.0, {"right": right}

    async def calc_reward(self, instance_id, **kwargs):
        state = self._instance_dict[instance_id]
        return float(state["response"] == state["ground_truth"]) * self.config.get("reward", 1.0)

    async def release(self, instance_id, **kwargs):
        del self._instance_dict[instance_id]
'''


@pytest.fixture()
def verl_tool(tmp_path, monkeypatch):
    if not (TARGET / "verl" / "tools" / "base_tool.py").is_file():
        pytest.skip(f"verl is not installed in {TARGET}; .ci/run installs it")
    add_verl_to_path()
    (tmp_path / "verl_calc.py").write_text(VERL_TOOL)
    monkeypatch.syspath_prepend(str(tmp_path))
    schema = {"type": "function", "function": {"name": "calc", "description": "check an answer",
              "parameters": {"type": "object", "properties": {"answer": {"type": "string"}},
                             "required": ["answer"]}}}
    config = tmp_path / "tools.yaml"
    config.write_text(json.dumps({"tools": [{"class_name": "verl_calc.CalcTool",   # verl's dotted form
                                             "config": {"type": "native", "reward": 0.5}, "tool_schema": schema}]}))
    return config


def test_a_tool_written_to_verls_base_tool_contract_runs_unchanged(verl_tool):
    tools = build_tools(str(verl_tool))
    assert type(tools["calc"].tool).__mro__[1].__module__ == "verl.tools.base_tool"
    call = lambda answer: '<tool_call>{"name": "calc", "arguments": {"answer": "' + answer + '"}}</tool_call>'
    script = lambda user: [call("9" if user == "4+5=" else "0"), "9"]
    kwargs = {p: {"calc": {"create_kwargs": {"ground_truth": "9"}}} for p in ("4+5=", "5+4=")}
    results, _, _ = run(script, ["4+5=", "5+4="], tools=tools, tools_kwargs=kwargs)
    right, wrong = results[0][0], results[1][0]
    assert right.messages[1]["content"] == "checked 9" and wrong.messages[1]["content"] == "checked 0"
    assert (right.tool_reward, wrong.tool_reward) == (0.5, 0.0)   # calc_reward, with its config
    assert right.tool_metrics == [("calc", {"right": 1.0})] and right.tool_errors == {}
    assert tools["calc"].tool._instance_dict == {}   # released


def test_a_tool_class_without_the_contract_is_refused_naming_the_entry(tmp_path):
    (tmp_path / "bad.py").write_text("class NotATool:\n    def execute(self):\n        return 1\n")
    with pytest.raises(ValueError, match=r"tools\[0\].class_name: .*neither a BaseTool subclass nor"):
        build_tools(entries=[{"class_name": f"{tmp_path / 'bad.py'}:NotATool"}])


def test_a_verl_contract_tool_runs_in_grpo_tools_as_the_native_tool_does(tmp_path, monkeypatch):
    """The add calculator written to verl's contract gives grpo_tools the metrics flowrl's AddTool gives."""
    if not (TARGET / "verl" / "tools" / "base_tool.py").is_file():
        pytest.skip(f"verl is not installed in {TARGET}; .ci/run installs it")
    import operators.models.tiny_tools as tiny_tools
    from flowrl.graph import load_graph
    from flowrl.run.trainer import Trainer

    add_verl_to_path()
    (tmp_path / "verl_add.py").write_text(textwrap.dedent('''
        from uuid import uuid4
        from verl.tools.base_tool import BaseTool
        from verl.tools.schemas import ToolResponse

        class Add(BaseTool):
            async def create(self, instance_id=None, **kwargs):
                return instance_id or str(uuid4()), ToolResponse()

            async def execute(self, instance_id, parameters, **kwargs):
                return ToolResponse(text=str(parameters["a"] + parameters["b"])), 0.0, {}
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(tiny_tools, "WARMUP_STEPS", 40)   # enough format warm-up that the model calls the tool
    monkeypatch.setenv("FLOWRL_CACHE_DIR", str(tmp_path / "cache"))
    schema = AddTool().tool_schema

    def history(tool, out):
        tiny_tools._warmed_up_state.cache_clear()
        overrides = {"data.batch_size": 2, "nodes.generate.n": 2, "trainer.val_every": 0,
                     "nodes.generate.tools": [tool]}
        rows = Trainer(load_graph(ROOT / "graphs" / "grpo_tools.yaml", overrides=overrides), backend="local",
                       steps=2, out=tmp_path / out).run()
        tiny_tools._warmed_up_state.cache_clear()
        # the per-tool metrics are named by the tool's class, which differs by design
        return [{k: v for k, v in row.items() if not measured(k) and not k.startswith("multi_turn/tool/add/")}
                for row in rows]

    native = history({"class_name": "operators.rollout.tools.AddTool", "config": {"reward": 0.0}}, "native")
    verl = history({"class_name": "verl_add.Add", "config": {"type": "native"}, "tool_schema": schema}, "verl")
    assert native == verl
    assert all(row["multi_turn/tool_calls_per_sample"] > 0 and row["multi_turn/tool_success_rate"] > 0
               for row in native)


def test_concurrent_large_tool_outputs_are_bounded_per_worker_and_cut_with_a_marker():
    """Issue 36: memory for large tool outputs grew with concurrent calls × output size. 32 conversations call a
    tool that builds 4 MB and then awaits (its output held, uncut, meanwhile): at most max_concurrent_tool_calls
    of them run at once, and the model reads each cut to max_tool_response_length with the '...' marker."""
    running, most = 0, 0

    async def calc(x: int) -> str:
        """4 MB of text, held across an await."""
        nonlocal running, most
        running += 1
        most = max(most, running)
        text = "y" * 4_000_000
        await asyncio.sleep(0.02)
        running -= 1
        return text

    prompts = [f"{a}+1=" for a in range(10, 42)]
    script = lambda user: [tool_call_text("calc", {"x": 1}), "3"]
    cfg = AgentConfig(max_response_length=400, max_tool_response_length=8, max_concurrent_tool_calls=2)
    tracemalloc.start()
    try:
        results, _, _ = run(script, prompts, cfg, tools={"calc": FunctionTool(calc)})
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert all(r[0].messages[1]["content"] == "yyyyyyyy..." for r in results)
    assert most == 2  # 32 calls, two at a time
    assert peak < 4 * 4_000_000  # two uncut outputs and change, not 32 (128 MB)
    assert AgentConfig().max_concurrent_tool_calls == 16 and AgentConfig().max_tool_response_length == 256
