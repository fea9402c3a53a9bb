"""flowrl diff: two runs compared node by node, the first node that introduced a difference named."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from flowrl.cli import app, parse_overrides
from flowrl.graph import load_graph
from flowrl.provenance.rundiff import FingerprintFileError, diff_runs
from flowrl.run.trainer import Trainer

TINY = {"data.batch_size": 4, "nodes.generate.n": 2, "nodes.generate.max_new_tokens": 4}


def _run(out, name="grpo", sets=(), steps=2):
    g = load_graph(name, overrides={**TINY, **parse_overrides(list(sets))})
    Trainer(g, backend="local", steps=steps, out=out, say=lambda m: None).run()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    return {"a": _run(root / "a"), "b": _run(root / "b"),
            "std": _run(root / "std", sets=["nodes.advantage.norm_adv_by_std_in_grpo=false"])}


def test_two_runs_of_one_graph_and_seed_are_identical(runs):
    res = CliRunner().invoke(app, ["diff", str(runs["a"]), str(runs["b"])])
    assert res.exit_code == 0, res.output
    report = diff_runs(runs["a"], runs["b"])
    assert report["same"] and report["finding"] is None and report["steps_compared"] == 2


def test_one_parameter_of_one_node_is_found_at_that_node_with_its_inputs_equal(runs):
    before = {p: p.read_bytes() for p in runs["a"].iterdir() if p.is_file()}
    res = CliRunner().invoke(app, ["diff", str(runs["a"]), str(runs["std"]), "--json"])
    assert res.exit_code == 1, res.output
    report = json.loads(res.stdout)
    f = report["finding"]
    assert (f["step"], f["node"], f["field"], f["inputs_equal"]) == (1, "advantage", "advantages", True)
    assert 0 < f["rows_differing"] <= f["rows_total"] == 8 and f["rows"][0] < 8 and f["size"] > 0
    assert report["parameter_differences"] == ["node 'advantage': norm_by_std = True in A, False in B"]
    assert report["graph_differences"] == []
    # it spread: the update's weights at step 1, then step 2's generation
    spread = {s["node"]: s for s in report["spread"]}
    assert spread["update_actor"]["first_step"] == 1 and spread["update_actor"]["fields"] == ["weights"]
    assert spread["generate"]["first_step"] == 2
    # the table says the same, and diff changed nothing of the run
    table = CliRunner().invoke(app, ["diff", str(runs["a"]), str(runs["std"])], env={"COLUMNS": "80"})
    assert table.exit_code == 1 and "advantage" in table.output
    lines = table.output.splitlines()  # piped: every metric's whole name on one row, past 80 columns if need be
    assert f["metrics"] and all(any(m["metric"] in line for line in lines) for m in f["metrics"]), table.output
    assert before == {p: p.read_bytes() for p in runs["a"].iterdir() if p.is_file()}


def test_graphs_that_differ_are_said_and_a_missing_file_is_named(runs, tmp_path):
    other = _run(tmp_path / "rloo", name="rloo", steps=1)
    report = diff_runs(runs["a"], other)
    assert not report["same"] and report["steps_a"] == 2 and report["steps_b"] == 1
    assert any("advantage" in d and "op" in d for d in report["graph_differences"])
    res = CliRunner().invoke(app, ["diff", str(runs["a"]), str(tmp_path / "nowhere")])
    assert res.exit_code == 2 and str(tmp_path / "nowhere" / "fingerprints.jsonl") in res.stderr
    # fingerprints of an older digest format are not compared with this one's
    lines = (runs["a"] / "fingerprints.jsonl").read_text().splitlines()
    old = json.loads(lines[0])
    del old["header"]["format"]
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "fingerprints.jsonl").write_text("\n".join([json.dumps(old), *lines[1:]]) + "\n")
    with pytest.raises(FingerprintFileError, match="format 2.*format 1"):
        diff_runs(runs["b"], tmp_path / "old")
    assert CliRunner().invoke(app, ["diff", str(tmp_path / "old"), str(runs["a"])]).exit_code == 2


def test_the_default_job_at_one_and_two_workers_parts_at_the_sharded_update(ray_session, tmp_path):
    base = {"data.batch_size": 8, "nodes.generate.n": 4, "nodes.generate.max_new_tokens": 6, "trainer.val_every": 0}
    for workers in (1, 2):
        g = load_graph("grpo", overrides={**base, "pools.train.workers": workers})
        Trainer(g, backend="ray", steps=2, out=tmp_path / f"w{workers}", say=lambda m: None).run()
    report = diff_runs(tmp_path / "w1", tmp_path / "w2")
    f = report["finding"]
    # the first difference is rounding, from equal inputs: where the CPU's kernels round a batch of 4 prompts
    # as they round 8 (AVX2 here before), the two ranks' sums in the update's weights at step 1; where they
    # do not (AVX-512/AMX), the rollout's log-probs, one node earlier, on the same starting weights
    assert (f["step"], f["inputs_equal"]) == (1, True)
    assert (f["node"], f["field"]) in {("update_actor", "weights"), ("generate", "rollout_log_probs")}
    assert report["graph_differences"] == [] and report["parameter_differences"] == []
    assert {s["node"] for s in report["spread"]} >= {"generate"}
    # rounding, not a different computation: close relatively, or (a KL near zero) absolutely
    assert all(m["relative"] < 1e-3 or abs(m["a"] - m["b"]) < 1e-6 for m in f["metrics"]), f["metrics"]
