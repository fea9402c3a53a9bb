"""examples/own-model end to end, as docs/your-own.md tells a user to run it: make the model and
the data, validate, run 2 steps; then check that the run used the user's model, files and reward."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from tests.test_docs import ROOT, blocks, run_block, shell

PAGE = ROOT / "docs" / "your-own.md"
EXAMPLE = ROOT / "examples" / "own-model"


def example_module():
    sys.path.insert(0, str(EXAMPLE))
    try:
        import my_reward
    finally:
        sys.path.remove(str(EXAMPLE))
    return my_reward


def test_the_reward_credits_words_up_to_the_first_wrong_one_less_extra_words():
    score = example_module().compute_score
    assert score("my_reverse", "7 3", "7 3", {}) == 1.0
    assert score("my_reverse", "7 4", "7 3", {}) == 0.5
    assert score("my_reverse", "3 3", "7 3", {}) == 0.0  # right in second place only: no credit
    assert score("my_reverse", "7 3 3", "7 3", {}) == pytest.approx(0.9)
    assert score("my_reverse", "", "7 3", {}) == 0.0


def test_the_page_shows_the_example_s_own_graph_and_reward():
    shown = {b.kind: b.text for b in blocks(PAGE) if b.mark == "snippet" and "examples/own-model" in b.reason}
    graph = "".join(line for line in (EXAMPLE / "graph.yaml").read_text(encoding="utf-8").splitlines(keepends=True)
                    if not line.startswith("#"))
    assert shown["yaml"] == graph
    reward = (EXAMPLE / "my_reward.py").read_text(encoding="utf-8")
    body = shown["python"].splitlines()
    assert body[0] in reward and all(line in reward.splitlines() for line in body[1:] if line.strip())


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The page's commands, run from a scratch checkout holding a copy of the example."""
    (command,) = [b for b in blocks(PAGE) if b.mark == "run by" and b.reason.startswith("tests/test_examples.py")]
    root = tmp_path_factory.mktemp("checkout")
    cwd, env = shell(root, link=("graphs", "tests"))
    shutil.copytree(EXAMPLE, cwd / "examples" / "own-model",
                    ignore=shutil.ignore_patterns("model", "data", "runs", "__pycache__"))
    done = run_block(command.text, cwd, env)
    assert done.returncode == 0, f"{command.where} exited {done.returncode}:\n{(done.stdout + done.stderr)[-3000:]}"
    return cwd / "examples" / "own-model"


@pytest.mark.timeout(900)  # the first test to use ``run`` pays for it: model, data, validate, 2 steps
def test_the_example_makes_a_model_directory_and_verl_format_files(run):
    import pandas as pd

    assert (run / "model" / "config.json").is_file()
    train = pd.read_parquet(run / "data" / "train.parquet")
    assert {"prompt", "data_source", "reward_model", "extra_info"} <= set(train.columns) and len(train) == 512
    assert train["reward_model"][0]["ground_truth"] == " ".join(reversed(train["prompt"][0][0]["content"].split()[1:3]))
    val = [json.loads(line) for line in (run / "data" / "val.jsonl").read_text(encoding="utf-8").splitlines()]
    assert len(val) == 64 and val[0]["data_source"] == "my_reverse"


def test_the_two_step_run_trains_validates_and_saves(run):
    out = run / "runs" / "own-model"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert "val/reward/mean" in rows[-1]  # the held-out jsonl, scored at the end
    assert (out / "checkpoints" / "step_00000002").is_dir()


def test_every_sample_was_scored_by_the_user_s_compute_score(run):
    score = example_module().compute_score
    dumps = sorted((run / "runs" / "own-model" / "rollouts").glob("step_*.jsonl"))
    assert len(dumps) == 2
    for dump in dumps:
        samples = [json.loads(line) for line in dump.read_text(encoding="utf-8").splitlines()]
        assert len(samples) == 16 * 8
        for s in samples:
            truth = " ".join(reversed(s["prompts"].split()[1:3]))
            assert sum(s["token_level_scores"]) == pytest.approx(score("my_reverse", s["responses"], truth, {}), abs=1e-6)
