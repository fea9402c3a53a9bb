"""Images in the loop: builtin:tiny-vl, its forward and its rollout against transformers called directly."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from operators.data.dataset import left_pad
from operators.models import load_model
from operators.models.forward import response_log_probs
from operators.models.tiny_vl import VOCAB, build_tiny_vl_processor, save_tiny_vl
from operators.models.vision import VisionInputs, vision_token_ids, without_vision_tokens
from operators.rollout.hf_engine import HFRolloutEngine


@pytest.fixture(scope="module")
def vl():
    model, tokenizer = load_model("builtin:tiny-vl", seed=3)
    return model.eval(), tokenizer, build_tiny_vl_processor()


def _prompt(processor, image: Image.Image, question: str) -> dict[str, torch.Tensor]:
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}],
        add_generation_prompt=True, tokenize=False)
    return processor(text=[text], images=[image], return_tensors="pt")


def _images():
    # two sizes: a different number of image tokens per row, so the batch is left-padded
    return [(Image.new("RGB", (32, 32), (230, 40, 40)), "what color ?"),
            (Image.new("RGB", (48, 32), (40, 60, 230)), "how many shapes ? answer")]


def test_log_probs_of_an_image_prompt_equal_transformers_called_directly(vl):
    model, tokenizer, processor = vl
    prompts = [_prompt(processor, image, q) for image, q in _images()]
    responses = [[VOCAB.index("red"), VOCAB.index("blue"), 2], [VOCAB.index("3"), 2, 0]]
    response_mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    ids, prompt_mask = left_pad([p["input_ids"][0].tolist() for p in prompts], tokenizer.pad_token_id)
    input_ids = torch.cat([ids, torch.tensor(responses)], 1)
    attention_mask = torch.cat([prompt_mask, response_mask], 1)
    vision = VisionInputs.of_rows([{k: p[k] for k in ("pixel_values", "image_grid_thw")} for p in prompts])
    with torch.no_grad():
        ours, _ = response_log_probs(model, input_ids, attention_mask, (attention_mask.cumsum(-1) - 1).clamp(min=0),
                                     3, vision=vision)
        for row, (p, response) in enumerate(zip(prompts, responses)):
            n = int(response_mask[row].sum())
            full = torch.cat([p["input_ids"], torch.tensor([response[:n]])], 1)
            types = torch.cat([p["mm_token_type_ids"], torch.zeros(1, n, dtype=torch.long)], 1)
            logits = model(input_ids=full, pixel_values=p["pixel_values"], image_grid_thw=p["image_grid_thw"],
                           mm_token_type_ids=types).logits[0, -n - 1:-1].float()
            # the policy never writes a vision token (the rollout masks them too)
            theirs = without_vision_tokens(model, logits).log_softmax(-1).gather(-1, full[0, -n:, None]).squeeze(-1)
            assert torch.allclose(ours[row, :n], theirs, atol=1e-5), (row, ours[row, :n], theirs)


def test_rollout_reads_the_image_and_its_log_probs_match_the_forward(vl):
    model, tokenizer, processor = vl
    prompts = [_prompt(processor, image, q) for image, q in _images()]
    ids, mask = left_pad([p["input_ids"][0].tolist() for p in prompts], tokenizer.pad_token_id)
    vision = VisionInputs.of_rows([{k: p[k] for k in ("pixel_values", "image_grid_thw")} for p in prompts])
    engine = HFRolloutEngine(model, tokenizer, seed=0)
    out = engine.generate(ids, mask, n=2, max_new_tokens=6, temperature=1.0, vision=vision,
                          seeds=torch.tensor([11, 12]))
    # greedy decoding equals transformers' own generate on each prompt alone
    greedy = engine.generate(ids, mask, greedy=True, max_new_tokens=6, vision=vision)
    for row, p in enumerate(prompts):
        theirs = model.generate(**p, max_new_tokens=6, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                                pad_token_id=tokenizer.pad_token_id,
                                suppress_tokens=vision_token_ids(model))[0, p["input_ids"].shape[1]:]
        n = int(greedy["response_mask"][row].sum())
        assert greedy["responses"][row, :n].tolist() == theirs[:n].tolist()
    # the sampler's log-probs are the forward's (vision rows repeated for the n samples)
    rows = [dict(pixel_values=p["pixel_values"], image_grid_thw=p["image_grid_thw"]) for p in prompts for _ in range(2)]
    with torch.no_grad():
        forward, _ = response_log_probs(model, out["input_ids"], out["attention_mask"], out["position_ids"],
                                        out["responses"].shape[1], vision=VisionInputs.of_rows(rows))
    real = out["response_mask"].bool()
    assert torch.allclose(forward[real], out["rollout_log_probs"][real], atol=1e-5)
    # the image matters: another picture gives other log-probs
    other = VisionInputs(torch.zeros_like(vision.pixel_values).repeat_interleave(1, 0), vision.image_grid_thw)
    rows_other = VisionInputs(other.pixel_values, other.image_grid_thw)
    with torch.no_grad():
        blank, _ = response_log_probs(model, out["input_ids"][::2], out["attention_mask"][::2],
                                      out["position_ids"][::2], out["responses"].shape[1], vision=rows_other)
    assert not torch.allclose(blank[real[::2]], forward[::2][real[::2]], atol=1e-4)


def test_saved_tiny_vl_loads_with_auto_processor_and_model(tmp_path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    save_tiny_vl(tmp_path / "vl", seed=1)
    processor = AutoProcessor.from_pretrained(tmp_path / "vl")
    model = AutoModelForImageTextToText.from_pretrained(tmp_path / "vl")
    built, _ = load_model("builtin:tiny-vl", seed=1)
    loaded, _ = load_model(str(tmp_path / "vl"))
    p = _prompt(processor, *_images()[0])
    with torch.no_grad():
        expect = built(**p).logits
        assert torch.allclose(model(**p).logits, expect, atol=1e-6)
        assert torch.allclose(loaded(**p).logits, expect, atol=1e-6)
