"""The agent loop as states: a loop of one's own overrides one handler, registered by name, chosen per row."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flowrl.data import DataProto
from flowrl.runtime.worker import RoleContext
from operators.roles import Actor, ActorConfig
from operators.rollout.agent_loop import AGENT_LOOPS, AgentLoop, get_agent_loop, register_agent_loop, run_rollouts
from operators.rollout.agent_ops import MultiTurn, multi_turn
from operators.rollout.batching import BatchingFront
from operators.rollout.conversation import AgentConfig, AgentLoopError, Request
from operators.rollout.base import SamplingParams
from operators.rollout.tools import AddTool
from tests.test_multi_turn import CALL, EOS, TOK, ScriptedEngine, ids, prompt_ids
from tests.userpkg.agent_loops import Hinted, ToolIsFinal


def test_a_loop_that_overrides_one_state_changes_only_that_state():
    script = lambda user: [CALL, "85"]
    tools = {"add": AddTool()}
    default = AgentLoop(TOK, AgentConfig(max_response_length=80), tools=tools, stop_token_ids=[EOS])
    final = get_agent_loop("tool_is_final")(TOK, AgentConfig(max_response_length=80), tools=tools,
                                            stop_token_ids=[EOS])
    engine = ScriptedEngine(script)
    front = BatchingFront(engine, SamplingParams(), {EOS}, TOK.pad_token_id)
    request = Request(prompt_ids("37+48="))
    [[a], [b]] = run_rollouts(front, [(default, request), (final, request)])
    first_turn = ids(CALL) + [EOS] + ids("<|tool|>85<|end|><|assistant|>")
    assert a.response_ids == first_turn + ids("85") + [EOS] and a.assistant_turns == 2
    assert b.response_ids == first_turn and b.assistant_turns == 1   # ended on the tool's answer
    assert b.response_mask == a.response_mask[:len(first_turn)] and b.log_probs == a.log_probs[:len(first_turn)]
    assert (a.finish_reason, b.finish_reason) == ("stop", "stop") and b.tool_successes == 1
    assert engine.calls == [2, 1]   # both loops shared the first round of turns


def test_loops_are_registered_by_name_or_found_by_import_path():
    assert AGENT_LOOPS["tool_agent"] is AgentLoop and AGENT_LOOPS["tool_is_final"] is ToolIsFinal
    assert get_agent_loop("tests.userpkg.agent_loops:Hinted") is Hinted
    with pytest.raises(AgentLoopError, match="unknown agent loop 'nope'.*tool_agent"):
        get_agent_loop("nope")
    with pytest.raises(AgentLoopError, match="not an AgentLoop subclass"):
        get_agent_loop("operators.rollout.tools:AddTool")
    with pytest.raises(ValueError, match="registered twice"):
        register_agent_loop("hinted")(ToolIsFinal)
    with pytest.raises(ValueError, match="unknown agent loop 'nope'"):
        MultiTurn(agent_loop="nope")


def _batch(names):
    prompts = [prompt_ids(p) for p in ("3+4=", "12+34=", "5+6=")]
    width = max(map(len, prompts))
    tensors = {"prompts": torch.tensor([[TOK.pad_token_id] * (width - len(p)) + p for p in prompts]),
               "prompt_mask": torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])}
    obj = lambda values: np.array(values, dtype=object)
    non_tensors = {"extra_info": obj([{}, {}, {}]), "uid": obj(["0-0", "0-1", "0-2"])}
    if names is not None:
        non_tensors["agent_name"] = obj(names)
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors)


def test_each_row_runs_the_loop_its_agent_name_column_names():
    actor = Actor(ActorConfig(model="builtin:tiny-tools"), RoleContext("actor", 0, 1, 0))
    params = MultiTurn(n=2, max_response_length=24, max_tokens_per_turn=8, max_assistant_turns=2,
                       tools=({"class_name": "operators.rollout.tools.AddTool"},))
    plain, _ = multi_turn.run(actor, _batch(None), params)
    mixed, _ = multi_turn.run(actor, _batch([None, "hinted", "tests.userpkg.agent_loops:Hinted"]), params)
    first_roles = [m[0]["role"] for m in mixed.non_tensor_batch["messages"]]
    assert first_roles == ["assistant"] * 2 + ["user"] * 4   # n=2 rows per prompt
    assert all(m[0]["content"] == "add" for m in mixed.non_tensor_batch["messages"][2:])
    hint = len(ids("<|user|>add<|end|><|assistant|>"))
    assert (mixed.batch["response_mask"][2:, :hint] == 0).all()
    # the default rows are what they are without the column: keyed seeds, whatever loop the others run
    assert torch.equal(mixed.batch["responses"][:2], plain.batch["responses"][:2])
    # (log-probs to rounding: the rows share their batched forward passes with other rows)
    assert torch.allclose(mixed.batch["rollout_log_probs"][:2], plain.batch["rollout_log_probs"][:2], atol=1e-5)
