"""``flowrl eval``: a run's checkpointed policy, or a graph's base model, scored on held-out prompts."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from flowrl.cli import app
from flowrl.graph import load_graph
from flowrl.run.trainer import Trainer
from operators.evaluate import EvalError, evaluate

# builtin:tiny on the copy task, 2 steps, validated and checkpointed at step 2 on 8 held-out prompts
TINY = {"data.batch_size": 4, "nodes.generate.n": 2, "nodes.generate.max_new_tokens": 4, "data.val_size": 8,
        "trainer.val_every": 2, "trainer.checkpoint_every": 2}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("grpo")
    history = Trainer(load_graph("grpo", overrides=TINY), backend="local", steps=2, out=out).run()
    return out, history


def _eval(*args: str) -> tuple[int, dict | str]:
    result = CliRunner().invoke(app, ["eval", *args, "--json"])
    if result.exit_code:
        return result.exit_code, " ".join(result.output.split())
    return 0, json.loads(result.stdout)


def test_eval_of_a_run_is_its_validation_at_the_checkpoint_and_greedy_is_deterministic(run_dir):
    """The newest checkpoint's policy on the run's own held-out prompts: greedy, its mean reward is the
    val/reward/mean the run reported at that step; two greedy evals agree; pass@k bounds mean@k."""
    out, history = run_dir
    code, first = _eval(str(out), "-k", "4", "--temperature", "1.0")
    assert code == 0, first
    assert first["prompts"] == 8 and first["policy"].endswith("step_00000002") and first["k"] == 4
    assert first["score"] == pytest.approx(history[-1]["val/reward/mean"], abs=1e-6)
    for key in ("pass_at_1", "pass_at_k", "mean_at_k", "score"):
        assert 0.0 <= first[key] <= 1.0, key
    assert first["pass_at_k"] >= first["mean_at_k"]
    code, again = _eval(str(out), "--checkpoint", "2", "-k", "4")
    assert code == 0 and again == first
    code, base = _eval("grpo", "--base", "--prompts", "4", *(f"--set={k}={v}" for k, v in TINY.items()))
    assert code == 0 and base["policy"] == "the base model" and base["pass_at_k"] is None and base["prompts"] == 4


def test_eval_names_what_it_cannot_evaluate(run_dir, tmp_path):
    out, _ = run_dir
    code, text = _eval(str(out), "--checkpoint", "5")
    assert code == 1 and "no checkpoint for step 5; available steps: 2" in text
    code, text = _eval(str(tmp_path))
    assert code == 1 and "no complete checkpoint" in text
    code, text = _eval(str(tmp_path / "nothing"))
    assert code == 1 and "is no run directory" in text and "--base" in text
    code, text = _eval(str(out), "--base")
    assert code == 2 and "--base takes a graph" in text
    code, text = _eval(str(out), "--role", "critic")
    assert code == 1 and "no role 'critic'" in text
    code, text = _eval("grpo", "--set", "data.batch_size=4")
    assert code == 2 and "--set changes the graph of --base" in text

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": "copy 3 7 =", "data_source": "builtin:copy",
                                           "reward_model": {"ground_truth": "3 7"}}) + "\n" for _ in range(8)))
    code, text = _eval("grpo", "--base", f"--set=data.source={prompts}", "--set=nodes.reward.fn=auto",
                       "--set=data.batch_size=4")
    assert code == 1 and "no held-out split" in text and "data.val_source" in text
    with pytest.raises(EvalError, match="k >= 0"):
        evaluate(load_graph("grpo"), k=-1)
