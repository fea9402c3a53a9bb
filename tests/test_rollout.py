"""The transformers rollout engine: shapes, masks, determinism, log-probs, weights and memory."""

from __future__ import annotations

import asyncio

import pytest
import torch

from operators.data import left_pad
from operators.models import VOCAB, build_tiny_model, load_model, response_log_probs
from operators.rollout import (
    HFRolloutEngine,
    SamplingParams,
    SGLangRolloutEngine,
    filter_top_k_top_p,
    pad_responses,
    prompt_seeds,
)

PAD, BOS, EOS = 0, 1, 2
DIGITS = [VOCAB.index(str(d)) for d in range(10)]
PROMPTS = [[BOS, VOCAB.index("copy"), DIGITS[3], DIGITS[7], VOCAB.index("=")],
           [BOS, VOCAB.index("reverse"), DIGITS[1], DIGITS[2], DIGITS[3], VOCAB.index("=")],
           [BOS, VOCAB.index("add"), DIGITS[8], DIGITS[5], VOCAB.index("=")]]


@pytest.fixture(scope="module")
def tiny():
    return load_model("builtin:tiny", seed=0)


@pytest.fixture()
def batch():
    return left_pad(PROMPTS, PAD)


def test_shapes_and_layout(tiny, batch):
    model, tok = tiny
    ids, mask = batch
    out = HFRolloutEngine(model, tok, seed=0).generate(ids, mask, n=4, max_new_tokens=6)
    n = 3 * 4
    shapes = {k: tuple(v.shape) for k, v in out.items()}
    assert shapes == {"prompts": (n, 6), "responses": (n, 6), "response_mask": (n, 6), "input_ids": (n, 12),
                      "attention_mask": (n, 12), "position_ids": (n, 12), "rollout_log_probs": (n, 6)}
    assert out["rollout_log_probs"].dtype == torch.float32 and out["responses"].dtype == torch.int64
    assert torch.equal(out["prompts"], ids.repeat_interleave(4, 0))        # each prompt's samples adjacent
    assert torch.equal(out["input_ids"], torch.cat([out["prompts"], out["responses"]], -1))
    assert torch.equal(out["attention_mask"], torch.cat([mask.repeat_interleave(4, 0), out["response_mask"]], -1))
    expected_pos = (out["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    assert torch.equal(out["position_ids"], expected_pos)


def test_response_mask_stops_after_the_stop_token(tiny, batch):
    model, tok = tiny
    ids, mask = batch
    # many stop tokens, so rows end at different places
    engine = HFRolloutEngine(model, tok, seed=0, stop_token_ids=[EOS] + DIGITS[:5])
    out = engine.generate(ids, mask, n=16, max_new_tokens=8)
    lengths = out["response_mask"].sum(-1)
    assert (lengths < 8).sum() > 5 and (lengths > 1).any()                   # the test sees early stops
    stops = set([EOS] + DIGITS[:5])
    for tokens, row_mask, lps, length in zip(out["responses"], out["response_mask"], out["rollout_log_probs"], lengths):
        length = int(length)
        assert row_mask.tolist() == [1] * length + [0] * (8 - length)       # contiguous, then zeros
        assert tokens[length:].eq(PAD).all() and lps[length:].eq(0).all()
        body = tokens[:length].tolist()
        assert not stops & set(body[:-1])                                   # no stop before the end
        if length < 8:
            assert body[-1] in stops                                        # the stop token is in the mask


def test_greedy_is_deterministic_and_ignores_the_seed(tiny, batch):
    model, tok = tiny
    ids, mask = batch
    a = HFRolloutEngine(model, tok, seed=0).generate(ids, mask, greedy=True, max_new_tokens=6)
    b = HFRolloutEngine(model, tok, seed=123).generate(ids, mask, greedy=True, max_new_tokens=6)
    assert torch.equal(a["responses"], b["responses"])
    logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    assert torch.equal(a["responses"][:, 0], logits[:, -1].argmax(-1))
    top1 = HFRolloutEngine(model, tok, seed=5).generate(ids, mask, top_k=1, max_new_tokens=6)
    assert torch.equal(top1["responses"], a["responses"])                  # top-k 1 is greedy


def test_seeded_sampling_is_reproducible(tiny, batch):
    model, tok = tiny
    ids, mask = batch
    params = SamplingParams(n=4, max_new_tokens=8, temperature=1.0)
    a = HFRolloutEngine(model, tok, seed=7)
    b = HFRolloutEngine(model, tok, seed=7)
    first_a, first_b = a.generate(ids, mask, params), b.generate(ids, mask, params)
    assert torch.equal(first_a["responses"], first_b["responses"])
    assert torch.equal(a.generate(ids, mask, params)["responses"], b.generate(ids, mask, params)["responses"])
    other = HFRolloutEngine(model, tok, seed=8).generate(ids, mask, params)
    assert not torch.equal(other["responses"], first_a["responses"])
    # a per-call seed overrides the engine's generator
    c = a.generate(ids, mask, params, seed=99)
    d = HFRolloutEngine(model, tok, seed=0).generate(ids, mask, params, seed=99)
    assert torch.equal(c["responses"], d["responses"])
    # rng state round trip
    state = a.rng_state()
    x = a.generate(ids, mask, params)
    a.set_rng_state(state)
    assert torch.equal(a.generate(ids, mask, params)["responses"], x["responses"])


def test_prompt_seeds_decide_the_samples_whatever_the_engine_seed_and_batch(tiny, batch):
    model, tok = tiny
    ids, mask = batch
    params = SamplingParams(n=4, max_new_tokens=8, temperature=1.0)
    seeds = prompt_seeds([f"5-{i}" for i in range(len(ids))], seed=3)
    a = HFRolloutEngine(model, tok, seed=7).generate(ids, mask, params, seeds=seeds)
    b = HFRolloutEngine(model, tok, seed=8).generate(ids.flip(0), mask.flip(0), params, seeds=seeds.flip(0))
    assert torch.equal(a["responses"], b["responses"].view(len(ids), 4, -1).flip(0).view(len(ids) * 4, -1))
    other = HFRolloutEngine(model, tok, seed=7).generate(ids, mask, params, seeds=seeds + 1)
    assert not torch.equal(other["responses"], a["responses"])
    with pytest.raises(ValueError, match="one per prompt"):
        HFRolloutEngine(model, tok).generate(ids, mask, params, seeds=seeds[:1])


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_rollout_log_probs_equal_a_recomputation(tiny, batch, temperature, top_p):
    model, tok = tiny
    ids, mask = batch
    out = HFRolloutEngine(model, tok, seed=1).generate(ids, mask, n=3, max_new_tokens=7,
                                                       temperature=temperature, top_p=top_p)
    with torch.no_grad():
        recomputed, _ = response_log_probs(model, out["input_ids"], out["attention_mask"], out["position_ids"],
                                           response_length=7, temperature=temperature)
    torch.testing.assert_close(recomputed * out["response_mask"], out["rollout_log_probs"], atol=1e-4, rtol=0)


def test_left_padding_does_not_change_greedy_output(tiny):
    model, tok = tiny
    alone_ids, alone_mask = left_pad([PROMPTS[0]], PAD)
    ids, mask = left_pad([PROMPTS[1], PROMPTS[0]], PAD)                       # PROMPTS[0] gets a pad
    engine = HFRolloutEngine(model, tok, seed=0)
    alone = engine.generate(alone_ids, alone_mask, greedy=True, max_new_tokens=6)
    padded = engine.generate(ids, mask, greedy=True, max_new_tokens=6)
    assert torch.equal(padded["responses"][1], alone["responses"][0])
    torch.testing.assert_close(padded["rollout_log_probs"][1], alone["rollout_log_probs"][0], atol=1e-4, rtol=0)


def test_update_weights_and_memory_release(batch):
    model, tok = load_model("builtin:tiny", seed=0)
    ids, mask = batch
    engine = HFRolloutEngine(model, tok, seed=0)
    other = build_tiny_model(seed=1)
    target = HFRolloutEngine(other, tok, seed=0).generate(ids, mask, greedy=True, max_new_tokens=6)
    before = engine.generate(ids, mask, greedy=True, max_new_tokens=6)
    assert not torch.equal(before["rollout_log_probs"], target["rollout_log_probs"])
    with pytest.raises(TypeError, match="version"):  # an engine is told the version, it never counts one
        engine.update_weights(other.state_dict())
    assert engine.update_weights(other.state_dict(), version=1) == {}
    after = engine.generate(ids, mask, greedy=True, max_new_tokens=6)
    assert torch.equal(after["responses"], target["responses"])
    engine.release_memory()
    with pytest.raises(RuntimeError, match="resume_memory"):
        engine.generate(ids, mask)
    engine.resume_memory()
    assert torch.equal(engine.generate(ids, mask, greedy=True, max_new_tokens=6)["responses"], target["responses"])
    with pytest.raises(RuntimeError, match="size mismatch|Missing key|Unexpected key"):
        engine.update_weights({"lm_head.weight": torch.zeros(3, 3)}, version=2)


def test_generate_one_matches_the_batch_path(tiny):
    model, tok = tiny
    engine = HFRolloutEngine(model, tok, seed=0, stop_token_ids=[EOS] + DIGITS[:5])

    async def both():
        return await asyncio.gather(engine.generate_one(PROMPTS[0], seed=3, max_new_tokens=8),
                                    engine.generate_one(PROMPTS[0], greedy=True, max_new_tokens=8))

    sampled, greedy = asyncio.run(both())
    ids = torch.tensor([PROMPTS[0]])
    batch = engine.generate(ids, torch.ones_like(ids), seed=3, max_new_tokens=8)
    length = int(batch["response_mask"][0].sum())
    assert sampled["response_ids"] == batch["responses"][0, :length].tolist()
    assert sampled["log_probs"] == pytest.approx(batch["rollout_log_probs"][0, :length].tolist(), abs=1e-6)
    for result in (sampled, greedy):
        stopped = result["response_ids"][-1] in [EOS] + DIGITS[:5]
        assert result["finish_reason"] == ("stop" if stopped else "length")
        assert len(result["response_ids"]) == len(result["log_probs"]) <= 8


def test_top_k_top_p_filter_by_hand():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    inf = float("-inf")
    assert filter_top_k_top_p(logits, top_k=2).tolist() == [[2.0, 1.0, inf, inf]]
    # probs ≈ 0.644, 0.237, 0.087, 0.032: the nucleus 0.8 needs the first two
    assert filter_top_k_top_p(logits, top_p=0.8).tolist() == [[2.0, 1.0, inf, inf]]
    assert filter_top_k_top_p(logits, top_p=0.5).tolist() == [[2.0, inf, inf, inf]]
    assert filter_top_k_top_p(logits, top_p=0.9).tolist() == [[2.0, 1.0, 0.0, inf]]
    assert torch.equal(filter_top_k_top_p(logits), logits)


def test_sampling_params_validate_and_pad_responses():
    with pytest.raises(ValueError):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError):
        SamplingParams(nucleus=0.9)
    assert SamplingParams(temperature=0).is_greedy
    responses, mask, lps = pad_responses([[5, 2], [7]], [[-0.5, -0.1], [-1.0]], length=3, pad_token_id=0)
    assert responses.tolist() == [[5, 2, 0], [7, 0, 0]] and mask.tolist() == [[1, 1, 0], [1, 0, 0]]
    torch.testing.assert_close(lps, torch.tensor([[-0.5, -0.1, 0.0], [-1.0, 0.0, 0.0]]))


def test_sglang_engine_says_it_needs_sglang():
    try:
        import sglang  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="needs sglang.*CUDA GPU"):
            SGLangRolloutEngine("/models/x", pad_token_id=0, stop_token_ids=[2])
    else:
        pytest.skip("sglang is installed: the engine itself needs a GPU test")


def test_the_auto_engine_is_vllm_where_it_imports_and_hf_elsewhere(monkeypatch):
    """``rollout.engine: auto`` resolves in the process that builds the actor: vllm's options where the
    package is found, hf's (with drop_finished) where it is not."""
    import importlib.machinery
    import importlib.util

    from operators.roles import RolloutConfig
    from operators.rollout.engines import engine_spec, resolve_engine

    found = importlib.util.find_spec
    for present, expected in ((False, "hf"), (True, "vllm")):
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, *a, present=present: importlib.machinery.ModuleSpec("vllm", None)
                            if present and name == "vllm"
                            else (None if name == "vllm" else found(name, *a)))
        assert resolve_engine("auto") == expected and engine_spec("auto").name == expected
        assert resolve_engine("hf") == "hf"
        options = RolloutConfig(engine="auto").options()
        assert ("drop_finished" in options) == (expected == "hf")
    with pytest.raises(ValueError, match="auto"):  # an unknown engine lists auto among the choices
        engine_spec("vlm")
