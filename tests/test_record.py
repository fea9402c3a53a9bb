"""trainer.record: node outputs saved per step as safetensors + JSON, atomically, within a budget."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flowrl.data import DataProto
from flowrl.graph import load_graph
from flowrl.provenance.record import Recorder, RecordError, read_record, recorded_steps, step_dir


def _graph(**record):
    return load_graph("grpo", overrides={"trainer.record": {"nodes": ["generate"], **record}})


def _step(i):
    gen = DataProto.from_dict({"responses": torch.arange(6).reshape(3, 2) + i,
                               "rollout_log_probs": torch.randn(3, 2, dtype=torch.float32)})
    objects = np.empty(3, dtype=object)
    for j, v in enumerate([{"index": 1}, [1, 2], None]):  # equal-length lists stay one object per row
        objects[j] = v
    data = DataProto.from_dict({"prompts": torch.ones(3, 4, dtype=torch.int64)},
                               {"uid": np.array(["a", "b", "c"], dtype=object), "extra_info": objects,
                                "weird": np.array([{1, 2}, set(), {3}], dtype=object)},
                               meta_info={"tokenizer": "builtin:tiny", "not_a_field": 1})
    return {"data": data, "generate": gen}


def test_a_step_round_trips_exactly_and_what_json_cannot_hold_is_named(tmp_path):
    said = []
    rec = Recorder(tmp_path, _graph(), say=said.append)
    assert rec.fields["generate"][:2] == ["input_ids", "attention_mask"] and "prompts" in rec.fields["data"]
    written = _step(0)
    rec.write(0, written)
    rec.write(1, _step(1))
    assert recorded_steps(tmp_path) == [1, 2] and not list((tmp_path / "records").glob(".tmp_*"))
    back = read_record(tmp_path, 1)
    assert torch.equal(back.data["generate"].batch["rollout_log_probs"], written["generate"].batch["rollout_log_probs"])
    assert list(back.data["data"].non_tensor_batch["extra_info"]) == [{"index": 1}, [1, 2], None]
    assert back.data["data"].meta_info == {"tokenizer": "builtin:tiny"}  # the data source's meta fields only
    assert "weird" not in back.data["data"] and "set" in back.skipped["data"]["weird"]
    assert sum("data.weird" in m for m in said) == 1  # said once, not every step


def test_the_oldest_steps_go_past_the_budget_with_one_warning(tmp_path):
    said = []
    rec = Recorder(tmp_path, _graph(max_gb=1e-6), say=said.append)  # 1 kB: one step's record fits, two do not
    for i in range(4):
        rec.write(i, _step(i))
    assert recorded_steps(tmp_path) == [4]
    assert len([m for m in said if "max_gb" in m]) == 1


def test_every_k_steps_and_a_resume_cuts_the_records_it_runs_again(tmp_path):
    rec = Recorder(tmp_path, _graph(every=2), say=print)
    assert [t for t in range(6) if rec.wants(t)] == [1, 3, 5]  # steps 2, 4, 6
    for t in (1, 3, 5):
        rec.write(t, _step(t))
    (tmp_path / "records" / ".tmp_step_00000008_1").mkdir()  # a run killed mid-write
    Recorder(tmp_path, _graph(every=2), say=print, keep_through=4)
    assert recorded_steps(tmp_path) == [2, 4] and not list((tmp_path / "records").glob(".tmp_*"))


def test_a_missing_or_corrupt_record_names_its_file(tmp_path):
    Recorder(tmp_path, _graph(), say=print).write(1, _step(1))
    with pytest.raises(RecordError, match="step_00000003.*recorded steps: 2"):
        read_record(tmp_path, 3)
    (step_dir(tmp_path, 2) / "record.json").write_text("{")
    with pytest.raises(RecordError, match=str(step_dir(tmp_path, 2) / "record.json")):
        read_record(tmp_path, 2)


def test_unknown_record_nodes_are_refused_where_they_are_written(tmp_path):
    g = load_graph("grpo", overrides={"trainer.record": {"nodes": ["generate", "rewards"]}})
    errors = g.check().errors
    assert len(errors) == 1 and "'rewards'" in str(errors[0]) and "did you mean 'reward'" in str(errors[0])
    assert errors[0].location.file is not None and errors[0].location.file.endswith("grpo.yaml")
