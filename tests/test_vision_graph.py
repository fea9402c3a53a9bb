"""Images through the graph: grpo_vision's twins, and pixels reaching every forward of a step."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from flowrl.data import DataProto
from flowrl.graph import load_graph
from flowrl.run.trainer import Trainer
from operators.data.multimodal import MultimodalPromptDataset, load_processor
from operators.data.shapes import ShapeRows
from operators.models import OptimConfig, load_model
from operators.models.engine import build_engine
from operators.models.forward import response_log_probs
from operators.models.vision import vision_inputs
from operators.rollout.hf_engine import HFRolloutEngine
from operators.sources import PromptSource, PromptSourceConfig

ROOT = Path(__file__).resolve().parents[1]


def test_yaml_and_python_twin_are_the_same_graph():
    a = load_graph(ROOT / "graphs" / "grpo_vision.yaml")
    b = load_graph(str(ROOT / "graphs" / "grpo_vision.py"))
    assert a.check().ok, [str(p) for p in a.check().errors]
    assert a.to_dict() == b.to_dict()


def test_pixels_reach_the_rollout_old_log_probs_and_the_update(tmp_path):
    """A step with n samples per prompt, streamed in micro-batches, π_old from its own forward and the
    update cut into token-budget micro-batches: every forward reads the right picture for each row, so
    π_old, the update's π (before its step) and the sampler's log-probs agree to float error."""
    g = load_graph(ROOT / "graphs" / "grpo_vision.yaml", overrides={
        "data.batch_size": 4, "nodes.generate.n": 3, "schedule.micro_batches": 2,
        "roles.actor.max_tokens_per_micro_batch": 40,
        "nodes.old_logprob": {"op": "logprob.old"},
        "nodes.update_actor.inputs": {},
    })
    history = Trainer(g, backend="local", steps=2, out=tmp_path).run()
    for row in history:
        assert row["actor/rollout_corr/log_prob_diff_max"] < 1e-4, row
        assert abs(row["actor/approx_kl"]) < 1e-6, row
        assert math.isfinite(row["actor/pg_loss"])


def _batch(n: int = 2):
    """A rollout batch of builtin:shapes prompts (n samples each) with their images repeated per sample."""
    source = PromptSource(PromptSourceConfig(source="builtin:shapes", batch_size=4), tokenizer="builtin:tiny-vl")
    prompts = source.next_batch()
    model, tokenizer = load_model("builtin:tiny-vl", seed=0)
    out = HFRolloutEngine(model, tokenizer).generate(prompts.batch["prompts"], prompts.batch["prompt_mask"], n=n,
                                                     max_new_tokens=3, vision=vision_inputs(prompts),
                                                     seeds=torch.arange(4))
    mask = out["response_mask"]
    advantages = torch.randn(mask.shape, generator=torch.Generator().manual_seed(0))
    return DataProto.from_dict(
        tensors={**{k: out[k] for k in ("input_ids", "attention_mask", "position_ids", "responses")},
                 "response_mask": mask, "advantages": advantages},
        non_tensors={"multi_modal_inputs": prompts.non_tensor_batch["multi_modal_inputs"].repeat(n)})


def _loss(model):
    def loss_fn(mb, norm):
        log_probs, _ = response_log_probs(model, mb["input_ids"], mb["attention_mask"], mb["position_ids"],
                                          mb["responses"].shape[1], vision=vision_inputs(mb))
        loss = -(log_probs * mb["advantages"] * mb["response_mask"]).sum() / norm.tokens
        return loss, {}
    return loss_fn


@pytest.mark.parametrize("budget,micro", [(None, 3), (30, None)])
def test_an_update_cut_into_micro_batches_equals_one_pass(budget, micro):
    """Each micro-batch takes its rows' pictures: the accumulated gradient (the vision tower's too) is the
    whole batch's. (Gradients, not weights: Adam's first step is lr·sign(g), which float noise can flip.)"""
    batch = _batch()
    grads = []
    for max_tokens, rows in ((None, None), (budget, micro)):
        model, _ = load_model("builtin:tiny-vl", seed=0)
        engine = build_engine(None, model, optim=OptimConfig(lr=1e-3, grad_clip=None), seed=0,
                              max_tokens_per_micro_batch=max_tokens)
        engine.train_batch(batch, _loss(engine.model), mini_batch_size=None, epochs=1, micro_batch_size=rows)
        grads.append({k: p.grad for k, p in engine.model.named_parameters()})
    vision = [k for k in grads[0] if "visual" in k]
    assert vision and all(float(grads[0][k].abs().max()) > 0 for k in vision)
    for k in grads[0]:
        assert torch.allclose(grads[0][k], grads[1][k], rtol=1e-4, atol=1e-7), k


def test_validation_pictures_are_held_out_and_the_reward_reads_the_answer():
    from operators.rewards.shapes import compute_score

    rows = ShapeRows("builtin:shapes", size=4, seed=7919)
    assert {compute_score(r["data_source"], r["reward_model"]["ground_truth"], r["reward_model"]["ground_truth"])
            for r in rows} == {1.0}
    assert load_processor("builtin:tiny") is None


TINY = {"data.batch_size": 4, "nodes.generate.n": 2, "trainer.checkpoint_every": 2, "trainer.val_every": 100}
VALUES = ("reward/mean", "actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/approx_kl")


def _train(out: Path, steps: int, resume: bool = False):
    g = load_graph(ROOT / "graphs" / "grpo_vision.yaml", overrides=TINY)
    rows = Trainer(g, backend="local", steps=steps, out=out, resume=resume, say=lambda m: None).run()
    return [{k: r[k] for k in VALUES} for r in rows]


def test_resume_is_exact_and_the_export_generates_flowrls_tokens_on_an_image(tmp_path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from flowrl.store.checkpoint import CheckpointStore
    from operators.models.export import export_hf
    from operators.models.vision import vision_token_ids

    full = _train(tmp_path / "full", steps=4)
    part = _train(tmp_path / "part", steps=2)
    assert part + _train(tmp_path / "part", steps=4, resume=True) == full  # exact, not approximate

    state, meta, _ = CheckpointStore(tmp_path / "full" / "checkpoints").read_role("actor", step=4)
    export_hf(state["model"], meta["graph"], tmp_path / "hf")
    processor = AutoProcessor.from_pretrained(tmp_path / "hf")
    exported = AutoModelForImageTextToText.from_pretrained(tmp_path / "hf")
    ours, tokenizer = load_model("builtin:tiny-vl")
    ours.load_state_dict(exported.state_dict())
    row = ShapeRows("builtin:shapes", size=1, seed=5)[0]
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": " what color ?"}]}],
        add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], images=row["images"], return_tensors="pt")
    theirs = exported.generate(**inputs, max_new_tokens=4, do_sample=False, suppress_tokens=vision_token_ids(ours),
                               eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    # flowrl's rollout on the same prompt, through the dataset's processing of the same picture
    dataset = MultimodalPromptDataset([row], load_processor("builtin:tiny-vl"))
    collated = dataset.collate([0])
    assert collated["input_ids"][0].tolist() == inputs["input_ids"][0].tolist()
    out = HFRolloutEngine(ours, tokenizer).generate(collated["input_ids"], collated["attention_mask"], greedy=True,
                                                    max_new_tokens=4, vision=vision_inputs(collated))
    n = int(out["response_mask"][0].sum())
    assert out["responses"][0, :n].tolist() == theirs[0, inputs["input_ids"].shape[1]:][:n].tolist()
