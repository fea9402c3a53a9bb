"""The checkpointer: format version, a manifest verified on load, a full disk, and export.

Every checkpoint here is written by a real run (local backend, builtin:tiny);
what is asserted is what a user sees: the run resumes from a good checkpoint
(named when it is not the newest), a message without a traceback, a model
directory that ``transformers`` generates from as flowrl does.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flowrl.graph import load_graph
from flowrl.store import checkpoint
from flowrl.store.checkpoint import FORMAT, CheckpointError, CheckpointStore
from flowrl.run.trainer import Trainer

TINY = {"data.batch_size": 4, "nodes.generate.n": 2, "nodes.generate.max_new_tokens": 4,
        "trainer.checkpoint_every": 2, "trainer.val_every": 0}
SET = [arg for k, v in TINY.items() for arg in ("--set", f"{k}={v}")]


def train(out: Path, steps: int, resume: bool = False, say=lambda m: None, **extra):
    g = load_graph("grpo", overrides={**TINY, **extra})
    return Trainer(g, backend="local", steps=steps, out=out, resume=resume, say=say).run()


def test_a_checkpoint_names_its_format_and_every_file_with_its_checksum(tmp_path):
    train(tmp_path, steps=2)
    store = CheckpointStore.of_run(tmp_path)
    path = store.complete()[0]
    # the store names the directory it wrote: the run's checkpoints/ folder, by completed steps
    assert path == store.path(1) == tmp_path / "checkpoints" / "step_00000002" and store.any_saved()
    meta = json.loads((path / "meta.json").read_text())
    assert meta["format"] == FORMAT and meta["written_by"].startswith("flowrl ")
    files = json.loads((path / "manifest.json").read_text())["files"]
    on_disk = {p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()} - {"manifest.json"}
    assert set(files) == on_disk and "meta.json" in files
    assert any(f.startswith("roles/actor/") and f.endswith(".safetensors") for f in files)
    assert not [p for p in path.rglob("*") if p.suffix in (".pt", ".pkl", ".pickle")]


def test_a_missing_shard_falls_back_to_the_previous_checkpoint_and_resumes_exactly(tmp_path):
    full = train(tmp_path / "full", steps=6)
    train(tmp_path / "part", steps=4)
    (shard,) = (tmp_path / "part" / "checkpoints" / "step_00000004" / "roles" / "actor").glob("*.safetensors")
    shard.unlink()
    said: list[str] = []
    rest = train(tmp_path / "part", steps=6, resume=True, say=said.append)
    assert any("step_00000004 is unreadable" in m and f"{shard.name} is missing" in m for m in said)
    assert any("resuming from" in m and "step_00000002" in m for m in said)
    assert [r["step"] for r in rest] == [3, 4, 5, 6]
    keys = ("reward/mean", "actor/pg_loss", "actor/grad_norm")
    assert [[r[k] for k in keys] for r in rest] == [[r[k] for k in keys] for r in full[2:]]


def test_with_every_checkpoint_corrupt_the_run_refuses_naming_the_file(tmp_path):
    train(tmp_path, steps=2)
    path = CheckpointStore(tmp_path / "checkpoints").complete()[0]
    meta = path / "meta.json"
    meta.write_text(meta.read_text().replace('"step": 1', '"step": 7'))  # edited by hand
    with pytest.raises(CheckpointError) as exc:
        train(tmp_path, steps=4, resume=True)
    assert "every checkpoint" in str(exc.value) and "meta.json is corrupt" in str(exc.value)


def test_a_checkpoint_of_the_format_before_is_refused_naming_the_version(tmp_path):
    """The layout every flowrl wrote before the checkpointer: workers.pt, weights.pt, meta.json."""
    graph = load_graph("grpo", overrides=TINY).config.dump()
    old = tmp_path / "checkpoints" / "step_00000002"
    old.mkdir(parents=True)
    torch.save({("train", 0): {"roles": {"actor": {"model": {}, "updates": 2}}, "versions": {"actor": 2}}},
               old / "workers.pt")
    torch.save({}, old / "weights.pt")
    (old / "meta.json").write_text(json.dumps({"graph": checkpoint.fingerprint(graph), "step": 1,
                                               "workers": {"train": 1}}))
    with pytest.raises(CheckpointError) as exc:
        train(tmp_path, steps=4, resume=True)
    assert "written by flowrl before the checkpointer (checkpoint format 1" in str(exc.value)
    assert f"reads format {FORMAT} only" in str(exc.value)


def test_a_full_disk_while_saving_is_one_message_and_leaves_no_partial_checkpoint(tmp_path, monkeypatch):
    real = checkpoint._write

    def full(path, data):
        if path.name == "manifest.json":
            raise OSError(28, "No space left on device")
        real(path, data)

    monkeypatch.setattr(checkpoint, "_write", full)
    with pytest.raises(CheckpointError) as exc:
        train(tmp_path, steps=2)
    assert "could not write the checkpoint of step 2" in str(exc.value) and "the disk is full" in str(exc.value)
    assert not list((tmp_path / "checkpoints").iterdir())  # the staging directory is gone


def _limit_file_size() -> None:
    # a write past 2 MB fails as on a full disk (EFBIG), instead of killing the process
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (2 << 20, 2 << 20))


def test_a_write_that_fails_inside_the_ranks_is_a_message_without_traceback(tmp_path):
    """The actor's shards (6 MB) cannot be written: the CLI says so, exit 1, nothing partial left."""
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "flowrl.cli", "run", "grpo", "--backend", "local", "--steps", "2",
                           "--out", str(out), *SET], capture_output=True, text=True, preexec_fn=_limit_file_size,
                          env={**os.environ, "COLUMNS": "400"}, timeout=300)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 1, text
    assert "could not write the state of role 'actor'" in text and "Traceback" not in text
    assert not list((out / "checkpoints").glob(".tmp_*")) and not list((out / "checkpoints").glob("step_*"))


def test_export_generates_with_transformers_from_a_plain_prompt_as_flowrl_does(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from typer.testing import CliRunner

    from flowrl.cli import app
    from flowrl.store.checkpoint_state import load_states
    from flowrl.runtime.distributed import PoolGroup
    from flowrl.runtime.worker import RoleContext
    from operators.roles import Actor, ActorConfig

    train(tmp_path / "run", steps=2)
    result = CliRunner().invoke(app, ["export", str(tmp_path / "run"), str(tmp_path / "hf")])
    assert result.exit_code == 0, result.output
    assert "\r" not in result.output + result.stderr  # no progress bars redrawn in a log

    # flowrl: the actor as the run left it, loaded through the checkpointer, prompted as in training
    store = CheckpointStore(tmp_path / "run" / "checkpoints")
    payload, _, path = store.load_latest()
    actor = Actor(ActorConfig(), RoleContext("actor", 0, 1, 0))
    load_states(path, {"actor": actor}, payload["workers"][("train", 0)]["roles"], PoolGroup.single("train"), 0)
    prompt = "copy 3 7 ="
    text = actor.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                               tokenize=False)
    ids = torch.tensor([actor.tokenizer.encode(text, add_special_tokens=False)])
    out = actor.engine.generate(ids, torch.ones_like(ids), max_new_tokens=6, temperature=0.0)
    ours = out["responses"][0][out["response_mask"][0].bool()].tolist()

    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    plain = tokenizer(prompt, return_tensors="pt")
    assert plain["input_ids"].tolist() == ids.tolist()  # the BOS the model was trained with
    generated = model.generate(**plain, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    theirs = generated[0, plain["input_ids"].shape[1]:].tolist()
    assert theirs[: len(ours)] == ours and len(ours) > 0


def test_export_names_a_missing_step_and_role(tmp_path):
    from typer.testing import CliRunner

    from flowrl.cli import app

    train(tmp_path / "run", steps=2)
    runner = CliRunner()
    bad_step = runner.invoke(app, ["export", str(tmp_path / "run"), str(tmp_path / "x"), "--step", "5"])
    assert bad_step.exit_code == 1 and "available steps: 2" in " ".join(bad_step.output.split())
    bad_role = runner.invoke(app, ["export", str(tmp_path / "run"), str(tmp_path / "x"), "--role", "critic"])
    assert bad_role.exit_code == 1 and "no role 'critic'" in " ".join(bad_role.output.split())
    assert "Traceback" not in bad_step.output + bad_role.output
