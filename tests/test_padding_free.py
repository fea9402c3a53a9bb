"""Paying for tokens, not padding: every shortcut gives the numbers of the padded path.

Rollout drops finished rows and returns responses as wide as the longest;
forward passes and the update run length-bucketed micro-batches cut to their
own longest response; micro-batch losses are normalised by the mini-batch's
token count. Each test compares against the full-width path.
"""

from __future__ import annotations

import math

import pytest
import torch

from flowrl.data import DataProto
from flowrl.data.padding import concat_padded, pad_to_common_width
from flowrl.runtime.worker import RoleContext
from operators import actor as actor_ops
from operators import critic as critic_ops
from operators import logprob
from operators.algos import functional
from operators.algos.functional import entropy_from_logits, logprobs_from_logits
from operators.models import response_log_probs, response_values
from operators.models.forward import pack_rows
from operators.models.hf import hf
from operators.models.microbatch import response_lengths, token_budget_split
from operators.models.data_parallel import LossNorm
from operators.roles import Actor, ActorConfig, Critic, ModelRoleConfig
from operators.rollout import HFRolloutEngine
from operators.rollout.base import SamplingParams, prompt_seeds, sample_seeds
from operators.rollout.hf_engine import sample_next_token

# stopping on a few common tokens as well as EOS makes an untrained model's lengths ragged
STOPS = [2, 7, 8, 9, 20]
PROMPTS = torch.tensor([[0, 1, 20, 7, 11, 16], [1, 20, 8, 12, 13, 16], [0, 0, 1, 20, 5, 16],
                        [1, 21, 9, 4, 6, 16]])
PROMPT_MASK = (PROMPTS != 0).long()
MAX_NEW = 48


def _actor(**cfg) -> Actor:
    """builtin:tiny with its weights jittered: untrained, its greedy answer is one token for every prompt."""
    role = Actor(ActorConfig(**{"optim": {"lr": 1e-3, "grad_clip": None}, **cfg}), RoleContext("actor", 0, 1, seed=0))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in role.model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    return role


def _rollout(role: Actor, drop_finished: bool = True, **params) -> dict[str, torch.Tensor]:
    engine = HFRolloutEngine(role.model, role.tokenizer, stop_token_ids=STOPS, seed=3, drop_finished=drop_finished)
    return engine.generate(PROMPTS, PROMPT_MASK, n=4, max_new_tokens=MAX_NEW, **params)


@pytest.fixture(scope="module")
def ragged_batch() -> DataProto:
    """16 rows whose responses run from 1 token to many, with old log-probs and advantages."""
    role = _actor()
    out = _rollout(role)
    lengths = out["response_mask"].sum(-1)
    assert lengths.min() < 4 and lengths.max() > 3 * lengths.float().mean() / 2, lengths  # ragged
    batch = DataProto.from_dict(tensors=out)
    batch = batch.union(logprob.old(role, batch))
    gen = torch.Generator().manual_seed(0)
    adv = torch.randn(len(batch), 1, generator=gen).expand(-1, out["responses"].shape[1]).contiguous()
    returns = torch.randn(len(batch), out["responses"].shape[1], generator=gen)
    return batch.union(DataProto.from_dict(tensors={"advantages": adv, "returns": returns,
                                                    "values": torch.zeros_like(returns)}))


def test_a_row_samples_the_same_token_in_any_subset_of_rows():
    logits = torch.randn(6, 29, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=0.7, top_p=0.9)
    seeds = sample_seeds(prompt_seeds([f"3-{i}" for i in range(3)], seed=0), n=2)
    whole, whole_lp = sample_next_token(logits, params, seeds, t=4)
    rows = torch.tensor([1, 4, 5])
    subset, subset_lp = sample_next_token(logits[rows], params, seeds[rows], t=4)
    assert torch.equal(subset, whole[rows]) and torch.equal(subset_lp, whole_lp[rows])
    later, _ = sample_next_token(logits, params, seeds, t=5)   # the next draw of each stream is another
    assert not torch.equal(later, whole)


def test_keyed_sampling_follows_the_truncated_distribution():
    """16,000 streams each draw one token: the counts fit the top-k distribution (chi-square, 2 dof),
    and no filtered token is ever drawn."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0]).expand(16_000, -1)
    seeds = sample_seeds(prompt_seeds([f"0-{i}" for i in range(2_000)], seed=0), n=8)
    token, _ = sample_next_token(logits, SamplingParams(top_k=3), seeds, t=0)
    counts = torch.bincount(token, minlength=5).double()
    assert counts[3:].sum() == 0
    expected = logits[0, :3].softmax(-1).double() * len(token)
    chi2 = float(((counts[:3] - expected) ** 2 / expected).sum())
    assert chi2 < 13.8, chi2    # p = 0.001 for 2 degrees of freedom


@pytest.mark.parametrize("params", [{"greedy": True}, {"temperature": 1.0}, {"temperature": 0.8, "top_k": 10}])
def test_dropping_finished_rows_gives_the_same_tokens_and_log_probs(params):
    role = _actor()
    dropped, kept = _rollout(role, True, **params), _rollout(role, False, **params)
    width = dropped["responses"].shape[1]
    assert kept["responses"].shape[1] == MAX_NEW
    assert width == int(dropped["response_mask"].sum(-1).max()) < MAX_NEW   # as wide as the longest
    assert torch.equal(dropped["responses"], kept["responses"][:, :width])
    assert torch.equal(dropped["response_mask"], kept["response_mask"][:, :width])
    assert not kept["response_mask"][:, width:].any()
    assert torch.allclose(dropped["rollout_log_probs"], kept["rollout_log_probs"][:, :width], atol=1e-5)
    assert torch.equal(dropped["input_ids"], kept["input_ids"][:, :PROMPTS.shape[1] + width])
    assert torch.equal(dropped["position_ids"], kept["position_ids"][:, :PROMPTS.shape[1] + width])


@pytest.mark.parametrize("sampling", [{"greedy": True}, {"temperature": 1.0}])
def test_shards_of_different_widths_join_as_one_wide_batch(sampling):
    """Rollouts of two halves (sampled ones with their prompts' seeds, as two ranks would),
    joined, equal the rollout of the whole batch."""
    role = _actor()
    engine = HFRolloutEngine(role.model, role.tokenizer, stop_token_ids=STOPS, seed=0)
    seeds = prompt_seeds([f"0-{i}" for i in range(len(PROMPTS))], seed=0)
    halves = [DataProto.from_dict(tensors=engine.generate(PROMPTS[s], PROMPT_MASK[s], n=2, seeds=seeds[s],
                                                          max_new_tokens=MAX_NEW, **sampling))
              for s in (slice(0, 2), slice(2, 4))]
    whole = engine.generate(PROMPTS, PROMPT_MASK, n=2, seeds=seeds, max_new_tokens=MAX_NEW, **sampling)
    joined = concat_padded(halves)
    assert halves[0].batch["responses"].shape[1] != halves[1].batch["responses"].shape[1]
    real = whole["attention_mask"].bool()  # position ids past a response are never read: padding writes 0
    for key, value in whole.items():
        ours = joined.batch[key]
        if key == "position_ids":
            ours, value = ours[real], value[real]
        assert torch.allclose(ours.float(), value.float(), atol=1e-5), key
    same = [DataProto.from_dict(tensors={"x": torch.ones(1, 2)}), DataProto.from_dict(tensors={"x": torch.ones(2, 2)})]
    assert pad_to_common_width(same)[0] is same[0]  # nothing to pad: no copy


def test_token_budget_split_places_every_row_once_within_the_budget():
    lengths = torch.tensor([30, 1, 7, 7, 2, 50, 3, 1])
    parts = token_budget_split(lengths, prompt_length=5, max_tokens=64)
    assert sorted(torch.cat(parts).tolist()) == list(range(8))
    for rows in parts:
        assert len(rows) == 1 or len(rows) * (5 + int(lengths[rows].max())) <= 64
    assert [p.tolist() for p in token_budget_split(lengths, 5, None, max_rows=3)] == [[0, 1, 2], [3, 4, 5], [6, 7]]


@pytest.mark.parametrize("budget", [40, 120])
def test_forward_passes_under_a_token_budget_equal_one_full_width_pass(ragged_batch, budget):
    seq = ragged_batch.select(batch_keys=["input_ids", "attention_mask", "position_ids", "responses"])
    mask = ragged_batch.batch["response_mask"].bool()
    full = logprob.old(_actor(), seq).batch["old_log_probs"]
    trimmed = logprob.old(_actor(max_tokens_per_micro_batch=budget), seq).batch["old_log_probs"]
    assert torch.allclose(trimmed[mask], full[mask], atol=1e-5)
    assert trimmed.shape == full.shape
    assert not trimmed[:, mask.sum(0) == 0].any()  # past the longest response nothing was computed: 0

    ctx = RoleContext("critic", 0, 1, seed=0)
    values = critic_ops.values(Critic(ModelRoleConfig(), ctx), seq).batch["values"]
    trimmed_values = critic_ops.values(Critic(ModelRoleConfig(max_tokens_per_micro_batch=budget), ctx), seq)
    assert torch.allclose(trimmed_values.batch["values"][mask], values[mask], atol=1e-5)


def test_packed_rows_give_the_masked_full_width_pass(ragged_batch):
    """Rows shifted to start at column 0 and run without a mask: on real positions, the
    log-probs, entropy, values and a masked loss's gradients of one masked full-width pass."""
    ids, attn, pos = (ragged_batch.batch[k] for k in ("input_ids", "attention_mask", "position_ids"))
    width = ragged_batch.batch["responses"].shape[1]
    mask = ragged_batch.batch["response_mask"].bool()
    packed = pack_rows(attn, width)
    assert packed is not None and (packed.source[:, 0] > 0).any()  # left-padded prompts were shifted
    model = _actor().model

    def masked_pass(attention_mask):
        logits = model(input_ids=ids, attention_mask=attention_mask, position_ids=pos).logits[:, -width - 1:-1]
        return logits / 0.7

    log_probs, entropy = response_log_probs(model, ids, attn, pos, width, temperature=0.7, with_entropy=True)
    logits = masked_pass(attn)
    expected = logprobs_from_logits(logits, ids[:, -width:])
    assert torch.allclose(log_probs[mask], expected[mask], atol=1e-5)
    assert torch.allclose(entropy[mask], entropy_from_logits(logits)[mask], atol=1e-5)
    # past a row's last token nothing is read: a row's outputs do not depend on the rows beside it
    alone = response_log_probs(model, ids[:3], attn[:3], pos[:3], width, temperature=0.7)[0]
    assert torch.allclose(alone, log_probs[:3], atol=1e-5)
    params = [p for p in model.parameters()]
    ours = torch.autograd.grad(log_probs[mask].sum(), params)
    theirs = torch.autograd.grad(expected[mask].sum(), params)
    assert all(_close(a, b) for a, b in zip(ours, theirs))

    critic = Critic(ModelRoleConfig(), RoleContext("critic", 0, 1, seed=0)).model
    values = critic(ids, attn, pos)[:, -width - 1:-1]
    assert torch.allclose(response_values(critic, ids, attn, pos, width)[mask], values[mask], atol=1e-5)

    # a row whose tokens are not one run (a hole in its response) needs the mask: nothing is packed
    row = int(mask.sum(-1).argmax())
    holed = attn.clone()
    holed[row, -width + 1] = 0
    assert pack_rows(holed, width) is None
    got = response_log_probs(model, ids, holed, pos, width, temperature=0.7)[0]
    assert torch.allclose(got[mask], logprobs_from_logits(masked_pass(holed), ids[:, -width:])[mask], atol=1e-5)


@pytest.mark.parametrize("vocab", [None, 49_152])
def test_the_lm_head_chunk_by_chunk_gives_the_whole_logits_and_their_gradients(ragged_batch, vocab, monkeypatch):
    """builtin:tiny, and a small Llama with SmolLM2's 49,152-token vocabulary, a few tokens' logits at a
    time: the log-probs, entropy and gradients of the whole [B, R, V] logits of one masked pass."""
    ids, attn, pos = (ragged_batch.batch[k] for k in ("input_ids", "attention_mask", "position_ids"))
    width = ragged_batch.batch["responses"].shape[1]
    mask = ragged_batch.batch["response_mask"].bool()
    model = _actor().model
    if vocab is not None:
        config = model.config.__class__(**{**model.config.to_dict(), "vocab_size": vocab, "num_hidden_layers": 1})
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = hf("LlamaForCausalLM")(config)
        ids = ids * 1009 % vocab  # tokens from the whole vocabulary
    vocab_size = model.config.vocab_size
    monkeypatch.setattr(functional, "LOGITS_CHUNK_ELEMENTS", 5 * vocab_size)  # 5 tokens a chunk
    log_probs, entropy = response_log_probs(model, ids, attn, pos, width, temperature=0.7, with_entropy=True)
    logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits[:, -width - 1:-1] / 0.7
    expected = logprobs_from_logits(logits, ids[:, -width:])
    assert int(mask.sum()) > 5 * 4  # many chunks
    torch.testing.assert_close(log_probs[mask], expected[mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy[mask], entropy_from_logits(logits)[mask], atol=1e-5, rtol=0)
    params = [p for p in model.parameters()]
    ours = torch.autograd.grad(log_probs[mask].sum() + 0.1 * entropy[mask].sum(), params)
    theirs = torch.autograd.grad(expected[mask].sum() + 0.1 * entropy_from_logits(logits)[mask].sum(), params)
    assert all(_close(a, b) for a, b in zip(ours, theirs))


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal up to float reordering: summation order differs between micro-batch cuts."""
    return torch.allclose(a, b, rtol=1e-4, atol=1e-5 * float(b.abs().max()))


def _grads(role) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in role.model.parameters() if p.grad is not None])


def _update(batch, role_cfg: dict, **params) -> tuple[torch.Tensor, dict]:
    role = _actor(**role_cfg)
    metrics = actor_ops.update(role, batch, clip_ratio=0.2, entropy_coeff=0.01, use_kl_loss=True,
                               **params).meta_info["metrics"]
    return _grads(role), metrics


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_a_token_budget_gives_the_loss_and_gradients_of_one_pass(ragged_batch, mode):
    batch = ragged_batch.union(DataProto.from_dict(tensors={"ref_log_prob": ragged_batch.batch["old_log_probs"] - 0.1}))
    whole, m_whole = _update(batch, {}, loss_agg_mode=mode)
    for budget in (40, 90):
        grads, m = _update(batch, {"max_tokens_per_micro_batch": budget}, loss_agg_mode=mode)
        assert _close(grads, whole), budget
        for key in ("actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/clipfrac", "actor/approx_kl"):
            assert m[key] == pytest.approx(m_whole[key], rel=1e-4, abs=1e-7), key


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_accumulating_ragged_micro_batches_equals_the_whole_mini_batch_step(ragged_batch, mode):
    """verl's micro-batch normalisation: each micro-batch's loss is divided by the
    mini-batch's token count, so 16 rows in ragged chunks of 3 give the one-pass step."""
    mask = ragged_batch.batch["response_mask"]
    chunk_tokens = [int(mask[s:s + 3].sum()) for s in range(0, 16, 3)]
    assert len(set(chunk_tokens)) > 1  # the chunks really are ragged: row shares would be wrong
    whole, m_whole = _update(ragged_batch, {}, loss_agg_mode=mode)
    accumulated, m = _update(ragged_batch, {}, loss_agg_mode=mode, micro_batch_size=3)
    assert _close(accumulated, whole)
    assert m["actor/pg_loss"] == pytest.approx(m_whole["actor/pg_loss"], rel=1e-4, abs=1e-7)


def test_critic_update_accumulates_to_the_one_pass_step(ragged_batch):
    ctx = RoleContext("critic", 0, 1, seed=0)
    grads = []
    for cfg, params in (({}, {}), ({"max_tokens_per_micro_batch": 50}, {}), ({}, {"micro_batch_size": 5})):
        critic = Critic(ModelRoleConfig(optim={"lr": 1e-3, "grad_clip": None}, **cfg), ctx)
        critic_ops.update(critic, ragged_batch, **params)
        grads.append(_grads(critic))
    assert _close(grads[1], grads[0])
    assert _close(grads[2], grads[0])


def test_loss_norm_weights_and_response_lengths(ragged_batch):
    mask = ragged_batch.batch["response_mask"]
    assert torch.equal(response_lengths(ragged_batch), mask.sum(-1))
    norm = LossNorm(tokens=float(mask.sum()), seqs=16.0)
    assert norm.weight(mask[:4]) + norm.weight(mask[4:]) == pytest.approx(1.0)


def test_micro_batched_rollouts_of_different_widths_feed_one_update(tmp_path):
    """With ``micro_batches: 2`` each half is generated apart, as wide as its own longest
    response; the group-scoped advantage and the update read both halves joined."""
    from flowrl.graph import load_graph
    from flowrl.run.trainer import Trainer

    g = load_graph("grpo_skewed", overrides={
        "data.batch_size": 4, "nodes.generate.n": 4, "nodes.generate.max_new_tokens": 40,
        "schedule.micro_batches": 2, "trainer.val_every": 0, "trainer.checkpoint_every": 0,
        "roles.actor.max_tokens_per_micro_batch": 64})
    history = Trainer(g, backend="local", steps=2, out=tmp_path, say=lambda m: None).run()
    assert [r["step"] for r in history] == [1, 2]
    assert all(0.0 <= r["reward/mean"] <= 1.0 and math.isfinite(r["actor/pg_loss"]) for r in history)
