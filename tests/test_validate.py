"""``flowrl validate`` refuses what the run would refuse: datasets, tokenizers, vocabularies, model directories.

Each case is an input a run rejects at its first step (or while loading); validate must exit 1
naming the file, row or key, without a traceback. Nothing here trains or starts Ray.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from flowrl.cli import app

runner = CliRunner()


def validate(*overrides: str):
    args = ["validate", "grpo"]
    for item in overrides:
        args += ["--set", item]
    res = runner.invoke(app, args, catch_exceptions=False)
    assert "Traceback" not in res.output
    return res


def error_lines(res) -> list[str]:
    return [line for line in res.output.splitlines() if line.startswith("error")]


def row(i: int, **changes) -> dict:
    out = {"prompt": [{"role": "user", "content": f"copy {i % 10} {(3 * i) % 10} ="}], "data_source": "builtin:copy",
           "reward_model": {"style": "rule", "ground_truth": f"{i % 10} {(3 * i) % 10}"}, "extra_info": {"index": i}}
    return {**out, **changes}


def write(path: Path, rows: list[dict]) -> Path:
    if path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def rejected(res, *parts: str) -> str:
    """The one error line that names every part (a file, a row, a key); fails unless validate exited 1."""
    assert res.exit_code == 1, res.output
    lines = [line for line in error_lines(res) if all(p in line for p in parts)]
    assert lines, f"no error line names {parts}: {res.output}"
    return lines[0]


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_a_good_file_validates(tmp_path, suffix):
    data = write(tmp_path / f"train{suffix}", [row(i) for i in range(64)])
    res = validate(f"data.source={data}")
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_a_prompt_that_is_an_int(tmp_path, suffix):
    data = write(tmp_path / f"train{suffix}", [row(i, prompt=7) for i in range(64)])
    line = rejected(validate(f"data.source={data}"), f"train{suffix}", "'prompt'")
    assert "grpo.yaml:" in line


ROW_PROBLEMS = [
    ({"reward_model": {"style": "rule"}}, "needs a 'ground_truth' key"),
    ({"reward_model": {"style": "human", "ground_truth": "1"}}, "reward_model.style is 'human'"),
    ({"extra_info": "abc"}, "'extra_info' is str"),
    ({"prompt": [{"content": "copy 1 2 ="}]}, "'prompt' is"),
    ({"data_source": None}, "no value for column 'data_source'"),
]


@pytest.mark.parametrize("changes, says", ROW_PROBLEMS)
def test_a_jsonl_row_that_does_not_fit_verls_schema(tmp_path, changes, says):
    rows = [row(i) for i in range(64)]
    rows[5] = row(5, **changes)
    data = write(tmp_path / "train.jsonl", rows)
    rejected(validate(f"data.source={data}"), "train.jsonl", "row 5", says)


@pytest.mark.parametrize("changes, says", [ROW_PROBLEMS[1], ROW_PROBLEMS[4]])
def test_a_sampled_parquet_row_that_does_not_fit(tmp_path, changes, says):
    rows = [row(i) for i in range(64)]
    rows[5] = row(5, **changes)
    data = write(tmp_path / "train.parquet", rows)
    rejected(validate(f"data.source={data}"), "train.parquet", "row 5", says)


@pytest.mark.parametrize("changes, says", [
    ({"reward_model": "1 2"}, "column 'reward_model' has type string"),
    ({"reward_model": {"style": "rule"}}, "column 'reward_model' has type struct"),
    ({"extra_info": "abc"}, "column 'extra_info' has type string"),
    ({"prompt": [{"content": "copy 1 2 ="}]}, "row 0: 'prompt' is"),
])
def test_a_parquet_column_that_no_row_fits(tmp_path, changes, says):
    """A column's type in a parquet file is one for all rows: its schema names it before a row is read."""
    data = write(tmp_path / "train.parquet", [row(i, **changes) for i in range(64)])
    rejected(validate(f"data.source={data}"), "train.parquet", says)


def test_fewer_rows_than_a_batch(tmp_path):
    data = write(tmp_path / "train.parquet", [row(i) for i in range(4)])
    rejected(validate(f"data.source={data}"), "batch_size=32 exceeds its 4 rows")
    rejected(validate("data.task_size=8"), "builtin:copy: batch_size=32 exceeds its 8 rows")


@pytest.mark.parametrize("key", ["source", "val_source"])
def test_an_unknown_builtin_task(key):
    rejected(validate(f"data.{key}=builtin:nosuch"), "unknown builtin task 'builtin:nosuch'", "builtin:copy")


def test_words_outside_the_builtin_vocabulary(tmp_path):
    rows = [row(i, prompt=[{"role": "user", "content": "hello world"}]) for i in range(64)]
    data = write(tmp_path / "train.jsonl", rows)
    rejected(validate(f"data.source={data}"), "train.jsonl", "row 0", "'hello', 'world'")
    # builtin:tiny-tools reads characters, not builtin:copy's words
    rejected(validate("roles.actor.model=builtin:tiny-tools"), "builtin:copy", "'copy'")


def test_a_prompt_over_max_prompt_length_when_that_is_an_error(tmp_path):
    rows = [row(i, prompt=[{"role": "user", "content": " ".join(["copy 1 2"] * 20)}]) for i in range(64)]
    data = write(tmp_path / "train.jsonl", rows)
    rejected(validate(f"data.source={data}", "data.max_prompt_length=16"), "row 0", "max_prompt_length=16")
    assert validate(f"data.source={data}", "data.max_prompt_length=16", "data.truncation=left").exit_code == 0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from operators.models.loading import load_model, save_model

    model, tokenizer = load_model("builtin:tiny")
    return save_model(model, tokenizer, tmp_path_factory.mktemp("models") / "tiny")


def broken_copy(model_dir: Path, tmp_path: Path, *remove: str) -> Path:
    out = shutil.copytree(model_dir, tmp_path / "model")
    for pattern in remove:
        for f in out.glob(pattern):
            f.unlink()
    return out


def test_a_saved_model_directory_validates(model_dir):
    assert validate(f"roles.actor.model={model_dir}").exit_code == 0


@pytest.mark.parametrize("remove, says", [
    (("*.safetensors",), "has no weights"),
    (("tokenizer*",), "has no tokenizer"),
])
def test_a_model_directory_without_weights_or_tokenizer(model_dir, tmp_path, remove, says):
    bad = broken_copy(model_dir, tmp_path, *remove)
    rejected(validate(f"roles.actor.model={bad}"), "role 'actor'", "'model'", says)


def test_a_tokenizer_without_a_chat_template(model_dir, tmp_path):
    bad = broken_copy(model_dir, tmp_path, "chat_template.*")
    rejected(validate(f"roles.actor.model={bad}"), "has no chat template")
    rejected(validate(f"data.tokenizer={bad}"), "has no chat template")


@pytest.mark.parametrize("spec, says", [("builtin:nosuch", "unknown builtin model"),
                                        ("/no/such/tokenizer", "no such directory")])
def test_a_data_tokenizer_that_does_not_load(spec, says):
    rejected(validate(f"data.tokenizer={spec}"), says)


def test_a_model_config_that_transformers_refuses(model_dir, tmp_path):
    bad = broken_copy(model_dir, tmp_path)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "hidden_size": "big"}))
    rejected(validate(f"roles.actor.model={bad}"), "role 'actor'", "transformers cannot load", "hidden_size")


def test_max_new_tokens_the_engine_cannot_allocate():
    rejected(validate("nodes.generate.max_new_tokens=1000000000"), "node 'generate'", "'max_new_tokens'")


def test_more_samples_than_the_rollout_can_allocate():
    # the engine allocates every response's buffers before the first token: a billion samples of each
    # prompt fails on the allocation; validate says so, naming the node and its parameter
    line = rejected(validate("nodes.generate.n=1000000000"), "node 'generate'", "field 'n'", "GiB")
    assert "grpo.yaml:" in line
    assert validate("nodes.generate.n=64").exit_code == 0


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_a_data_source_without_a_builtin_reward(tmp_path, suffix):
    # fn: auto picks the rule by data_source; the run fails at the first step that scores row 40
    rows = [row(i) for i in range(64)]
    rows[40] = row(40, data_source="myorg/copy")
    data = write(tmp_path / f"train{suffix}", rows)
    # the default job names its reward (task_eos); fn: auto is what reads data_source
    rejected(validate(f"data.source={data}", "nodes.reward.fn=auto"), "node 'reward'", f"train{suffix}", "row 40",
             "'myorg/copy'")
    assert validate(f"data.source={data}", "nodes.reward.fn=exact").exit_code == 0
    assert validate(f"data.val_source={data}", "nodes.reward.fn=partial").exit_code == 0
    rejected(validate(f"data.val_source={data}", "nodes.reward.fn=auto"), "node 'reward'", "row 40")


def test_the_default_jobs_task_reward_pointed_at_other_data_is_a_warning(tmp_path):
    # the default job names task_eos; a user who swaps in their own file keeps it unless told
    from flowrl.graph import load_graph
    from flowrl.graph.checks import ParameterWarning, check

    data = write(tmp_path / "train.jsonl", [row(i, data_source="myorg/copy") for i in range(8)])
    [warning] = [w for w in check(load_graph("grpo", overrides={"data.source": str(data)})).warnings
                 if isinstance(w, ParameterWarning)]
    assert (warning.node, warning.field) == ("reward", "fn") and "fn=auto" in warning.fix
    assert not check(load_graph("grpo")).warnings  # a builtin task: its own reward
    assert not check(load_graph("grpo", overrides={"data.source": str(data), "nodes.reward.fn": "exact"})).warnings


# ---------------------------------------------------------------- what YAML itself would hide

# written here, not read from graphs/: the lines the tests name must not move when the default job does
GRAPH = """name: g
description: GRPO on the copy task
roles:
  actor: {model: builtin:tiny, optim: {lr: 5.0e-4}}
pools:
  train: {workers: 1, cpus: 1, roles: [actor]}
data: {source: builtin:copy, batch_size: 32}
nodes:
  generate:     {op: rollout.generate, n: 8, max_new_tokens: 8}
  reward:       {op: reward.rule}
  advantage:    {op: advantage.grpo, inputs: {token_level_rewards: token_level_scores}}
  update_actor: {op: actor.update, inputs: {old_log_probs: rollout_log_probs}}
trainer: {steps: 300}
"""


def graph_file(tmp_path: Path, old: str = "", new: str = "", head: str = "") -> Path:
    assert old in GRAPH
    path = tmp_path / "g.yaml"
    path.write_text(head + GRAPH.replace(old, new, 1))
    return path


def validate_file(path: Path, timeout: float = 120):
    """``flowrl validate path`` in its own process: a graph that expands without bound must not hang the
    test run (the timeout is a guard against a hang, not a measure of speed)."""
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-m", "flowrl.cli", "validate", str(path)], capture_output=True,
                          text=True, env=env, timeout=timeout)


def test_a_yaml_alias_bomb_is_refused_not_expanded(tmp_path):
    levels = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    levels += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
    bomb = graph_file(tmp_path, "description: GRPO on the copy task", "description: *a8",
                      head="x-aliases:\n" + "".join(f"  {line}\n" for line in levels))
    assert len(bomb.read_bytes()) < 1200
    res = validate_file(bomb)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "MemoryError" not in res.stderr and "Traceback" not in res.stderr
    assert f"{bomb}:1" in res.stderr and "expand to more than" in res.stderr


def test_a_recursive_alias_and_deep_nesting_are_refused(tmp_path):
    loop = graph_file(tmp_path, "description: GRPO on the copy task", "description: &loop [*loop]")
    res = runner.invoke(app, ["validate", str(loop)], catch_exceptions=False)
    rejected(res, str(loop), "expand to more than")
    deep = tmp_path / "deep.yaml"
    deep.write_text("name: x\ndescription: " + "[" * 3000 + "]" * 3000 + "\n")
    res = runner.invoke(app, ["validate", str(deep)], catch_exceptions=False)
    assert res.exit_code == 1 and "nested too deeply" in res.output


def test_a_node_defined_twice_is_refused_naming_both_lines(tmp_path):
    twice = graph_file(tmp_path, "  reward:       {op: reward.rule}\n",
                       "  reward:       {op: reward.rule}\n  reward: {op: reward.rule, fn: exact}\n")
    first, again = 10, 11
    res = runner.invoke(app, ["validate", str(twice)], catch_exceptions=False)
    line = rejected(res, f"{twice}:{again}", "node 'reward'", f"lines {first} and {again}")
    assert "defined twice" in line


def test_a_key_written_twice_is_refused(tmp_path):
    twice = graph_file(tmp_path, "trainer: {steps: 300}", "trainer: {steps: 5, steps: 300}")
    res = runner.invoke(app, ["validate", str(twice)], catch_exceptions=False)
    rejected(res, f"{twice}:13", "'trainer.steps'", "twice")
    # a key given again beside a merged mapping (<<) overrides it, as YAML means: not written twice
    merged = graph_file(tmp_path, "optim: {lr: 5.0e-4}", "optim: {<<: {lr: 1.0e-3}, lr: 5.0e-4}")
    res = runner.invoke(app, ["validate", str(merged)], catch_exceptions=False)
    assert res.exit_code == 0, res.output
