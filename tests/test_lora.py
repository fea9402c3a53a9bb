"""LoRA with peft: only the adapters train, the reference is the base with them off, checkpoints
hold the adapters and resume exactly, export writes a merged model and a peft adapter directory,
rollout engines with their own copy get merged weights, and two FSDP2 ranks take the update one
process takes (within 1e-5). builtin:tiny throughout; the vLLM push runs where vLLM is installed.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from flowrl.cli import app
from flowrl.data import DataProto
from flowrl.data.dispatch import TASK_ROWS
from flowrl.graph import load_graph
from flowrl.plan.pools import pool_specs, role_notes
from flowrl.run.trainer import Trainer
from flowrl.runtime.worker import RoleContext
from flowrl.store.checkpoint import CheckpointStore
from operators import actor as actor_ops
from operators import logprob
from operators.models import load_model
from operators.models.lora import BaseView, merged_weights
from operators.roles import Actor, ActorConfig
from tests.test_distributed import on_ranks, ranks  # noqa: F401  (the module's two ranks)
from tests.test_distributed_metrics import SPLIT, update_batch

LORA = {"r": 4, "alpha": 8.0}
UPDATE = dict(mini_batch_size=4, micro_batch_size=2, epochs=2, use_kl_loss=True)
runner = CliRunner()


def lora_actor(group=None, **lora) -> Actor:
    rank, world = (group.rank, group.world_size) if group is not None else (0, 1)
    return Actor(ActorConfig(optim={"lr": 1e-2, "grad_clip": 1.0}, lora={**LORA, **lora}),
                 RoleContext("actor", rank, world, 0, group=group))


def sequences(batch) -> DataProto:
    """``batch``'s token columns alone: what a log-prob operator reads (its own output not yet there)."""
    return DataProto.from_dict({k: batch.batch[k] for k in ("input_ids", "attention_mask", "position_ids",
                                                             "responses")})


def ref_log_probs(role, batch) -> torch.Tensor:
    return logprob.ref(role, sequences(batch)).batch["ref_log_prob"]


def base_log_probs(batch) -> torch.Tensor:
    """The plain builtin:tiny's log-probs: what the reference must give."""
    return ref_log_probs(Actor(ActorConfig(), RoleContext("ref", 0, 1, 0, frozen=True)), batch)


@pytest.fixture(scope="module")
def batch():
    return update_batch()


def test_only_the_adapters_change_and_hold_optimizer_state(batch):
    actor = lora_actor()
    named = dict(actor.model.named_parameters())
    before = {n: p.detach().clone() for n, p in named.items()}
    actor_ops.update(actor, batch, **UPDATE)
    adapters = [n for n in named if ".lora_" in n]
    assert adapters and all(named[n].requires_grad for n in adapters)
    for n, p in named.items():
        if ".lora_" in n:
            continue
        assert not p.requires_grad and torch.equal(p, before[n]), n  # the base, bit for bit
    assert all(not torch.equal(named[n], before[n]) for n in adapters if ".lora_B." in n)
    in_optimizer = {id(p) for g in actor.optimizer.param_groups for p in g["params"]}
    assert in_optimizer == {id(named[n]) for n in adapters}
    assert {id(p) for p in actor.optimizer.state} == in_optimizer


def test_the_reference_is_the_base_before_and_after_updates(batch):
    actor = lora_actor()
    reference = actor.frozen_view()
    assert isinstance(reference, BaseView)
    base = base_log_probs(batch)
    torch.testing.assert_close(ref_log_probs(reference, batch), base, rtol=0, atol=1e-6)
    for _ in range(2):
        actor_ops.update(actor, batch, **UPDATE)
    policy = logprob.old(actor, sequences(batch)).batch["old_log_probs"]
    assert (policy - base).abs().max() > 1e-3  # the adapters moved the policy away from the base
    torch.testing.assert_close(ref_log_probs(reference, batch), base, rtol=0, atol=1e-6)
    # the adapters are on again after the reference's pass
    torch.testing.assert_close(logprob.old(actor, sequences(batch)).batch["old_log_probs"], policy, rtol=0, atol=0)


def test_merged_weights_are_peft_merge_and_the_rollout_source(batch):
    actor = lora_actor()
    actor_ops.update(actor, batch, **UPDATE)
    merged = dict(actor.train_engine.named_weights())
    import copy

    expected = copy.deepcopy(actor.model).merge_and_unload().state_dict()
    assert sorted(merged) == sorted(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(merged[name], tensor, rtol=0, atol=1e-7)
    assert sorted(actor.get_weights()) == sorted(expected)
    # another pool's copy (same config) loads them and computes the merged model
    copy_actor = lora_actor()
    copy_actor.set_weights(actor.get_weights())
    torch.testing.assert_close(logprob.old(copy_actor, sequences(batch)).batch["old_log_probs"],
                               logprob.old(actor, sequences(batch)).batch["old_log_probs"], rtol=0, atol=1e-5)


# ---------------------------------------------------------------- the graph: validate


def ppo(**extra):
    return load_graph("ppo", overrides={"roles.actor.lora": dict(LORA), **extra})


def test_validate_explains_the_reference_and_builds_no_copy():
    g = ppo()
    assert g.check().ok
    train = next(s for s in pool_specs(g) if s.name == "train")
    ref = next(b for b in train.roles if b.name == "ref")
    assert (ref.shares, ref.frozen, ref.factory is not None) == ("actor", True, True) and ref.config is None
    notes = role_notes(g)
    assert len(notes) == 1 and "'ref'" in notes[0] and "adapters switched off" in notes[0]
    out = runner.invoke(app, ["validate", "ppo", "--set", "roles.actor.lora={r: 4}"], catch_exceptions=False)
    assert out.exit_code == 0 and "adapters switched off" in " ".join(out.output.split())
    # without lora the reference is a copy of its own, and nothing to note
    plain = load_graph("ppo")
    assert role_notes(plain) == []
    assert next(b for s in pool_specs(plain) for b in s.roles if b.name == "ref").shares is None


@pytest.mark.parametrize("lora, words", [
    ({"r": 0}, "greater than or equal to 1"),
    ({"alpha": 0}, "greater than 0"),
    ({"dropout": 1.0}, "less than 1"),
    ({"target_modules": ["q_proj", "qkv_proj"]}, "['qkv_proj'] match no linear module"),
    ({"rank": 4}, "unknown parameter 'lora.rank'"),
])
def test_validate_rejects_a_bad_lora_block_naming_it(lora, words):
    report = load_graph("ppo", overrides={"roles.actor.lora": lora}).check()
    assert not report.ok
    text = " ".join(str(e) for e in report.errors)
    assert "role 'actor'" in text and words in text, text
    if "match no" in words:  # the model's own linear module names, to pick from
        assert "down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj" in text


def test_validate_rejects_lora_on_a_role_that_does_not_train(tmp_path):
    data = yaml.safe_load((Path(__file__).parents[1] / "graphs" / "ppo.yaml").read_text())
    data["roles"]["actor"]["lora"] = dict(LORA)
    del data["nodes"]["update_actor"]
    (tmp_path / "g.yaml").write_text(yaml.safe_dump(data))
    g = load_graph(tmp_path / "g.yaml")
    errors = [str(e) for e in g.check().errors]
    assert any("role 'actor' has lora but no node trains it" in e for e in errors), errors
    g = load_graph("ppo", overrides={"roles.ref.lora": dict(LORA)})
    errors = [str(e) for e in g.check().errors]
    assert any("role 'ref' is derived from 'actor'" in e and "set lora on 'actor'" in e for e in errors), errors


# ---------------------------------------------------------------- a run: resume, export

TINY = {"data.batch_size": 4, "nodes.generate.n": 2, "nodes.generate.max_new_tokens": 4,
        "trainer.checkpoint_every": 2, "roles.actor.lora": dict(LORA), "roles.actor.optim.lr": 1e-2}
KEYS = ("actor/pg_loss", "actor/grad_norm", "actor/approx_kl", "actor/entropy", "critic/vf_loss", "reward/mean",
        "response_length/mean")


def train(out: Path, steps: int, resume: bool = False):
    g = load_graph("ppo", overrides=TINY)
    return Trainer(g, backend="local", steps=steps, out=out, resume=resume, say=lambda m: None).run()


def metrics(out: Path):
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [[r.get(k) for k in KEYS] for r in rows]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-runs")
    train(root / "full", steps=4)
    train(root / "part", steps=2)
    train(root / "part", steps=4, resume=True)
    return root


def test_resume_is_bit_exact_and_checkpoints_hold_adapters_only(runs):
    full, part = metrics(runs / "full"), metrics(runs / "part")
    assert len(full) == 4 and full[-1][0] is not None
    assert part == full  # exact equality, not approximate
    state, _, _ = CheckpointStore.of_run(runs / "full").read_role("actor", 4)
    assert state["model"] and all(".lora_" in k for k in state["model"])
    assert {k for k in state["optimizer"]["state"]} == set(state["model"])


def test_export_writes_a_merged_model_and_a_peft_adapter(runs, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = runner.invoke(app, ["export", str(runs / "full"), str(tmp_path / "hf")], catch_exceptions=False)
    assert out.exit_code == 0, out.output
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert not any("lora" in n for n in merged.state_dict())
    adapted = PeftModel.from_pretrained(load_model("builtin:tiny")[0], tmp_path / "hf" / "adapter")
    state, _, _ = CheckpointStore.of_run(runs / "full").read_role("actor", 4)
    policy = lora_actor()
    policy.load_state_dict(state)  # flowrl's policy at step 4
    ids = AutoTokenizer.from_pretrained(tmp_path / "hf")(["copy 3 7 =", "copy 1 2 ="])["input_ids"]
    prompts = torch.tensor(ids)
    greedy = dict(do_sample=False, max_new_tokens=6, pad_token_id=0)
    expected = policy.model.generate(input_ids=prompts, **greedy)
    assert torch.equal(merged.generate(input_ids=prompts, **greedy), expected)
    assert torch.equal(adapted.generate(input_ids=prompts, **greedy), expected)


def test_eval_scores_a_lora_checkpoint_as_the_plain_model_with_the_adapters_merged_in(runs):
    """``flowrl eval`` of a LoRA run puts the checkpoint's adapters on the base; its scores equal those of
    the plain graph (no lora) given the merged weights, and differ from the base's."""
    from operators.evaluate import evaluate

    out = runner.invoke(app, ["eval", str(runs / "full"), "--json", "--prompts", "16"], catch_exceptions=False)
    assert out.exit_code == 0, out.output
    scored = json.loads(out.output)
    state, _, _ = CheckpointStore.of_run(runs / "full").read_role("actor", 4)
    policy = lora_actor()
    policy.load_state_dict(state)
    merged = dict(merged_weights(policy.model))
    plain = load_graph("ppo", overrides={k: v for k, v in TINY.items() if k != "roles.actor.lora"})
    assert evaluate(plain, merged, size=16).score == pytest.approx(scored["score"], abs=0)
    assert evaluate(plain, None, size=16).score != scored["score"]


# ---------------------------------------------------------------- FSDP2 on two ranks


def _lora_update_on_rank(state, part) -> dict[str, torch.Tensor] | None:
    actor = lora_actor(state["group"])
    actor_ops.update(actor, part, **UPDATE)
    return actor.get_weights()


def test_a_two_rank_fsdp2_lora_update_equals_one_process(ranks, batch):  # noqa: F811
    parts = []
    for rows in SPLIT:  # what a balanced dispatch hands each rank
        part = batch[torch.tensor(rows)]
        part.meta_info = {**part.meta_info, TASK_ROWS: (rows, len(batch))}
        parts.append(part)
    got = on_ranks(ranks, _lora_update_on_rank, parts)
    assert got[1] is None  # the full weights land on rank 0
    single = lora_actor()
    before = dict(merged_weights(single.model))
    actor_ops.update(single, batch, **UPDATE)
    expected = single.get_weights()
    assert sorted(got[0]) == sorted(expected)
    moved = max(float((expected[n] - before[n]).abs().max()) for n in expected)
    assert moved > 1e-4  # the update changed the merged weights
    worst = max(float((got[0][n] - expected[n]).abs().max()) for n in expected)
    assert worst <= 1e-5, worst


# ---------------------------------------------------------------- vLLM: merged weights pushed, checked

HAS_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed here: docs/lora.md runs this test with "
                    "build/vllm-venv's python")
@pytest.mark.timeout(1200)  # its own vLLM engine start: 283 s at a load of 6-25 on 2 cores
def test_a_lora_actor_pushes_merged_weights_into_vllm_and_the_check_bites(batch):
    from operators.rollout.vllm_engine import WeightSyncError

    options = {"kv_cache_mib": 64, "max_num_seqs": 64, "weight_bucket_mb": 0.5, "gpu_memory_utilization": 0.3}
    actor = Actor(ActorConfig(optim={"lr": 1e-2, "grad_clip": 1.0}, lora=dict(LORA),
                              rollout={"engine": "vllm", "engine_kwargs": options}), RoleContext("actor", 0, 1, 0))
    engine = actor.engine  # started from the merged copy of the weights (plain Hugging Face names)
    try:
        for _ in range(2):
            actor_ops.update(actor, batch, **UPDATE)
        metrics = actor.set_version(1)  # the merged push, stamped, and the probe check
        assert metrics["rollout/weight_check_max_diff"] <= 1e-3 and engine.weight_version == 1
        # the base alone, adapters not folded in, is caught by the same check
        base = actor.model.get_base_model()
        actor.train_engine.named_weights = lambda: ((n.replace(".base_layer.", "."), t)
                                                    for n, t in base.state_dict().items() if ".lora_" not in n)
        with pytest.raises(WeightSyncError, match="weight check after push"):
            actor.set_version(2)
    finally:
        actor.close()
