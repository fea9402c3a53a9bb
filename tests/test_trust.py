"""Runs people can trust: bad input, run-directory ownership, SIGTERM, durable files, safe checkpoints,
a local-only Ray (issue 13)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save

from flowrl.graph import load_graph
from flowrl.store.checkpoint import CheckpointStore
from flowrl.store.rundir import LOCK_NAME, RunDirectory, RunDirectoryError
from flowrl.run.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
TINY = {"data.batch_size": 4, "nodes.generate.n": 2, "nodes.generate.max_new_tokens": 4}
TINY_SET = [x for k, v in TINY.items() for x in ("--set", f"{k}={v}")]
VALUES = ("step", "reward/mean", "actor/pg_loss", "actor/entropy", "actor/grad_norm")


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, COLUMNS="400", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **extra)
    env.pop("FORCE_COLOR", None)
    return env


def cli(*args: str, cwd: Path = ROOT, timeout: float = 240, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flowrl.cli", *args], cwd=cwd, env=_env(**env),
                          capture_output=True, text=True, timeout=timeout)


def flat(text: str) -> str:
    return " ".join(text.split())


def train(out: Path, steps: int, resume: bool = False, say=lambda m: None, **extra):
    g = load_graph("grpo", overrides={**TINY, **extra})
    return Trainer(g, backend="local", steps=steps, out=out, resume=resume, say=say).run()


def rows(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _read(path: Path) -> bytes:
    return path.read_bytes() if path.is_file() else b""


def values(rs: list[dict]) -> list[tuple]:
    return [tuple(r[k] for k in VALUES) for r in rs]


# ---------------------------------------------------------------- the bad-input catalogue
class Evil:
    """Unpickling this runs a shell command: what a crafted checkpoint would carry."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _grpo_yaml(tmp: Path, **changes: str) -> Path:
    text = (ROOT / "graphs" / "grpo.yaml").read_text()
    for old, new in changes.items():
        assert old in text
        text = text.replace(old, new)
    path = tmp / "g.yaml"
    path.write_text(text)
    return path


def case_binary_file(tmp: Path) -> list[str]:
    (tmp / "bin.yaml").write_bytes(bytes(range(256)) * 4)
    return ["validate", str(tmp / "bin.yaml")]


def case_set_into_a_scalar(tmp: Path) -> list[str]:
    return ["validate", "grpo", "--set", "data.batch_size.x=1"]


def case_import_that_raises(tmp: Path) -> list[str]:
    (tmp / "broken_mod.py").write_text("raise RuntimeError('boom at import')\n")
    text = (ROOT / "graphs" / "grpo.yaml").read_text()
    (tmp / "g.yaml").write_text("imports: [broken_mod]\n" + text)
    return ["validate", str(tmp / "g.yaml")]


def case_name_is_a_path(tmp: Path) -> list[str]:
    g = _grpo_yaml(tmp, **{"name: grpo": "name: ../../x"})
    return ["validate", str(g)]


def case_set_applies_to_python_graphs(tmp: Path) -> list[str]:
    return ["validate", "graphs/grpo.py", "--set", "data.batch_size=0"]


def case_resume_and_overwrite(tmp: Path) -> list[str]:
    return ["run", "grpo", "--resume", "--overwrite", "--out", str(tmp / "run")]


def case_fresh_run_over_another_run(tmp: Path) -> list[str]:
    (tmp / "run").mkdir()
    (tmp / "run" / "metrics.jsonl").write_text('{"step": 1}\n')
    return ["run", "grpo", "--backend", "local", "--out", str(tmp / "run"), *TINY_SET]


def case_nothing_to_resume(tmp: Path) -> list[str]:
    return ["run", "grpo", "--backend", "local", "--resume", "--out", str(tmp / "run"), *TINY_SET]


def case_meta_without_graph(tmp: Path) -> list[str]:
    ck = tmp / "run" / "checkpoints" / "step_00000002"
    ck.mkdir(parents=True)
    (ck / "meta.json").write_text("{}")
    for name in ("workers.pt", "weights.pt"):
        torch.save({}, ck / name)
    return ["run", "grpo", "--backend", "local", "--resume", "--out", str(tmp / "run"), *TINY_SET]


def case_checkpoint_with_a_callable(tmp: Path) -> list[str]:
    ck = tmp / "run" / "checkpoints" / "step_00000002"
    ck.mkdir(parents=True)
    (ck / "meta.json").write_text(json.dumps({"graph": {}}))
    torch.save({"x": Evil(tmp / "pwned")}, ck / "workers.pt")
    torch.save({}, ck / "weights.pt")
    return ["run", "grpo", "--backend", "local", "--resume", "--out", str(tmp / "run"), *TINY_SET]


def case_measured_with_a_torn_line(tmp: Path) -> list[str]:
    (tmp / "run").mkdir()
    (tmp / "run" / "metrics.jsonl").write_text('{"step": 1, "timing/generate": 0.5}\n{"step": 2, "timing/gen')
    return ["plan", "grpo", "--measured", str(tmp / "run")]


def case_unknown_graph(tmp: Path) -> list[str]:
    return ["validate", "no_such_graph"]


def case_misspelled_reward_fn(tmp: Path) -> list[str]:
    return ["validate", "grpo", "--set", "nodes.reward.fn=arithh"]


def case_dataset_without_reward_model(tmp: Path) -> list[str]:
    (tmp / "d.jsonl").write_text(json.dumps({"prompt": [{"role": "user", "content": "1+1"}],
                                             "data_source": "x"}) + "\n")
    return ["validate", "grpo", "--set", f"data.source={tmp / 'd.jsonl'}"]


def case_dataset_with_a_byte_that_is_not_utf8(tmp: Path) -> list[str]:
    good = json.dumps({"prompt": [{"role": "user", "content": "copy 1 2 ="}], "data_source": "x",
                       "reward_model": {"ground_truth": "1 2"}})
    (tmp / "d.jsonl").write_bytes(good.encode() + b"\n" + good.encode().replace(b"copy", b"c\xffpy") + b"\n")
    return ["validate", "grpo", "--set", f"data.source={tmp / 'd.jsonl'}"]


def case_zero_row_dataset(tmp: Path) -> list[str]:
    (tmp / "d.jsonl").write_text("")
    return ["validate", "grpo", "--set", f"data.source={tmp / 'd.jsonl'}"]


def case_model_dir_without_config(tmp: Path) -> list[str]:
    (tmp / "model").mkdir()
    return ["validate", "grpo", "--set", f"roles.actor.model={tmp / 'model'}"]


def case_top_k_out_of_range(tmp: Path) -> list[str]:
    return ["validate", "grpo", "--set", "nodes.generate.top_k=-2"]


def case_kl_loss_without_reference(tmp: Path) -> list[str]:
    return ["validate", "grpo", "--set", "nodes.update_actor.use_kl_loss=true"]


def case_validation_with_nothing_that_scores(tmp: Path) -> list[str]:
    g = _grpo_yaml(tmp, **{"  reward:       {op: reward.rule, fn: task_eos}\n": "",
                          "inputs: {token_level_rewards: token_level_scores}": "inputs: {token_level_rewards: rw}",
                          "name: grpo": "name: g\nimports: [mymod]"})
    (tmp / "mymod.py").write_text(
        "from flowrl.graph import operator\n"
        "@operator('mymod.const', inputs={'responses': 'int64[B, R]'}, outputs={'rw': 'float32[B, R]'})\n"
        "def const(batch, p):\n    return {'rw': batch['responses'].float() * 0}\n")
    return ["validate", str(g)]


def case_staleness_of_a_misspelled_role(tmp: Path) -> list[str]:
    g = _grpo_yaml(tmp, **{"staleness: 0": "staleness: {acter: 1}"})
    return ["validate", str(g)]


def case_bad_data_path_is_one_error(tmp: Path) -> list[str]:
    return ["validate", "grpo", "--set", "data.source=nope.parquet"]


def case_own_operator_next_to_the_graph_file(tmp: Path) -> list[str]:
    (tmp / "mymod.py").write_text((ROOT / "tests" / "userpkg" / "length_penalty.py").read_text()
                                  .replace("userpkg.length_penalty", "mymod.length_penalty"))
    g = _grpo_yaml(tmp, **{"inputs: {token_level_rewards: token_level_scores}": "",
                          "  reward:       {op: reward.rule, fn: task_eos}\n":
                          "  reward:       {op: reward.rule, fn: task_eos}\n  penalty: {op: 'mymod:length_penalty'}\n"})
    return ["validate", str(g)]


def case_prompt_of_the_wrong_type(tmp: Path) -> list[str]:
    row = {"prompt": 7, "data_source": "x", "reward_model": {"ground_truth": "1"}}
    (tmp / "d.jsonl").write_text(json.dumps(row) + "\n")
    return ["validate", "grpo", "--set", f"data.source={tmp / 'd.jsonl'}"]


def case_word_outside_the_tiny_vocabulary(tmp: Path) -> list[str]:
    row = {"prompt": [{"role": "user", "content": "copy 1 2 zebra"}], "data_source": "builtin:copy",
           "reward_model": {"ground_truth": "1 2"}}
    (tmp / "d.jsonl").write_text((json.dumps(row) + "\n") * 4)
    return ["run", "grpo", "--backend", "local", "--steps", "1", "--out", str(tmp / "run"), *TINY_SET,
            "--set", f"data.source={tmp / 'd.jsonl'}"]


def case_ray_address_in_the_environment(tmp: Path) -> tuple[list[str], dict[str, str]]:
    args = ["run", "grpo", "--steps", "1", "--out", str(tmp / "run"), *TINY_SET]
    return args, {"RAY_ADDRESS": "127.0.0.1:1"}  # nothing listens on port 1


# (case, exit code, fragments of the message: each short enough to assert on normalised whitespace)
CATALOGUE = [
    (case_binary_file, 1, ["bin.yaml is not a text file"]),
    (case_set_into_a_scalar, 1, ["--set data.batch_size.x=1", "is not a section"]),
    (case_import_that_raises, 1, ["importing module 'broken_mod' raised RuntimeError: boom at import"]),
    (case_name_is_a_path, 1, ["not a path"]),
    (case_set_applies_to_python_graphs, 1, ["data.batch_size"]),
    (case_resume_and_overwrite, 2, ["give one of them"]),
    (case_fresh_run_over_another_run, 1, ["already holds a run (metrics.jsonl)", "--overwrite"]),
    (case_nothing_to_resume, 1, ["no complete checkpoint", "start without --resume"]),
    (case_meta_without_graph, 1, ["meta.json has no 'graph' mapping", "every checkpoint"]),
    # a checkpoint of the pickled layout before the checkpointer: refused by its format, never unpickled
    (case_checkpoint_with_a_callable, 1, ["written by flowrl before the checkpointer", "checkpoint format 1"]),
    (case_measured_with_a_torn_line, 0, ["metrics.jsonl: line 2 is incomplete"]),
    (case_unknown_graph, 1, ["no graph 'no_such_graph'"]),
    (case_misspelled_reward_fn, 1, ["node 'reward', field 'fn'", "unknown reward function 'arithh'"]),
    (case_dataset_without_reward_model, 1, ["missing required column 'reward_model'"]),
    (case_zero_row_dataset, 1, ["the file has no rows"]),
    (case_dataset_with_a_byte_that_is_not_utf8, 1, ["line 2 is not UTF-8 text (byte 0xff at column", "save the file as UTF-8"]),
    (case_model_dir_without_config, 1, ["(no config.json)"]),
    (case_top_k_out_of_range, 1, ["field 'top_k'", "greater than or equal to -1"]),
    (case_kl_loss_without_reference, 1, ["use_kl_loss: true needs 'ref_log_prob'"]),
    (case_validation_with_nothing_that_scores, 1, ["trainer.val_every asks for validation"]),
    (case_staleness_of_a_misspelled_role, 1, ["schedule.staleness names 'acter'", "did you mean 'actor'?"]),
    (case_bad_data_path_is_one_error, 1, ["7 inputs of advantage, generate, reward have no producer", "1 error"]),
    (case_own_operator_next_to_the_graph_file, 0, ["ok grpo"]),
    (case_prompt_of_the_wrong_type, 1, ["row 0: 'prompt' is int", "a list of chat messages"]),
    (case_word_outside_the_tiny_vocabulary, 1, ["outside the tokenizer's vocabulary ('zebra')"]),
    (case_ray_address_in_the_environment, 1, ["cannot reach the Ray cluster at 127.0.0.1:1 (RAY_ADDRESS"]),
]


@pytest.fixture(scope="module")
def catalogue_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """The selected cases' CLI runs, three at a time (each is mostly a fresh interpreter's imports):
    case → (its directory, a future of its completed process)."""
    selected = [item.callspec.params["make"] for item in request.session.items
                if getattr(item, "originalname", None) == "test_bad_input_gets_a_message_not_a_traceback"]
    with ThreadPoolExecutor(max_workers=3) as pool:
        runs = {}
        for make in selected:
            where = tmp_path_factory.mktemp(make.__name__)
            made = make(where)
            args, env = made if isinstance(made, tuple) else (made, {})
            runs[make] = (where, pool.submit(cli, *args, **env))
        yield runs


@pytest.mark.parametrize("make,code,fragments", CATALOGUE, ids=[c[0].__name__[5:] for c in CATALOGUE])
def test_bad_input_gets_a_message_not_a_traceback(catalogue_runs, make, code, fragments):
    tmp_path, run = catalogue_runs[make]
    res = run.result()
    both = flat(res.stdout + res.stderr)
    assert res.returncode == code, both
    for fragment in fragments:
        assert fragment in both
    assert "Traceback" not in res.stderr
    assert "\x1b[" not in res.stderr  # no colour codes off a terminal
    assert not (tmp_path / "pwned").exists()  # nothing in a checkpoint ran


# ---------------------------------------------------------------- the run directory
def test_a_second_run_on_a_directory_is_refused_naming_the_holder(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; "
         "from flowrl.store.rundir import RunDirectory; "
         "d = RunDirectory(Path(sys.argv[1])); d.lock(); print('held', flush=True); time.sleep(60)",
         str(tmp_path)], env=_env(), stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunDirectoryError) as exc:
            train(tmp_path, steps=1)
        assert f"pid {holder.pid}" in str(exc.value) and "in use by another run" in str(exc.value)
    finally:
        holder.kill()
        holder.wait()
    said: list[str] = []
    RunDirectory(tmp_path, say=said.append).lock()  # the holder died: its lock is taken over, saying so
    assert any("taking over the lock" in m and f"pid {holder.pid}" in m for m in said)
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()


def test_overwrite_replaces_a_run_and_every_run_ends_with_a_checkpoint(tmp_path):
    train(tmp_path, steps=2)
    assert [p.name for p in CheckpointStore(tmp_path / "checkpoints").complete()] == ["step_00000002"]
    g = load_graph("grpo", overrides=TINY)
    with pytest.raises(RunDirectoryError):
        Trainer(g, backend="local", steps=1, out=tmp_path, say=lambda m: None).run()
    Trainer(g, backend="local", steps=1, out=tmp_path, overwrite=True, say=lambda m: None).run()
    assert [r["step"] for r in rows(tmp_path)] == [1]
    assert [p.name for p in CheckpointStore(tmp_path / "checkpoints").complete()] == ["step_00000001"]


def test_sigterm_saves_exits_143_and_resume_equals_an_uninterrupted_run(tmp_path):
    steps = 6
    cut = tmp_path / "cut"
    proc = subprocess.Popen([sys.executable, "-m", "flowrl.cli", "run", "grpo", "--backend", "local",
                             "--steps", str(steps), "--out", str(cut), *TINY_SET],
                            cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 180
    # the first row, not the file: the sinks create metrics.jsonl before the runtime starts, and the
    # run's own handler goes in after the runtime's start (ray.init installs one of its own)
    while time.time() < deadline and b"\n" not in _read(cut / "metrics.jsonl"):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 143, out
    assert "checkpoint saved, continue with --resume" in flat(out)
    done = len(rows(cut))
    assert 1 <= done < steps  # it stopped early, after the step in flight
    assert CheckpointStore(cut / "checkpoints").complete()[0].name == f"step_{done:08d}"
    resumed = cli("run", "grpo", "--backend", "local", "--steps", str(steps), "--out", str(cut), "--resume",
                  *TINY_SET)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    full = train(tmp_path / "full", steps=steps)
    assert values(rows(cut)) == values(full)


def test_a_second_sigterm_aborts_and_loses_nothing_already_saved(tmp_path):
    """SIGTERM, then SIGTERM again while the step in flight finishes: the run aborts at once (143),
    and a resume from its last complete checkpoint gives the uninterrupted run's metrics."""
    slow = {"trainer.checkpoint_every": 2, "nodes.reward.fn": "tests.userpkg.verl_rewards:compute_score_slowly",
            "nodes.reward.batched": True}
    slow_set = [x for k, v in slow.items() for x in ("--set", f"{k}={v}")]
    steps, cut = 6, tmp_path / "cut"
    proc = subprocess.Popen([sys.executable, "-m", "flowrl.cli", "run", "grpo", "--backend", "local",
                             "--steps", "100", "--out", str(cut), *TINY_SET, *slow_set],
                            cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    store = CheckpointStore(cut / "checkpoints")
    deadline = time.time() + 180
    while time.time() < deadline and not (store.root.is_dir() and store.complete()):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.15)   # the first is being handled: a step of this graph takes 0.8 s or more
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 143, out
    assert "aborted by a second signal" in flat(out)
    saved = [p.name for p in store.complete()]
    assert saved and saved[0] in ("step_00000002", "step_00000004"), saved   # the abort saved nothing new
    resumed = cli("run", "grpo", "--backend", "local", "--steps", str(steps), "--out", str(cut), "--resume",
                  *TINY_SET, *slow_set)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    # the uninterrupted run without the sleep: compute_score_slowly is compute_score_batched, 0.8 s later
    full = train(tmp_path / "full", steps=steps,
                 **{**slow, "nodes.reward.fn": "tests.userpkg.verl_rewards:compute_score_batched"})
    assert values(rows(cut)) == values(full)


# ---------------------------------------------------------------- durable, tolerant files
def test_a_torn_metrics_line_is_dropped_with_a_warning_and_resume_goes_on(tmp_path):
    train(tmp_path, steps=4, **{"trainer.checkpoint_every": 2})
    # a crash mid-write after the step-4 checkpoint: rows 1..4 are whole, the fifth is cut
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 5, "reward/me')
    said: list[str] = []
    more = train(tmp_path, steps=5, resume=True, say=said.append, **{"trainer.checkpoint_every": 2})
    assert [r["step"] for r in more] == [5]
    assert any(str(tmp_path / "metrics.jsonl") in m and "line 5 is incomplete" in m for m in said)
    assert [r["step"] for r in rows(tmp_path)] == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("spoil", ["torn", "garbage"])
def test_a_bad_fingerprints_line_is_dropped_with_a_warning_and_resume_goes_on(tmp_path, spoil):
    train(tmp_path, steps=4, **{"trainer.checkpoint_every": 2})
    path = tmp_path / "fingerprints.jsonl"
    lines = path.read_text().splitlines()
    assert [json.loads(x).get("step") for x in lines[1:]] == [1, 2, 3, 4]
    if spoil == "torn":  # a crash mid-write: the last record cut in half
        lines[-1] = lines[-1][: len(lines[-1]) // 2]
        bad, kept = len(lines), [1, 2, 3, 5]  # step 4's record is lost; the resume goes on after its checkpoint
    else:  # a garbage line among whole records (a disk error, a stray write)
        lines.insert(2, "\x00\x00 not json {")
        bad, kept = 3, [1, 2, 3, 4, 5]
    path.write_text("\n".join(lines) + "\n")
    said: list[str] = []
    more = train(tmp_path, steps=5, resume=True, say=said.append, **{"trainer.checkpoint_every": 2})
    assert [r["step"] for r in more] == [5]
    assert any(str(path) in m and f"line {bad} " in m and "dropped it" in m for m in said), said
    records = [json.loads(x) for x in path.read_text().splitlines()]
    assert "header" in records[0] and [r["step"] for r in records[1:]] == kept


def test_resume_drops_only_the_rows_after_the_checkpoint(tmp_path):
    train(tmp_path, steps=4, **{"trainer.checkpoint_every": 2})
    newest = CheckpointStore(tmp_path / "checkpoints").complete()[0]
    assert newest.name == "step_00000004"
    # a run killed after step 3 leaves its rows but no checkpoint of them
    shutil.rmtree(newest)
    before = rows(tmp_path)
    said: list[str] = []
    train(tmp_path, steps=4, resume=True, say=said.append, **{"trainer.checkpoint_every": 2})
    after = rows(tmp_path)
    assert [r["step"] for r in after] == [1, 2, 3, 4]
    assert values(after[:2]) == values(before[:2])  # the rows up to the checkpoint are the same rows


def _replace_in_checkpoint(path: Path, name: str, data: bytes) -> None:
    """Write ``data`` as the checkpoint's file ``name`` and list it in the manifest, as an attacker (or a
    careless tool) that knows the format would: the checksums pass, what is inside must not."""
    (path / name).write_bytes(data)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (path / "manifest.json").write_text(json.dumps(manifest))


# ---------------------------------------------------------------- the data is part of the run's identity
def _prompts(path: Path, seed: int) -> Path:
    from operators.data.tasks import TaskRows

    rows = TaskRows("copy", size=16, seed=seed)
    path.write_text("".join(json.dumps(rows[i]) + "\n" for i in range(len(rows))))
    return path


def test_a_resume_on_changed_data_is_refused_naming_the_file_unless_allowed(tmp_path):
    data = _prompts(tmp_path / "prompts.jsonl", seed=0)
    original = data.read_bytes()
    on_file = {"data.source": str(data), "trainer.checkpoint_every": 2}
    train(tmp_path / "run", steps=2, **on_file)
    [ckpt] = CheckpointStore(tmp_path / "run" / "checkpoints").complete()
    recorded = json.loads((ckpt / "meta.json").read_text())["data"]
    assert recorded == {"source": str(data), "path": str(data.resolve()), "size": len(original),
                        "sha256": hashlib.sha256(original).hexdigest()}

    _prompts(data, seed=1)  # the same file name, other prompts: the run would silently be another one
    g = load_graph("grpo", overrides={**TINY, **on_file})
    from flowrl.store.checkpoint import DataChanged

    with pytest.raises(DataChanged) as err:  # refused while the trainer is made, before a worker is waited on
        Trainer(g, backend="local", steps=3, out=tmp_path / "run", resume=True)
    message = flat(str(err.value))
    assert f"the data source {data.resolve()} changed since checkpoint {ckpt} was saved" in message
    assert "sha256: '" + hashlib.sha256(original).hexdigest()[:12] in message and "--allow-data-change" in message
    done = cli("run", "grpo", "--backend", "local", "--steps", "3", "--out", str(tmp_path / "run"), "--resume",
               *TINY_SET, "--set", f"data.source={data}", "--set", "trainer.checkpoint_every=2")
    assert done.returncode == 1 and "Traceback" not in done.stderr + done.stdout
    assert "--allow-data-change" in flat(done.stderr) and str(data.resolve()) in flat(done.stderr)
    assert steps_of(tmp_path / "run") == [1, 2]  # nothing written

    said: list[str] = []
    more = Trainer(g, backend="local", steps=3, out=tmp_path / "run", resume=True, say=said.append,
                   allow_data_change=True).run()
    assert [r["step"] for r in more] == [3]
    assert any("changed since checkpoint" in m and "(--allow-data-change)" in m for m in said), said
    newest = CheckpointStore(tmp_path / "run" / "checkpoints").complete()[0]
    assert json.loads((newest / "meta.json").read_text())["data"]["sha256"] == hashlib.sha256(data.read_bytes()).hexdigest()

    data.write_bytes(original)  # the data back as step 2 saw it, on a copy of the run cut there: no word
    cut = tmp_path / "cut"
    shutil.copytree(tmp_path / "run", cut)
    shutil.rmtree(cut / "checkpoints" / newest.name)
    said.clear()
    assert [r["step"] for r in train(cut, steps=3, resume=True, say=said.append, **on_file)] == [3]
    assert not any("since checkpoint" in m for m in said), said


def steps_of(out: Path) -> list[int]:
    return [r["step"] for r in rows(out)]


def test_a_pickled_callable_in_a_checkpoint_is_refused_without_running_it(tmp_path):
    train(tmp_path, steps=4, **{"trainer.checkpoint_every": 2})
    newest = CheckpointStore(tmp_path / "checkpoints").complete()[0]
    marker = tmp_path / "pwned"
    (shard,) = (newest / "roles" / "actor").glob("*.safetensors")
    buffer = io.BytesIO()
    torch.save({"weights": Evil(marker)}, buffer)
    _replace_in_checkpoint(newest, shard.relative_to(newest).as_posix(), buffer.getvalue())
    said: list[str] = []
    more = train(tmp_path, steps=5, resume=True, say=said.append, **{"trainer.checkpoint_every": 2})
    assert not marker.exists()
    assert any("step_00000004" in m and "unreadable" in m for m in said)
    assert any("resuming from" in m and "step_00000002" in m for m in said)
    assert [r["step"] for r in more] == [3, 4, 5]


def test_a_step_that_disagrees_with_its_directory_is_refused_by_name(tmp_path):
    train(tmp_path, steps=4, **{"trainer.checkpoint_every": 2})
    ck = CheckpointStore(tmp_path / "checkpoints").complete()[0]
    meta = json.loads((ck / "meta.json").read_text())
    # edited (or a checkpoint copied in under another step's name), manifest and all: never taken as step 41
    _replace_in_checkpoint(ck, "meta.json", json.dumps({**meta, "step": 40}).encode())
    said = []
    more = train(tmp_path, steps=5, resume=True, say=said.append, **{"trainer.checkpoint_every": 2})
    assert [r["step"] for r in more] == [3, 4, 5]  # from the checkpoint of step 2
    assert any(ck.name in m and "40 + 1 steps" in m for m in said)


def test_a_checkpoint_of_the_wrong_shape_falls_back_to_the_previous_one(tmp_path):
    train(tmp_path, steps=4, **{"trainer.checkpoint_every": 2})
    newest = CheckpointStore(tmp_path / "checkpoints").complete()[0]
    (shard,) = (newest / "roles" / "actor").glob("*.safetensors")
    tensors = load_file(str(shard))
    name = next(iter(tensors))
    tensors[name] = torch.zeros(3, 3)
    _replace_in_checkpoint(newest, shard.relative_to(newest).as_posix(), save(tensors))
    said: list[str] = []
    more = train(tmp_path, steps=5, resume=True, say=said.append, **{"trainer.checkpoint_every": 2})
    assert any("step_00000004" in m and "does not fit" in m for m in said)
    assert [r["step"] for r in more] == [3, 4, 5]


# ---------------------------------------------------------------- closed by default, on Ray too
def _process_tree(root: int) -> list[int]:
    kids: dict[int, list[int]] = {}
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                ppid = int(Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(p))
    out, i = [root], 0
    while i < len(out):
        out.extend(kids.get(out[i], []))
        i += 1
    return out


def _listening_addresses(pids: list[int]) -> list[str]:
    """The local address (hex, as /proc/net prints it) of every TCP socket ``pids`` listen on."""
    inodes = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            parts = line.split()
            if parts[3] == "0A" and parts[9] in inodes:  # 0A: LISTEN
                out.append(parts[1].split(":")[0])
    return out


LOOPBACK = {"0100007F",  # 127.0.0.1
            "0000000000000000FFFF00000100007F",  # ::ffff:127.0.0.1
            "00000000000000000000000001000000"}  # ::1


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads listening sockets from Linux /proc")
def test_a_ray_run_listens_on_loopback_only_and_sigterm_saves_and_exits_143(tmp_path, ray_session):
    """With another local Ray up (the tests' own), the run starts a Ray of its own rather than join it."""
    env = _env()
    env.pop("RAY_ADDRESS", None)
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "flowrl.cli", "run", "grpo", "--backend", "ray", "--steps", "500",
                             "--out", str(out), *TINY_SET],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 240
        while time.time() < deadline and not (out / "metrics.jsonl").is_file():
            time.sleep(0.1)
        found = _listening_addresses(_process_tree(proc.pid))
        proc.send_signal(signal.SIGTERM)
        text, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert len(found) >= 3, text  # Ray's servers (GCS, raylet, object manager...) were seen listening
    assert set(found) <= LOOPBACK, found
    assert proc.returncode == 143, text  # not Ray's abort (134), not a lost run
    done = len(rows(out))
    assert CheckpointStore(out / "checkpoints").complete()[0].name == f"step_{done:08d}"


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full to stand in for a full disk")
def test_a_full_disk_names_the_metrics_file_and_how_to_continue(tmp_path):
    from flowrl.store.sinks import Sinks

    sinks = Sinks(tmp_path)
    sinks.jsonl.close()
    sinks.jsonl = open("/dev/full", "a")  # every write fails with ENOSPC
    with pytest.raises(OSError) as exc:
        sinks.write(1, {"step": 1, "reward/mean": 0.5})
    assert "cannot write /dev/full" in str(exc.value) and "--resume" in str(exc.value)


# ---------------------------------------------------------------- checkpoints that prove themselves
def _empty_manifest(ck: Path) -> None:
    (ck / "manifest.json").write_text('{"format": 2, "files": {}}')


def _manifest_files_a_list(ck: Path) -> None:
    (ck / "manifest.json").write_text('{"format": 2, "files": []}')


def _entry_without_sha256(ck: Path) -> None:
    manifest = json.loads((ck / "manifest.json").read_text())
    del manifest["files"]["meta.json"]["sha256"]
    (ck / "manifest.json").write_text(json.dumps(manifest))


def _meta_nested_too_deep(ck: Path) -> None:
    _replace_in_checkpoint(ck, "meta.json", b"[" * 100_000)


def _shard_left_out(ck: Path) -> None:
    manifest = json.loads((ck / "manifest.json").read_text())
    for rel in [r for r in manifest["files"] if r.startswith("roles/")]:
        del manifest["files"][rel]
        (ck / rel).unlink()
    (ck / "manifest.json").write_text(json.dumps(manifest))


def _older_directory_swapped_in(ck: Path) -> None:
    older = CheckpointStore(ck.parent).complete()[1]
    shutil.rmtree(ck)
    shutil.copytree(older, ck)


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("two_checkpoints")
    train(out, steps=4, **{"trainer.checkpoint_every": 2})
    return out


@pytest.mark.parametrize("spoil, says", [
    (_empty_manifest, "is not in manifest.json"),
    (_manifest_files_a_list, "is not a format-2 manifest"),
    (_entry_without_sha256, "entry for 'meta.json' is not {bytes, sha256}"),
    (_meta_nested_too_deep, "meta.json is nested deeper than any flowrl writes"),
    (_shard_left_out, "manifest.json does not list roles/actor/ (no shard)"),
    (_older_directory_swapped_in, "(a checkpoint moved or copied in)"),
], ids=lambda v: v.__name__[1:] if callable(v) else None)
def test_a_checkpoint_that_cannot_prove_itself_falls_back_naming_why(two_checkpoints, tmp_path, spoil, says):
    run = tmp_path / "run"
    shutil.copytree(two_checkpoints, run)
    store = CheckpointStore(run / "checkpoints")
    newest, older = store.complete()
    spoil(newest)
    warned = []
    _, meta, path = store.load_latest(warn=warned.append)
    assert path == older and meta["step"] == 1
    assert len(warned) == 1 and newest.name in warned[0] and says in warned[0]


def test_a_refusal_that_needs_no_ray_comes_before_ray_starts(tmp_path):
    """A ray run over another run's directory is refused before anything waits on Ray: pointed at a Ray
    address nobody answers, it says the run directory's refusal, never the Ray cluster's."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1}\n')
    res = cli("run", "grpo", "--address", "127.0.0.1:1", "--out", str(tmp_path / "run"), *TINY_SET)
    both = flat(res.stdout + res.stderr)
    assert res.returncode == 1 and "already holds a run (metrics.jsonl)" in both and "Traceback" not in both
    assert "cannot reach the Ray cluster" not in both
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == '{"step": 1}\n'  # nothing lost
    res = cli("run", "grpo", "--resume", "--address", "127.0.0.1:1", "--out", str(tmp_path / "empty"), *TINY_SET)
    assert res.returncode == 1 and "nothing to resume" in flat(res.stdout + res.stderr)


def test_ray_failing_to_start_during_resume_names_ray_and_leaves_the_checkpoints_untouched(two_checkpoints, tmp_path):
    """Issue 36 item 3: Ray's failure during ``--resume`` was reported as "every checkpoint … is unreadable"
    about files never read, and the natural reaction to that (``--overwrite``, deleting them) loses the run."""
    run = tmp_path / "run"
    shutil.copytree(two_checkpoints, run)
    before = {p: p.read_bytes() for p in sorted((run / "checkpoints").rglob("*")) if p.is_file()}
    res = cli("run", "grpo", "--resume", "--steps", "6", "--address", "127.0.0.1:1", "--out", str(run), *TINY_SET,
              "--set", "trainer.checkpoint_every=2")
    both = flat(res.stdout + res.stderr)
    assert res.returncode == 1 and "Traceback" not in both
    assert "cannot reach the Ray cluster at 127.0.0.1:1 (--address)" in both
    assert "unreadable" not in both and "--overwrite" not in both
    assert {p: p.read_bytes() for p in sorted((run / "checkpoints").rglob("*")) if p.is_file()} == before
    assert [r["step"] for r in rows(run)] == [1, 2, 3, 4]
