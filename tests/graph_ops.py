"""Test operators: a PPO-shaped set with small real tensor math, a data source and
role kinds, all under ``test.``/``test_`` names so they never collide with the
real ``operators`` package. Importing this module registers them.

The role objects are plain classes with a tensor of weights; ``update`` ops
change it, so the runtime's state edges are observable.
"""

from __future__ import annotations

import time

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from flowrl.graph import Params, Role, StateSpec, operator, role_kind, source


# ---------------------------------------------------------------- data source
class SourceCfg(BaseModel):
    model_config = ConfigDict(extra="forbid")
    source: str
    batch_size: int = 4
    prompt_len: int = 3


def _source_fields(cfg: SourceCfg) -> dict[str, str]:
    return {"prompts": "int64[B, P]", "uid": "object[B]", "ground_truth": "object[B]"}


@source("testdata", config=SourceCfg, fields=_source_fields)
class TestData:
    """Deterministic prompts: row i of step s is [s, i, i+1, ...]."""

    def __init__(self, cfg: SourceCfg, seed: int = 0) -> None:
        self.cfg, self.step = cfg, 0

    def next_batch(self) -> dict:
        b, p, s = self.cfg.batch_size, self.cfg.prompt_len, self.step
        self.step += 1
        prompts = torch.arange(p).repeat(b, 1) + torch.arange(b)[:, None] + 100 * s
        uid = np.array([f"s{s}-{i}" for i in range(b)], dtype=object)
        return {"prompts": prompts, "uid": uid, "ground_truth": np.array([str(i) for i in range(b)], dtype=object)}


# ---------------------------------------------------------------- roles
class PolicyCfg(BaseModel):
    model_config = ConfigDict(extra="forbid")
    width: int = 4
    lr: float = 0.1


@role_kind("test_actor", config=PolicyCfg)
class TestPolicy(Role):
    """A 'model': one weight vector; its version is the worker's count of updates."""

    def __init__(self, cfg: PolicyCfg, ctx=None) -> None:
        self.w = torch.ones(cfg.width)
        self.lr = cfg.lr

    def get_weights(self) -> torch.Tensor:
        return self.w.clone()

    def set_weights(self, w: torch.Tensor) -> None:
        self.w = w.clone()


@role_kind("test_critic", config=PolicyCfg)
class TestCritic(TestPolicy):
    """The same as the policy, as another kind."""


# ---------------------------------------------------------------- operators
class GenParams(Params):
    n: int = Field(1, ge=1, description="samples per prompt")
    max_new_tokens: int = Field(4, ge=1, description="response length")
    sleep_s: float = 0.0


@operator(
    "test.generate", role="actor", role_kinds=("test_actor",), scope="row",
    inputs={"prompts": "int64[B, P]", "uid": "object[B]"},
    outputs={"responses": "int64[B, R]", "response_mask": "int64[B, R]", "policy_version": "int64[B]"},
    params=GenParams, cost=3.0, node_name="generate", expands="n", token_mask="response_mask",
)
def generate(actor, batch, p: GenParams):
    time.sleep(p.sleep_s)
    last = batch["prompts"][:, -1:].repeat_interleave(p.n, dim=0)  # n samples per prompt
    resp = last.repeat(1, p.max_new_tokens) + int(actor.w.sum())
    mask = torch.ones_like(resp)
    version = torch.full((resp.shape[0],), actor.version, dtype=torch.int64)
    return {"responses": resp, "response_mask": mask, "policy_version": version}


@operator(
    "test.reward", scope="row",
    inputs={"responses": "int64[B, R]", "response_mask": "int64[B, R]"},
    outputs={"token_level_scores": "float32[B, R]"}, node_name="reward", score="token_level_scores",
    token_mask="response_mask",
)
def reward(batch, p):
    scores = (batch["responses"] % 2).float() * batch["response_mask"]
    return {"token_level_scores": scores}


class Sleep(Params):
    sleep_s: float = Field(0.0, ge=0, description="seconds of simulated work per call")


@operator(
    "test.old_logprob", role="actor", role_kinds=("test_actor",), scope="row",
    inputs={"responses": "int64[B, R]"}, outputs={"old_log_probs": "float32[B, R]"},
    node_name="old_logprob", cost=2.0, params=Sleep,
)
def old_logprob(actor, batch, p: Sleep):
    time.sleep(p.sleep_s)
    return {"old_log_probs": -batch["responses"].float() / (1.0 + actor.w.sum())}


@operator(
    "test.ref_logprob", role="ref", role_kinds=("test_actor",), scope="row",
    inputs={"responses": "int64[B, R]"}, outputs={"ref_log_prob": "float32[B, R]"},
    node_name="ref_logprob", cost=2.0, params=Sleep,
)
def ref_logprob(ref, batch, p: Sleep):
    time.sleep(p.sleep_s)
    return {"ref_log_prob": -batch["responses"].float() / (1.0 + ref.w.sum())}


@operator(
    "test.values", role="critic", role_kinds=("test_critic",), scope="row",
    inputs={"responses": "int64[B, R]"}, outputs={"values": "float32[B, R]"}, node_name="values", cost=2.0,
    params=Sleep,
)
def values(critic, batch, p: Sleep):
    time.sleep(p.sleep_s)
    return {"values": batch["responses"].float() * critic.w.mean()}


class GAEParams(Params):
    gamma: float = Field(1.0, ge=0, le=1, description="discount")
    lam: float = Field(0.95, ge=0, le=1, description="GAE lambda")


@operator(
    "test.gae", scope="batch",
    inputs={"token_level_rewards": "float32[B, R]", "values": "float32[B, R]", "response_mask": "int64[B, R]"},
    outputs={"advantages": "float32[B, R]", "returns": "float32[B, R]"},
    params=GAEParams, node_name="advantage", token_mask="response_mask",
)
def gae(batch, p: GAEParams):
    adv = (batch["token_level_rewards"] - batch["values"]) * p.lam
    return {"advantages": adv, "returns": adv + batch["values"]}


@operator(
    "test.kl_reward", scope="row",
    inputs={"token_level_scores": "float32[B, R]", "old_log_probs": "float32[B, R]",
            "ref_log_prob": "float32[B, R]"},
    outputs={"token_level_rewards": "float32[B, R]"}, node_name="kl_reward",
)
def kl_reward(batch, p):
    kl = batch["old_log_probs"] - batch["ref_log_prob"]
    return {"token_level_rewards": batch["token_level_scores"] - 0.1 * kl}


class UpdateParams(Params):
    clip_ratio: float = Field(0.2, gt=0, description="PPO clip epsilon")
    sleep_s: float = Field(0.0, ge=0)


@operator(
    "test.update_actor", role="actor", role_kinds=("test_actor",), scope="batch", dispatch="all",
    inputs={"advantages": "float32[B, R]", "old_log_probs": "float32[B, R]"}, outputs={},
    params=UpdateParams, updates_role=True, node_name="update_actor", cost=4.0,
)
def update_actor(actor, batch, p: UpdateParams):
    time.sleep(p.sleep_s)
    step = float(batch["advantages"].mean())
    actor.w = actor.w + actor.lr * step
    return {}, {"actor/step": step, "actor/version": actor.version}  # the version it trained from


@operator(
    "test.update_critic", role="critic", role_kinds=("test_critic",), scope="batch", dispatch="all",
    inputs={"returns": "float32[B, R]", "values": "float32[B, R]"}, outputs={},
    updates_role=True, node_name="update_critic", cost=4.0,
)
def update_critic(critic, batch, p):
    err = float((batch["returns"] - batch["values"]).pow(2).mean())
    critic.w = critic.w - critic.lr * 0.01
    return {}, {"critic/vf_loss": err}


# ---------------------------------------------------------------- failure ops
class Fault(Params):
    mode: str = Field("raise", description="raise | hang | die")


@operator(
    "test.fault", role="critic", role_kinds=("test_critic",), scope="row",
    inputs={"responses": "int64[B, R]"}, outputs={"fault_out": "float32[B]"}, params=Fault, node_name="fault",
)
def fault(critic, batch, p: Fault):
    if p.mode == "raise":
        raise ValueError("the reward server returned garbage")
    if p.mode == "hang":
        time.sleep(3600)
    if p.mode == "die":
        import os

        os._exit(3)
    return {"fault_out": torch.zeros(len(batch))}


def _first_beta(p: Params) -> dict[str, float]:
    return {"beta": 1.0}


@operator(
    "test.stateful_kl", role="actor", role_kinds=("test_actor",), scope="batch",
    inputs={"token_level_scores": "float32[B, R]", "old_log_probs": "float32[B, R]",
            "ref_log_prob": "float32[B, R]"},
    outputs={"token_level_rewards": "float32[B, R]"}, node_name="kl_reward", state=StateSpec(_first_beta),
)
def stateful_kl(actor, batch, p):
    """Split across the actor's ranks; each rank would move β by its own rows' KL."""
    state = batch.meta_info["operator_state"]
    beta = state["beta"]
    kl = batch["old_log_probs"] - batch["ref_log_prob"]
    state["beta"] = beta + 1.0 + float(kl.abs().sum())
    return {"token_level_rewards": batch["token_level_scores"] - beta * kl}, {"beta": beta}
