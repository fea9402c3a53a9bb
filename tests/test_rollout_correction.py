"""Rollout correction (mismatch metrics, TIS, MIS), policy-loss choice on actor.update, and the
mini-batch normaliser that makes ragged micro-batches add up to the whole mini-batch."""

from __future__ import annotations

import math

import pytest
import torch

from flowrl.data import DataProto
from flowrl.graph import load_graph
from flowrl.run.trainer import Trainer
from operators.algos import AGG_MODES, POLICY_LOSSES, agg_loss, rollout_correction

T = torch.tensor


def test_tis_and_mis_by_hand():
    train = T([[-1.0, -1.0, -1.0], [-1.0, -1.0, 0.0]])
    rollout = T([[-2.0, -1.0, -1.5], [-1.0, -0.5, 0.0]])      # log ρ = [1, 0, .5], [0, -.5, pad]
    mask = T([[1, 1, 1], [1, 1, 0]])
    token = rollout_correction(train, rollout, mask, is_level="token", is_threshold=2.0)
    torch.testing.assert_close(token.weights, T([[2.0, 1.0, math.exp(0.5)], [1.0, math.exp(-0.5), 0.0]]))
    m = token.metrics
    assert m["rollout_corr/log_prob_abs_diff"] == pytest.approx(2.0 / 5)
    assert m["rollout_corr/kl"] == pytest.approx(-1.0 / 5)                 # mean(log π_rollout - log π_train)
    assert m["rollout_corr/frac_outside_threshold"] == pytest.approx(1 / 5)  # only ρ = e > 2
    assert m["rollout_corr/ratio_max"] == pytest.approx(math.e)
    assert m["rollout_corr/is_weight_max"] == 2.0 and m["rollout_corr/is_raw_weight_max"] == pytest.approx(math.e)

    seq = rollout_correction(train, rollout, mask, is_level="sequence", is_threshold=10.0)
    torch.testing.assert_close(seq.weights, T([[math.exp(1.5)] * 3, [math.exp(-0.5)] * 2 + [0.0]]))

    mis = rollout_correction(train, rollout, mask, rs_level="token", rs_threshold=2.0)
    assert mis.weights is None
    assert mis.response_mask.tolist() == [[0, 1, 1], [1, 1, 0]]               # e is outside [1/2, 2]
    assert mis.metrics["rollout_corr/rs_masked_fraction"] == pytest.approx(1 / 5)
    seq_mis = rollout_correction(train, rollout, mask, rs_level="sequence", rs_threshold=4.0)
    assert seq_mis.response_mask.tolist() == [[0, 0, 0], [1, 1, 0]]           # Πρ = e^1.5 > 4; e^-.5 ≥ 1/4
    seq_mis = rollout_correction(train, rollout, mask, rs_level="sequence", rs_threshold=4.0,
                                 rs_threshold_lower=0.7)
    assert seq_mis.response_mask.tolist() == [[0, 0, 0], [0, 0, 0]]          # e^1.5 > 4; e^-.5 < .7


def test_metrics_ignore_whatever_sits_under_the_mask():
    train, rollout = T([[-1.0, float("nan")]]), T([[-1.0, 5.0]])
    out = rollout_correction(train, rollout, T([[1, 0]]), is_level="token")
    assert all(math.isfinite(v) for v in out.metrics.values())
    assert out.weights.tolist() == [[1.0, 0.0]]


@pytest.mark.parametrize("mode", AGG_MODES)
def test_ragged_micro_batches_with_the_mini_batch_normaliser_add_up_to_the_whole(mode):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 6, generator=gen, requires_grad=True)
    lengths = T([6, 1, 3, 0, 5, 2, 4])                                       # one row without tokens
    mask = (torch.arange(6)[None] < lengths[:, None]).long()
    whole = agg_loss(logits.square(), mask, mode)
    (whole_grad,) = torch.autograd.grad(whole, logits)
    norm = {"norm_tokens": int(mask.sum()), "norm_seqs": int((mask.sum(-1) > 0).sum())}
    parts = [slice(0, 1), slice(1, 4), slice(4, 7)]                           # ragged: 1, 3 and 3 rows
    summed = sum(agg_loss(logits[s].square(), mask[s], mode, **norm) for s in parts)
    (summed_grad,) = torch.autograd.grad(summed, logits)
    torch.testing.assert_close(summed, whole)
    torch.testing.assert_close(summed_grad, whole_grad)


@pytest.fixture(scope="module")
def actor_and_batch():
    from flowrl.runtime.worker import RoleContext
    from operators import logprob, rollout
    from operators.roles import Actor, ActorConfig

    role = Actor(ActorConfig(optim={"lr": 1e-3, "grad_clip": 1.0}), RoleContext("actor", 0, 1, seed=0))
    prompts = torch.tensor([[1, 20, 7, 11, 16], [1, 20, 8, 12, 16]])
    batch = DataProto.from_dict(tensors={"prompts": prompts, "prompt_mask": torch.ones_like(prompts)},
                                non_tensors={"uid": ["a", "b"]})
    batch = rollout.generate(role, batch, n=2, max_new_tokens=3)
    batch = logprob.old(role, batch)
    batch.pop(batch_keys=["rollout_log_probs"])
    # a sampler that disagreed with the trainer: rollout log-probs shifted by ±0.9
    shift = torch.tensor([0.9, -0.9, 0.2, 0.0])[:, None] * batch.batch["response_mask"]
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])[:, None].expand(-1, 3).contiguous()
    batch = batch.union(DataProto.from_dict(tensors={
        "advantages": adv, "rollout_log_probs": batch.batch["old_log_probs"] - shift}))
    return role, batch


def test_actor_update_logs_the_mismatch_and_bounds_the_tis_weight(actor_and_batch):
    from operators import actor as actor_ops

    role, batch = actor_and_batch
    out = actor_ops.update(role, batch, rollout_is="token", rollout_is_threshold=1.5, dual_clip=False)
    m = out.meta_info["metrics"]
    assert m["actor/rollout_corr/is_raw_weight_max"] == pytest.approx(math.exp(0.9), rel=1e-4)
    assert m["actor/rollout_corr/is_weight_max"] == pytest.approx(1.5)
    assert m["actor/rollout_corr/ratio_max"] == pytest.approx(math.exp(0.9), rel=1e-3)  # π_train = π_old here
    out = actor_ops.update(role, batch, rollout_rs="sequence", rollout_rs_threshold=2.0)
    assert out.meta_info["metrics"]["actor/rollout_corr/rs_masked_fraction"] > 0


def test_actor_update_takes_verls_rejection_options_and_icepop(actor_and_batch):
    from operators import actor as actor_ops

    role, batch = actor_and_batch          # log ρ = 0.9 on row 0, -0.9 on row 1, 0.2 on row 2, 0 on row 3
    tokens = batch.batch["response_mask"].sum(-1).double()
    rows_0_1 = float(tokens[:2].sum() / tokens.sum())   # the share of tokens in rows 0 and 1
    out = actor_ops.update(role, batch, rollout_rs="token_k1,seq_max_k3", rollout_rs_threshold="0.5_2.0,0.5")
    m = out.meta_info["metrics"]
    # k1 = -log ρ: ±0.9 lies outside [log .5, log 2] = ±0.69, so rows 0 and 1 go; k3(0.9) = 0.56 > 0.5 too
    assert m["actor/rollout_corr/rs_token_k1_masked_fraction"] == pytest.approx(rows_0_1)
    assert m["actor/rollout_corr/rs_seq_max_k3_seq_masked_fraction"] == pytest.approx(0.25)
    assert m["actor/rollout_corr/rs_masked_fraction"] == pytest.approx(rows_0_1)
    out = actor_ops.update(role, batch, rollout_is="token", rollout_is_threshold="0.5_2.0")
    m = out.meta_info["metrics"]                 # IcePop: ρ = e^0.9 > 2 gets weight 0, not 2
    assert m["actor/rollout_corr/is_weight_max"] == pytest.approx(math.exp(0.2), rel=1e-4)
    assert m["actor/rollout_corr/is_oob_fraction"] == pytest.approx(rows_0_1)


@pytest.mark.parametrize("params,message", [
    ({"rollout_rs": "token_k4"}, "unknown option.*token_k4"),
    ({"rollout_rs": "seq_max_k2", "rollout_rs_threshold": "0.1_2"}, "for seq_max_k2: one number"),
    ({"rollout_rs": "token_k2,token_k3", "rollout_rs_threshold": "1,2,3"}, "one per option"),
    ({"rollout_is": "token", "rollout_is_threshold": "2_0.5"}, "lower <= upper"),
])
def test_bad_rollout_correction_specs_fail_when_the_graph_loads(params, message):
    from pydantic import ValidationError

    from operators.actor import ActorUpdate

    with pytest.raises(ValidationError, match=message):
        ActorUpdate(**params)


def test_tis_without_a_separate_pi_old_says_how_to_get_one(actor_and_batch):
    from operators import actor as actor_ops

    role, batch = actor_and_batch
    bypass = batch.select(batch_keys=[k for k in batch.batch.keys() if k != "rollout_log_probs"])
    with pytest.raises(ValueError, match="Add a logprob.old node"):
        actor_ops.update(role, bypass, rollout_is="token")


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_every_policy_loss_trains_through_actor_update(actor_and_batch, name):
    from operators import actor as actor_ops

    role, batch = actor_and_batch
    before = role.updates
    out = actor_ops.update(role, batch, policy_loss=name, dro_beta=0.1, micro_batch_size=3)
    assert math.isfinite(out.meta_info["metrics"]["actor/pg_loss"]) and role.updates == before + 1


def test_unknown_policy_loss_lists_the_names():
    from pydantic import ValidationError

    from operators.actor import ActorUpdate

    with pytest.raises(ValidationError, match="vanilla.*gspo|gspo.*vanilla"):
        ActorUpdate(policy_loss="ppo2")


def test_grpo_async_logs_the_mismatch_every_step_and_tis_bounds_the_weight(tmp_path):
    tiny = {"data.batch_size": 4, "nodes.generate.n": 2, "nodes.generate.max_new_tokens": 4}
    history = Trainer(load_graph("grpo_async", overrides=tiny), backend="local", steps=3, out=tmp_path / "a").run()
    assert all("actor/rollout_corr/k3_kl" in row and "actor/rollout_corr/frac_outside_threshold" in row
               for row in history)
    tis = load_graph("tests/data/grpo_async_tis.yaml", overrides={**tiny, "nodes.update_actor.rollout_is_threshold": 1.01})
    history = Trainer(tis, backend="local", steps=3, out=tmp_path / "b").run()
    assert all(row["actor/rollout_corr/is_weight_max"] <= 1.01 + 1e-6 for row in history)
    assert history[-1]["actor/rollout_corr/ratio_max"] > 1.0                 # the sampler lags a version
