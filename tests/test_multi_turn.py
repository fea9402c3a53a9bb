"""The agent loop (rollout.multi_turn): token in/out, masks, limits, tool errors, concurrency, verl data."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from operators.data.tool_tasks import tool_call_text
from operators.models import load_tokenizer
from operators.rollout.agent_loop import AgentLoop
from operators.rollout.batching import BatchingFront
from operators.rollout.conversation import AgentConfig, Request, rollout_metrics, trajectory_tensors
from operators.rollout.turns import TurnRenderer, first_mismatch
from operators.rollout.base import RolloutEngine, SamplingParams, pad_responses, rollout_output
from operators.rollout.envs import EnvStep, Environment, Interaction
from operators.rollout.tools import AddTool, BaseTool, FunctionTool, ToolResult, build_tools

ROOT = Path(__file__).resolve().parents[1]
TOK = load_tokenizer("builtin:tiny-tools")
EOS = TOK.eos_token_id


def ids(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False)


def prompt_ids(content: str) -> list[int]:
    return ids(TOK.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                       tokenize=False))


class ScriptedEngine(RolloutEngine):
    """A fixed model: the k-th assistant turn of a conversation (k = EOS tokens in it) is ``script(prompt)[k]``.

    Log-probs are ``-(j + 1) / 100`` for the j-th token of a turn, so masks can be checked against them.
    """

    def __init__(self, script):
        self.script = script
        self.stop_token_ids = torch.tensor([EOS])
        self.calls: list[int] = []

    def _turn(self, context: list[int]) -> list[int]:
        prompt_end = context.index(TOK.convert_tokens_to_ids("<|assistant|>")) + 1
        user = TOK.decode(context[:prompt_end]).split("<|user|>")[1].split("<|end|>")[0]
        k = context.count(EOS)
        return ids(self.script(user)[k]) + [EOS]

    def generate(self, input_ids, attention_mask, params=None, **overrides):
        params = self.resolve(params, overrides)
        self.calls.append(len(input_ids))
        turns = [self._turn(row[mask.bool()].tolist()) for row, mask in zip(input_ids, attention_mask)]
        lps = [[-(j + 1) / 100 for j in range(len(t))] for t in turns]
        responses, mask, log_probs = pad_responses(turns, lps, params.max_new_tokens, 0)
        return rollout_output(input_ids, attention_mask, responses, mask, log_probs)

    async def generate_one(self, prompt_ids, params=None, **overrides):
        raise NotImplementedError

    def update_weights(self, state_dict):
        """A scripted engine has no weights to load."""

    def release_memory(self):
        """Nor memory to release or take back."""

    def resume_memory(self):
        """Nor memory to release or take back."""


def run(script, prompts, config=None, tools=None, environment=None, tools_kwargs=None, interaction_kwargs=None):
    engine = ScriptedEngine(script)
    loop = AgentLoop(TOK, config or AgentConfig(max_response_length=80),
                     tools=tools if tools is not None else {"add": AddTool({"reward": 0.1})},
                     environment=environment, stop_token_ids=[EOS])
    front = BatchingFront(engine, SamplingParams(), loop.stop_ids, TOK.pad_token_id)
    requests = [Request(prompt_ids(p), (tools_kwargs or {}).get(p, {}), (interaction_kwargs or {}).get(p, {}))
                for p in prompts]
    return loop.run(front, requests), engine, front


CALL = tool_call_text("add", {"a": 37, "b": 48})


def test_scripted_multi_call_conversation_gives_exact_ids_masks_and_log_probs():
    script = lambda user: [CALL, tool_call_text("add", {"a": 85, "b": 1}), "86"]
    [[traj]], _, _ = run(script, ["37+48="], tools_kwargs={"37+48=": {"add": {"create_kwargs": {"a": 37, "b": 48}}}})
    turn1, turn2, turn3 = ids(CALL) + [EOS], ids(tool_call_text("add", {"a": 85, "b": 1})) + [EOS], ids("86") + [EOS]
    tool1, tool2 = ids("<|tool|>85<|end|><|assistant|>"), ids("<|tool|>86<|end|><|assistant|>")
    expected = turn1 + tool1 + turn2 + tool2 + turn3
    assert traj.response_ids == expected
    assert traj.response_mask == [1] * len(turn1) + [0] * len(tool1) + [1] * len(turn2) + [0] * len(tool2) + [1] * 3
    lp = lambda t: [-(j + 1) / 100 for j in range(len(t))]
    assert traj.log_probs == pytest.approx(lp(turn1) + [0.0] * len(tool1) + lp(turn2) + [0.0] * len(tool2) + lp(turn3))
    assert traj.finish_reason == "stop" and traj.assistant_turns == 3
    assert (traj.tool_calls, traj.tool_successes) == (2, 2)
    assert traj.tool_reward == pytest.approx(0.1)  # the first call used the prompt's numbers
    assert traj.final_answer() == "86"
    assert traj.tokenization_mismatch is None
    assert [m["role"] for m in traj.messages] == ["assistant", "tool", "assistant", "tool", "assistant"]

    out = trajectory_tensors([traj], 80, TOK.pad_token_id)
    n = len(expected)
    assert out["responses"][0, :n].tolist() == expected
    assert out["response_mask"][0].tolist() == traj.response_mask + [0] * (80 - n)
    p = len(traj.prompt_ids)
    assert out["attention_mask"][0].tolist() == [1] * (p + n) + [0] * (80 - n)   # tool tokens are context
    assert bool((out["rollout_log_probs"][0] * (1 - out["response_mask"][0]) == 0).all())


def test_truncation_cuts_ids_masks_and_log_probs_together_and_finishes_with_length():
    script = lambda user: [CALL, "85"]
    cut = len(ids(CALL)) + 1 + 3   # inside the tool turn
    [[traj]], _, _ = run(script, ["37+48="], AgentConfig(max_response_length=cut))
    assert len(traj.response_ids) == len(traj.response_mask) == len(traj.log_probs) == cut
    assert traj.response_mask[-3:] == [0, 0, 0] and traj.finish_reason == "length"


def test_context_length_is_checked_before_every_generation():
    script = lambda user: [CALL, "85"]
    p = len(prompt_ids("37+48="))
    after_tool = len(ids(CALL)) + 1 + len(ids("<|tool|>85<|end|><|assistant|>"))
    [[traj]], _, _ = run(script, ["37+48="], AgentConfig(max_response_length=80, max_model_len=p + after_tool))
    assert traj.finish_reason == "length" and traj.assistant_turns == 1 and len(traj.response_ids) == after_tool


def test_max_assistant_turns_ends_with_max_turns():
    script = lambda user: [CALL] * 5
    [[traj]], _, _ = run(script, ["37+48="], AgentConfig(max_response_length=200, max_assistant_turns=2))
    assert traj.finish_reason == "max_turns" and traj.assistant_turns == 2 and traj.tool_calls == 1
    assert traj.response_mask[-1] == 1   # no tool reply appended after the last allowed turn


def test_concurrency_batches_turns_and_keeps_prompt_order():
    prompts = [f"{a}+{a + 1}=" for a in range(10, 26)]
    # each conversation's answer is its own prompt's sum: a mix-up would show
    script = lambda user: [tool_call_text("add", dict(zip("ab", map(int, user[:-1].split("+"))))),
                           str(sum(map(int, user[:-1].split("+"))))]
    results, engine, front = run(script, prompts)
    assert [r[0].final_answer() for r in results] == [str(2 * a + 1) for a in range(10, 26)]
    assert engine.calls == [16, 16] and front.rounds == 2   # two rounds of turns, each one batched call


class SlowTool(BaseTool):
    async def execute(self, instance_id, parameters, **kw):
        await asyncio.sleep(30)
        return ToolResult("late")


def calc(x: int) -> int:
    """Always fails."""
    raise RuntimeError("kaput")


CATALOGUE = {
    "bad_json": '<tool_call>{"name": "add", "arguments": {"a": 3,, }}</tool_call>',
    "unknown_tool": tool_call_text("mul", {"a": 1, "b": 2}),
    "bad_arguments": '<tool_call>{"name": "add", "arguments": {"a": "x", "b": 2}}</tool_call>',
    "unclosed_tag": '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}',
    "tool_exception": tool_call_text("calc", {"x": 1}),
    "timeout": tool_call_text("tool", {}),
}


@pytest.mark.parametrize("kind", list(CATALOGUE))
def test_each_malformed_call_is_a_tool_error_turn_and_a_metric_and_the_run_goes_on(kind):
    # tool names are words of the tiny vocabulary, so the scripted model can write them
    tools = {"add": AddTool(), "calc": FunctionTool(calc),
             "tool": SlowTool(tool_schema={"type": "function", "function": {"name": "tool", "parameters": {}}})}
    script = lambda user: [CATALOGUE[kind], "3"]
    [[traj]], _, _ = run(script, ["1+2="], AgentConfig(max_response_length=120, tool_timeout_s=0.2), tools=tools)
    assert traj.tool_errors == {kind: 1} and traj.tool_successes == 0
    assert traj.messages[1]["role"] == "tool" and traj.messages[1]["content"].startswith("Error:")
    assert traj.finish_reason == "stop" and traj.final_answer() == "3"   # the model got another turn
    metrics = rollout_metrics([traj])
    assert metrics[f"multi_turn/tool_errors/{kind}"] == 1.0 and metrics["multi_turn/tool_success_rate"] == 0.0


def test_a_sync_tool_that_hangs_is_a_timeout_and_does_not_hold_the_rollout():
    import threading

    release, finished = threading.Event(), threading.Event()

    def sub(a: int, b: int) -> int:
        """Hangs until released."""
        release.wait(30)
        finished.set()
        return a - b

    script = lambda user: [tool_call_text("sub", {"a": 1, "b": 2}), "3"]
    [[traj]], _, _ = run(script, ["1+2="], AgentConfig(max_response_length=120, tool_timeout_s=0.2),
                         tools={"sub": FunctionTool(sub)})
    assert traj.tool_errors == {"timeout": 1} and traj.final_answer() == "3"
    assert not finished.is_set()   # the rollout ended while the tool was still hanging
    release.set()


def test_max_tool_errors_ends_with_tool_error():
    script = lambda user: [CATALOGUE["unknown_tool"], "3"]
    [[traj]], _, _ = run(script, ["1+2="], AgentConfig(max_response_length=120, max_tool_errors=1))
    assert traj.finish_reason == "tool_error" and traj.state.value == "failed"


def test_parallel_calls_beyond_the_limit_are_errors_and_responses_are_truncated():
    two = CALL + tool_call_text("add", {"a": 1, "b": 1})
    script = lambda user: [two, "85"]
    cfg = AgentConfig(max_response_length=200, max_parallel_calls=1, max_tool_response_length=1,
                      tool_response_truncate_side="left")
    [[traj]], _, _ = run(script, ["37+48="], cfg)
    assert traj.tool_errors == {"too_many_calls": 1} and traj.tool_successes == 1
    assert traj.messages[1]["content"] == "...5"


def test_tokenisation_check_catches_a_drifting_template():
    # a model that writes "85" as "8","5" is canonical; one whose turn re-tokenises differently is caught
    renderer = TurnRenderer(TOK)
    messages = [{"role": "assistant", "content": CALL}, {"role": "tool", "content": "85"},
                {"role": "assistant", "content": "85"}]
    incremental = ids(CALL) + [EOS] + renderer.new_turns(messages[1:2]) + ids("85") + [EOS]
    assert first_mismatch(incremental, renderer.response_as_whole(messages, False), "strict") is None
    drifting = TOK.chat_template.replace("<|end|>{% endif %}", " <|end|>{% endif %}")  # a space before <|end|>
    tok2 = load_tokenizer("builtin:tiny-tools")
    tok2.chat_template = drifting
    whole = TurnRenderer(tok2).response_as_whole(messages, False)
    # the whole-conversation rendering has a space the incremental ids lack, right after the tool's "85"
    position = len(ids(CALL)) + 1 + len(ids("<|tool|>85"))
    assert first_mismatch(incremental, whole, "strict") == position
    assert first_mismatch(incremental, whole, "ignore_strippable", TOK) is None   # whitespace only
    assert first_mismatch(incremental, whole, "off") is None
    # a content change is not whitespace: caught in both modes
    other = list(incremental)
    other[position - 2] = ids("9")[0]   # the tool said "95", not "85"
    assert first_mismatch(incremental, other, "ignore_strippable", TOK) == position - 2


def test_tokenisation_check_runs_inside_the_loop():
    # the model samples a non-canonical tokenisation of its call: '"a": ' spelt char by char
    spelt = [t for ch in '"a": ' for t in ids(ch)]
    call_ids = ids('<tool_call>{"name": "add", "arguments": {') + spelt + ids('37, "b": 48}}</tool_call>')

    class Spelling(ScriptedEngine):
        def _turn(self, context):
            return (call_ids if context.count(EOS) == 0 else ids("85")) + [EOS]

    loop = AgentLoop(TOK, AgentConfig(max_response_length=80), tools={"add": AddTool()}, stop_token_ids=[EOS])
    front = BatchingFront(Spelling(None), SamplingParams(), loop.stop_ids, TOK.pad_token_id)
    [[traj]] = loop.run(front, [Request(prompt_ids("37+48="))])
    assert traj.tool_successes == 1                       # the call itself parses
    assert traj.tokenization_mismatch == len(ids('<tool_call>{"name": "add", "arguments": {'))
    assert rollout_metrics([traj])["multi_turn/tokenization_mismatch"] == 1.0


class Teacher(Interaction):
    """A simulated user: 'again' until the answer is right, reward 1 when it is."""

    async def respond(self, messages):
        right = messages[-1]["content"] == str(self.kwargs["answer"])
        return EnvStep("" if right else "again", reward=float(right), done=right)


def test_interaction_plays_the_user_and_its_reward_counts():
    script = lambda user: ["7", "9"]
    [[traj]], _, _ = run(script, ["4+5="], AgentConfig(max_response_length=80, max_user_turns=2), tools={},
                         environment=Teacher, interaction_kwargs={"4+5=": {"answer": 9}})
    assert [m["role"] for m in traj.messages] == ["assistant", "user", "assistant"]
    assert traj.env_reward == 1.0 and traj.user_turns == 1 and traj.finish_reason == "stop"
    assert traj.response_mask == [1, 1] + [0] * len(ids("<|user|>again<|end|><|assistant|>")) + [1, 1]


class Delegator(Environment):
    """Asks for a sub-agent conversation once: two trajectories per rollout."""

    trajectories = 2

    async def step(self, action):
        return EnvStep(done=True, info={"spawn": [[{"role": "user", "content": "1+1="}]]})


def test_an_environment_can_yield_several_trajectories_per_rollout():
    script = lambda user: ["5" if user == "2+3=" else "2"]
    [[main, child]], _, _ = run(script, ["2+3="], tools={}, environment=Delegator)
    assert main.final_answer() == "5" and child.messages[-1]["content"] == "2"
    assert child.prompt_ids == prompt_ids("1+1=") and child.final_answer() == "5"  # scored on the main outcome


def test_function_tools_from_a_yaml_tool_config(tmp_path):
    (tmp_path / "my_tools.py").write_text("def mul(a: int, b: int) -> int:\n    '''Multiply.'''\n    return a * b\n")
    config = tmp_path / "tools.yaml"
    config.write_text(f"tools:\n  - function: {tmp_path / 'my_tools.py'}:mul\n"
                      "  - class_name: operators.rollout.tools.AddTool\n    config: {reward: 0.5}\n")
    tools = build_tools(str(config))
    assert sorted(tools) == ["add", "mul"] and tools["add"].config == {"reward": 0.5}
    assert tools["mul"].tool_schema["function"]["description"] == "Multiply."


def test_verl_multiturn_dataset_runs_with_a_user_written_tool(tmp_path):
    """gsm8k_multiturn_w_tool layout: system + user messages, extra_info.tools_kwargs / interaction_kwargs."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from operators.data import PromptLoader, load_dataset

    (tmp_path / "calc.py").write_text(
        "from operators.rollout.tools import BaseTool, ToolResult\n"
        "class Calc(BaseTool):\n"
        "    async def create(self, instance_id=None, ground_truth=None, **kw):\n"
        "        iid = await super().create(instance_id)\n"
        "        self._instances[iid] = {'truth': ground_truth, 'answer': None}\n"
        "        return iid\n"
        "    async def execute(self, iid, parameters, **kw):\n"
        "        self._instances[iid]['answer'] = str(parameters['answer'])\n"
        "        return ToolResult(str(parameters['answer']), 0.0, {})\n"
        "    async def calc_reward(self, iid, **kw):\n"
        "        state = self._instances[iid]\n"
        "        return 1.0 if state['answer'] == state['truth'] else 0.0\n")
    schema = {"type": "function", "function": {"name": "calc", "description": "check",
              "parameters": {"type": "object", "properties": {"answer": {"type": "string"}},
                             "required": ["answer"]}}}
    (tmp_path / "tools.yaml").write_text(json.dumps({"tools": [
        {"class_name": f"{tmp_path / 'calc.py'}:Calc", "config": {"type": "native"}, "tool_schema": schema}]}))
    rows = [{"data_source": "openai/gsm8k",
             "prompt": [{"role": "system", "content": "call the tool"}, {"role": "user", "content": f"{a}+{a}="}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(2 * a)},
             "extra_info": {"index": a, "split": "train", "need_tools_kwargs": True,
                            "tools_kwargs": {"calc": {"create_kwargs": {"ground_truth": str(2 * a)}}},
                            "interaction_kwargs": {"query": f"{a}+{a}=", "ground_truth": str(2 * a)}}}
            for a in range(10, 14)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    batch = PromptLoader(load_dataset(str(tmp_path / "train.parquet"), TOK), batch_size=4, shuffle=False).next_batch()
    assert batch["tools_kwargs"][0] == {"calc": {"create_kwargs": {"ground_truth": "20"}}}
    assert batch["interaction_kwargs"][0] == {"query": "10+10=", "ground_truth": "20"}

    answer_for = {}
    for i in range(4):
        text = TOK.decode(batch["raw_prompt_ids"][i])
        a = int(text.split("<|user|>")[1].split("+")[0])
        answer_for[i] = str(2 * a) if i % 2 == 0 else "0"   # rows 1 and 3 answer wrong

    class Model(ScriptedEngine):
        def _turn(self, context):
            row = next(i for i in range(4) if context[:len(batch["raw_prompt_ids"][i])] == batch["raw_prompt_ids"][i])
            k = context.count(EOS)
            text = '<tool_call>{"name": "calc", "arguments": {"answer": "' + answer_for[row] + '"}}</tool_call>'
            return ids([text, answer_for[row]][k]) + [EOS]

    tools = build_tools(str(tmp_path / "tools.yaml"))
    loop = AgentLoop(TOK, AgentConfig(max_response_length=80), tools=tools, stop_token_ids=[EOS])
    front = BatchingFront(Model(None), SamplingParams(), loop.stop_ids, TOK.pad_token_id)
    requests = [Request(list(batch["raw_prompt_ids"][i]), batch["tools_kwargs"][i], batch["interaction_kwargs"][i])
                for i in range(4)]
    results = loop.run(front, requests)
    assert [r[0].tool_reward for r in results] == [1.0, 0.0, 1.0, 0.0]
    assert all(r[0].tool_successes == 1 for r in results)


def test_yaml_and_python_twin_of_grpo_tools_are_the_same_graph():
    from flowrl.graph import load_graph

    a = load_graph(ROOT / "graphs" / "grpo_tools.yaml")
    b = load_graph(str(ROOT / "graphs" / "grpo_tools.py"))
    assert a.check().ok, [str(p) for p in a.check().errors]
    assert a.to_dict() == b.to_dict()


def test_grpo_tools_runs_through_the_trainer(tmp_path, monkeypatch):
    """Two steps of the tool graph: the multi-turn metrics and an interior-zero mask reach the trainer."""
    import operators.models.tiny_tools as tiny_tools
    from flowrl.graph import load_graph
    from flowrl.run.trainer import Trainer

    monkeypatch.setattr(tiny_tools, "WARMUP_STEPS", 2)   # the format warm-up's length does not matter here
    monkeypatch.setenv("FLOWRL_CACHE_DIR", str(tmp_path / "cache"))
    tiny_tools._warmed_up_state.cache_clear()
    overrides = {"data.batch_size": 2, "nodes.generate.n": 2, "trainer.val_every": 0}
    history = Trainer(load_graph(ROOT / "graphs" / "grpo_tools.yaml", overrides=overrides), backend="local",
                      steps=2, out=tmp_path / "run").run()
    tiny_tools._warmed_up_state.cache_clear()
    last = history[-1]
    assert sum(last[f"multi_turn/finish/{r}"] for r in ("stop", "length", "max_turns", "tool_error")) == 4
    assert 0.0 <= last["multi_turn/tool_success_rate"] <= 1.0 and last["multi_turn/assistant_turns"] >= 1
    assert 0.0 <= last["reward/mean"] <= 1.2


def test_scores_land_on_the_last_sampled_token_of_an_interior_zero_mask():
    from operators.rewards import place_at_last_token

    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0, 0], [1, 0, 0, 0, 0, 0, 0, 0]])
    placed = place_at_last_token(torch.tensor([2.0, 3.0]), mask)
    assert placed[0].tolist() == [0, 0, 0, 0, 0, 2.0, 0, 0] and placed[1].tolist() == [3.0] + [0] * 7


def test_agent_reward_adds_the_outcome_and_the_tool_rewards():
    import numpy as np

    from flowrl.data import DataProto
    from operators.rollout.agent_ops import AgentReward, agent_reward

    obj = lambda *v: np.array(list(v), dtype=object)
    batch = DataProto.from_dict(
        tensors={"response_mask": torch.tensor([[1, 0, 1], [1, 1, 0]]), "tool_reward": torch.tensor([0.2, 0.1])},
        non_tensors={"answer": obj("85", "84"), "data_source": obj("builtin:tool_add", "builtin:tool_add"),
                     "ground_truth": obj("85", "85"), "extra_info": obj({}, {})})
    out, metrics = agent_reward.run(None, batch, AgentReward())
    assert torch.allclose(out.batch["token_level_scores"], torch.tensor([[0, 0, 1.2], [0, 0.1, 0]]))
    assert metrics["reward/outcome"] == pytest.approx(0.5)


def test_actor_log_probs_of_the_assembled_batch_match_the_turn_by_turn_log_probs():
    """The rows built from a conversation (left-padded prompt, tool turns attended but masked) give the
    actor the same log-probs the sampler had turn by turn: the PPO ratio starts at exactly 1."""
    from transformers import LlamaForCausalLM

    from operators.models import response_log_probs
    from operators.models.tiny_tools import tiny_tools_config

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_tools_config()).eval()

    class Forced(ScriptedEngine):
        """Writes the script's tokens, reporting the model's own log-prob of each (teacher forcing)."""

        def generate(self, input_ids, attention_mask, params=None, **overrides):
            params = self.resolve(params, overrides)
            turns, lps = [], []
            for row, mask in zip(input_ids, attention_mask):
                context = row[mask.bool()].tolist()
                turn = self._turn(context)
                full = torch.tensor([context + turn])
                with torch.no_grad():
                    logits = model(input_ids=full).logits[0, len(context) - 1:-1].log_softmax(-1)
                turns.append(turn)
                lps.append(logits.gather(-1, torch.tensor(turn)[:, None])[:, 0].tolist())
            responses, mask, log_probs = pad_responses(turns, lps, params.max_new_tokens, 0)
            return rollout_output(input_ids, attention_mask, responses, mask, log_probs)

    def script(user):
        a, b = map(int, user[:-1].split("+"))
        return [tool_call_text("add", {"a": a, "b": b}), str(a + b)]

    loop = AgentLoop(TOK, AgentConfig(max_response_length=40), tools={"add": AddTool()}, stop_token_ids=[EOS])
    front = BatchingFront(Forced(script), SamplingParams(), loop.stop_ids, TOK.pad_token_id)
    prompts = ["3+4=", "12+345=", "98+7="]   # different prompt and tool-reply lengths: padding on both sides
    trajectories = [r[0] for r in loop.run(front, [Request(prompt_ids(p)) for p in prompts])]
    out = trajectory_tensors(trajectories, 40, TOK.pad_token_id)
    with torch.no_grad():
        actor, _ = response_log_probs(model, out["input_ids"], out["attention_mask"], out["position_ids"], 40)
    mask = out["response_mask"].bool()
    assert mask.sum() > 0 and (~mask[:, :20]).any()   # interior zeros are there
    assert torch.allclose(actor[mask], out["rollout_log_probs"][mask], atol=1e-5)


def test_a_tool_that_cannot_be_imported_is_a_graph_check_error_naming_the_node():
    from flowrl.graph import load_graph

    g = load_graph(ROOT / "graphs" / "grpo_tools.yaml",
                   overrides={"nodes.generate.tools": [{"class_name": "nosuch.module:Tool"}]})
    errors = [str(p) for p in g.check().errors]
    assert any("generate" in e and "tools[0]" in e and "nosuch" in e for e in errors), errors


def test_a_verl_multiturn_parquet_trains_through_the_graph_with_a_user_tool(tmp_path, monkeypatch):
    """gsm8k_multiturn_w_tool-layout parquet → data source → rollout.multi_turn with a user tool → GRPO."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    import operators.models.tiny_tools as tiny_tools
    from flowrl.graph import load_graph
    from flowrl.run.trainer import Trainer

    monkeypatch.setattr(tiny_tools, "WARMUP_STEPS", 2)
    monkeypatch.setenv("FLOWRL_CACHE_DIR", str(tmp_path / "cache"))
    tiny_tools._warmed_up_state.cache_clear()
    (tmp_path / "mytools.py").write_text("def calc(x: int) -> int:\n    '''Echo.'''\n    return x\n")
    rows = [{"data_source": "openai/gsm8k",
             "prompt": [{"role": "system", "content": "call the tool"}, {"role": "user", "content": f"{a}+1="}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(a + 1)},
             "extra_info": {"index": a, "split": "train", "tools_kwargs": {"calc": {"create_kwargs": {"x": a}}},
                            "interaction_kwargs": {"query": f"{a}+1="}}} for a in range(8)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    overrides = {"data.source": str(tmp_path / "train.parquet"), "data.batch_size": 2, "nodes.generate.n": 2,
                 "nodes.generate.tools": [], "nodes.generate.tool_functions": [f"{tmp_path / 'mytools.py'}:calc"],
                 "nodes.reward.fn": "exact", "trainer.val_every": 0}
    g = load_graph(ROOT / "graphs" / "grpo_tools.yaml", overrides=overrides)
    assert g.check().ok, [str(p) for p in g.check().errors]
    history = Trainer(g, backend="local", steps=2, out=tmp_path / "run").run()
    tiny_tools._warmed_up_state.cache_clear()
    assert [row["step"] for row in history] == [1, 2]
    assert sum(history[-1][f"multi_turn/finish/{r}"] for r in ("stop", "length", "max_turns", "tool_error")) == 4


def test_a_seeded_conversation_samples_the_same_turns_whatever_shares_its_rounds():
    """Requests with seeds (as rollout.multi_turn gives them, from the prompts' uids) sample the same
    tokens alone or batched with others: a pool's ranks split conversations without changing them."""
    from transformers import LlamaForCausalLM

    from operators.models.tiny_tools import tiny_tools_config
    from operators.rollout import HFRolloutEngine

    torch.manual_seed(0)
    engine = HFRolloutEngine(LlamaForCausalLM(tiny_tools_config()).eval(), TOK, stop_token_ids=[EOS], seed=0)
    loop = AgentLoop(TOK, AgentConfig(max_response_length=12, max_tokens_per_turn=6), tools={"add": AddTool()},
                     stop_token_ids=[EOS])

    def sample(requests):
        front = BatchingFront(engine, SamplingParams(temperature=1.0), loop.stop_ids, TOK.pad_token_id)
        return [r[0].response_ids for r in loop.run(front, requests)]

    prompts = [prompt_ids(p) for p in ("3+4=", "12+345=", "98+7=")]
    together = sample([Request(p, seed=100 + i) for i, p in enumerate(prompts)])
    apart = sample([Request(prompts[2], seed=102), Request(prompts[0], seed=100)])
    assert apart == [together[2], together[0]]
    assert sample([Request(prompts[0], seed=101)]) != [together[0]]   # another seed, other tokens
